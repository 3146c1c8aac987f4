"""Async-TP (passes/async_tp.py, runtime/async_tp.py): all-gather → matmuls and matmuls →
reduce-scatter run as chunked ops; values against eager, forward and backward, and the rewrite in
the plan and the generated code; the policy's reasons."""
import glob
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.testing import FileCheck

from commfuse import choices as choices_mod, config
from commfuse.collectives import CommRequest
from tests.dist_utils import device, run_ranks


def _blocks(rank, world, dump_dir, dtype):
    """A sequence-parallel SwiGLU MLP (gathered along the sequence dim, scattered back: DTensor's
    reordering around dim 0) and an all-gather along dim 0 that feeds two matmuls, with an avg
    reduce-scatter of one matmul; forward and backward against eager."""
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    torch.manual_seed(0)
    h, f = 16, 8 * world
    params = [torch.randn(*s, device=device(), dtype=dtype) / 4
              for s in ((f // world, h), (f // world, h), (h, f // world), (6, h), (5, h), (h, 6))]

    def fn(x, y, w1, w3, w2, wq, wk, wo):
        full = funcol.all_gather_tensor_autograd(x, 1, g)
        mlp = funcol.reduce_scatter_tensor_autograd(
            (torch.nn.functional.silu(full @ w1.t()) * (full @ w3.t())) @ w2.t(), "sum", 1, g)
        rows = funcol.all_gather_tensor_autograd(y, 0, g)
        q, k = rows @ wq.t(), rows @ wk.t()
        attn = funcol.reduce_scatter_tensor_autograd(torch.tanh(q) @ wo.t(), "sum", 0, g)
        return mlp, attn, k

    def run(f, args, cast):  # outputs and gradients, in fp32
        args = [a.detach().to(cast).requires_grad_() for a in args]
        out = f(*args)
        sum(o.float().pow(2).sum() for o in out).backward()  # (NCCL wants contiguous gradients)
        return [t.float() for t in (*out, *(a.grad for a in args))]

    torch.manual_seed(rank + 1)
    args = [torch.randn(2, 3, h, device=device(), dtype=dtype), torch.randn(4, h, device=device(), dtype=dtype), *params]
    exact, eager = run(fn, args, torch.float32), run(fn, args, dtype)
    torch._dynamo.reset()
    with config.patch({"dump_dir": dump_dir, "comm.async_tp": "on"}):
        got = run(torch.compile(fn, backend="commfuse", dynamic=False), args, dtype)
    for i, (o, e, r) in enumerate(zip(got, eager, exact)):  # as close to fp32 as eager is, in its dtype
        scale = max(1.0, r.abs().max().item())
        bound = 2 * (e - r).abs().max().item() + (1e-5 if dtype == torch.float32 else 1e-2) * scale
        assert (o - r).abs().max().item() <= bound, (i, (o - r).abs().max().item(), bound)
    return True


def _both_dtypes(rank, world, dump_dir):  # one spawn: fp32 dumped, then bf16
    return _blocks(rank, world, dump_dir, torch.float32) and _blocks(rank, world, None, torch.bfloat16)


def test_sequence_parallel_blocks_match_eager_two_ranks(tmp_path):
    run_ranks(_both_dtypes, 2, args=(str(tmp_path),))
    for kind in ("forward", "backward"):
        (path,) = glob.glob(f"{tmp_path}/rank0/*_{kind}_*/summary.json")
        s = json.load(open(path))
        plans = [(p["collective"], p["algorithm"]) for p in s["comm_plans"]]
        # every collective runs with its matmuls: none is left to c10d or to a kernel of its own
        assert plans and all(a == "async_tp" for _, a in plans), plans
        assert {c for c, _ in plans} == {"all_gather_into_tensor", "reduce_scatter_tensor"}, plans
        code = open(os.path.join(os.path.dirname(path), "output_code.py")).read()
        assert "_c10d_functional" not in code
        if kind == "forward":  # the two gathers feed three matmuls; the scatters follow their matmuls
            FileCheck().check("commfuse_comm.all_gather_mm").check("commfuse_comm.mm_reduce_scatter") \
                .check("commfuse_comm.all_gather_mm").check("commfuse_comm.mm_reduce_scatter").run(code)
            assert code.count("aten.mm") == 0, "a matmul of the forward ran apart from its collective"


@pytest.mark.world4
def test_bfloat16_four_ranks(tmp_path):
    run_ranks(_blocks, 4, args=(None, torch.bfloat16))


def _repeated_calls(rank, world):
    """The ops called again and again, new values at the same addresses each call (on a GPU their
    launches replay a CUDA graph from the third call), then at new addresses: every result is the
    collective's, as c10d computes it."""
    from commfuse.runtime import async_tp
    ops, group = torch.ops.commfuse_comm, dist.group.WORLD.group_name
    torch.manual_seed(rank)
    x, a = torch.empty(6, 16, device=device()), torch.empty(4 * world, 12, device=device())
    w, w2 = torch.randn(16, 8, device=device()), torch.randn(12, 5, device=device())
    for call in range(8):
        if call == 6:  # tensors elsewhere: a key never seen
            x, a = x.clone(), a.clone()
        x.normal_(), a.normal_()
        gathered, y = ops.all_gather_mm(x, [w], group, world, None)
        want = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(want, x)
        torch.testing.assert_close(gathered, torch.cat(want))
        torch.testing.assert_close(y, torch.cat(want) @ w, atol=1e-4, rtol=1e-4)
        del gathered, y, want  # (freed before the next call: a loop's allocator then hands out the same addresses)
        for op in ("sum", "avg"):
            got = ops.mm_reduce_scatter([a], [w2], op, group, world, None)
            total = a @ w2
            dist.all_reduce(total)
            want = total.view(world, 4, 5)[rank] / (world if op == "avg" else 1)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            del got, total, want
    torch.cuda.synchronize() if device().type == "cuda" else None
    return len(async_tp._replays.graphs)


def test_repeated_calls_match_c10d():
    graphs = run_ranks(_repeated_calls, 2)
    if torch.cuda.is_available():  # the replays ran: all-gather + matmul, and a scatter of each op
        assert all(n >= 3 for n in graphs), graphs


def test_policy(monkeypatch):
    """auto leaves the collectives alone (not measured to win in a training step); `on` or torch's
    _micro_pipeline_tp chunk wherever symmetric memory can run the collective; off never."""
    policy = choices_mod.Choices()
    monkeypatch.setattr(choices_mod.Choices, "comm_ineligible", lambda self, r: "")

    def why(op=""):
        return policy.async_tp(CommRequest("reduce_scatter_tensor", op, "0", torch.bfloat16, torch.device("cuda"), (8, 4)))
    assert "not measured to win" in why()
    with config.patch({"comm.async_tp": "off"}):
        assert why() == "comm.async_tp is off"
    with config.patch({"comm.async_tp": "on"}):
        assert why() == "" and why("max") == "reduce op max"
    monkeypatch.setattr(torch._inductor.config, "_micro_pipeline_tp", True)
    assert why() == ""
    with config.patch({"comm.async_tp": "off"}):  # ours, said explicitly, wins
        assert why() == "comm.async_tp is off"


def test_option_is_checked():
    with pytest.raises(ValueError, match="async_tp"):
        config.parse("comm.async_tp", "sometimes", "COMMFUSE_COMM_ASYNC_TP")
