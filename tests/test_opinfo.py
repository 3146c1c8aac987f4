"""OpInfo, pytest edition: a fixed, representative subset of PyTorch's OpInfo database through
the backend (COMMFUSE_TEST_BACKEND, default "commfuse"), forward and backward, against eager. The
runner is tests/opinfo_suite.py; its CLI runs the whole database (docs/results.md).

Every listed op must give ZERO mismatches (wrong values) and ZERO errors, in both directions.
Samples that are not applicable (random, complex outputs, eager fails, ...) are skipped.

    pytest -n 2 tests/test_opinfo.py
    COMMFUSE_TEST_BACKEND=aot_eager pytest -n 2 tests/test_opinfo.py   # validates the harness
"""
from __future__ import annotations

import os

import pytest

from tests import opinfo_suite as suite

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

# (fw, bw) class where not ("lowered", "lowered"): matmuls run aten's mm, cumsum aten's scan.
# A backward of views only is no graph (AOTAutograd replays views): "skipped".
EXPECTED = {
    **{op: ("extern", "extern") for op in ("mm", "bmm", "matmul", "addmm", "nn.functional.linear",
                                           "cumsum")},
    **{op: ("lowered", "skipped") for op in ("argmax", "view", "reshape", "permute", "transpose",
                                             "expand", "squeeze", "unsqueeze")},
    "index_select": ("extern", "lowered"), "scatter_add": ("extern", "lowered"),
    "gather": ("lowered", "extern"),
}


@pytest.mark.parametrize("name", OPS)
def test_opinfo(name):
    r = suite.run_op(name, samples=SAMPLES_PER_OP, op_timeout=OP_TIMEOUT_S)
    bad = [(s, d) for s in r.samples for d in suite.DIRECTIONS
           if getattr(s, d) in (suite.MISMATCH, *suite.ERROR_STATUSES)]
    if bad:
        lines = [f"{name} on backend {suite.BACKEND!r}: fw {r.fw}, bw {r.bw}"]
        for s, d in bad:
            lines += [f"  sample {s.index} {d} [{s.desc}]", f"    {getattr(s, d)}: {getattr(s, d + '_msg')}"]
            lines += ["      " + ln for ln in s.detail.strip().splitlines()[-6:]]
        lines.append(f"  reproduce: COMMFUSE_TEST_BACKEND={suite.BACKEND} python -m tests.opinfo_suite "
                     f"--filter ={name} --samples 8 --jobs 0")
        pytest.fail(("WRONG VALUES: " if "wrong" in (r.fw, r.bw) else "ERRORS: ") + "\n".join(lines),
                    pytrace=False)
    if r.fw == "skipped":
        pytest.skip(f"{name}: {r.skip_reason or [s.fw_msg for s in r.samples]}")
    if suite.BACKEND == "commfuse":  # lowered, or run through aten, as intended
        assert (r.fw, r.bw) == EXPECTED.get(name, ("lowered", "lowered")), [
            (s.fw_fallbacks, s.bw_fallbacks) for s in r.samples]
