"""Reductions that would launch too few programs are split: a first kernel reduces parts of each
row (of columns, for a reduction over a non-contiguous dim) in many programs, a second combines the
partials. Values against eager; the generated code shows the split and the partials' layout."""
import re

import pytest
import torch
import torch.nn.functional as F

from commfuse.choices import Choices
from tests.common import DEVICE, compile_and_run, kernel_defs

# sums of ~1000 fp32 values in another order than the float64 reference
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {}}
REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}


class GpuBlocks(Choices):
    """A GPU's blocks on any device (the interpreter's are wider): what some tests here check."""

    def kernel_config(self, kind, xnumel, rnumel, accumulators=1, device=None):
        return super().kernel_config(kind, xnumel, rnumel, accumulators)


def _launches(code):
    """(kernel, programs' xnumel, rnumel) of each reduction launch, in order."""
    return [(m[0], int(m[1]), int(m[2])) for m in
            re.findall(r"(cf_red\w*)_launch\d+\(_stream, \(cdiv\((\d+), \d+\), 1, 1\), .*, (\d+)\)$", code, re.M)]


def _partials(code):
    """Shape and dtype of the buffers the first kernel writes its partials to."""
    return re.findall(r"empty_strided(?:_cuda)?\(\(([\d, ]+)\), \([\d, ]+\), (?:device=torch\.device\([^)]*\), dtype=)?torch\.(\w+)\)", code)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", list(REDUCTIONS))
def test_column_reduction_splits(tmp_path, kind, dtype):
    """A reduction over dim 0 of (999, 200), a pointwise before and after: 4 programs of 64
    columns would run it; 4 parts (each program keeps 64 x 250 >= 8192 elements) of dealt-out
    rows, masked since 999 is not a multiple of 4."""
    torch.manual_seed(0)
    x = torch.randn(999, 200, device=DEVICE).to(dtype)
    b = torch.randn(200, device=DEVICE).to(dtype)
    red = REDUCTIONS[kind]
    fn = lambda x, b: torch.sigmoid(red(torch.relu(x * 2 + 1), 0) + b)  # noqa: E731
    out, dumps = compile_and_run(fn, x, b, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x.double(), b.double()).to(dtype), **TOL[dtype])
    _, code = dumps.only()
    assert [n for _, *n in _launches(code)] == [[800, 250], [200, 4]], code
    partial = torch.float32 if kind in ("sum", "mean") else dtype
    assert _partials(code)[0] == ("4, 200", str(partial).split(".")[1]), code
    # part s reads rows s, s + 4, ...: one contiguous row of 64 columns per load
    assert "tl.load(ptr_arg0_1 + (800*rindex + xindex)" in code, code
    assert len(kernel_defs(code)) == 2, code


@pytest.mark.parametrize("fn", [lambda x: (x > 2.5).any(0), lambda x: (x * 100).int().amin(0)],
                         ids=["any-bool", "amin-int32"])
def test_bool_and_integer_reductions_split(tmp_path, fn):
    """Masked parts take the reduction's identity: False for any, the largest int32 for amin."""
    torch.manual_seed(0)
    x = torch.randn(999, 200, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    assert torch.equal(out, fn(x))
    assert [n for _, *n in _launches(dumps.only()[1])] == [[800, 250], [200, 4]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_reduction_splits(tmp_path, dtype):
    """3 rows of 20001: 3 programs; with parts of at least 2048 elements, 8 contiguous chunks per
    row (the last one masked), the epilogue fused into the combining kernel."""
    torch.manual_seed(0)
    x = torch.randn(3, 20001, device=DEVICE).to(dtype)
    fn = lambda x: torch.tanh(torch.sum(x.abs() + 0.5, -1) * 1e-4) * 2  # noqa: E731
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, split_reduction_min=2048)
    torch.testing.assert_close(out, fn(x.double()).to(dtype), **TOL[dtype])
    _, code = dumps.only()
    assert [n for _, *n in _launches(code)] == [[24, 2501], [3, 8]], code
    assert _partials(code)[0] == ("3, 8", "float32"), code
    assert "20001*((xindex) // (8)) + 2501*((xindex) % (8))" in code, code  # part s: a chunk of its row
    assert len(kernel_defs(code)) == 2, code


def test_enough_programs_keeps_one_kernel(tmp_path):
    """With a target of 2 programs, the same column reduction fills it unsplit."""
    torch.manual_seed(0)
    x = torch.randn(999, 100, device=DEVICE)
    out, dumps = compile_and_run(lambda x: x.sum(0), x, tmp_path=tmp_path, split_reduction_programs=2)
    torch.testing.assert_close(out, x.sum(0), **TOL[torch.float32])
    assert [n for _, *n in _launches(dumps.only()[1])] == [[100, 999]]


def test_bias_gradient_splits_in_backward(tmp_path):
    """A linear layer's bias gradient, the sum over the 4096 rows of the output's gradient, is
    split in the backward graph (64 columns: one program unsplit)."""
    torch.manual_seed(0)
    x = torch.randn(32, 128, 48, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 48, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
    out, dumps = compile_and_run(fn, x, w, b, tmp_path=tmp_path)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, b), grad)
    wide = [t.detach().float().requires_grad_() for t in (x, w, b)]  # sums of 4096 products: fp32 reference
    want = torch.autograd.grad(fn(*wide), wide, grad.float())
    for g, e in zip(got, want):
        torch.testing.assert_close(g.float(), e, atol=2e-2 * e.abs().max().item(), rtol=2e-2)
    backward = dumps.code(next(g for g in dumps.graphs() if "backward" in g))
    assert (2048, 128) in [tuple(n) for _, *n in _launches(backward)], backward  # 32 parts of 128 rows


