"""`torchrun --nproc-per-node N -m commfuse.tune --out TABLE.json`: time the standalone kernel of
each registered all-reduce algorithm (commfuse/collectives.py: one-shot, two-shot) and the c10d collective over a grid of sizes on this host, and each
symmetric-memory algorithm with a residual add and RMSNorm fused over a grid of (rows, hidden),
and the all-gather's and reduce-scatter's symmetric kernel against c10d over the sizes, under CUDA
graphs; write the table the compiler's algorithm choice reads (commfuse/tuned_tables.py)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import choices, tuned_tables
from .collectives import ALGORITHMS
from .runtime.loader import load_module
from .runtime.symm import SymmPool
from .runtime.timing import cuda_graph_time_us, interleaved_times_us


def kernels(world: int, dtype):
    """The standalone kernel of each registered algorithm the table times alone, compiled."""
    names = [n for n in tuned_tables.ALGORITHMS if n in ALGORITHMS and ALGORITHMS[n].kernel is not None]
    src = "import triton\nimport triton.language as tl\nfrom commfuse.runtime import triton_helpers\nconstants = {}\n" + \
        "\n".join(ALGORITHMS[n].kernel(n, world, "sum", dtype, False) for n in names)
    mod = load_module(src, {})[0]
    return {n: getattr(mod, n) for n in names}


def launcher(kernel, pool, numel, out, dtype):
    cfg = choices.Choices().comm_launch(numel)
    peers = pool.peer_views(0, numel, dtype)
    sigs = pool.signals
    rank = pool.rank

    def run():
        kernel[(cfg["NPROG"],)](*peers, out, *sigs, sigs[rank], rank, numel,
                                BLOCK=cfg["BLOCK"], NPROG=cfg["NPROG"], num_warps=cfg["num_warps"])
    return run, peers


def measure(sizes, dtype=torch.bfloat16) -> list[dict]:
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmPool(group.group_name, dev, max(sizes))
    ks = kernels(world, dtype)
    rows = []
    for i, nbytes in enumerate(sizes):
        progress(f"all-reduce alone, size {i + 1}/{len(sizes)}: {nbytes} B, {len(ks) + 1} algorithms")
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


def progress(what: str) -> None:
    """One line on rank 0 per step of the grid: the whole run takes minutes."""
    if dist.get_rank() == 0:
        print(f"commfuse.tune: {what}", file=sys.stderr, flush=True)


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def ar_norm_step(group, norm_w):
    """All-reduce, residual add, RMSNorm: what follows a row-parallel linear."""
    def step(y, res):
        h = funcol.all_reduce(y, "sum", group) + res
        return rms_norm(h, norm_w), h
    return step


def measure_fused(rows_grid, hiddens, dtype=torch.bfloat16, k=16) -> list[dict]:
    """Per (rows, hidden, producer): the compiled step `ar_norm_step(produce(x))` with each
    symmetric-memory algorithm forced, timed whole. The producer writes the all-reduce input: a
    pointwise one fuses into one-shot's kernel as its prologue (`"prologue": true`), or runs in a
    kernel of its own (`one_shot_apart`, and always before two-shot); a K=16 matmul, as after a
    row-parallel linear, runs before either at a cost both share."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(dist.get_rank())
    out = []
    for hidden in hiddens:
        w = torch.randn(k, hidden, dtype=dtype, device=dev) / k ** 0.5
        step = ar_norm_step(dist.group.WORLD, torch.randn(hidden, dtype=dtype, device=dev))
        producers = {True: (lambda x: x * 1.0, hidden), False: (lambda x: x @ w, k)}
        for prologue, (produce, width) in producers.items():
            def fn(x, res, produce=produce):
                return step(produce(x), res)
            for rows in rows_grid:
                done = len(out) + 1
                progress(f"all-reduce + RMSNorm, case {done}/{len(hiddens) * 2 * len(rows_grid)}: {rows} rows x "
                         f"{hidden * dtype.itemsize} B, {'pointwise' if prologue else 'matmul'} producer (compiles each algorithm)")
                x = torch.randn(rows, width, dtype=dtype, device=dev)
                res = torch.randn(rows, hidden, dtype=dtype, device=dev)
                want = fn(x, res)
                runs = {}
                torch._dynamo.reset()  # one code object: a fresh cache per shape, under the recompile limit
                for algo in tuned_tables.FUSED_ALGORITHMS if prologue else ("one_shot", "two_shot"):
                    compiled = torch.compile(fn, backend="commfuse", dynamic=False,
                                             options={"comm.algorithm": algo})
                    for g, r in zip(compiled(x, res), want):
                        torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)
                    runs[algo] = functools.partial(compiled, x, res)
                out.append({"rows": rows, "row_bytes": hidden * dtype.itemsize, "prologue": prologue,
                            **interleaved_times_us(runs)})
    torch._dynamo.reset()
    return out


