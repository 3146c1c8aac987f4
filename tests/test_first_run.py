"""A generated module that raises at its first run: the error names the graph and the op; with
fallback_on_error the graph is rerun through aten, unless it had already written an input (the
update would apply twice) or met the other ranks. The failure is injected at a kernel launch."""
import logging
import re

import pytest
import torch

from commfuse import compiled, config
from commfuse.runtime import launch
from tests.common import DEVICE


def _launches(monkeypatch, fail_at=None) -> list:
    """Counts kernel launches; the `fail_at`-th (1-based) raises instead."""
    seen, real = [], launch.Site.__call__

    def site(self, *args):
        seen.append(1)
        if len(seen) == fail_at:
            raise RuntimeError("injected launch failure")
        return real(self, *args)
    monkeypatch.setattr(launch.Site, "__call__", site)
    return seen


def _fail_last_launch(monkeypatch, fn, *args):
    """Compiles `fn` fresh and makes the last kernel launch of its first run raise."""
    torch._dynamo.reset()
    with monkeypatch.context() as m:
        count = _launches(m)
        torch.compile(fn, backend="commfuse")(*[a.clone() for a in args])
    assert len(count) >= 2, count  # the failure comes after other work
    torch._dynamo.reset()
    return _launches(monkeypatch, fail_at=len(count))


def _pure(x, y):
    return torch.mm(x * 2, y).relu() + 1


def _updates_its_input(x, y):
    x.add_(1)  # a kernel storing into x, then aten's mm, then the failing kernel
    return torch.mm(x, y).relu() + 1


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8, device=DEVICE), torch.randn(8, 3, device=DEVICE)


def test_a_pure_graph_is_rerun_through_aten(monkeypatch, caplog):
    x, y = _inputs()
    seen = _fail_last_launch(monkeypatch, _pure, x, y)
    fn = torch.compile(_pure, backend="commfuse")
    with config.patch(fallback_on_error=True), caplog.at_level(logging.WARNING, logger="commfuse"):
        out = fn(x, y)
    torch.testing.assert_close(out, _pure(x, y))
    summary = compiled.summaries[-1]
    assert summary["first_run_error"].startswith("kernel cf_") and "injected" in summary["first_run_error"]
    assert not summary["compiled"]  # it runs through aten: counted as compiled, it hid the fallback
    assert re.search(rf"graph {summary['graph_id']} failed at its first run, in kernel cf_\w+ "
                     r"\(RuntimeError: injected launch failure\); it runs through aten", caplog.text), caplog.text
    launches = len(seen)
    x2 = torch.randn_like(x)
    torch.testing.assert_close(fn(x2, y), _pure(x2, y))  # later calls: aten too, no kernel launched
    assert len(seen) == launches


def test_a_graph_that_updated_an_input_raises_and_says_why(monkeypatch):
    x, y = _inputs()
    _fail_last_launch(monkeypatch, _updates_its_input, x, y)
    fn = torch.compile(_updates_its_input, backend="commfuse")
    before = x.clone()
    with config.patch(fallback_on_error=True), pytest.raises(RuntimeError, match="injected launch failure") as e:
        fn(x, y)
    note = "\n".join(e.value.__notes__)
    assert re.search(r"graph g\d+_inference_\w+ failed at its first run, in kernel cf_\w+; not rerun through "
                     r"aten: it had already run a line that stores into input arg0_1", note), note
    torch.testing.assert_close(x, before + 1)  # updated once, not twice


def test_without_fallback_the_error_names_the_graph_and_op(monkeypatch):
    x, y = _inputs()
    _fail_last_launch(monkeypatch, _pure, x, y)
    fn = torch.compile(_pure, backend="commfuse")
    with config.patch(fallback_on_error=False), \
            pytest.raises(RuntimeError, match=r"graph g\d+_inference_\w+ failed at its first run, in kernel "
                                              r"cf_\w+; not rerun through aten: fallback_on_error is off"):
        fn(x, y)


def test_an_error_aten_raises_too_is_the_programs(monkeypatch):
    """Where aten fails as well (eager would), its error is raised and the graph stays compiled."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x.max(0), backend="commfuse")
    for _ in range(2):
        with config.patch(fallback_on_error=True), pytest.raises(IndexError, match="non-zero size"):
            fn(torch.randn(0, 4, device=DEVICE))
        summary = compiled.summaries[-1]
        assert summary["compiled"] and "first_run_error" not in summary
