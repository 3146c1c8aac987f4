"""Mixed-order reductions (commfuse/mix_order.py): a norm's weight gradient, a sum over rows, is
computed in the kernel that computes the input gradient row by row, so the output gradient and the
input are read once. Values against eager; the generated code shows which kernels read what."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

from commfuse import config
from tests.common import DEVICE, Dumps


def _rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def _layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


def _grads(fn, *args):
    """Gradients of every argument of fn, for a fixed output gradient."""
    out = fn(*args)
    return torch.autograd.grad(out, args, torch.ones_like(out) * 0.5 + out.detach().abs().sqrt())


def _readers(code: str, arg: str) -> list[str]:
    """The kernels whose launches pass `arg`."""
    return re.findall(rf"^    (cf_\w+?)_launch\d+\(.*\b{arg}\b", code, re.M)


def _mixed_backward(tmp_path, fn, shape, dtype, nparams, **patch):
    """The generated code of fn's backward, its gradients checked against eager's in fp64."""
    torch.manual_seed(0)
    x = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
    params = [torch.randn(shape[-1], device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(nparams)]
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path), **patch):
        grads = _grads(torch.compile(fn, backend="commfuse"), x, *params)
    want = _grads(fn, *(a.detach().double().requires_grad_() for a in (x, *params)))
    eager = _grads(fn, x, *params)  # bf16 sums of 2100 rows: as close to fp64 as eager's, or closer
    for g, w, e in zip(grads, want, eager, strict=True):
        assert (g.double() - w).abs().max() <= 2 * (e.double() - w).abs().max() + 1e-4
    dumps = Dumps(tmp_path)
    backward = next(g for g in dumps.graphs() if "_backward_" in os.path.basename(g))
    return dumps.summary(backward), dumps.code(backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_backward_reads_rows_once(tmp_path, norm, dtype):
    """RMSNorm and LayerNorm backward over (3, 700, 96): 2100 rows, not a multiple of the row
    block. The weight (and bias) gradients' partial sums come from the row kernel, one per program;
    a second kernel totals them. The output gradient is read by that one kernel only."""
    fn, nparams = (_rms_norm, 1) if norm == "rms" else (_layer_norm, 2)
    summary, code = _mixed_backward(tmp_path, fn, (3, 700, 96), dtype, nparams, mix_order_min_elements=0)
    assert len(summary["mixed_order"]) == 1 and code.count("tl.num_programs(0)") == 1, code
    assert code.count("tl.sum(") - code.count("tl.sum(tl.where") >= nparams, code  # the partials' totals
    assert len(set(_readers(code, "tangents_1"))) == 1, code  # the output gradient: read once


def test_small_column_sums_stay_apart(tmp_path):
    """Below `mix_order_min_elements` (the rows fit in L2 for the second read), the weight
    gradient keeps its own kernels: two kernels read the output gradient."""
    summary, code = _mixed_backward(tmp_path, _rms_norm, (2100, 96), torch.float32, 1)
    assert summary["mixed_order"] == [] and "tl.num_programs(0)" not in code, code
    assert len(set(_readers(code, "tangents_1"))) == 2, code


def test_a_norm_over_a_transposed_view_fuses_with_the_next_norm(tmp_path):
    """Segformer's patch embedding: LayerNorm over `x.flatten(2).transpose(1, 2)` reads x down its
    columns, and the block's first LayerNorm reads the result by rows. They share no data walked
    both ways (unlike a row kernel and its column sums), so both norms are one kernel."""
    def fn(x, w1, b1, w2, b2):
        h = F.layer_norm(x.flatten(2).transpose(1, 2), (16,), w1, b1)
        return h, F.layer_norm(h, (16,), w2, b2)
    torch.manual_seed(0)
    args = [torch.randn(2, 16, 8, 8, device=DEVICE)] + [torch.randn(16, device=DEVICE) for _ in range(4)]
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        got = torch.compile(fn, backend="commfuse")(*args)
    for g, w in zip(got, fn(*args), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    dumps = Dumps(tmp_path)
    (graph,) = dumps.graphs()
    assert len(dumps.summary(graph)["kernels"]) == 1, dumps.code(graph)
