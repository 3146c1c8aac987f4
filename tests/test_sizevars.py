"""Size hints: the concrete sizes behind symbolic ones, for heuristics. Each graph has its own,
taken from its example inputs before lowering starts."""
from __future__ import annotations

import torch

from tests.common import compile_and_run


def sliced_mm(x, z, w):
    y = x.exp()                   # not stored yet
    return y[: z.shape[0]] @ w    # an extern reads a slice of it


def test_hints_are_this_graphs_while_lowering(tmp_path):
    """Lowering decides by hints whether an extern's operand, a slice of a value not stored yet,
    is copied out (its rows) or read from the whole value stored (when the slice is most of it).
    The hints were a global set after lowering, so this decision saw the previous graph's sizes
    (or none): here the whole 64 x 8 value was stored to pass 5 of its rows."""
    w = torch.randn(8, 3)
    x = torch.randn(4, 8)
    compile_and_run(sliced_mm, x, torch.randn(4), w, tmp_path=tmp_path / "a", dynamic=True)
    x = torch.randn(64, 8)
    z = torch.randn(5)
    out, dumps = compile_and_run(sliced_mm, x, z, w, tmp_path=tmp_path / "b", dynamic=True)
    torch.testing.assert_close(out, sliced_mm(x, z, w))
    summary, code = dumps.only()
    stored = [b["bytes"] for b in summary["buffers"]]
    assert 64 * 8 * 4 not in stored, (stored, code)  # the whole exp(x) is never stored
    assert 5 * 8 * 4 in stored, (stored, code)       # its 5 rows are
