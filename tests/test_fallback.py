"""The aten fallback, op by op: ops we do not lower run as extern calls with the outputs, dtypes,
strides and aliasing their meta functions give (tuples, None and int items, tensor lists, views,
in-place writes), forward and backward, against eager. Ops we normally decompose or lower are
sent to the fallback with `fallback_ops`."""
import pytest
import torch
import torch.nn.functional as F

from commfuse import config
from tests.common import DEVICE, compile_and_run

aten = torch.ops.aten


def _leaves(x):
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def check(fn, *args, tmp_path, externs, fallback_ops=(), grad=True, atol=1e-5, rtol=1e-5):
    """fn compiled matches eager, forward and (for float inputs) backward; each op named in
    `externs` ran as an aten call in one of the compiled graphs."""
    def fresh():
        return [a.detach().clone().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor)
                else a for a in args]
    want_in, got_in = fresh(), fresh()
    want = fn(*want_in)
    got, dumps = compile_and_run(fn, *got_in, tmp_path=tmp_path, fallback_ops=list(fallback_ops))
    for w, g in zip(_leaves(want), _leaves(got)):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
        assert g.stride() == w.stride() or g.numel() <= 1, (g.stride(), w.stride())
    floats = [o for o in _leaves(want) if o.is_floating_point() and o.requires_grad]
    if grad and floats:
        torch.manual_seed(1)
        cot = [torch.randn_like(o) for o in floats]
        wants = torch.autograd.grad(floats, [a for a in want_in if isinstance(a, torch.Tensor) and a.requires_grad], cot)
        gots = torch.autograd.grad([o for o in _leaves(got) if o.is_floating_point() and o.requires_grad],
                                   [a for a in got_in if isinstance(a, torch.Tensor) and a.requires_grad], cot)
        for w, g in zip(wants, gots):
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
    summaries = [dumps.summary(g) for g in dumps.graphs()]
    assert summaries and all(s["compiled"] for s in summaries), summaries
    calls = [c for s in summaries for c in s["extern_calls"]]
    for op in externs:
        assert any(c.startswith(op) for c in calls), (op, calls)
    return summaries


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_forward_backward(tmp_path, causal):
    q, k, v = rand(2, 4, 16, 16), rand(2, 4, 16, 16), rand(2, 4, 16, 16)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal) * 2  # noqa: E731
    flash = "aten._scaled_dot_product_flash_attention_for_cpu" if DEVICE == "cpu" else "aten._scaled_dot_product"
    summaries = check(fn, q, k, v, tmp_path=tmp_path, externs=[flash], atol=1e-4, rtol=1e-4)
    fw = next(s for s in summaries if "forward" in s["graph_id"])
    assert fw["kernels"], "the scaling after attention is a generated kernel reading its output"


# ----------------------------------------------------------------------------- normalizations
def test_native_layer_norm_and_backward(tmp_path):
    x, w, b = rand(4, 8, 32), rand(32), rand(32)
    fn = lambda x, w, b: F.layer_norm(x, (32,), w, b).relu()  # noqa: E731
    check(fn, x, w, b, tmp_path=tmp_path, atol=1e-4, rtol=1e-4,
          externs=["aten.native_layer_norm.default", "aten.native_layer_norm_backward"],
          fallback_ops=["aten.native_layer_norm", "aten.native_layer_norm_backward"])


def test_native_group_norm_and_backward(tmp_path):
    x, w, b = rand(2, 8, 5, 5), rand(8), rand(8)
    fn = lambda x, w, b: F.group_norm(x, 4, w, b) * 3  # noqa: E731
    check(fn, x, w, b, tmp_path=tmp_path, atol=1e-4, rtol=1e-4,
          externs=["aten.native_group_norm.default", "aten.native_group_norm_backward"],
          fallback_ops=["aten.native_group_norm", "aten.native_group_norm_backward"])


