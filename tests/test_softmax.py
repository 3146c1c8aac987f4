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


def test_softmax_backward(tmp_path):
    x = torch.randn(4, 100, device=DEVICE, requires_grad=True)
    g = torch.randn(4, 100, device=DEVICE)
    fn = lambda x: torch.log_softmax(x, -1) * 2 + torch.softmax(x, -1)  # noqa: E731
    out, _ = compile_and_run(fn, x, tmp_path=tmp_path, **LOOPED)
    (grad,) = torch.autograd.grad(out, x, g)
    (ref,) = torch.autograd.grad(fn(x), x, g)
    torch.testing.assert_close(grad, ref)
