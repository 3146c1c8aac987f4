"""Data-dependent sizes (Dynamo's capture_dynamic_output_shape_ops / capture_scalar_outputs): the
symbols u0, u1, ... an op's result introduces are read off that result in the generated wrapper,
right after the extern that produces it, and every kernel, allocation and extern using them runs
after it. Values are checked against eager over several calls whose data change the sizes."""
import re

import pytest
import torch

from tests.common import DEVICE, compile_and_run
from tests.dist_utils import WORLD, run_ranks


@pytest.fixture(autouse=True)
def _capture_data_dependent():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        yield


def _repeats(x):
    return (x.detach().abs() * 3).long().clamp(max=3)


CASES = {
    "nonzero": (lambda x: torch.nonzero(x > 0) * 2 + 1, False),
    "nonzero_float_sum": (lambda x: (torch.nonzero(x > 0).float() * 2 + 1).sum(0), False),
    "mask": (lambda x: x[x > 0] * 2, True),
    "mask_sum": (lambda x: (x[x > 0] ** 2).sum(), True),
    "masked_select": (lambda x: torch.masked_select(x, x > 0).sin() * 3, True),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, _repeats(x)) ** 2, True),
    # u0 * 4 elements, and a size used without reading the tensor that bound it
    "times_4": (lambda x: (x[x > 0].view(-1, 1) * torch.arange(1., 5., device=x.device)).reshape(-1).sin() * 2, True),
    "arange_of_count": (lambda x: torch.arange(torch.nonzero(x > 0).shape[0], device=x.device) * 2 + x.sum(), False),
    "item_sizes": (lambda x: torch.zeros((x > 0).sum().item() * 2, 3, device=x.device) + x.max().item(), False),
    # a size through a float (TruncToInt of an unbacked float): computed after the extern's result
    "float_item_size": (lambda x: torch.ones(int(x.abs().sum().item() + 1), device=x.device) * x.sum(), False),
    # softmax's decomposition over a size known only at run time (none kept: empty)
    "mask_softmax": (lambda x: x[x > 0].softmax(0) + x[x > 0].log_softmax(0), True),
    # repeat by a count from the data (its decomposition would test the count: left whole; torch's
    # own backward of it tests the count too, under aot_eager and Inductor as well: forward only)
    "repeat_item": (lambda x: x.repeat((x > 0).sum().item(), 2) * 2, False),
    # a slice to a bound from the data: not clamped by the bound's guessed size (aten's, as Min(n, u0))
    "slice_item": (lambda x: x[:(x > 0).sum().item()] * 2, True),
    "slice_item_add": (lambda x: torch.ones((x > 0).sum().item(), device=x.device) + x[:(x > 0).sum().item()], False),
}


def _torch_traces_empty_softmax() -> bool:
    """torch 2.11 on CUDA traces softmax over x[mask] with an assert u0 >= 1: the empty call fails
    under aot_eager too, so there is nothing of ours to hold to eager."""
    torch._dynamo.reset()
    traced = torch.compile(CASES["mask_softmax"][0], backend="aot_eager")
    try:
        traced(torch.randn(9, device=DEVICE))
        traced(torch.randn(5, device=DEVICE) - 5)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_data_dependent_sizes_match_eager(name):
    fn, backward = CASES[name]
    if name == "mask_softmax" and not _torch_traces_empty_softmax():
        pytest.skip("this torch's own trace of softmax over x[mask] asserts a nonzero size (aot_eager and Inductor fail too)")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="commfuse", options={"fallback_on_error": False})
    for n, seed in ((9, 0), (13, 1), (9, 2), (5, 3)):  # counts vary from call to call; the last has none > 0
        torch.manual_seed(seed)
        x = torch.randn(n, device=DEVICE) - (5 if seed == 3 else 0)
        x.requires_grad_(backward)
        x_ref = x.detach().clone().requires_grad_(backward)
        out, ref = compiled(x), fn(x_ref)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref)
        if backward:
            grad = torch.randn_like(ref)
            out.backward(grad)
            ref.backward(grad)
            torch.testing.assert_close(x.grad, x_ref.grad)


def test_size_is_bound_after_its_extern_and_before_the_fused_kernel(tmp_path):
    """`x[x > 0]` runs through aten; its size is read off the result before the reduction
    kernel that takes it as an argument, and nothing uses it before."""
    def fn(x):
        y = x[x > 0]
        return y.sum() + y * 2
    x = torch.randn(10, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path, fallback_on_error=False)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    body = code[code.index("def call("):]
    index = re.search(r"(buf\d+) = aten\.index\.Tensor\(", body)
    bind = re.search(rf"(u\d+) = {index.group(1)}\.size\(\)\[0\]", body)
    assert index and bind, body
    sym = bind.group(1)
    assert not re.search(rf"\b{sym}\b", body[:index.start()]), body  # no use before it is bound
    launch = re.search(rf"cf_red_\w+_launch0\(.*\b{sym}\)", body)
    assert launch and launch.start() > bind.end(), body  # a fused reduction over the u0 elements
    assert len(summary["kernels"]) == 2, summary["kernels"]  # the mask's kernel, then sum and output in one


def _moe_dispatch(rank, world):
    """Tokens routed to experts by the data: each rank sends each peer the tokens of its experts,
    with all_to_all_single split sizes that come from the data (bincount().tolist())."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    experts = 2 * world

    def dispatch(x, router):
        expert = router(x).argmax(-1)
        order = expert.argsort()
        send = (expert // 2).bincount(minlength=world)  # tokens for each rank's two experts
        counts = funcol.all_to_all_single(send, None, None, g)
        send_splits, recv_splits = send.tolist(), counts.tolist()
        for s in send_splits + recv_splits:
            torch._check(s >= 0)  # torch._check_is_size
        got = funcol.all_to_all_single(x[order] * 2, recv_splits, send_splits, g)
        return (got.sin() + 1).sum(0), got.shape[0]

    from tests.dist_utils import device
    torch.manual_seed(0)
    router = torch.nn.Linear(8, experts).to(device())
    fn = torch.compile(dispatch, backend="commfuse", options={"fallback_on_error": False})
    results = []
    for step in range(3):  # different routings, different splits
        torch.manual_seed(10 * step + rank)
        x = torch.randn(6 + 3 * rank + step, 8, device=device())
        out, n = fn(x, router)
        ref, n_ref = dispatch(x, router)
        assert n == n_ref, (n, n_ref)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        results.append(n)
    return results


def test_moe_all_to_all_with_data_dependent_splits():
    per_rank = run_ranks(_moe_dispatch, WORLD)
    assert sum(map(sum, per_rank)) == sum(6 + 3 * r + s for r in range(WORLD) for s in range(3))
