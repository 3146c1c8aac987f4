"""Async-TP's ops alone (commfuse/runtime/async_tp.py) against c10d's collective and the matmul, one
after the other, at a Llama-3-8B layer's sequence-parallel sizes (B=2, H=4096, the column shard of
4096 outputs), on GPUs only: host µs per call (launched back to back), GPU µs per call (the median of
replays of a CUDA graph of 10 calls, after a barrier each), and with --profile rank 0's cProfile of the fused ops.

    torchrun --standalone --nproc-per-node 4 bench/async_tp_ops.py [--seq 1024] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401  (registers the ops)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from bench import timing  # noqa: E402
from commfuse.runtime import async_tp  # noqa: E402


def host_us(fn, n=30) -> float:
    for _ in range(3):
        fn()
    timing.sync(torch.device("cuda"))
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024, help="sequence length over all ranks")
    ap.add_argument("--profile", action="store_true", help="rank 0's cProfile of 20 calls of each fused op")
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    b, h, n = 2, 4096, 4096 // world
    torch.manual_seed(0)
    wq = torch.randn(n, h, device=dev, dtype=torch.bfloat16) / 64
    wo = torch.randn(h, n, device=dev, dtype=torch.bfloat16) / 64
    x = torch.randn(b * args.seq // world, h, device=dev, dtype=torch.bfloat16)
    a = torch.randn(b * args.seq, n, device=dev, dtype=torch.bfloat16)
    gathered = torch.empty(b * args.seq, h, device=dev, dtype=torch.bfloat16)
    ops = torch.ops.commfuse_comm
    cases = {
        "all-gather + matmul, chunked": lambda: ops.all_gather_mm(x, [wq.t()], group, world, None),
        "c10d all-gather, then matmul": lambda: funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group)) @ wq.t(),
        "the matmul alone": lambda: gathered @ wq.t(),
        "matmul + reduce-scatter, chunked": lambda: ops.mm_reduce_scatter([a], [wo.t()], "sum", group, world, None),
        "matmul, then c10d reduce-scatter": lambda: funcol.wait_tensor(funcol.reduce_scatter_tensor(a @ wo.t(), "sum", 0, group)),
        "one barrier of the ops": lambda: async_tp._barrier(async_tp._workspace(group, dev, 1 << 20, None), group),
    }
    for name, fn in cases.items():
        h_us, g_us = host_us(fn), timing.cuda_graph_time_us(fn, iters=10)
        if rank == 0:
            print(f"S={args.seq} W={world} {name}: host {h_us:.1f} µs/call; GPU (CUDA graph) {g_us:.1f} µs/call", flush=True)
    if args.profile:
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            cases["all-gather + matmul, chunked"]()
            cases["matmul + reduce-scatter, chunked"]()
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