def gather_scatter_steps(group) -> dict:
    """`x * 2`, then the collective (dim 0; sum): what `measure_gather_scatter` times, by op."""
    return {"all_gather_into_tensor": lambda x: funcol.all_gather_tensor(x * 2, 0, group),
            "reduce_scatter_tensor": lambda x: funcol.reduce_scatter_tensor(x * 2, "sum", 0, group)}


def measure_gather_scatter(sizes, dev, dtype=torch.bfloat16, cols=256, timer=interleaved_times_us, extra=None) -> dict:
    """Per collective (its table section) and gathered size: `gather_scatter_steps` compiled with
    the symmetric kernel and with c10d (the producer writes the comm buffer, or NCCL's input),
    checked against eager and timed side by side, with `extra(op, x, want)`'s runs if given."""
    world, out = dist.get_world_size(), {}
    for op, fn in gather_scatter_steps(dist.group.WORLD).items():
        section, (symm, _) = tuned_tables.SECTIONS[op]
        for nbytes in sizes:
            progress(f"{op}, {nbytes} B (compiles each plan)")
            rows = nbytes // dtype.itemsize // cols
            assert rows % world == 0, f"{nbytes} B in rows of {cols} do not split over {world} ranks"
            x = torch.randn(rows // world if op == "all_gather_into_tensor" else rows, cols, device=dev, dtype=dtype)
            want, runs = fn(x), {}
            for name, mode in ((symm, "symmetric"), ("c10d", "c10d")):
                torch._dynamo.reset()
                compiled = torch.compile(fn, backend="commfuse", dynamic=False, options={"comm.gather_scatter": mode})
                torch.testing.assert_close(compiled(x).float(), want.float(), atol=5e-2, rtol=5e-2)
                runs[name] = functools.partial(compiled, x)
            out.setdefault(section, []).append({"bytes": nbytes, **timer({**runs, **(extra(op, x, want) if extra else {})})})
    torch._dynamo.reset()
    return out


def _grid(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--fused-rows", type=_grid, default=[1, 2, 4, 8, 16, 32, 128, 512],
                    help="rows of the fused all-reduce + RMSNorm grid (comma-separated)")
    ap.add_argument("--fused-hidden", type=_grid, default=[4096, 8192],
                    help="row lengths of the fused grid (comma-separated; empty: skip it)")
    args = ap.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= gpus:
        ap.error(f"the tuner times CUDA kernels over NVLink and needs CUDA GPUs, one per process: this "
                 f"process is local rank {local_rank} and sees {gpus} (on a CPU there is nothing to tune: "
                 "the interpreter's timings mean nothing, and the built-in thresholds apply)")
    if "WORLD_SIZE" not in os.environ:
        ap.error("run it under torchrun: torchrun --nproc-per-node N -m commfuse.tune --out TABLE.json")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    sizes, n = [], args.min_kib << 10
    while n <= args.max_mib << 20:
        sizes.append(n)
        n *= 2
    rows = measure(sizes)
    fused = measure_fused(args.fused_rows, args.fused_hidden)
    gathered = measure_gather_scatter(sizes, torch.device("cuda", local_rank))
    if dist.get_rank() == 0:
        table = {"host": {**tuned_tables.host_key(dist.get_world_size(), "cuda"), "link": "nvlink"},
                 "dtype": "bfloat16", "unit": "us, CUDA graphs, median", "measurements": rows,
                 "fused": fused, **gathered}
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
        for r in rows + fused + [dict(r, section=k) for k, v in gathered.items() for r in v]:
            where = f"{r.get('section', '')} {r['bytes']:>10} B" if "bytes" in r else \
                f"{r['rows']:>4} x {r['row_bytes']:>6} B + norm{', prologue' if r['prologue'] else ''}"
            timed = {a: t for a, t in r.items() if a not in ("bytes", "rows", "row_bytes", "prologue", "section")}
            print(f"{where}  " + "  ".join(f"{a} {t:7.1f}" for a, t in timed.items())
                  + f"  -> {min(timed, key=timed.get)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
