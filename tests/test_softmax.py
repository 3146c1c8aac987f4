"""Online softmax: the row's max and sum of exp in one pass over a looped row."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck

from tests.common import DEVICE, compile_and_run, count, kernel_defs

LOOP = "for roffset in range(0, rnumel, RBLOCK):"
LOOPED = {"persistent_reduction_max": 64}  # rows longer than 64 are reduced in a loop


def _rows_with_infs(m, n, dtype=torch.float32):
    x = torch.randn(m, n, device=DEVICE).to(dtype)
    x[1, : n // 2] = float("-inf")   # a masked half row
    x[2, 5] = float("-inf")
    x[3] = float("-inf")              # a fully masked row: NaN, as in eager
    return x


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("online", [True, False])
def test_looped_softmax_passes_and_values(tmp_path, fn, online):
    x = _rows_with_infs(5, 300)
    out, dumps = compile_and_run(lambda x: fn(x, -1), x, tmp_path=tmp_path, online_softmax=online, **LOOPED)
    torch.testing.assert_close(out, fn(x, -1), equal_nan=True)
    summary, code = dumps.only()
    assert len(kernel_defs(code)) == 1
    passes = 2 if online else 3  # online: max and sum of exp in the first pass, then the output
    count(code, LOOP, passes)
    count(code, "tl.load(", passes)
    count(code, "triton_helpers.online_softmax_update(", 1 if online else 0)
    check = FileCheck().check(LOOP).check("tl.load(ptr_arg0_1 + ")
    if online:
        check = check.check_next("= triton_helpers.online_softmax_update(")
    for _ in range(passes - 1):  # each pass loads the row in its own loop; the last one stores
        check = check.check(LOOP).check("tl.load(ptr_arg0_1 + ")
    check.check("tl.store(").run(code)
    # each pass rounds as the others: on a GPU an FMA in one pass only left a masked (finfo.min) row's
    # x - max at about ±1e31 (CodeGen's left-padded attention, docs/results.md)
    count(code, "enable_fp_fusion=False", 2)  # its launch and its compile ahead of the first call


def test_online_softmax_bf16(tmp_path):
    x = torch.randn(3, 4, 200, device=DEVICE, dtype=torch.bfloat16)
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, online_softmax=True, **LOOPED)
    torch.testing.assert_close(out, fn(x))
    count(dumps.only()[1], LOOP, 2)


@pytest.mark.parametrize("online", [True, False])
def test_cross_entropy_reads_logits_once_for_max_and_sum(tmp_path, online):
    x = _rows_with_infs(6, 300)
    x[3] = torch.randn(300)           # CE of a fully -inf row is NaN; keep the -inf halves
    t = torch.tensor([7, 200, 0, 299, 5, 100], device=DEVICE)
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    out, dumps = compile_and_run(fn, x, t, tmp_path=tmp_path, online_softmax=online, **LOOPED)
    torch.testing.assert_close(out, fn(x, t))
    summary, code = dumps.only()
    count(code, LOOP, 1 if online else 2)
    check = FileCheck().check("def cf_")  # the row statistics' kernel loops over the row
    for _ in range(1 if online else 2):
        check = check.check(LOOP)
    check.check("def cf_").check_not("for roffset").check("def call(").run(code)  # the loss kernel gathers x[t]


def test_persistent_softmax_unchanged(tmp_path):
    """A whole row in registers: max, then sum of exp, from the same loaded values."""
    x = _rows_with_infs(8, 48)
    out, dumps = compile_and_run(lambda x: torch.softmax(x, -1), x, tmp_path=tmp_path)
    torch.testing.assert_close(out, torch.softmax(x, -1), equal_nan=True)
    summary, code = dumps.only()
    count(code, "for roffset", 0)
    count(code, "tl.load(", 1)
    count(code, "triton_helpers.max_nan)", 1)  # one row max, shared
    count(code, "enable_fp_fusion", 0)  # each value computed once


def test_softmax_backward(tmp_path):
    x = torch.randn(4, 100, device=DEVICE, requires_grad=True)
    g = torch.randn(4, 100, device=DEVICE)
    fn = lambda x: torch.log_softmax(x, -1) * 2 + torch.softmax(x, -1)  # noqa: E731
    out, _ = compile_and_run(fn, x, tmp_path=tmp_path, **LOOPED)
    (grad,) = torch.autograd.grad(out, x, g)
    (ref,) = torch.autograd.grad(fn(x), x, g)
    torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_backward_sums_no_one_hot(tmp_path, weighted):
    """nll_loss_backward scatters -1 at each row's target, and log_softmax's backward sums that
    row: the sum of a one-hot row is its one value (one_hot.py), so the backward is one pointwise
    pass over the logits, no reduction over the vocabulary. With class weights the row's value
    depends on the target's weight: that sum stays a reduction, and both are exact."""
    x = torch.randn(16, 300, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 300, (16,), device=DEVICE)
    t[3] = -100  # ignored
    w = torch.rand(300, device=DEVICE) if weighted else None
    fn = lambda x, t: F.cross_entropy(x, t, weight=w)  # noqa: E731
    fn(x, t).backward()
    want, x.grad = x.grad, None
    loss, dumps = compile_and_run(fn, x, t, tmp_path=tmp_path, **LOOPED)
    loss.backward()
    torch.testing.assert_close(loss, fn(x, t))
    torch.testing.assert_close(x.grad, want)
    backward = dumps.code(dumps.graphs()[-1])
    assert "_backward_" in dumps.graphs()[-1]
    count(backward, "tl.sum(", 1 if weighted else 0)


def test_sum_of_one_hot_rewrite():
    """The rewrite on an FX graph: the sum goes, the one-hot product stays for its other reader;
    rows with an index and a scale are exact, keepdim or not."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from commfuse.passes.one_hot import sum_one_hot

    def f(idx, scale):
        g = torch.zeros(4, 10).scatter(1, idx, -2.0) * scale
        return g.sum(1, keepdim=True), g.sum(-1), g + 1
    idx, scale = torch.tensor([[3], [0], [9], [3]]), torch.randn(4, 1)
    gm = make_fx(f, tracing_mode="fake")(idx, scale)
    assert sum_one_hot(gm) == 2
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sum.dim_IntList)
    scale[1], scale[2] = float("inf"), float("nan")  # the other columns' 0 * inf: NaN, as eager sums it
    for got, want in zip(gm(idx, scale), f(idx, scale)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    wide = torch.randn(4, 10)  # a scale that varies along the row: not a one-hot's single value
    gm = make_fx(f, tracing_mode="fake")(idx, wide)
    assert sum_one_hot(gm) == 0


@pytest.mark.parametrize("zeros,scale", [(torch.int64, torch.int64), (torch.int64, torch.float32),
                                         (torch.float64, torch.float32), (torch.bool, torch.float32)])
def test_sum_of_one_hot_in_other_dtypes(zeros, scale):
    """The scattered value as the zeros' dtype stores it (1.7 into int64: 1; into bool: True), the
    product in eager's dtype (int64 zeros times an int64 scale: int64)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from commfuse.passes.one_hot import sum_one_hot

    def f(idx, scale):
        return (torch.zeros(4, 8, dtype=zeros).scatter(1, idx, 1.7) * scale).sum(1)
    idx = torch.tensor([[0], [3], [5], [7]])
    scale = (torch.tensor([[3], [5], [-7], [2]]) * (1 if scale == torch.int64 else 1.3)).to(scale)
    gm = make_fx(f, tracing_mode="fake")(idx, scale)
    assert sum_one_hot(gm) == 1
    got, want = gm(idx, scale), f(idx, scale)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
