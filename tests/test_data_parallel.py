"""Data parallelism around a compiled model: DDP splits Dynamo's graph at its gradient buckets
(DDPOptimizer) and compiles each piece; the first call of each piece is made with fake tensors at
compile time. Losses and gradients match eager DDP."""
import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.dist_utils import device, run_ranks


def _ddp_steps(rank, world, steps=2):
    from commfuse import backend
    dev = device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)],
                                torch.nn.Linear(256, 10)).to(dev)
    eager = DDP(copy.deepcopy(model), bucket_cap_mb=1)
    compiled = DDP(torch.compile(model, backend="commfuse"), bucket_cap_mb=1)  # 1 MB: several buckets
    torch.manual_seed(1 + rank)
    x, t = torch.randn(8, 256, device=dev), torch.randint(0, 10, (8,), device=dev)
    worst = 0.0
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(compiled(x), t)
        loss.backward()
        ref = torch.nn.functional.cross_entropy(eager(x), t)
        ref.backward()
        assert type(loss) is torch.Tensor  # a real tensor, not a fake one left from compiling
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for p, q in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    return [(s["graph_id"], s["compiled"]) for s in backend.summaries], worst


def test_ddp_buckets_compile_and_match_eager():
    for graphs, _ in run_ranks(_ddp_steps, world=2):
        forward = [g for g, _ in graphs if "_forward_" in g]
        assert len(forward) >= 2, graphs  # the graph was split at a bucket boundary
        assert all(ok for _, ok in graphs), graphs
