"""Attention: SDPA runs aten's fused attention kernel for the device, forward and backward, and
grouped-query attention passes K/V unrepeated (no copies), against eager."""
import pytest
import torch
import torch.nn.functional as F

from commfuse.passes.attention import contiguous_masks, use_sdpa_gqa
from tests.common import DEVICE, compile_and_run, count


def repeat_kv(x, n):
    """HF transformers' repeat_kv: each K/V head repeated for the n query heads sharing it."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def interleave(x, n):
    return torch.repeat_interleave(x, n, dim=1)


# On CUDA, bf16 as models run: flash attention takes grouped K/V there (fp32 goes to the math
# kernel, which repeats them itself). Tolerances follow the dtype.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


def _inputs(heads=8, kv_heads=2, seq=16, dim=32):
    torch.manual_seed(0)
    shapes = [(2, heads, seq, dim), (2, kv_heads, seq, dim), (2, kv_heads, seq, dim)]
    return [torch.randn(s, device=DEVICE, dtype=DTYPE, requires_grad=True) for s in shapes]


def _run(fn, inputs, tmp_path, **patch):
    out, dumps = compile_and_run(fn, *inputs, tmp_path=tmp_path, **patch)
    out.backward(torch.ones_like(out))
    grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    return out, grads, [dumps.summary(g) for g in dumps.graphs()]


def _allocated(summaries) -> int:
    return sum(a["bytes"] for s in summaries for a in s["buffers"] if "in_place_of" not in a)


@pytest.mark.parametrize("repeat", [repeat_kv, interleave])
def test_gqa_passes_kv_unrepeated(tmp_path, repeat):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat(k, 4), repeat(v, 4), is_causal=True) * 2
    inputs = _inputs()
    want = fn(*inputs)
    want.backward(torch.ones_like(want))
    want_grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None

    got, grads, summaries = _run(fn, inputs, tmp_path / "gqa")
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)
    assert all(s["compiled"] for s in summaries)
    assert any("scaled_dot_product" in c for s in summaries for c in s["extern_calls"])

    # the same program with the rewrite off materializes the repeated K and V
    _, _, copied = _run(fn, inputs, tmp_path / "copies", sdpa_gqa=False)
    kv_copy = 2 * 8 * 16 * 32 * DTYPE.itemsize  # one repeated K (or V)
    assert _allocated(copied) - _allocated(summaries) >= 2 * kv_copy, (_allocated(copied), _allocated(summaries))


def _rewrites(fn, inputs, rewrite=use_sdpa_gqa) -> int:
    """How many SDPA calls `rewrite` changes in the graph Dynamo captures of fn."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(rewrite(gm))
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*inputs)
    return sum(counts)


def test_gqa_rewrite_leaves_other_attention_alone():
    """Equal head counts, a repeat on another dim, or K and V repeated differently are not
    grouped-query attention; the HF pattern is."""
    q, k, v = (t.detach() for t in _inputs())
    k4, v4 = repeat_kv(k, 4), repeat_kv(v, 4)
    assert _rewrites(lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4)), (q, k, v)) == 1
    assert _rewrites(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k4, v4)) == 0
    assert _rewrites(lambda q, k, v: F.scaled_dot_product_attention(q, k.repeat_interleave(1, dim=2), v), (q, k4, v4)) == 0
    assert _rewrites(lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 4), v), (q, k, v4)) == 0


def t5_bias(q, k, v, table):
    """T5's relative position bias: gathered [q, k, heads], permuted to the heads' dim, a learned
    float mask whose last dim has stride `heads`."""
    s = q.shape[2]
    pos = torch.arange(s, device=q.device)
    bias = table[(pos[None, :] - pos[:, None]).clamp(-3, 3) + 3].permute(2, 0, 1)[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def keys_broadcast(q, k, v, keep):
    """A bool mask that varies along the queries only: stride 0 in its last dim."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :, None].expand(-1, 1, -1, k.shape[2]))


def rows_of_minus_inf(q, k, v, keep):
    """The same as a float mask: the masked queries' rows are all -inf."""
    bias = torch.where(keep, 0.0, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, :, None].expand(-1, 1, -1, k.shape[2]))


