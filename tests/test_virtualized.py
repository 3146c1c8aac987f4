"""The ops handler's names are declared once (virtualized.OPS); every handler implements them."""
from __future__ import annotations

import pytest

from commfuse.codegen.triton_ops import TritonOps
from commfuse.dependencies import RecordingOps
from commfuse.virtualized import OPS, V, ops


def test_triton_ops_implements_the_declared_ops():
    methods = {n for n in dir(TritonOps) if not n.startswith("_") and callable(getattr(TritonOps, n))}
    assert methods == OPS, (sorted(OPS - methods), sorted(methods - OPS))


def test_ops_refuses_undeclared_names():
    handler = RecordingOps()
    with V.set_ops(handler):
        for name in OPS:
            getattr(ops, name)
        ops.exp("t0")
        with pytest.raises(AttributeError, match="not an op"):
            ops.expp("t0")
    with pytest.raises(AttributeError):
        handler.expp("t0")
    assert handler.lines[-1][0] == "t0 = exp({})"
