"""`torchrun --nproc-per-node N -m commfuse.tune --out TABLE.json`: time commfuse's one-shot and
two-shot all-reduce kernels and the c10d collective over a grid of sizes on this host, under CUDA
graphs, and write the table the compiler's algorithm choice reads (commfuse/tuning.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from . import choices, tuning


def cuda_graph_time_us(fn, iters=100, reps=5) -> float:
    """Median per-call µs of `fn` replayed from a CUDA graph of `iters` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def kernels(world: int, dtype):
    """Our standalone one-shot and two-shot all-reduce kernels, compiled."""
    from codegen import comm as comm_codegen
    from .runtime.loader import load_module
    src = "import triton\nimport triton.language as tl\nconstants = {}\n" + \
        comm_codegen.one_shot_all_reduce("one_shot", world, "sum", dtype, False) + "\n" + \
        comm_codegen.two_shot_all_reduce("two_shot", world, "sum", dtype)
    mod = load_module(src, {})[0]
    return {"one_shot": mod.one_shot, "two_shot": mod.two_shot}


def launcher(kernel, pool, numel, out, dtype):
    cfg = choices.comm_launch(numel)
    peers = pool.peer_views(0, numel, dtype)
    sigs = pool.signals
    rank = pool.rank

    def run():
        kernel[(cfg["NPROG"],)](*peers, out, *sigs, sigs[rank], rank, numel,
                                BLOCK=cfg["BLOCK"], NPROG=cfg["NPROG"], num_warps=cfg["num_warps"])
    return run, peers


def measure(sizes, dtype=torch.bfloat16) -> list[dict]:
    from .runtime.symm import SymmPool
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmPool(group.group_name, dev, max(sizes))
    ks = kernels(world, dtype)
    rows = []
    for nbytes in sizes:
        numel = nbytes // dtype.itemsize
        out = torch.empty(numel, dtype=dtype, device=dev)
        plain = torch.randn(numel, dtype=dtype, device=dev)
        row = {"bytes": nbytes}
        for name, kernel in ks.items():
            run, peers = launcher(kernel, pool, numel, out, dtype)
            peers[rank].normal_()
            want = peers[rank].float().clone()
            dist.all_reduce(want)
            run()
            torch.testing.assert_close(out.float(), want, atol=0.1, rtol=2e-2)
            row[name] = cuda_graph_time_us(run)
        row["c10d"] = cuda_graph_time_us(lambda: dist.all_reduce(plain))
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    args = ap.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    sizes, n = [], args.min_kib << 10
    while n <= args.max_mib << 20:
        sizes.append(n)
        n *= 2
    rows = measure(sizes)
    if dist.get_rank() == 0:
        table = {"host": {**tuning.host_key(dist.get_world_size(), "cuda"), "link": "nvlink"},
                 "dtype": "bfloat16", "unit": "us, CUDA graphs, median", "measurements": rows}
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
        for r in rows:
            best = min(tuning.ALGORITHMS, key=lambda a: r[a])
            print(f"{r['bytes']:>10} B  " + "  ".join(f"{a} {r[a]:7.1f}" for a in tuning.ALGORITHMS) + f"  -> {best}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