def test_column_tiles_follow_size_and_accumulators():
    """Column-reduction tiles: 64 x 64 for one or two accumulators per lane, 32 x 32 for more (a
    Welford lane carries three), and few-column blocks of a whole 512-row slice for a reduction
    small enough to be latency-bound (a split's second stage)."""
    from commfuse.choices import Choices
    config = Choices().kernel_config
    assert config("looped_tiles", 4096, 4096) == {"XBLOCK": 64, "RBLOCK": 64, "num_warps": 4}
    assert config("looped_tiles", 4096, 4096, 2)["XBLOCK"] == 64
    assert config("looped_tiles", 4096, 4096, 3) == {"XBLOCK": 32, "RBLOCK": 32, "num_warps": 4}
    assert config("looped_tiles", 64, 512, 1) == {"XBLOCK": 8, "RBLOCK": 512, "num_warps": 4}


@pytest.mark.parametrize("shape,dims,offset,passes", [
    ((4, 16, 32, 32), (0, 2, 3), 1e3, 1),  # BatchNorm's statistics: split columns of a channels-last map
    ((3, 20480), (-1,), 1e4, 1),            # long rows, looped, split
    ((4097, 8), (0,), 10.0, 2),             # no equal parts: M2 unsplit, the mean's sum split
], ids=["channels", "rows", "unsplit"])
def test_variance_reads_its_input_once(tmp_path, shape, dims, offset, passes):
    """A variance whose rows are looped is one Welford pass over x, not a pass for the mean and
    another for the deviations, and stays accurate when the mean is far from 0 (where the sum of
    squares minus the squared sum would cancel). Its parts must be equal (a padded value would
    count): where none are, M2 is not split, and the mean, split, reads x again."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE) * 2 + offset
    if len(shape) == 4:
        x = x.to(memory_format=torch.channels_last)
    fn = lambda x: torch.var_mean(x, dims, correction=1)  # noqa: E731
    (var, mean), dumps = compile_and_run(fn, x, tmp_path=tmp_path, choices=GpuBlocks())
    want_var, want_mean = fn(x.double())
    torch.testing.assert_close(var.double(), want_var, rtol=1e-4, atol=0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-5, atol=0)
    _, code = dumps.only()
    kernels = code.split("# ---- host code")[0].split("@triton.jit")[1:]
    readers = [k for k in kernels if re.search(r"tl\.load\(ptr_arg0_1\b", k)]
    assert len(readers) == passes and any("triton_helpers.welford" in k for k in readers), code
    if shape == (4, 16, 32, 32):  # the split's small second stage: blocks of 8 columns
        assert re.search(r"Site\(cf_red\w*, dict\(XBLOCK=8, RBLOCK=\d+\b", code), code


def test_column_sum_over_stacked_rows_is_split(tmp_path):
    """The bias gradient of a fused q/k/v projection, as nn.MultiheadAttention's backward forms it:
    three gradients stacked, flattened to 3 x 64 columns and summed over 4096 rows. Its index along
    the columns is a `Mod`, not affine; it is still a column walk, tiled and split (as one
    program per column on H200, four layers' took 1.6 ms)."""
    torch.manual_seed(0)
    a, b, c = (torch.randn(32, 128, 64, device=DEVICE, dtype=torch.float64) for _ in range(3))
    fn = lambda a, b, c: torch.stack([a.sin(), b.cos(), c.exp()], 2).flatten(2).sum([0, 1])  # noqa: E731
    out, dumps = compile_and_run(fn, a, b, c, tmp_path=tmp_path, choices=GpuBlocks())
    torch.testing.assert_close(out, fn(a, b, c))
    _, code = dumps.only()
    assert [n for _, *n in _launches(code)] == [[192 * 32, 128], [192, 32]], code  # 32 parts of 128 rows
    assert "Site(cf_red_sum_0, dict(XBLOCK=64, RBLOCK=64," in code, code  # column tiles, not whole rows
