"""Optimizer steps, gradient clipping and EMA as compiled: `aten._foreach_*` ops become the
per-tensor ops they stand for, so each parameter's update is one kernel, which stores the new
parameter and state into the inputs: no aten calls."""
import pytest
import torch

from common import DEVICE, Dumps
from commfuse import config

SHAPES = [(16, 8), (8,), (5, 7), (7,)]


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in SHAPES]


def _calls(dumps) -> tuple[list, int]:
    """(aten calls, kernels) over every compiled graph."""
    summaries = [dumps.summary(g) for g in dumps.graphs()]
    assert summaries and all(s["compiled"] for s in summaries), summaries
    return [c for s in summaries for c in s["extern_calls"]], sum(len(s["kernels"]) for s in summaries)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),  # lerp as prims.fma
], ids=["adamw_foreach", "sgd_momentum_foreach", "adam_single_tensor"])
def test_optimizer_step_fuses_per_parameter(tmp_path, make):
    want, got = _params(), _params()
    opt_want, opt_got = make(want), make(got)
    torch._dynamo.reset()
    step = torch.compile(opt_got.step, backend="commfuse")
    with config.patch(dump_dir=str(tmp_path)):
        for i in range(3):
            torch.manual_seed(10 + i)
            for w, g in zip(want, got):
                w.grad = torch.randn_like(w)
                g.grad = w.grad.clone()
            opt_want.step()
            step()
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    calls, kernels = _calls(Dumps(tmp_path))
    assert not calls, calls  # no foreach op, no prims.fma, no copy_ back into the parameters and state
    # per graph: a kernel per parameter (its state updated with it), and the step counters
    assert kernels <= 2 * len(SHAPES) * len(Dumps(tmp_path).graphs()), kernels


def test_clip_grad_norm_and_ema(tmp_path):
    want, got = _params(), _params()
    avg_want, avg_got = _params(1), _params(1)
    torch.manual_seed(2)
    for w, g in zip(want, got):
        w.grad = 3 * torch.randn_like(w)
        g.grad = w.grad.clone()

    @torch.no_grad()
    def fn(ps, avg):
        norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        torch._foreach_lerp_(avg, ps, 0.1)
        return norm
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        norm = torch.compile(fn, backend="commfuse")(got, avg_got)
    torch.testing.assert_close(norm, fn(want, avg_want))
    for w, g in zip(want + avg_want, got + avg_got):
        torch.testing.assert_close(g.grad if w.grad is not None else g, w.grad if w.grad is not None else w)
    calls, _ = _calls(Dumps(tmp_path))
    assert not calls, calls


def test_foreach_overloads(tmp_path):
    """Scalar, List, ScalarList and Tensor overloads, numbers where the per-tensor op takes none."""
    torch.manual_seed(0)
    xs, ys = ([torch.rand(s, device=DEVICE) + 0.5 for s in SHAPES] for _ in range(2))
    t = torch.tensor(1.5, device=DEVICE)

    def fn(xs, ys, t):
        zs = [z.clone() for z in xs]
        torch._foreach_zero_(zs)
        outs = [torch._foreach_add(xs, ys, alpha=2), torch._foreach_sub(xs, 1.5), torch._foreach_div(xs, t),
                torch._foreach_mul(xs, [2.0, 3.0, 4.0, 5.0]), torch._foreach_maximum(xs, 0.7),
                torch._foreach_minimum(xs, ys), torch._foreach_pow(2.0, xs), torch._foreach_pow(xs, 3),
                torch._foreach_addcdiv(xs, xs, ys, [0.5] * 4), torch._foreach_addcmul(xs, xs, ys, value=0.3),
                torch._foreach_lerp(xs, ys, 0.3), torch._foreach_sqrt(xs), torch._foreach_norm(xs), zs]
        return [x for out in outs for x in out]
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        got = torch.compile(fn, backend="commfuse")(xs, ys, t)
    for g, w in zip(got, fn(xs, ys, t), strict=True):
        torch.testing.assert_close(g, w)
    calls, _ = _calls(Dumps(tmp_path))
    assert not [c for c in calls if "_foreach" in c], calls


@pytest.mark.parametrize("update", [
    lambda x: x.copy_(torch.roll(x, 1, 0) * 2),            # each row from the row before it
    lambda x: x.copy_(x.t().clone() + 1),                   # from the transposed element
    lambda x: x.copy_(x.cumsum(0)),                         # from every row before it
    lambda x: x.sub_(x.mean(0, keepdim=True)),              # from a reduction over the columns
    lambda x: x.mul_(2).add_(x[:, :1].clone()),             # twice, the second from a column of the first
], ids=["roll", "transposed", "cumsum", "column_mean", "chained"])
def test_input_updated_from_its_own_other_elements(tmp_path, update):
    """A graph input written in place by the kernel computing its new value (MutationLayout) must
    not be read at other elements after programs overwrote them: what reads it elsewhere is
    computed first."""
    torch.manual_seed(0)
    x = torch.randn(300, 300, device=DEVICE)
    want = update(x.clone())
    got = x.clone()
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        out = torch.compile(update, backend="commfuse")(got)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(out, want)
    assert not any("copy_" in c for c in _calls(Dumps(tmp_path))[0])  # stored by a kernel, in place
