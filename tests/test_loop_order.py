"""Loop ordering: pointwise loops follow the output's storage order, and are permuted after
fusion when that lets two groups walk a shared buffer alike (so it is read once)."""
import pytest
import torch

from torch.testing import FileCheck

from commfuse import loop_order
from tests.common import DEVICE, compile_and_run, count, kernel_defs


def loaf_example(x):
    y = torch.sum(torch.sum(x, dim=-1))
    z = x / 10.0
    z_t = z.t().contiguous().t()
    return y, z_t


@pytest.mark.parametrize("loaf", [True, False])
def test_loaf_example_reads_x_once(tmp_path, loaf):
    x = torch.randn(64, 48, device=DEVICE)
    out, dumps = compile_and_run(loaf_example, x, tmp_path=tmp_path, loop_ordering_after_fusion=loaf)
    ref = loaf_example(x)
    torch.testing.assert_close(out, ref)
    assert out[1].stride() == ref[1].stride() == (1, 64)
    summary, code = dumps.only()
    count(code, "tl.load(ptr_arg0_1 +", 1 if loaf else 2)
    assert len(kernel_defs(code)) == (2 if loaf else 3)


def test_reordered_pointwise_joins_a_reduction_over_a_middle_dim(tmp_path):
    x = torch.randn(3, 200, 4, device=DEVICE)
    fn = lambda x: torch.softmax(x, 1)  # noqa: E731
    for loaf, kernels in ((True, 1), (False, 2)):
        out, dumps = compile_and_run(fn, x, tmp_path=tmp_path / str(loaf), persistent_reduction_max=64,
                                     loop_ordering_after_fusion=loaf, online_softmax=True)
        torch.testing.assert_close(out, fn(x))
        summary, code = dumps.only()
        assert len(kernel_defs(code)) == kernels
        count(code, "tl.load(ptr_arg0_1 +", 2)


def test_transposed_output_is_written_in_storage_order(tmp_path):
    x = torch.randn(64, 48, device=DEVICE)
    fn = lambda x: (x * 2).t()  # noqa: E731  (eager: a view; stored as such)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    assert out.stride() == fn(x).stride()
    summary, code = dumps.only()
    FileCheck().check("tl.load(ptr_arg0_1 + (xindex),").check("tl.store(ptr_buf0 + (xindex),").run(code)
    count(code, "tl.load(", 1)


def test_transposed_write_tiles(tmp_path):
    x = torch.randn(64, 48, device=DEVICE)
    fn = lambda x: (x * 3, (x * 2).t().contiguous().t())  # noqa: E731
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, loop_ordering_after_fusion=True)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert [k["tiled"] for k in summary["kernels"]] == [True]
    count(code, "tl.load(ptr_arg0_1 +", 1)


def relu_backward_and_bias_grad(g, w, le, x, w2):
    """A feed-forward block's backward: a masked gradient, seq-first, read by two matmuls and
    by its bias-gradient sum over the sequence (a reduction that walks it transposed)."""
    T, B, F = le.shape
    y = torch.where(le, 0.0, (g @ w).view(T, B, F)).view(T * B, F)
    grad_input = y @ w2
    return y.view(T, B, F).sum(0), y.t() @ x, grad_input


def test_pointwise_kept_apart_keeps_its_storage_order(tmp_path):
    """The sum would join the masking kernel if its loops were permuted; it is kept apart (the
    matmuls read the mask's result anyway), so the permutation must be undone: the masking
    kernel walks its buffers in storage order, not along the sequence (which cost 40x on GPU)."""
    T, B, F, D = 16, 4, 32, 8
    args = (torch.randn(T * B, D, device=DEVICE), torch.randn(D, F, device=DEVICE),
            torch.rand(T, B, F, device=DEVICE) > 0.5, torch.randn(T * B, D, device=DEVICE),
            torch.randn(F, D, device=DEVICE))
    out, dumps = compile_and_run(relu_backward_and_bias_grad, *args, tmp_path=tmp_path)
    torch.testing.assert_close(out, relu_backward_and_bias_grad(*args))
    summary, code = dumps.only()
    [where] = [k for k in summary["kernels"] if k["writes"] == ["buf1"]]
    assert not where["reduction"], summary["kernels"]
    body = code.split(f"def {where['name']}(")[1].split("@triton.jit")[0]
    assert body.count("(xindex),") == 3 and "//" not in body, body


def test_sizes_compare_normalized():
    assert loop_order.sizes_key([4, 8]) == loop_order.sizes_key((4, 8))
    assert loop_order.sizes_key([4, 8]) != loop_order.sizes_key((8, 4))


def test_reordering_invalidates_cached_placements():
    from commfuse import ir
    from commfuse.scheduler import SchedulerNode, XSYM
    from commfuse.sizevars import Mod
    from commfuse.virtualized import ops
    lay = ir.contiguous_layout(torch.device("cpu"), torch.float32, [4, 8])
    body = ir.Pointwise(torch.device("cpu"), torch.float32, lambda i: ops.load("x", i[0] + 4 * i[1]), [4, 8])
    node = SchedulerNode(ir.ComputedBuffer(name="buf0", layout=lay, data=body), 0)
    before = node.kernel_index_map(32, 1)
    assert node.kernel_index_map(32, 1) is before          # cached
    node.reorder_loops([1, 0])
    assert node.ranges == [8, 4]
    after = node.kernel_index_map(32, 1)
    assert after != before and after[node.loop_vars()[1]] == Mod(XSYM, 4)
