"""Where the time of a comm kernel goes (GPU, torchrun): a diagnostic, not a benchmark table.

    torchrun --standalone --nproc-per-node 2 tools/comm_probe.py --out DIR

1. Barrier cost: kernels that do nothing but n barriers (n = 1, 2, 4) with 1, 8 and 64 programs,
   each way of writing the barrier (Triton atomics or inline PTX; relaxed or release signal),
   timed under CUDA graphs; the PTX of the one-barrier kernels goes to DIR.
2. Per-kernel GPU time of the all-reduce + residual + RMSNorm step (no CUDA graph, so kernels
   are timed one by one by the profiler): commfuse vs Inductor with auto_select, B = 1, 8, 32.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from codegen.comm import barrier_lines  # noqa: E402
from codegen.common import IndentedBuffer  # noqa: E402
from commfuse.runtime.loader import load_module  # noqa: E402
from commfuse.runtime.symm import SymmPool, signal_stride  # noqa: E402
from commfuse.tune import cuda_graph_time_us  # noqa: E402


def barrier_kernel(world: int, n: int, inline_ptx: bool, release: bool) -> str:
    params = {f"@sig{r}": f"sig{r}" for r in range(world)} | {"@sig_own": "sig_own", "@rank": "rank"}
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def barriers({', '.join(f'sig{r}' for r in range(world))}, sig_own, rank):")
    with code.indent():
        code.writeline(f"slot = tl.program_id(0) * {signal_stride(world)}")
        code.writeline("epoch = tl.load(sig_own + slot + rank, volatile=True)")
        for _ in range(n):
            for line in barrier_lines(world, params, release, inline_ptx):
                code.writeline(line)
        code.writeline("tl.store(sig_own + slot + rank, epoch)")
    return "import triton\nimport triton.language as tl\nconstants = {}\n" + code.getvalue()


def barrier_costs(out_dir, rank, world, dev):
    """µs per kernel of n barriers, for each way of writing the barrier."""
    pool = SymmPool(dist.group.WORLD.group_name, dev, 4096)
    lines = ["| barrier | n | 1 program | 8 programs | 64 programs |", "|---|---|---|---|---|"]
    for inline_ptx in (False, True):
        for release in (False, True):
            name = f"{'ptx' if inline_ptx else 'atomics'} {'release' if release else 'relaxed'}"
            for n in (1, 2, 4):
                k = load_module(barrier_kernel(world, n, inline_ptx, release), {})[0].barriers
                row = []
                for progs in (1, 8, 64):
                    fn = lambda: k[(progs,)](*pool.signals, pool.signals[rank], rank, num_warps=8)  # noqa: E731
                    compiled = fn()  # a launch returns the compiled kernel
                    torch.cuda.synchronize()
                    row.append(cuda_graph_time_us(fn))
                    if n == 1 and progs == 1 and rank == 0 and hasattr(compiled, "asm"):
                        with open(os.path.join(out_dir, f"barrier_{name.replace(' ', '_')}.ptx"), "w") as f:
                            f.write(compiled.asm["ptx"])
                lines.append(f"| {name} | {n} | " + " | ".join(f"{t:.1f}" for t in row) + " |")
    return lines


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def kernel_times(rank, dev, H=4096):
    from torch.profiler import ProfilerActivity, profile
    import torch._inductor.config as ic
    g = dist.group.WORLD
    w = torch.ones(H, device=dev, dtype=torch.bfloat16)

    def step(x, res):
        h = funcol.all_reduce(x * 1.0, "sum", g) + res
        return rms_norm(h, w), h
    lines = []
    for backend in ("commfuse", "inductor"):
        torch._dynamo.reset()
        ic._collective.auto_select = backend == "inductor"
        fn = torch.compile(step, backend=backend, dynamic=False)
        for B in (1, 8, 32):
            x = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
            r = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
            for _ in range(5):
                fn(x, r)
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn(x, r)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.count >= 20:
                    lines.append(f"{backend} B={B} H={H}: {e.key[:70]:70s} {e.device_time / 1:8.1f} us x{e.count}")
    ic._collective.auto_select = False
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    lines = [f"Barrier-only kernels, {world}x {torch.cuda.get_device_name()}, µs per kernel under CUDA graphs:", ""]
    lines += barrier_costs(args.out, rank, world, dev)
    lines += ["", "Per-kernel GPU time (profiler, no CUDA graph), all-reduce + residual + RMSNorm:", ""]
    lines += kernel_times(rank, dev)
    if rank == 0:
        print("\n".join(lines))
        with open(os.path.join(args.out, "comm_probe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
