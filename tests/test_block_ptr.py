"""N-D block pointers (config.use_block_ptr): which accesses get one, and values either way.

Triton versions without `tl.make_block_ptr` get the same N-D box as pointer arithmetic; the
summary counts block-pointer accesses in both cases."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck

from commfuse.compat import triton_has_block_ptr
from tests.common import DEVICE, compile_and_run, count


def run(fn, *args, tmp_path, **patch):
    out, dumps = compile_and_run(fn, *args, tmp_path=tmp_path, use_block_ptr=True, **patch)
    torch.testing.assert_close(out, fn(*args))
    summary, code = dumps.only()
    counts = [k["block_ptrs"] for k in summary["kernels"]]
    count(code, "tl.make_block_ptr(", sum(counts) if triton_has_block_ptr() else 0)
    return counts, code


def check_box(code, ptr, block_ptr_text, arithmetic_text):
    """The load of `ptr` addresses a box: a block pointer's shape and strides where Triton has
    them, else the same box as N-D pointer arithmetic."""
    if triton_has_block_ptr():
        FileCheck().check(f"tl.make_block_ptr({ptr}, ").check_same(block_ptr_text).run(code)
    else:
        FileCheck().check(f"tl.load({ptr} + ").check_same(arithmetic_text).run(code)


def test_permuted_3d_power_of_2(tmp_path):
    x = torch.randn(4, 16, 8, device=DEVICE)
    counts, code = run(lambda x: x.permute(0, 2, 1).contiguous() * 2, x, tmp_path=tmp_path)
    assert counts == [2]                         # the 3-D permuted read, the 1-D write
    check_box(code, "ptr_arg0_1", "shape=[4, 8, 16], strides=[128, 1, 8]", "[:, None, None] * 128")


def test_padded_rows_power_of_2(tmp_path):
    big = torch.randn(32, 160, device=DEVICE)
    counts, code = run(lambda b: b[:, :128] * 2, big, tmp_path=tmp_path)
    assert counts == [2]
    check_box(code, "ptr_arg0_1", "shape=[32, 128], strides=[160, 1]", "[:, None] * 160")


def test_padded_rows_multiple_of_the_largest_block(tmp_path):
    big = torch.randn(4, 3200, device=DEVICE)  # rows of 3072 = 3 * 1024 (max_block)
    counts, _ = run(lambda b: b[:, :3072] * 2, big, tmp_path=tmp_path)
    assert counts == [2]


def test_unsupported_rows_fall_back(tmp_path):
    big = torch.randn(4, 3200, device=DEVICE)  # rows of 100: neither
    counts, code = run(lambda b: b[:, :100] * 2, big, tmp_path=tmp_path)
    assert counts == [1]                          # only the contiguous write
    count(code, "tl.load(ptr_arg0_1 + (3200*((xindex) // (100)) + ((xindex) % (100)))", 1)


def test_broadcast(tmp_path):
    x, b = torch.randn(32, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    counts, code = run(lambda x, b: x + b, x, b, tmp_path=tmp_path)
    if triton_has_block_ptr():  # triton 3.6 cannot compile this broadcast: b keeps a plain pointer
        assert counts == [2]  # (values were checked in run())
        return
    assert counts == [3]
    # b loaded once per row block, then broadcast
    count(code, "tl.broadcast_to(tl.reshape(tl.load(ptr_arg1_1 + ", 1)


@pytest.mark.parametrize("n", [96, 600], ids=["persistent", "looped"])
def test_reduction(tmp_path, n):
    x, w = torch.randn(8, n, device=DEVICE), torch.randn(n, device=DEVICE)
    counts, code = run(lambda x, w: (x * w).sum(-1), x, w, tmp_path=tmp_path, persistent_reduction_max=128)
    assert counts == [2]                          # x (2-D) and w (broadcast over rows)
    count(code, "for roffset in range(", 1 if n > 128 else 0)


def test_tiled_transpose(tmp_path):
    x, y = torch.randn(64, 32, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    counts, _ = run(lambda x, y: x + y.t(), x, y, tmp_path=tmp_path)
    assert counts == [3]


def test_masked_and_indirect_loads_stay_plain(tmp_path):
    x, i = torch.randn(16, 32, device=DEVICE), torch.tensor([3, 0, 7], device=DEVICE)
    counts, code = run(lambda x: F.pad(x, (1, 1)) * 2, x, tmp_path=tmp_path / "pad")
    assert counts == [1]                          # only the contiguous write
    count(code, "tl.load(ptr_arg0_1 + (32*((xindex) // (34)) + ((xindex) % (34)) - 1), xmask & (", 1)
    counts, code = run(lambda x, i: x[i] + 1, x, i, tmp_path=tmp_path / "gather")
    count(code, "tl.load(ptr_arg0_1 + (32*tmp", 1)


def test_off_by_default(tmp_path):
    x = torch.randn(4, 16, 8, device=DEVICE)
    out, dumps = compile_and_run(lambda x: x.permute(0, 2, 1).contiguous(), x, tmp_path=tmp_path)
    summary, code = dumps.only()
    assert summary["kernels"][0]["block_ptrs"] == 0
    count(code, "tl.make_block_ptr", 0)
    count(code, "[:, None, None]", 0)             # nor the box as N-D pointer arithmetic


def test_identity_wrappers_are_normalized_away():
    """x // 4096 and x % 4096 over x < 2048 are 0 and x: without the kernel's ranges the match
    fails on them; with them it finds the same 2-D box as for the plain index."""
    from commfuse.codegen.block_ptr import Axis, block_ptr
    from commfuse.scheduler import XSYM as x
    from commfuse.sizevars import FloorDiv, Mod, simplify_with_ranges
    axes = [Axis(x, 2048, "XBLOCK", "xoffset", 1024)]
    plain = 160 * FloorDiv(x, 64) + Mod(x, 64)
    wrapped = 160 * FloorDiv(Mod(x, 4096), 64) + Mod(Mod(x, 4096), 64) + 7 * FloorDiv(x, 4096)
    assert block_ptr(wrapped, axes, ["XBLOCK"]) is None
    normalized = simplify_with_ranges(wrapped, {x: 2048})
    assert normalized == plain
    box = block_ptr(normalized, axes, ["XBLOCK"])
    assert [(d.size, d.inner, d.stride) for d in box.dims] == [(32, 64, 160), (64, 1, 1)]
