"""Data-parallel training with commfuse, checked step by step against eager PyTorch.

    torchrun --standalone --nproc-per-node 2 launch/train_example.py
    python launch/train_example.py                      # one rank, no torchrun

Every rank builds the same small transformer-style model (same seed), takes its own shard of each
global batch, and runs forward + backward through `torch.compile(model, backend="commfuse")`. The
gradients are averaged with a plain `torch.distributed.all_reduce` after backward, outside the
compiled region, and a plain SGD step follows. An eager copy of the model takes the same steps; loss
and every gradient are compared on every step.

Environment:
    COMMFUSE_EXAMPLE_BACKEND   torch.compile backend to use (default commfuse; `eager` or `inductor`
                               to check the script itself)
    COMMFUSE_EXAMPLE_DEVICE    `cpu` to stay on the CPU even where CUDA is available
    COMMFUSE_DUMP_DIR          per-rank dumps of what commfuse generated (read by the backend)
On CPU, commfuse runs its Triton kernels in Triton's interpreter, so the defaults are kept small.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _util import init_distributed, max_abs_diff, now, resolve_backend


class Block(nn.Module):
    """Pre-norm transformer block: single-head attention + GELU MLP."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyModel(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        logits = self.head(h.mean(dim=1))  # pool over the sequence
        return F.cross_entropy(logits, target)


def train_step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach()


def average_grads(model, world_size: int) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=os.environ.get("COMMFUSE_EXAMPLE_BACKEND", "commfuse"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-3)
    args = ap.parse_args()

    d = init_distributed()
    backend = resolve_backend(args.backend)
    d.print0(f"commfuse train example: backend={args.backend} world_size={d.world_size} device={d.device}")

    torch.manual_seed(0)  # identical initial weights on every rank
    eager = TinyModel(args.features, args.hidden, args.classes, args.layers).to(d.device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend)

    eager_opt = torch.optim.SGD(eager.parameters(), lr=args.lr)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    names = [n for n, _ in model.named_parameters()]

    step_times, worst_loss, worst_grad = [], 0.0, 0.0
    for step in range(args.steps):
        # One global batch per step (same on all ranks); each rank trains on its own shard of it.
        g = torch.Generator().manual_seed(1000 + step)
        gx = torch.randn(d.world_size * args.batch, args.seq, args.features, generator=g)
        gy = torch.randint(0, args.classes, (d.world_size * args.batch,), generator=g)
        shard = slice(d.rank * args.batch, (d.rank + 1) * args.batch)
        x, y = gx[shard].to(d.device), gy[shard].to(d.device)

        t0 = now(d.device)
        loss = train_step(compiled, x, y)
        t1 = now(d.device)
        ref_loss = train_step(eager, x, y)

        # Compare before the all-reduce: a mismatch points at this rank's compiled graph.
        loss_diff = max_abs_diff(loss, ref_loss)
        grad_diffs = {
            n: max_abs_diff(p.grad, q.grad) for n, p, q in zip(names, model.parameters(), eager.parameters())
        }
        torch.testing.assert_close(loss, ref_loss, atol=args.atol, rtol=args.rtol)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=args.atol, rtol=args.rtol, msg=lambda m, n=n: f"grad of {n}: {m}")

        average_grads(model, d.world_size)
        average_grads(eager, d.world_size)
        opt.step()
        eager_opt.step()

        worst_grad_name = max(grad_diffs, key=grad_diffs.get)
        worst_loss = max(worst_loss, loss_diff)
        worst_grad = max(worst_grad, grad_diffs[worst_grad_name])
        step_times.append(t1 - t0)
        d.print(
            f"step {step}: loss {loss.item():.6f} (eager {ref_loss.item():.6f}, |diff| {loss_diff:.2e}) "
            f"max |grad diff| {grad_diffs[worst_grad_name]:.2e} ({worst_grad_name}) "
            f"fwd+bwd {1e3 * (t1 - t0):.1f} ms{' (includes compile)' if step == 0 else ''}"
        )

    # After identical all-reduced updates, parameters must agree with eager, and across ranks.
    worst_param = max(max_abs_diff(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    sums = [torch.zeros_like(checksum) for _ in range(d.world_size)]
    dist.all_gather(sums, checksum)
    assert all(torch.equal(s, sums[0]) for s in sums), f"ranks disagree on parameters: {sums}"

    stats = torch.tensor([worst_loss, worst_grad, worst_param], device=d.device, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    steady = step_times[1:] or step_times
    d.print0(
        f"summary: {args.steps} steps on {d.world_size} rank(s), backend={args.backend}: "
        f"first step (with compile) {step_times[0]:.2f} s, later steps {1e3 * sum(steady) / len(steady):.1f} ms avg; "
        f"max |diff| vs eager over all ranks: loss {stats[0]:.2e}, grad {stats[1]:.2e}, params {stats[2]:.2e}. OK"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