def test_batch_norm_training_mutates_running_stats(tmp_path):
    """`_native_batch_norm_legit_functional` returns five tensors; the running stats it updates
    are written back into the module's buffers."""
    bn = torch.nn.BatchNorm2d(6).to(DEVICE)
    ref = torch.nn.BatchNorm2d(6).to(DEVICE)
    x = rand(4, 6, 5, 5)
    fn = lambda x: bn(x).relu()  # noqa: E731
    want = (lambda x: ref(x).relu())(x)
    ops = ["aten._native_batch_norm_legit_functional", "aten.native_batch_norm_backward",
           "aten._native_batch_norm_legit"]
    got, dumps = compile_and_run(fn, x, tmp_path=tmp_path, fallback_ops=ops)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    calls = [c for g in dumps.graphs() for c in dumps.summary(g)["extern_calls"]]
    assert any(c.startswith("aten._native_batch_norm_legit") for c in calls), calls


def test_batch_norm_eval(tmp_path):
    bn = torch.nn.BatchNorm2d(6).to(DEVICE).eval()
    bn.running_mean.uniform_(), bn.running_var.uniform_(0.5, 2)
    check(lambda x: bn(x) + 1, rand(2, 6, 3, 3), tmp_path=tmp_path, grad=False,
          externs=["aten._native_batch_norm_legit_no_training"],
          fallback_ops=["aten._native_batch_norm_legit_no_training"])


# ----------------------------------------------------------------------------- tuple results
def test_topk_both_outputs(tmp_path):
    fn = lambda x: (lambda r: (r.values * 2, r.indices + 1))(torch.topk(x, 3, dim=-1))  # noqa: E731
    check(fn, rand(5, 17), tmp_path=tmp_path, externs=["aten.topk"])


def test_sort_and_index_with_it(tmp_path):
    def fn(x):
        v, i = torch.sort(x, dim=0, descending=True)
        return v.exp(), torch.gather(x, 0, i)
    check(fn, rand(9, 4), tmp_path=tmp_path, externs=["aten.sort"])


def test_max_dim(tmp_path):
    fn = lambda x: (lambda r: (r[0] + 1, r[1] * 2))(torch.max(x, dim=1))  # noqa: E731
    check(fn, rand(6, 7), tmp_path=tmp_path, externs=["aten.max.dim"], fallback_ops=["aten.max"])


def test_embedding_bag(tmp_path):
    w = rand(20, 8)
    idx = torch.tensor([1, 4, 4, 9, 0, 19, 3], device=DEVICE)
    offsets = torch.tensor([0, 3, 5], device=DEVICE)
    fn = lambda w, i, o: F.embedding_bag(i, w, o, mode="mean") * 2  # noqa: E731
    check(fn, w, idx, offsets, tmp_path=tmp_path, externs=["aten._embedding_bag"])


def test_cumsum(tmp_path):
    check(lambda x: torch.cumsum(x * 2, 1).sin(), rand(4, 33), tmp_path=tmp_path, externs=["aten.cumsum"],
          atol=1e-4, rtol=1e-4)


def test_index_put_accumulate(tmp_path):
    idx = torch.tensor([0, 2, 2, 5], device=DEVICE)
    fn = lambda x, v: torch.index_put(x * 1, (idx,), v, accumulate=True) + 1  # noqa: E731
    check(fn, rand(6, 3), rand(4, 3), tmp_path=tmp_path, externs=["aten.index_put"],
          fallback_ops=["aten.index_put"])


def test_foreach_tensor_lists(tmp_path):
    """`_foreach_*` take and return lists of tensors."""
    xs, ys = [rand(3, 4), rand(5)], [rand(3, 4), rand(5)]
    fn = lambda xs, ys: [t * 2 for t in torch._foreach_mul(xs, ys)]  # noqa: E731
    check(fn, xs, ys, tmp_path=tmp_path, grad=False, externs=["aten._foreach_mul"],
          fallback_ops=["aten._foreach_mul"])


def test_in_place_on_an_input_is_written_back(tmp_path):
    """An input mutated in place (the KV-cache pattern) by an op we send to aten."""
    cache = torch.zeros(8, 4, device=DEVICE)
    ref = cache.clone()
    pos, y = torch.tensor([3], device=DEVICE), rand(1, 4)

    def fn(cache, pos, y):
        cache.index_copy_(0, pos, y)
        return cache.sum(0)
    want = fn(ref, pos, y)
    got, dumps = compile_and_run(fn, cache, pos, y, tmp_path=tmp_path, fallback_ops=["aten.index_copy"])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, ref)


