"""Tensor-parallel training with commfuse, checked step by step against eager PyTorch.

    torchrun --standalone --nproc-per-node 2 launch/train_example.py
    python launch/train_example.py                      # one rank, no torchrun

A small Llama-style model (RMSNorm, causal attention, SwiGLU MLP) is split over the ranks with
DTensor's tensor parallelism: q/k/v and the MLP's gate/up projections column-parallel, the output
projections row-parallel. Each row-parallel output is all-reduced inside the compiled graph (and
the column-parallel inputs' gradients in the backward graph): commfuse makes each all-reduce a comm
kernel over symmetric memory and fuses its neighbours into it (the residual add and the next
RMSNorm). An eager copy of the same tensor-parallel model takes the same SGD steps; the loss and
every gradient are compared on every step. At the end each rank reports what commfuse compiled:
the comm plans (algorithm and why), the kernels, and what each comm kernel fused.

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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head_dim = head_dim

    def forward(self, x):
        b, t, _ = x.shape  # under tensor parallelism, q/k/v hold this rank's heads only
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, dim // heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))  # all-reduce + add + RMSNorm: one comm kernel
        return h + self.mlp(self.mlp_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), targets.flatten())


def tensor_parallel(model: TinyLlama, device: torch.device, world: int) -> TinyLlama:
    """Megatron-style: column-parallel in, row-parallel out (an all-reduce after each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(device.type, (world,))
    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}
    for blk in model.blocks:
        parallelize_module(blk, mesh, plan)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def report(summaries: list) -> list[str]:
    """What commfuse compiled on this rank, from its summaries (the dumps' summary.json)."""
    lines = []
    for s in summaries:
        if not s.get("compiled", True):
            lines.append(f"{s['graph_id']}: not compiled ({s['fallback_reason']})")
            continue
        kernels, comm = s["kernels"], [k for k in s["kernels"] if k.get("collective")]
        lines.append(f"{s['graph_id']}: {len(kernels)} kernels ({len(comm)} comm), {len(s['extern_calls'])} extern calls "
                     f"({', '.join(sorted(set(s['extern_calls'])))}), {s['compile_seconds']:.1f} s"
                     f"{' from the ' + s['cache'] + ' cache' if s.get('cache') else ''}")
        for p in s["comm_plans"]:
            k = next((k for k in comm if p["result"] in k["nodes"]), None)
            fused = "runs through c10d" if k is None else f"comm kernel {k['name']}" + (
                ", with its producer" if p["buffer"] in k["nodes"] else "") + (
                f", fused with {len(k['nodes']) - 1 - (p['buffer'] in k['nodes'])} epilogue node(s) "
                f"({' + '.join(k['name'].split('_')[2:-1])})")
            lines.append(f"  {p['collective']} {p['reduce_op']} of {p['buffer']} over group {p['group']}: "
                         f"{p['algorithm']} ({p['reason']}); {fused}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=os.environ.get("COMMFUSE_EXAMPLE_BACKEND", "commfuse"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4, help="a multiple of the number of ranks")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-3)
    args = ap.parse_args()

    d = init_distributed()
    backend = resolve_backend(args.backend)
    d.print0(f"commfuse train example: tensor-parallel, backend={args.backend} world_size={d.world_size} device={d.device}")

    torch.manual_seed(0)  # identical initial weights on every rank, each then keeps its shard
    base = TinyLlama(args.vocab, args.dim, args.heads, args.hidden, args.layers).to(d.device)
    eager = tensor_parallel(copy.deepcopy(base), d.device, d.world_size)
    model = tensor_parallel(base, d.device, d.world_size)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    # per parameter: a foreach step (CUDA's default) mixes the sharded DTensors and the plain
    # replicated parameters in one list, which DTensor refuses, whatever the backend
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=args.lr, foreach=False) for m in (model, eager))
    names = [n for n, _ in model.named_parameters()]

    step_times, worst_loss, worst_grad = [], 0.0, 0.0
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 + step)  # tensor parallelism: the same batch on every rank
        tokens, targets = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(d.device)
                           for _ in range(2))
        t0 = now(d.device)
        loss = compiled(tokens, targets)
        loss.backward()
        t1 = now(d.device)
        ref = eager(tokens, targets)
        ref.backward()

        torch.testing.assert_close(loss, ref, atol=args.atol, rtol=args.rtol)
        grad_diffs = {}
        for n, p, q in zip(names, model.parameters(), eager.parameters()):
            torch.testing.assert_close(local(p.grad), local(q.grad), atol=args.atol, rtol=args.rtol,
                                       msg=lambda m, n=n: f"grad of {n}: {m}")
            grad_diffs[n] = max_abs_diff(local(p.grad), local(q.grad))
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad(set_to_none=True)

        worst = max(grad_diffs, key=grad_diffs.get)
        worst_loss, worst_grad = max(worst_loss, max_abs_diff(loss, ref)), max(worst_grad, grad_diffs[worst])
        step_times.append(t1 - t0)
        d.print(f"step {step}: loss {loss.item():.6f} (eager {ref.item():.6f}) max |grad diff| {grad_diffs[worst]:.2e} "
                f"({worst}) fwd+bwd {1e3 * (t1 - t0):.1f} ms{' (includes compile)' if step == 0 else ''}")

    worst_param = max(max_abs_diff(local(p), local(q)) for p, q in zip(model.parameters(), eager.parameters()))
    stats = torch.tensor([worst_loss, worst_grad, worst_param], device=d.device, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if args.backend == "commfuse":
        from commfuse.compiled import summaries
        reports = [None] * d.world_size
        dist.all_gather_object(reports, report(summaries))
        for r, lines in enumerate(reports):
            d.print0("\n".join([f"[rank{r}] what commfuse compiled:"] + [f"[rank{r}]   {line}" for line in lines]))
    steady = step_times[1:] or step_times
    d.print0(
        f"summary: {args.steps} steps on {d.world_size} rank(s), backend={args.backend}: "
        f"first step (with compile) {step_times[0]:.2f} s, later steps {1e3 * sum(steady) / len(steady):.1f} ms avg; "
        f"max |diff| vs eager over all ranks: loss {stats[0]:.2e}, grad {stats[1]:.2e}, params {stats[2]:.2e}. OK"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
