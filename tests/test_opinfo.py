"""OpInfo peer suite, pytest edition: a fixed, representative subset of PyTorch's OpInfo
database run through the backend (COMMFUSE_TEST_BACKEND, default "commfuse") and compared with
eager.  The machinery lives in tools/opinfo_suite.py; the CLI there runs the whole database.

Every listed op must produce ZERO mismatches (wrong numbers) and ZERO errors: commfuse falls
back to aten for graphs it cannot compile, so a compile/runtime error is a bug too.  Samples
that are not applicable (eager fails, random results, complex outputs, ...) are skipped.

    pytest -n 2 tests/test_opinfo.py
    COMMFUSE_TEST_BACKEND=aot_eager pytest -n 2 tests/test_opinfo.py   # validates the harness
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TOOLS = str(Path(__file__).resolve().parent.parent / "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)

import opinfo_suite as suite  # noqa: E402

SAMPLES_PER_OP = int(os.environ.get("COMMFUSE_OPINFO_SAMPLES", "2"))
OP_TIMEOUT_S = float(os.environ.get("COMMFUSE_OPINFO_OP_TIMEOUT", "90"))

# Full OpInfo names ("name" or "name.variant").  Keep this list stable: it is the contract.
OPS = [
    # elementwise: unary, binary, ternary, activations
    "add", "mul", "div.no_rounding_mode", "neg", "exp", "log", "tanh", "sigmoid", "rsqrt",
    "pow", "where", "clamp", "maximum", "addcmul", "nn.functional.relu", "nn.functional.gelu",
    # reductions and normalizations
    "sum", "mean", "amax", "argmax", "var", "softmax", "log_softmax", "logsumexp", "cumsum",
    "nn.functional.layer_norm",
    # views and shape ops
    "view", "reshape", "permute", "transpose", "expand", "squeeze", "unsqueeze", "narrow",
    "cat", "split",
    # indexing
    "__getitem__", "index_select", "gather", "scatter_add", "masked_fill",
    # matmul-ish
    "mm", "bmm", "matmul", "addmm", "nn.functional.linear",
]


@pytest.mark.parametrize("name", OPS)
def test_opinfo(name):
    result = suite.run_op(name, samples=SAMPLES_PER_OP, dtype="float32",
                          op_timeout=OP_TIMEOUT_S, pick="spread")
    if not result.samples:
        pytest.skip(f"{name}: {result.skip_reason}")

    mismatches = [s for s in result.samples if s.status == suite.MISMATCH]
    errors = [s for s in result.samples if s.status in suite.ERROR_STATUSES]
    if mismatches or errors:
        lines = [f"{name} on backend {suite.BACKEND!r}: {len(mismatches)} MISMATCH, "
                 f"{len(errors)} error(s) out of {len(result.samples)} sample(s)"]
        for s in mismatches + errors:
            lines.append(f"  sample {s.index} [{s.desc}]")
            lines.append(f"    {s.status}: {s.message}")
            if s.detail:
                tail = s.detail.strip().splitlines()[-6:]
                lines.extend("      " + ln for ln in tail)
        lines.append(f"  reproduce: COMMFUSE_TEST_BACKEND={suite.BACKEND} python "
                     f"tools/opinfo_suite.py --filter ={name} --ops 0 --samples 8 --pick spread "
                     f"--jobs 0")
        msg = "\n".join(lines)
        # Wrong numbers are the serious failure; errors fail too (commfuse falls back to aten).
        pytest.fail(("WRONG NUMBERS: " if mismatches else "ERRORS: ") + msg, pytrace=False)

    if all(s.status == suite.SKIPPED for s in result.samples):
        reasons = "; ".join(sorted({s.message for s in result.samples}))
        pytest.skip(f"{name}: every sample skipped ({reasons})")

    # A PASS where Dynamo handed the backend no graph at all tested nothing.
    assert any(s.graphs for s in result.samples if s.status == suite.PASS), (
        f"{name}: the backend never received a graph (Dynamo ran every sample eagerly)")