def test_random_op_falls_back(tmp_path):
    """Random ops run as aten: same seed, same numbers as eager."""
    fn = lambda x: torch.bernoulli(torch.sigmoid(x)) * x  # noqa: E731
    x = rand(16, 16)
    torch.manual_seed(3)
    want = fn(x)
    torch.manual_seed(3)
    got, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    assert ((got == 0) | (got == x)).all()
    assert got.shape == want.shape


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("commfuse_test::stats", mutates_args=())
def _stats(x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    return x.sum(-1), x.shape[-1], x.t().contiguous().t()


@_stats.register_fake
def _(x):
    return x.new_empty(x.shape[:-1]), x.shape[-1], torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype, device=x.device)


@torch.library.custom_op("commfuse_test::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@_scale_.register_fake
def _(x, s):
    return None


def test_custom_op_tuple_with_int_and_transposed_output(tmp_path):
    """A user's op returning (tensor, int, column-major tensor): the int is a constant, the
    column-major output is indexed by its own strides."""
    def fn(x):
        s, n, t = torch.ops.commfuse_test.stats(x)
        return s / n, t + 1
    check(fn, rand(5, 6), tmp_path=tmp_path, grad=False, externs=["commfuse_test.stats"])


def test_custom_op_mutating_an_intermediate(tmp_path):
    def fn(x):
        y = x + 1
        torch.ops.commfuse_test.scale_(y, 3.0)
        return y * 2
    # AOTAutograd wraps the op in `auto_functionalized_v2`, which runs it on a copy
    check(fn, rand(4, 4), tmp_path=tmp_path, grad=False, externs=["auto_functionalized"])


def test_layout_disagreeing_with_meta_is_copied():
    """An aten result whose strides differ from what its meta function promised is copied into
    the promised layout rather than read by the wrong strides."""
    from commfuse.runtime.support import as_meta_layout
    t = torch.arange(6.).view(2, 3)
    same = as_meta_layout(t, (2, 3), (3, 1))
    assert same is t
    moved = as_meta_layout(t, (2, 3), (1, 2))
    assert moved.stride() == (1, 2) and torch.equal(moved, t)
    with pytest.raises(RuntimeError, match="meta function"):
        as_meta_layout(t, (3, 2), (2, 1))
    # a dtype other than the meta's: converted where a kernel of ours reads it, else aten's own
    assert as_meta_layout(t, (2, 3), (3, 1), torch.bfloat16).dtype == torch.bfloat16
    assert as_meta_layout(t.bfloat16(), (2, 3), (3, 1)).dtype == torch.bfloat16


@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm", "group_norm"])
def test_a_norm_backward_kept_whole_with_mixed_precision(norm):
    """`fallback_ops` naming a norm's backward, on a bf16 input with fp32 weights (CPU autocast's
    mix): its forward stays whole too (aten's backward reads aten's fp32 statistics, which torch's
    meta functions call bf16), and where a kernel of ours reads an aten result of another dtype
    than its meta's (group norm's input gradient), it is converted, not misread."""
    fn = {"layer_norm": lambda x, w, b: F.layer_norm(x.relu(), (8,), w, b),
          "batch_norm": lambda x, w, b: F.batch_norm(x.relu(), None, None, w, b, training=True),
          "group_norm": lambda x, w, b: F.group_norm(x.relu(), 2, w, b)}[norm]
    if DEVICE == "cuda":
        pytest.skip("CUDA's norms take no bf16 input with fp32 weights: eager fails alike (the mix is the CPU's)")

    def grads(compiled):
        torch.manual_seed(0)
        args = [torch.randn(4, 8, device=DEVICE).bfloat16().requires_grad_(),
                torch.randn(8, device=DEVICE, requires_grad=True), torch.randn(8, device=DEVICE, requires_grad=True)]
        out = compiled(*args)
        (out.float() * torch.linspace(-1, 1, 32, device=DEVICE).view(4, 8)).sum().backward()
        return [out.float()] + [a.grad.float() for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="commfuse", options={
        "fallback_ops": [f"aten.native_{norm}_backward"], "fallback_on_error": False})
    torch.testing.assert_close(grads(compiled), grads(fn), atol=2e-2, rtol=2e-2)


def test_a_long_elementwise_chain_compiles_in_one_kernel(tmp_path):
    """750 single-use pointwise ops in a row (an elementwise recurrence): each value inlined into
    the next nested its loader in its reader's, past Python's recursion limit, and the whole
    graph ran through aten. Long bodies are now stored, and the kernel that reads each fuses it."""
    def fn(x):
        for i in range(300):
            x = (x * 1.001 + 0.001).tanh() if i % 2 else x.relu() - 0.01
        return x
    x = torch.randn(4, 8, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, fallback_on_error=False)
    torch.testing.assert_close(out, fn(x))
    summary, _ = dumps.only()
    assert len(summary["kernels"]) == 1 and not summary["extern_calls"], summary


# ----------------------------------------------------------------------------- one op, not the graph
def test_a_failing_lowering_costs_only_its_op(tmp_path, monkeypatch):
    """A lowering that raises sends its op to aten; the rest of the graph still compiles."""
    from commfuse import lowering
    lowering.load_all()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setitem(lowering.lowerings, aten.tanh.default, broken)
    fn = lambda x: torch.tanh(x * 2) + 1  # noqa: E731
    x = rand(8, 8)
    with config.patch(fallback_on_error=True):
        got, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(got, fn(x))
    summary, code = dumps.only()
    assert summary["compiled"] and summary["extern_calls"] == ["aten.tanh.out"]
    assert "boom" in summary["fallback_reasons"]["aten.tanh.default"]
    assert len(summary["kernels"]) == 2  # x * 2 before it, + 1 after it


def test_a_graph_that_fails_falls_back_whole_and_says_so(tmp_path, monkeypatch):
    """The safety net: a failure after lowering runs the graph through aten, with a summary that
    gives the reason (the warning: test_backend.py)."""
    from commfuse import scheduler

    def broken(self, *a, **k):
        raise RuntimeError("scheduler boom")
    monkeypatch.setattr(scheduler.Scheduler, "__init__", broken)
    fn = lambda x: x.sin() + 1  # noqa: E731
    x = rand(4)
    with config.patch(fallback_on_error=True):
        got, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(got, fn(x))
    summary = dumps.summary(dumps.graphs()[0])
    assert summary["compiled"] is False and "scheduler boom" in summary["fallback_reason"]


def test_value_computed_from_an_input_before_it_is_updated(tmp_path):
    """`count.add_(1)` then a use of the new count: AOTAutograd writes `add = count + 1`,
    `copy_(count, add)`, and later reads `add`. A value not stored yet must not be recomputed
    from the updated input (it read count + 2)."""
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.count.add_(1)
            return x * self.count
    model, ref = Counter().to(DEVICE), Counter().to(DEVICE)
    compiled = torch.compile(model, backend="commfuse")
    for _ in range(3):
        x = rand(4)
        torch.testing.assert_close(compiled(x), ref(x))
        assert model.count.item() == ref.count.item()


def test_backward_leaves_forward_outputs_alone_with_effect_tokens(tmp_path):
    """`linalg.lu_factor` carries an effect token (its error check): AOTAutograd's donated-input
    indices are then shifted, and the backward once wrote over the user's `lu`."""
    x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
    lu, _ = torch.compile(lambda x: torch.linalg.lu_factor(x), backend="commfuse")(x)
    before = lu.detach().clone()
    lu.backward(torch.ones(5, 5, device=DEVICE))
    torch.testing.assert_close(lu.detach(), before)


def test_a_view_run_by_aten_sees_the_strides_the_graph_meant():
    """A reshape commfuse does not lower (splitting a dynamic channel count: s // 2 * 2 == s
    cannot be proven) runs as aten.view, whose output strides follow its input's. The input, a
    channels_last value, had been stored contiguous, and the kernel reading the view was built
    for channels_last strides: a wrong sum (and wrong gradients in a max-pool backward)."""
    w = torch.randn(4, 8, 1, 1, dtype=torch.float64, device=DEVICE)

    def fn(x):
        y = x * 2
        return F.conv2d(y, w), y.view(y.shape[0], 2, y.shape[1] // 2, y.shape[2], y.shape[3]).sum(1)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, device=DEVICE).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    for got, want in zip(torch.compile(fn, backend="commfuse", dynamic=True)(x), fn(x)):
        torch.testing.assert_close(got, want)


def test_float8_casts_run_through_aten_alone(tmp_path):
    """A float8 round trip (no kernel of ours computes in float8): each cast runs through aten,
    the graph around it compiles (it fell back whole)."""
    x = rand(8, 16)
    fn = lambda x: (x * 3).to(torch.float8_e4m3fn).to(torch.float32) + 1  # noqa: E731
    summaries = check(fn, x, tmp_path=tmp_path, externs=["aten._to_copy"], grad=False)
    assert sum(len(s["kernels"]) for s in summaries) >= 2, summaries


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float32], ids=["complex64", "float32"])
def test_as_strided_run_by_aten_reads_eagers_storage(tmp_path, dtype):
    """torchtitan's RoPE cache under full DTensor: as_strided over an expand (batch stride 0),
    both run by aten (complex: no kernel of ours). The expand's result was copied dense before
    the as_strided, by a Triton kernel: no complex type there (KeyError 'complex64'), and for
    floats the as_strided then indexed the copy's storage (off by 4 from eager)."""
    def fn(rope, pos):
        e = rope[None, :, None, :].expand(4, -1, -1, -1)
        a = torch.as_strided(e, [2, 16, 1, 8], [0, 8, 8, 1], 0)
        return torch.gather(a.clone(), 1, pos.view(2, 16, 1, 1).expand(2, 16, 1, 8))
    rope = torch.randn(16, 8, dtype=dtype, device=DEVICE)
    pos = torch.arange(16, device=DEVICE).flip(0).expand(2, -1).contiguous()
    check(fn, rope, pos, tmp_path=tmp_path, externs=["aten.as_strided"], grad=False,
          fallback_ops=["aten.expand.default", "aten.as_strided.default"])


