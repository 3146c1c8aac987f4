"""Tensor-parallel decode loop with the all-reduce inside the compiled function.

    torchrun --standalone --nproc-per-node 2 launch/decode_example.py
    python launch/decode_example.py                     # one rank, no torchrun

Each layer is a Megatron-style MLP: a column-parallel linear (each rank holds a slice of W1's
columns), GELU, then a row-parallel linear (each rank holds the matching slice of W2's rows) whose
partial products x_shard @ W2_shard are summed over the ranks with
`torch.distributed._functional_collectives.all_reduce`, followed by a residual add and RMSNorm:

    y = rms_norm(x + all_reduce(gelu(x @ W1_shard) @ W2_shard, "sum")) * g

The collective is traced into the graph, so commfuse sees all-reduce -> add -> RMSNorm as one
region it may fuse (on GPU: a symmetric-memory all-reduce with the add and norm as its epilogue).
Every decode step is checked against the same function run eagerly, and against the unsharded
computation (full W1, W2) done locally.

Environment: COMMFUSE_EXAMPLE_BACKEND (default commfuse), COMMFUSE_EXAMPLE_DEVICE=cpu,
COMMFUSE_DUMP_DIR (see launch/train_example.py).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from _util import init_distributed, max_abs_diff, now, resolve_backend


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g


def decode_step(x, layers, group):
    """One token through all layers on this rank's shards. layers: [(w1_shard, w2_shard, g)]."""
    for w1, w2, g in layers:
        partial = F.gelu(x @ w1) @ w2  # this rank's share of the row-parallel output
        x = rms_norm(x + funcol.all_reduce(partial, "sum", group), g)
    return x


def reference_step(x, full_layers):
    for w1, w2, g in full_layers:
        x = rms_norm(x + F.gelu(x @ w1) @ w2, g)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=os.environ.get("COMMFUSE_EXAMPLE_BACKEND", "commfuse"))
    ap.add_argument("--steps", type=int, default=8, help="decode steps (tokens)")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256, help="MLP width, divided among the ranks")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-3)
    args = ap.parse_args()

    d = init_distributed()
    backend = resolve_backend(args.backend)
    assert args.ffn % d.world_size == 0, "--ffn must be divisible by the world size"
    d.print0(f"commfuse decode example: backend={args.backend} world_size={d.world_size} device={d.device}")

    # Full weights from one seed on every rank; each rank keeps its slice.
    torch.manual_seed(0)
    full, shards = [], []
    per = args.ffn // d.world_size
    cols = slice(d.rank * per, (d.rank + 1) * per)
    for _ in range(args.layers):
        w1 = torch.randn(args.hidden, args.ffn) * args.hidden**-0.5
        w2 = torch.randn(args.ffn, args.hidden) * args.ffn**-0.5
        g = 1 + 0.1 * torch.randn(args.hidden)
        full.append(tuple(t.to(d.device) for t in (w1, w2, g)))
        shards.append(tuple(t.contiguous().to(d.device) for t in (w1[:, cols], w2[cols, :], g)))

    group = dist.group.WORLD
    step_fn = torch.compile(decode_step, backend=backend)

    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1)).to(d.device)
    x_eager, times, worst_eager, worst_ref = x.clone(), [], 0.0, 0.0
    for step in range(args.steps):
        t0 = now(d.device)
        y = step_fn(x, shards, group)
        t1 = now(d.device)
        y_eager = decode_step(x_eager, shards, group)
        y_ref = reference_step(x_eager, full)
        de, dr = max_abs_diff(y, y_eager), max_abs_diff(y, y_ref)
        torch.testing.assert_close(y, y_eager, atol=args.atol, rtol=args.rtol)
        torch.testing.assert_close(y, y_ref, atol=args.atol, rtol=args.rtol)
        worst_eager, worst_ref = max(worst_eager, de), max(worst_ref, dr)
        times.append(t1 - t0)
        d.print(
            f"step {step}: max |diff| vs eager {de:.2e}, vs unsharded {dr:.2e}, "
            f"{1e3 * (t1 - t0):.2f} ms{' (includes compile)' if step == 0 else ''}"
        )
        x, x_eager = y, y_eager  # feed the output back in, as a decode loop does

    stats = torch.tensor([worst_eager, worst_ref], dtype=torch.float64, device=d.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    steady = times[1:] or times
    d.print0(
        f"summary: {args.steps} decode steps, {args.layers} layers on {d.world_size} rank(s), backend={args.backend}: "
        f"first step (with compile) {times[0]:.2f} s, later steps {1e3 * sum(steady) / len(steady):.2f} ms avg; "
        f"max |diff| over all ranks: vs eager {stats[0]:.2e}, vs unsharded {stats[1]:.2e}. OK"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