@pytest.mark.parametrize("fn", [t5_bias, keys_broadcast, rows_of_minus_inf])
@pytest.mark.parametrize("seq", [32, 9])
def test_strided_masks_reach_sdpa_in_rows(tmp_path, fn, seq):
    """A mask whose last dim is strided made CUDA's aten pick its math attention (fp32 scores
    written out) over a fused kernel. It reaches SDPA contiguous; on CUDA the compiled graph runs
    a fused kernel, forward and backward, its mask stored in rows aligned as the kernel needs (9
    keys: rows padded to 16). A query whose keys are all masked gets 0, as from the math kernel
    (a fused one gives other values there)."""
    q, k, v = _inputs(heads=4, kv_heads=4, seq=seq)
    extra = (torch.randn(7, 4, device=DEVICE, dtype=DTYPE, requires_grad=True) if fn is t5_bias else
             torch.rand(2, seq, device=DEVICE) > 0.2)
    assert _rewrites(fn, (q, k, v, extra), contiguous_masks) == 1
    assert _rewrites(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                     (q, k, v, torch.zeros(seq, seq, device=DEVICE, dtype=DTYPE)), contiguous_masks) == 0
    inputs = (q, k, v, extra)
    want = fn(*inputs)
    want.backward(torch.ones_like(want))
    want_grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    got, grads, summaries = _run(fn, inputs, tmp_path)
    for a, e in zip([got, *grads], [want, *want_grads]):  # bf16: the fused kernel rounds otherwise
        if e is not None:   # than the math kernel, and the bias's gradient sums many products
            torch.testing.assert_close(a, e, rtol=TOL["rtol"], atol=TOL["atol"] * max(1.0, e.abs().max().item()))
    if DEVICE == "cuda":  # aten's math attention is decomposed: no attention op is left to call
        calls = [c for s in summaries for c in s["extern_calls"]]
        assert sum("attention" in c for c in calls) == 2, calls  # forward and backward


def test_layers_sharing_a_mask_share_its_contiguous_copy():
    """T5 passes one position bias to every layer: one copy of it, not one per layer."""
    q, k, v = (t.detach() for t in _inputs(heads=4, kv_heads=4, seq=16))
    table = torch.randn(7, 4, device=DEVICE, dtype=DTYPE)
    graphs = []

    def backend(gm, example_inputs):
        contiguous_masks(gm)
        graphs.append(gm)
        return gm

    def two_layers(q, k, v, table):
        pos = torch.arange(16, device=q.device)
        bias = table[(pos[None, :] - pos[:, None]).clamp(-3, 3) + 3].permute(2, 0, 1)[None]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return F.scaled_dot_product_attention(h, k, v, attn_mask=bias)
    torch._dynamo.reset()
    got = torch.compile(two_layers, backend=backend)(q, k, v, table)
    torch.testing.assert_close(got, two_layers(q, k, v, table), **TOL)
    copies = [n for n in graphs[0].graph.nodes if n.target is torch.clone]
    assert len(copies) == 1, graphs[0].code


@pytest.mark.parametrize("train", [False, True])
def test_layers_recomputing_one_mask_store_it_once(tmp_path, train):
    """Layers that each compute the same mask from the same inputs (HF T5 adds the padding mask to
    the position bias in every layer) store it once, not once per layer, all alive from the kernel
    that computes them together: common subexpressions are eliminated (by AOTAutograd's
    partitioner in training, by commfuse in inference), attention without dropout included."""
    q, k, v = (t.detach().requires_grad_(train) for t in _inputs(heads=4, kv_heads=4, seq=16))
    table = torch.randn(7, 4, device=DEVICE, dtype=DTYPE)
    with torch.set_grad_enabled(train):
        got, dumps = compile_and_run(lambda q, k, v, t: t5_bias(t5_bias(q, k, v, t), k, v, t), q, k, v, table,
                                     tmp_path=tmp_path)
    torch.testing.assert_close(got, t5_bias(t5_bias(q, k, v, table), k, v, table), **TOL)
    mask_bytes = 4 * 16 * 16 * DTYPE.itemsize
    stored = [b["bytes"] for b in dumps.summary(dumps.graphs()[0])["buffers"]]
    assert stored.count(mask_bytes) == 1, stored


def test_attention_output_feeds_a_fused_kernel(tmp_path):
    """SDPA's output is a buffer like any other: the projection and residual after it compile."""
    q, k, v = _inputs(heads=4, kv_heads=4)
    w = torch.randn(32, 32, device=DEVICE, dtype=DTYPE, requires_grad=True)

    def fn(q, k, v, w):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.relu(a @ w + q).sum(-1)
    want = fn(q, k, v, w)
    got, dumps = compile_and_run(fn, q, k, v, w, tmp_path=tmp_path)
    torch.testing.assert_close(got, want, **(TOL if DTYPE == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)))
    summary = dumps.summary(dumps.graphs()[0])
    assert summary["kernels"] and any("scaled_dot_product" in c for c in summary["extern_calls"])