def test_the_imaginary_part_of_a_conjugate_is_negated(tmp_path):
    """z.conj().imag is a lazily negated view in aten (_neg_view sets its neg bit); a kernel of
    ours read the view's storage as it is, without the negation: +imag * 2 where eager gives
    -imag * 2, forward and backward."""
    z = torch.randn(4, 3, dtype=torch.complex64, device=DEVICE)
    check(lambda z: ((z.conj().imag * 2), (z.conj().imag * z.real).sum()), z, tmp_path=tmp_path,
          externs=["aten._conj"])


def test_a_saved_conjugate_is_not_written_over(tmp_path):
    """A complex RoPE over one head (DeepSeek-V3's shared rotary key) saves the conjugate of its
    gathered frequencies for the backward, a view with the conj bit set. The backward's product
    had the same size and was written into it (a donated input): it came back conjugated, and
    view_as_real refused it (a crash where aot_eager ran)."""
    def rope(x, freqs, pos):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[pos].unsqueeze(2)).flatten(3)
    freqs = torch.polar(torch.ones(32, 8, device=DEVICE), rand(32, 8))
    pos = torch.arange(8, device=DEVICE).expand(2, 8)
    check(rope, rand(2, 8, 1, 16), freqs, pos, tmp_path=tmp_path, externs=["aten.view_as_real"])


