"""Whole models through the backend: a GPT-style block forward and backward, dynamic shapes."""
import math
import re
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import FileCheck

from commfuse import config
from tests.common import ALLOC, DEVICE, compile_and_run, count


class Block(nn.Module):
    """Embedding -> LayerNorm -> causal attention (softmax) -> LayerNorm -> GELU MLP -> logits."""

    def __init__(self, vocab=64, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_block_forward_backward(tmp_path):
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    ref = Block().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (2, 8), device=DEVICE)
    targets = torch.randint(0, 64, (2, 8), device=DEVICE)
    loss, dumps = compile_and_run(model, tokens, targets, tmp_path=tmp_path)
    loss.backward()
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    got, want = _grads(model), _grads(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    kinds = sorted(os.path.basename(g).split("_")[1] for g in dumps.graphs())
    assert kinds == ["backward", "forward"]


def test_dynamic_batch_compiles_at_most_twice():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("commfuse")
    fn = lambda x, w: F.layer_norm(torch.relu(x @ w), (w.shape[1],)).sum(-1)  # noqa: E731
    compiled = torch.compile(fn, backend=counter, dynamic=True)
    w = torch.randn(16, 24, device=DEVICE)
    for b in (3, 5, 9):
        x = torch.randn(b, 16, device=DEVICE)
        torch.testing.assert_close(compiled(x, w), fn(x, w), atol=1e-5, rtol=1e-5)
    assert counter.frame_count <= 2


def test_dynamic_sizes_are_symbolic_in_the_code(tmp_path):
    fn = lambda x: (x * 2).softmax(-1)  # noqa: E731
    x = torch.randn(5, 40, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, dynamic=True)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    # the sizes are symbols bound at run time, not the example's 5 x 40
    rows, cols = re.findall(r"^    (s\d+) = arg\d+_1$", code, re.M)
    FileCheck().check(f"{ALLOC}(({rows}, {cols}), ({cols}, 1)").check(f"(_stream, (cdiv({rows}, ").run(code)
    count(code, "cdiv(5,", 0)
    assert len(summary["kernels"]) == 1


def test_a_float_of_the_sizes_is_a_scalar_the_wrapper_computes(tmp_path):
    """x * (1 / (n - 1)) under dynamic shapes: the factor is a SymFloat, which aten turns into a
    0-d tensor (scalar_tensor). That tensor failed to lower (a constant that is a symbol), and the
    whole graph fell back to aten."""
    fn = lambda x: x * (1.0 / (x.shape[0] - 1))  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="commfuse", dynamic=True)
    with config.patch(dump_dir=str(tmp_path), fallback_on_error=False):
        for n in (9, 5, 17):
            x = torch.randn(n, 4, device=DEVICE, requires_grad=True)
            y = compiled(x)
            torch.testing.assert_close(y, fn(x))
            torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.full_like(x, 1 / (n - 1)))


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_sizes_torch_computes_through_floats(mode):
    """interpolate by a scale factor under dynamic shapes: the output's size is
    TruncToInt(1.5 * ToFloat(s0)), which the wrapper printed as is (a NameError at the first call)
    and kernels could not print. It is now a size of its own, computed on the host as torch does."""
    fn = lambda x: F.interpolate(x, scale_factor=1.5, mode=mode) * 2  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="commfuse", dynamic=True)
    with config.patch(fallback_on_error=False):
        for n in (7, 10):
            x = torch.randn(1, 2, n, n + 1, device=DEVICE, requires_grad=True)
            y = compiled(x)
            torch.testing.assert_close(y, fn(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0],
                                       torch.autograd.grad(fn(x).sum(), x)[0], atol=1e-5, rtol=1e-5)


def test_a_float_of_the_sizes_keeps_float64():
    """var's backward under dynamic shapes scales by 2 / (n - 1), a float the wrapper computes.
    Passed to the kernel as Triton types a Python float (fp32), float64 gradients carried fp32
    rounding (1.5e-8 relative)."""
    x = torch.randn(11, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, device=DEVICE, dtype=torch.float64)
    torch._dynamo.reset()
    got, = torch.autograd.grad(torch.compile(lambda t: t.var(0), backend="commfuse", dynamic=True)(x), x, g)
    want, = torch.autograd.grad(x.var(0), x, g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_checkpointed_dropout_compiles_and_replays_its_mask():
    """Dropout inside checkpoint(use_reentrant=False): AOTAutograd saves the RNG state around the
    random op (run_and_save_rng_state, replayed by run_with_rng_state in the backward). Those
    nodes carry no value, so their outputs were lost and both graphs fell back to aten whole."""
    from torch.utils.checkpoint import checkpoint
    from commfuse import backend

    def fn(x):
        return checkpoint(lambda y: F.dropout(y * 2.0, 0.5, True).sin(), x, use_reentrant=False)
    x = torch.randn(64, 64, device=DEVICE, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    before = len(backend.summaries)
    y = torch.compile(fn, backend="commfuse")(x)
    grad, = torch.autograd.grad(y.sum(), x)
    assert [s["compiled"] for s in backend.summaries[before:]] == [True, True]
    kept = y != 0  # the backward replays the forward's mask
    assert 0.3 < kept.double().mean().item() < 0.7
    torch.testing.assert_close(grad, torch.where(kept, torch.cos(4 * x) * 4, torch.zeros_like(x)))
