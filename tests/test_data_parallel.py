"""Data parallelism around a compiled model. DDP splits Dynamo's graph at its gradient buckets
(DDPOptimizer) and compiles each piece; the first call of each piece is made with fake tensors at
compile time. FSDP2 shards a model whose layers are compiled one by one, its all-gathers and
reduce-scatters in hooks around them. Losses and gradients match the same wrapper run eagerly."""
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.dist_utils import SharedRanks, device, run_ranks

pytestmark = pytest.mark.xdist_group("data_parallel")  # one worker: its checks share a spawn


def _ddp_steps(rank, world, steps=2):
    from commfuse import backend
    before = len(backend.summaries)
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
    return [(s["graph_id"], s["compiled"]) for s in backend.summaries[before:]], worst


def test_ddp_buckets_compile_and_match_eager():
    for graphs, _ in SHARED.result(_ddp_steps):
        forward = [g for g, _ in graphs if "_forward_" in g]
        assert len(forward) >= 2, graphs  # the graph was split at a bucket boundary
        assert all(ok for _, ok in graphs), graphs


def _fsdp_steps(rank, world, options, steps=3):
    """FSDP2 (fully_shard per layer and at the root), each layer compiled as torchtitan does,
    against the same sharded model run eagerly."""
    from bench.llama import Config, fsdp_llama
    from commfuse import backend
    cfg = Config(dim=32, n_heads=4, n_kv_heads=2, ffn=64, n_layers=2, max_batch=1, max_seq=8)
    eager, compiled = fsdp_llama(cfg, device()), fsdp_llama(cfg, device())
    before = len(backend.summaries)
    for layer in compiled.layers:
        layer.compile(backend="commfuse", options=options)
    torch.manual_seed(1 + rank)  # each rank its own batch
    x = torch.randn(2, 8, 32, device=device())
    for _ in range(steps):
        losses = [m(x).square().mean() for m in (compiled, eager)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(*losses, atol=1e-5, rtol=1e-5)
        for p, q in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), atol=1e-5, rtol=1e-5)
            p.grad = q.grad = None
    return [(s["graph_id"], s["compiled"]) for s in backend.summaries[before:]]


# DDP and FSDP2 (plain) in one spawn
SHARED = SharedRanks([_ddp_steps, (_fsdp_steps, ({},))], 2)


@pytest.mark.parametrize("options", [{}, pytest.param({"cuda_graphs": True}, marks=pytest.mark.gpu)],
                         ids=["plain", "cuda_graphs"])
def test_fsdp2_per_layer_compile_matches_eager(options):
    """(In CUDA-graph mode the layers share one compiled code, and FSDP2 frees each layer's
    gathered weights after its forward: the next layer's may land at the same address.)"""
    for graphs in (SHARED.result(_fsdp_steps, {}) if not options else run_ranks(_fsdp_steps, world=2, args=(options,))):
        assert any("_forward_" in g for g, _ in graphs) and any("_backward_" in g for g, _ in graphs), graphs
        assert all(ok for _, ok in graphs), graphs
