"""Random tensors drawn inside the kernels that read them (lowering/random.py): their law, their
seeding, and a dropout whose backward applies the forward's mask. Values are not eager's (no
generator but eager's own gives eager's values), so these check properties, not values."""
import pytest
import torch
import torch.nn.functional as F

from tests.common import DEVICE, compile_and_run

N = (64, 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_their_law(tmp_path, dtype):
    """rand in [0, 1) with mean 1/2 and variance 1/12, randn with mean 0 and variance 1 (64000
    draws: 5 standard errors), each drawn in the kernel that uses it, none by aten."""
    x = torch.zeros(N, device=DEVICE, dtype=dtype)
    fn = lambda x: (torch.rand_like(x), torch.randn_like(x), torch.rand(N, device=x.device, dtype=x.dtype),  # noqa: E731
                    torch.randn(N, device=x.device, dtype=x.dtype) + x)
    outs, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    for out, (mean, var) in zip(outs, [(0.5, 1 / 12), (0.0, 1.0)] * 2):
        u = out.double()
        assert out.dtype == dtype and out.shape == N
        assert abs(u.mean() - mean) < 5 * (var / u.numel()) ** 0.5, u.mean()
        assert abs(u.var() - var) < 0.02 * var, u.var()
    for out in outs[::2]:  # [0, 1) in the dtype: bf16 draws rounded up to 1.0 (about 1 in 500)
        assert out.min() >= 0 and out.max() < 1
    summary, code = dumps.only()
    assert summary["fallback_ops"] == [] and code.count("tl.rand(") == 2 and code.count("tl.randn(") == 2, summary
    assert all(not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])  # four streams


def test_draws_follow_the_seed_and_change_between_calls():
    x = torch.zeros(N, device=DEVICE)
    fn = torch.compile(lambda x: torch.rand_like(x) + torch.randn_like(x), backend="commfuse")
    torch.manual_seed(1)
    first, second = fn(x), fn(x)
    torch.manual_seed(1)
    again = fn(x)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dropout_backward_applies_the_forward_mask():
    """Dropout in training: the kept fraction is 1 - p, kept values are scaled by 1 / (1 - p), and
    the gradient passes exactly where the forward kept."""
    torch.manual_seed(0)
    x = (torch.rand(N, device=DEVICE) + 0.5).requires_grad_()
    w = torch.randn(N[1], device=DEVICE)
    fn = torch.compile(lambda x: F.dropout(x, 0.25, training=True) * w, backend="commfuse")
    out = fn(x)
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert abs(kept.float().mean() - 0.75) < 0.01
    torch.testing.assert_close(out, torch.where(kept, x / 0.75 * w, 0.0).detach())
    torch.testing.assert_close(x.grad, torch.where(kept, w / 0.75, 0.0).expand(N))


def test_fp64_draws_run_through_aten(tmp_path):
    """fp32 Philox draws would lack fp64's low bits: aten draws those."""
    x = torch.zeros(N, device=DEVICE, dtype=torch.float64)
    out, dumps = compile_and_run(lambda x: torch.rand_like(x) * 2, x, tmp_path=tmp_path)
    assert dumps.only()[0]["fallback_ops"] == ["aten.rand_like.default"]
    assert 0.9 < out.mean() < 1.1