# ----------------------------------------------------------------------------- control flow
@torch.compiler.nested_compile_region
def _region(t, w):
    return (t @ w).sin() * t


def _cond(x, w):
    return torch.cond(x.sum() > 0, lambda t, w: (t @ w).sin() * 2, lambda t, w: (t @ w).cos() + 1, (x, w)) + x


def _map(x, w):
    from torch._higher_order_ops.map import map as map_rows
    return map_rows(lambda t, w: (t @ w).sin() + 1, x, w) * 2


def _while(x, w):
    def body(i, t):
        return i + 1, (t @ w).tanh() + t
    return torch._higher_order_ops.while_loop(lambda i, t: i < 3, body, (torch.tensor(0, device=x.device), x))[1] + 1


@pytest.mark.parametrize("fn, grad", [(_cond, True), (_map, True), (_while, False),
                                      (lambda x, w: _region(x, w) + _region(x + 1, w), True)],
                         ids=["cond", "map", "while_loop", "nested_compile_region"])
def test_higher_order_control_flow_runs_as_one_op(tmp_path, fn, grad):
    """torch.cond, map, while_loop and invoke_subgraph run as their operator with their subgraphs,
    and the code around them compiles. invoke_subgraph's forward returns its input as a value saved
    for the backward: that input's memory was handed to a later buffer, and the gradients were wrong."""
    check(fn, rand(4, 8), rand(8, 8), tmp_path=tmp_path, grad=grad, externs=[], atol=1e-4, rtol=1e-4)
