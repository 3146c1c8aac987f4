"""flex_attention runs as its own eager implementation: the higher-order ops flex_attention and
flex_attention_backward, with their score_mod / mask_mod subgraphs and block-mask tensors, are
extern calls. Forward and backward (a captured bias's gradient too) match eager for causal and
document masks made inside or outside the compiled code, score_mods, GQA and the logsumexp; both
caches store such graphs and load them again with their subgraphs.

On CPU, torch's `flex_attention` refuses inputs that require grad (`_validate_device`) although
its eager implementation has a backward: the tests lift that one check, for eager and compiled
alike."""
from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from commfuse import backend, config
from tests.common import DEVICE, compile_and_run

B, H, S, D = 2, 4, 128, 16


@pytest.fixture(autouse=True)
def _cpu_backward(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(fa, "_validate_device", lambda *qkv: None)


def causal(b, h, q, kv):
    return q >= kv


def alibi(score, b, h, q, kv):
    return score - (h + 1) * 0.125 * (q - kv).abs()


def _bias():
    return torch.randn(H, S, S, device=DEVICE, requires_grad=True)


def mask_inside(q, k, v, bias):
    mask = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
    return flex_attention(q, k, v, block_mask=mask)


def learned_bias(q, k, v, bias):
    def score_mod(score, b, h, qi, ki):
        return score + bias[h, qi, ki]
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=_MASK[0])


def documents(q, k, v, bias):
    doc = torch.arange(S, device=q.device) // 48  # three documents, causal inside each

    def same_doc(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)
    return flex_attention(q, k, v, score_mod=alibi, block_mask=create_block_mask(same_doc, None, None, S, S, device=q.device))


def gqa(q, k, v, bias):
    return flex_attention(q, k[:, :1], v[:, :1], score_mod=alibi, block_mask=_MASK[0], enable_gqa=True)


def lse(q, k, v, bias):
    out, lse = flex_attention(q, k, v, block_mask=_MASK[0], return_lse=True)
    return out * lse.unsqueeze(-1).sigmoid()


_MASK = []  # made outside the compiled code, read as a global


@pytest.fixture(autouse=True)
def _mask():
    _MASK[:] = [create_block_mask(causal, B, H, S, S, device=DEVICE)]


def _run(fn, q, k, v, bias):
    out = fn(q, k, v, bias)
    out.backward(torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1)))
    grads = [t.grad for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    return out.detach(), grads


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(B, H, S, D, device=DEVICE, requires_grad=True) for _ in range(3)] + [_bias()]


@pytest.mark.parametrize("fn", [mask_inside, learned_bias, documents, gqa, lse])
def test_forward_and_backward_match_eager(tmp_path, fn):
    inputs = _inputs()
    want = _run(fn, *inputs)
    got = _run(lambda *a: compile_and_run(fn, *a, tmp_path=tmp_path)[0], *inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[1][3] is not None) == (fn is learned_bias)
    summaries = [s for s in backend.summaries if "flex_attention" in s.get("fallback_reasons", {})
                 or "flex_attention_backward" in s.get("fallback_reasons", {})][-2:]
    assert [s["graph_id"].split("_")[1] for s in summaries] == ["forward", "backward"]
    assert all(s["compiled"] for s in summaries)


def test_a_block_mask_passed_in(tmp_path):
    def fn(q, k, v, mask):
        return flex_attention(q, k, v, score_mod=alibi, block_mask=mask) * 2
    q, k, v, _ = _inputs()
    mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 40), B, 1, S, S, device=DEVICE)
    want = _run(lambda *a: fn(*a[:3], mask), q, k, v, _bias())
    got = _run(lambda *a: compile_and_run(fn, *a[:3], mask, tmp_path=tmp_path)[0], q, k, v, _bias())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["graph", "AOTAutograd"])
def test_graphs_are_stored_and_loaded_with_their_subgraphs(tmp_path, cache):
    """Our graph cache takes the subgraphs from the live graph, AOTAutograd's stores them by value
    (as their code); the kernel options (a dict) are stored by value."""
    inputs = _inputs()
    want = _run(learned_bias, *inputs)
    sources = []
    for _ in range(2):
        torch._dynamo.reset()
        before = len(backend.summaries)
        with config.patch(cache_dir=str(tmp_path)), \
                torch._functorch.config.patch(enable_autograd_cache=cache == "AOTAutograd"):
            got = _run(torch.compile(learned_bias, backend="commfuse"), *inputs)
        sources.append([s["cache"] for s in backend.summaries[before:]])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sources == [[None, None], [cache, cache]], sources


@pytest.mark.parametrize("cache", ["graph", "AOTAutograd"])
def test_another_score_mod_is_another_entry(tmp_path, cache):
    """Graphs that differ only in a subgraph (a slope baked into the score_mod) are keyed apart."""
    def with_slope(slope):
        def fn(q, k, v, bias):
            def score_mod(score, b, h, qi, ki):
                return score - slope * (qi - ki).abs()
            return flex_attention(q, k, v, score_mod=score_mod)
        return fn
    inputs = _inputs()
    for slope in (0.5, 0.125):
        want = _run(with_slope(slope), *inputs)
        torch._dynamo.reset()
        before = len(backend.summaries)
        with config.patch(cache_dir=str(tmp_path)), \
                torch._functorch.config.patch(enable_autograd_cache=cache == "AOTAutograd"):
            got = _run(torch.compile(with_slope(slope), backend="commfuse"), *inputs)
        assert [s["cache"] for s in backend.summaries[before:]] == [None, None]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dynamic_sequence_length(tmp_path):
    """One graph for two lengths: the block mask's sizes are the graph's symbols."""
    def fn(q, k, v, bias):
        return mask_inside(q, k, v, bias) + alibi_out(q, k, v)

    def alibi_out(q, k, v):
        return flex_attention(q, k, v, score_mod=alibi)
    compiled = torch.compile(fn, backend="commfuse", dynamic=True)
    before = len(backend.summaries)
    with config.patch(dump_dir=str(tmp_path)):
        for seq in (256, 192):
            torch.manual_seed(seq)
            inputs = [torch.randn(1, 2, seq, D, device=DEVICE, requires_grad=True) for _ in range(3)] + [_bias()]
            torch.testing.assert_close(_run(compiled, *inputs), _run(fn, *inputs), atol=1e-5, rtol=1e-5)
    assert [s["graph_id"].split("_")[1] for s in backend.summaries[before:]] == ["forward", "backward"]


class Attention(torch.nn.Module):
    """torchtitan's layout: projections viewed as (B, L, N, H), transposed for flex_attention and
    back; grouped K/V heads; a learned per-head slope in the score_mod."""
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.slope = torch.nn.Parameter(torch.full((heads,), 0.1))

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        slope = self.slope

        def score_mod(score, b_, h, qi, ki):
            return score - slope[h] * (qi - ki)
        o = flex_attention(q, k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=mask,
                           enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1)) + x


def test_training_steps_of_an_attention_block():
    torch.manual_seed(0)
    model = Attention().to(DEVICE)
    ref = Attention().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="commfuse")
    mask = create_block_mask(causal, None, None, 64, 64, device=DEVICE)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for _ in range(2):
        x = torch.randn(2, 64, 64, device=DEVICE)
        for m, opt in zip((ref, compiled), opts):
            m(x, mask).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert model.slope.grad is None and not torch.equal(model.slope, torch.full_like(model.slope, 0.1))