@pytest.mark.parametrize("q_len", [1, 4])
def test_math_attention_gradients(tmp_path, q_len):
    """SDPA's math kernel (fp32 on CUDA, or forced) decomposes into ops we lower; its backward
    reads activations the forward saved as transposed views. They must reach it in the strides
    its graph was traced with (a view in another order once gave a wrong grad of V)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4)) * 2
    torch.manual_seed(0)
    q = torch.randn(2, 8, q_len, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH):
        want = fn(q, k, v)
        want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
        got, _ = compile_and_run(fn, q, k, v, tmp_path=tmp_path, sdpa_gqa=False)
        grads = torch.autograd.grad(got, (q, k, v), torch.ones_like(got))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


class KernelChoice(torch.nn.Module):
    """torchtitan's SDPA: the call inside `sdpa_kernel(backends, set_priority=True)`, whose enter and
    exit Dynamo keeps in the graph as calls with no fake value; K/V repeated HF's way when grouped."""

    def __init__(self, backends, group):
        super().__init__()
        self.backends, self.group = backends, group

    def forward(self, q, k, v):
        from torch.nn.attention import sdpa_kernel
        if self.group > 1:
            k, v = repeat_kv(k, self.group), repeat_kv(v, self.group)
        with sdpa_kernel(self.backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2


@pytest.mark.parametrize("math", [True, False])
@pytest.mark.parametrize("group", [1, 4])
def test_attention_inside_sdpa_kernel(tmp_path, math, group):
    """Forward and backward match eager. K/V go unrepeated only where the math backend is enabled,
    which takes them whatever the dtype: the backends chosen are never left without a kernel."""
    from torch.nn.attention import SDPBackend
    backends = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION] if math else [SDPBackend.FLASH_ATTENTION]
    fn = KernelChoice(backends, group)
    inputs = _inputs(heads=8, kv_heads=8 // group)
    want = fn(*inputs)
    want_grads = torch.autograd.grad(want, inputs, torch.ones_like(want))
    got, grads, summaries = _run(fn, inputs, tmp_path)
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)
    assert all(s["compiled"] for s in summaries)
    assert _rewrites(fn, [t.detach() for t in inputs]) == (group > 1 and math)


class CachedAttention(torch.nn.Module):
    """One decode layer over a static KV cache kept as module buffers: the new K/V are written at
    `pos` in place, and the mask comes from `pos`."""

    def __init__(self, heads=4, kv_heads=2, dim=16, cache_len=32):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim, bias=False)
        self.kv = torch.nn.Linear(heads * dim, 2 * kv_heads * dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, kv_heads, cache_len, dim))
        self.register_buffer("v_cache", torch.zeros(1, kv_heads, cache_len, dim))

    def forward(self, x, pos):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).unbind(2)
        self.k_cache.index_copy_(2, pos, k.transpose(1, 2))
        self.v_cache.index_copy_(2, pos, v.transpose(1, 2))
        mask = torch.arange(self.k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(q, repeat_kv(self.k_cache, 2), repeat_kv(self.v_cache, 2), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, -1)


def test_decode_updates_the_static_cache_in_place(tmp_path):
    torch.manual_seed(0)
    model, ref = CachedAttention().to(DEVICE), CachedAttention().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="commfuse")
    from commfuse import config
    from tests.common import Dumps
    with torch.no_grad(), config.patch(dump_dir=str(tmp_path)):
        for step in range(4):
            x, pos = torch.randn(1, 1, 64, device=DEVICE), torch.tensor([step], device=DEVICE)
            torch.testing.assert_close(compiled(x, pos), ref(x, pos), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.k_cache, ref.k_cache)
            torch.testing.assert_close(model.v_cache, ref.v_cache)
    summary, code = Dumps(tmp_path).only()
    # the cache is written where it lives, by the kernel computing K and V: no copy of it in,
    # none back, no aten index_put_
    assert not any("index_put" in c for c in summary["extern_calls"]), summary["extern_calls"]
    count(code, "# effect: stores into input arg", 2)  # the graph's inputs: the caches
    count(code, "copy_", 0)
    if DEVICE == "cpu":  # fp32 on CUDA: aten's math kernel, lowered by us
        assert any("scaled_dot_product" in c for c in summary["extern_calls"])


@pytest.fixture
def efficient_attention_on_cpu():
    """CUDA's memory-efficient attention stood in for on CPU, checking what the CUDA kernel
    checks of its mask: unit stride along rows, rows starting at multiples of 16 elements."""
    lib = torch.library.Library("aten", "IMPL")
    masks = []

    def efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
        masks.append(bias.stride())
        assert bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1]), bias.stride()
        b, h, n, d = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        seed = torch.empty((), dtype=torch.int64)
        return (out.transpose(1, 2).contiguous().transpose(1, 2), q.new_empty(b, h, 0), seed, seed.clone())
    lib.impl("_scaled_dot_product_efficient_attention", efficient, "CPU")
    yield masks
    lib._destroy()


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_efficient_kernels_mask_is_stored_in_aligned_rows(efficient_attention_on_cpu, tmp_path, dynamic):
    """A mask of 9 keys computed in the graph is stored with rows 16 elements apart for the
    efficient kernel (it refuses others; eager pads them so), static sizes or symbolic."""
    if DEVICE != "cpu":
        pytest.skip("the stand-in kernel is a CPU one; tests/test_model_zoo.py's tiny T5 covers CUDA")

    def fn(q, bias):
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, bias * 2, False)[0]
    q, bias = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 9)
    got, _ = compile_and_run(fn, q, bias, tmp_path=tmp_path, dynamic=dynamic)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, attn_mask=bias * 2))
    assert efficient_attention_on_cpu and efficient_attention_on_cpu[-1][-2] == 16
