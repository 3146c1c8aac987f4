#!/usr/bin/env python
"""OpInfo peer suite: run PyTorch's own OpInfo database through a torch.compile backend.

For each selected OpInfo entry (``torch.testing._internal.common_methods_invocations.op_db``,
sorted by name) we take up to K sample inputs, run the op eagerly, then compile a small wrapper
with ``torch.compile(fn, backend=BACKEND, fullgraph=False, dynamic=False)`` (after
``torch._dynamo.reset()``) and compare.  The wrapper closes over the sample's argument
*structure*: every tensor in it (however nested in lists/tuples/dicts) is a graph input, every
other value (ints, dims, dtypes, slices, ...) is a compile-time constant.

Each sample ends in exactly one status:

    PASS           compiled outputs (and any mutated inputs) match eager
    COMPILE_ERROR  the compiled call raised while Dynamo traced or the backend compiled
    RUNTIME_ERROR  the compiled call raised while running the compiled code
    TIMEOUT        the op's wall-clock budget ran out inside the compiled call
    MISMATCH       the compiled call returned wrong numbers / shapes / dtypes  (the serious one)
    SKIPPED        not applicable: eager itself fails, eager is nondeterministic (random ops),
                   complex / sparse / non-tensor outputs, out= samples, ...

pass rate = PASS / (PASS + COMPILE_ERROR + RUNTIME_ERROR + TIMEOUT + MISMATCH).

Backend: ``COMMFUSE_TEST_BACKEND`` (default ``commfuse``); any name known to
``torch._dynamo.list_backends`` works (validate the harness itself with ``aot_eager``), as does
``module:attr``.  ``commfuse`` is also found from this checkout when the package is not installed.

Usage::

    COMMFUSE_TEST_BACKEND=aot_eager python tools/opinfo_suite.py --ops 150 --samples 2
    python tools/opinfo_suite.py --filter softmax --samples 4 --json /tmp/softmax.json -v

This module is also imported by tests/test_opinfo.py (``run_op``, ``get_op``, ``STATUSES``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from collections import Counter


def _device() -> str:
    """Samples live on the GPU where there is one (compiled Triton), else on CPU (interpreter)."""
    import torch
    return os.environ.get("COMMFUSE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
from pathlib import Path
from typing import Any, Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent

BACKEND = os.environ.get("COMMFUSE_TEST_BACKEND", "commfuse")

PASS = "PASS"
COMPILE_ERROR = "COMPILE_ERROR"
RUNTIME_ERROR = "RUNTIME_ERROR"
TIMEOUT = "TIMEOUT"
MISMATCH = "MISMATCH"
SKIPPED = "SKIPPED"
STATUSES = (PASS, COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT, MISMATCH, SKIPPED)
ERROR_STATUSES = (COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT)
# Statuses that count in the pass-rate denominator.
COUNTED_STATUSES = (PASS,) + ERROR_STATUSES + (MISMATCH,)

DTYPES = ("float32", "float16", "bfloat16", "float64")
DEFAULT_OP_TIMEOUT_S = 120.0
MAX_SAMPLES_SCANNED = 64  # samples looked at per op while searching for K applicable ones

# --------------------------------------------------------------------------------------------
# Which ops are not applicable at all (op-level, decided before running anything).
# Everything else that is not applicable is detected per sample at run time (eager fails,
# eager is nondeterministic, complex/sparse/non-tensor outputs, ...).
# --------------------------------------------------------------------------------------------

# Results always depend on the RNG (compiled code need not consume it like eager does).  Ops
# that are random only for some samples (dropout with p > 0 and training=True, SDPA with
# dropout_p > 0, rrelu in training) are caught per sample: the second eager run is watched for
# aten ops tagged nondeterministic_seeded.
_RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "normal.in_place", "normal.number_mean", "uniform",
    "rand_like", "randint", "randint_like", "randn", "randn_like",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "pca_lowrank", "svd_lowrank",
}
# Results are (partly) uninitialized memory.
_UNINITIALIZED_OPS = {
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
    "new_empty_strided", "resize_", "resize_as_",
}
# Output shape depends on the data.
_DATA_DEPENDENT_OPS = {
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount",
    "repeat_interleave",
}
# Only non-tensor results.
_NON_TENSOR_OUTPUT_OPS = {"item", "equal", "allclose", "broadcast_shapes"}
_SPARSE_RE = re.compile(r"(^|\.)sparse(\.|_|$)|to_sparse")


def op_full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def static_skip_reason(op, dtype) -> str | None:
    """Why `op` is not applicable at all for `dtype` on CPU, or None."""
    name = op_full_name(op)
    if _SPARSE_RE.search(name):
        return "sparse op"
    if name.startswith("jiterator_"):
        return "CUDA-only op"
    if name in _RANDOM_OPS:
        return "random op (results depend on RNG)"
    if name in _UNINITIALIZED_OPS:
        return "returns uninitialized memory"
    if name in _DATA_DEPENDENT_OPS:
        return "data-dependent output shape"
    if name in _NON_TENSOR_OUTPUT_OPS:
        return "non-tensor output only"
    try:
        supported = op.supported_dtypes(_device())
    except Exception as e:  # pragma: no cover - defensive
        return f"cannot query dtypes: {type(e).__name__}"
    if dtype not in supported:
        return f"{str(dtype).replace('torch.', '')} not supported on {_device()}"
    return None


# --------------------------------------------------------------------------------------------
# op_db loading
# --------------------------------------------------------------------------------------------

_OP_DB: list | None = None
_OPS_BY_NAME: dict[str, Any] | None = None


def _install_expecttest_shim() -> bool:
    """torch.testing._internal.common_utils imports `expecttest` only to subclass its TestCase.
    If the package is missing, stand in a minimal module so op_db can still be imported."""
    import importlib.util
    if "expecttest" in sys.modules or importlib.util.find_spec("expecttest") is not None:
        return False
    import unittest
    shim = types.ModuleType("expecttest")
    shim.TestCase = unittest.TestCase
    shim.ACCEPT = False
    shim.__doc__ = "minimal stand-in installed by tools/opinfo_suite.py"
    sys.modules["expecttest"] = shim
    return True


def load_op_db() -> list:
    """Import and return op_db (cached).  Undoes common_utils' import-time side effect of
    freezing torch.backends flags so the rest of the process is unaffected."""
    global _OP_DB, _OPS_BY_NAME
    if _OP_DB is None:
        import torch.backends
        was_frozen = torch.backends.flags_frozen()
        _install_expecttest_shim()
        from torch.testing._internal.common_methods_invocations import op_db
        if not was_frozen and torch.backends.flags_frozen():
            setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
        _OP_DB = sorted(op_db, key=op_full_name)
        _OPS_BY_NAME = {op_full_name(o): o for o in _OP_DB}
    return _OP_DB


def get_op(name: str):
    """The OpInfo whose full name ("name" or "name.variant") is `name`, or None."""
    load_op_db()
    assert _OPS_BY_NAME is not None
    return _OPS_BY_NAME.get(name)


def parse_dtype(s):
    import torch
    if isinstance(s, torch.dtype):
        return s
    s = str(s).replace("torch.", "")
    if s not in DTYPES:
        raise ValueError(f"dtype {s!r} not supported by the suite (choose from {DTYPES})")
    return getattr(torch, s)


# --------------------------------------------------------------------------------------------
# Backend resolution and instrumentation
# --------------------------------------------------------------------------------------------

def resolve_backend(name: str) -> Callable:
    """Backend name -> compiler callable.  Raises if it cannot be found."""
    import torch._dynamo
    if ":" in name:
        mod, _, attr = name.partition(":")
        return getattr(importlib.import_module(mod), attr)
    try:
        return torch._dynamo.lookup_backend(name)
    except Exception:
        if name != "commfuse":
            raise
    # Not registered through an installed entry point: use this checkout.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from commfuse.backend import commfuse_backend  # noqa: WPS433
    return commfuse_backend


class _BackendProbe:
    """Wraps a backend to record which phase an exception came from and how much it compiled."""

    def __init__(self, inner: Callable):
        self.inner = inner
        self.graphs = 0
        self.nodes = 0
        self.err_phase: str | None = None

    def backend(self, gm, example_inputs):
        self.graphs += 1
        self.nodes += sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method",
                                                                "call_module"))
        try:
            compiled = self.inner(gm, example_inputs)
        except BaseException:
            self.err_phase = self.err_phase or "compile"
            raise
        probe = self

        @functools.wraps(compiled)
        def run(*args, **kwargs):
            try:
                return compiled(*args, **kwargs)
            except BaseException:
                probe.err_phase = probe.err_phase or "run"
                raise

        return run


# --------------------------------------------------------------------------------------------
# Per-op wall-clock limit
# --------------------------------------------------------------------------------------------

class OpTimeout(BaseException):
    """Raised from SIGALRM.  A BaseException so that `except Exception` in Dynamo or a backend
    does not swallow it."""


class _Deadline:
    def __init__(self):
        self.expired = False


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise OpTimeout in the main thread after `seconds` of wall time (no-op off the main
    thread or without SIGALRM).  Yields an object whose `.expired` says whether it fired."""
    deadline = _Deadline()
    if (not seconds or seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield deadline
        return

    def _fire(signum, frame):
        deadline.expired = True
        raise OpTimeout(f"op exceeded its {seconds:g}s wall-clock budget")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield deadline
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------------------------
# Sample structure: tensors become inputs, everything else is a constant
# --------------------------------------------------------------------------------------------

class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self):
        return f"<input {self.i}>"


def _template(obj, tensors: list, memo: dict):
    import torch
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:  # the same tensor twice stays one input (keeps aliasing)
            memo[key] = len(tensors)
            tensors.append(obj)
        return _Slot(memo[key])
    if type(obj) in (list, tuple):
        return type(obj)(_template(x, tensors, memo) for x in obj)
    if type(obj) is dict:
        return {k: _template(v, tensors, memo) for k, v in obj.items()}
    return obj


def _fill(t, inputs):
    if isinstance(t, _Slot):
        return inputs[t.i]
    if type(t) is list:
        return [_fill(x, inputs) for x in t]
    if type(t) is tuple:
        return tuple(_fill(x, inputs) for x in t)
    if type(t) is dict:
        return {k: _fill(v, inputs) for k, v in t.items()}
    return t


def split_sample(sample):
    """-> (template of (args, kwargs) with tensors replaced by slots, list of tensors)."""
    tensors: list = []
    tmpl = _template(((sample.input,) + tuple(sample.args), dict(sample.kwargs)), tensors, {})
    return tmpl, tensors


def make_fn(func: Callable, tmpl) -> Callable:
    """A function of the sample's tensors only; non-tensor args are closed-over constants."""
    args_t, kwargs_t = tmpl

    def fn(*inputs):
        return func(*_fill(args_t, inputs), **_fill(kwargs_t, inputs))

    return fn


def clone_exact(t):
    """A copy with the same sizes, strides and storage offset (so non-contiguous, expanded and
    offset inputs reach the backend as they would reach eager)."""
    import torch
    if t.layout != torch.strided or t.is_quantized:
        return t.clone()
    storage = t.untyped_storage().clone()
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(storage, t.storage_offset(), t.size(), t.stride())
    out.requires_grad_(t.requires_grad)
    return out


def _leaves(obj) -> list:
    import torch.utils._pytree as pytree
    return pytree.tree_leaves(obj)


def sample_skip_reason(sample) -> str | None:
    """Why a sample is not applicable (decided before running it), or None."""
    import torch
    if "out" in sample.kwargs:
        return "out= sample"
    for leaf in _leaves((sample.input, sample.args, sample.kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided:
                return f"{leaf.layout} input"
            if leaf.is_complex():
                return "complex input"
            if leaf.is_quantized:
                return "quantized input"
    return None


def describe(obj, limit: int = 160) -> str:
    import torch

    def d(o):
        if isinstance(o, torch.Tensor):
            s = f"T{list(o.shape)}"
            if o.dtype not in (torch.float32,):
                s += f":{str(o.dtype).replace('torch.', '')}"
            if o.numel() > 1 and not o.is_contiguous():
                s += ":nc"
            return s
        if type(o) in (list, tuple):
            inner = ", ".join(d(x) for x in o)
            return f"[{inner}]" if type(o) is list else f"({inner})"
        if type(o) is dict:
            return "{" + ", ".join(f"{k}={d(v)}" for k, v in o.items()) + "}"
        return repr(o)

    s = d(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def sample_desc(sample) -> str:
    parts = [describe(sample.input)]
    parts += [describe(a) for a in sample.args]
    parts += [f"{k}={describe(v)}" for k, v in sample.kwargs.items()]
    s = ", ".join(parts)
    return s if len(s) <= 240 else s[:237] + "..."


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

# torch.testing.assert_close defaults, times 10.
_BASE_TOL = {
    "float64": (1e-7 * 10, 1e-7 * 10),
    "float32": (1.3e-6 * 10, 1e-5 * 10),
    "float16": (1e-3 * 10, 1e-5 * 10),
    "bfloat16": (1.6e-2 * 10, 1e-5 * 10),
}
# Low-precision absolute floors (one half-precision ulp near 1 is ~1e-3 / ~8e-3).
_ATOL_FLOOR = {"float16": 1e-3, "bfloat16": 1e-2}
# Ops that accumulate (reduction order legitimately differs between implementations).
_ACCUM_RE = re.compile(
    r"sum|prod|mean|var|std|norm|cum|logsumexp|logaddexp|softmax|softmin|matmul|mm|mv|dot|"
    r"inner|outer|einsum|tensordot|linear|conv|linalg|pool|loss|entropy|fft|stft|interpolate|"
    r"upsample|trace|dist|cov|corrcoef|kron|trapz|trapezoid|grid_sample|attention|embedding_bag|"
    r"baddbmm|addbmm|addr|chain|det|inverse|solve|cholesky|pinv|lstsq|svd|qr|eig|lu|matrix|"
    r"quantile|median|histc|histogram|renorm|normalize|local_response|scatter_reduce|index_reduce"
    r"|cross|lerp|polygamma|gradient|diff"
)
_ACCUM_FACTOR = 5.0


def is_accumulating(op) -> bool:
    try:
        from torch.testing._internal.opinfo.core import ReductionOpInfo
        if isinstance(op, ReductionOpInfo):
            return True
    except Exception:  # pragma: no cover
        pass
    return bool(_ACCUM_RE.search(op_full_name(op)))


def tolerance(dtype, accumulating: bool, input_dtype=None) -> tuple[float, float]:
    """(rtol, atol) for an output of `dtype`; the looser of output and input dtype applies."""
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    best = (0.0, 0.0)
    for dt in (dtype, input_dtype):
        if dt is None:
            continue
        key = str(dt).replace("torch.", "").replace("complex128", "float64").replace(
            "complex64", "float32").replace("complex32", "float16")
        rtol, atol = _BASE_TOL.get(key, _BASE_TOL["float32"])
        atol = max(atol, _ATOL_FLOOR.get(key, 0.0))
        if accumulating:
            rtol, atol = rtol * _ACCUM_FACTOR, atol * _ACCUM_FACTOR
        best = (max(best[0], rtol), max(best[1], atol))
    return best


def _first_lines(msg: str, n: int = 6, width: int = 600) -> str:
    lines = [ln for ln in str(msg).strip().splitlines() if ln.strip()]
    s = " | ".join(ln.strip() for ln in lines[:n])
    return s if len(s) <= width else s[: width - 3] + "..."


def compare(expected, actual, accumulating: bool, input_dtype, what: str = "output") -> str | None:
    """None if `actual` matches `expected`, else a short description of the first difference."""
    import torch
    import torch.utils._pytree as pytree
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        return (f"{what} structure differs: expected {len(exp_leaves)} leaves, "
                f"got {len(act_leaves)} ({describe(expected, 80)} vs {describe(actual, 80)})")
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        where = f"{what}[{i}]" if len(exp_leaves) > 1 else what
        if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
                return f"{where}: expected {type(e).__name__}, got {type(a).__name__}"
            rtol, atol = tolerance(e.dtype, accumulating, input_dtype)
            try:
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=True,
                    check_dtype=True, check_layout=True, check_stride=False)
            except AssertionError as ex:
                return f"{where}: {_first_lines(ex)}"
            except Exception as ex:  # e.g. comparing unsupported tensor kinds
                return f"{where}: comparison failed: {type(ex).__name__}: {_first_lines(ex, 2)}"
        elif isinstance(e, float) or isinstance(a, float):
            try:
                ef, af = float(e), float(a)
            except (TypeError, ValueError):
                return f"{where}: expected {e!r}, got {a!r}"
            if not ((math.isnan(ef) and math.isnan(af))
                    or math.isclose(ef, af, rel_tol=1e-5, abs_tol=1e-6)):
                return f"{where}: expected {e!r}, got {a!r}"
        else:
            try:
                same = bool(e == a)
            except Exception:
                same = e is a
            if not same:
                return f"{where}: expected {e!r}, got {a!r}"
    return None


def output_skip_reason(out) -> str | None:
    import torch
    tensors = [x for x in _leaves(out) if isinstance(x, torch.Tensor)]
    if not tensors:
        return f"non-tensor output only ({type(out).__name__})"
    for t in tensors:
        if t.layout != torch.strided:
            return f"{t.layout} output"
        if t.is_complex():
            return "complex output"
        if t.is_quantized:
            return "quantized output"
    return None


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SampleResult:
    index: int
    status: str
    message: str = ""
    phase: str = ""          # eager / compile / run / compare
    time_s: float = 0.0
    graphs: int = 0          # FX graphs the backend was handed
    nodes: int = 0           # op nodes in them
    desc: str = ""
    detail: str = ""         # traceback tail for errors (JSON only)


@dataclasses.dataclass
class OpResult:
    name: str
    samples: list[SampleResult] = dataclasses.field(default_factory=list)
    time_s: float = 0.0
    skip_reason: str | None = None   # op-level: not applicable at all

    def counts(self) -> Counter:
        return Counter(s.status for s in self.samples)

    def worst(self) -> str:
        c = self.counts()
        for st in (MISMATCH, COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT, PASS):
            if c.get(st):
                return st
        return SKIPPED

    def failures(self) -> list[SampleResult]:
        return [s for s in self.samples if s.status in ERROR_STATUSES + (MISMATCH,)]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["counts"] = dict(self.counts())
        return d


def collect_samples(op, dtype, k: int, seed: int = 0, pick: str = "first"):
    """Up to `k` applicable samples, as (index in sample_inputs, sample); deterministic (seeded,
    materialized before anything runs).  pick="first": the first k applicable ones;
    pick="spread": k spread evenly over the first MAX_SAMPLES_SCANNED applicable ones (the
    first samples are often 0-d tensors).  Returns (samples, Counter of filtered-out reasons)."""
    import torch
    torch.manual_seed(seed)
    applicable, filtered = [], Counter()
    gen = op.sample_inputs(_device(), dtype, requires_grad=False)
    for n, sample in enumerate(gen):
        if (pick == "first" and len(applicable) >= k) or n >= MAX_SAMPLES_SCANNED:
            break
        why = sample_skip_reason(sample)
        if why:
            filtered[why] += 1
            continue
        applicable.append((n, sample))
    if pick == "spread" and len(applicable) > k:
        step = len(applicable) / k
        applicable = [applicable[int(i * step)] for i in range(k)]
    return applicable[:k], filtered


def _make_seeded_op_detector():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class SeededOpDetector(TorchDispatchMode):
        """Records aten ops tagged nondeterministic_seeded (bernoulli, uniform_, native_dropout,
        randn, ...) that run underneath it."""

        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return SeededOpDetector


_SEEDED_DETECTOR_CLS = None


def _SeededOpDetector():
    global _SEEDED_DETECTOR_CLS
    if _SEEDED_DETECTOR_CLS is None:
        _SEEDED_DETECTOR_CLS = _make_seeded_op_detector()
    return _SEEDED_DETECTOR_CLS()


def _exc_summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_lines(exc, 3, 400)}"


def _unwrap_exc(exc: BaseException) -> BaseException:
    """BackendCompilerFailed and friends carry the interesting exception as inner_exception."""
    inner = getattr(exc, "inner_exception", None)
    return inner if isinstance(inner, BaseException) else exc


def _tb_tail(exc: BaseException, limit: int = 2500) -> str:
    s = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return s[-limit:]


def run_sample(op, index: int, sample, dtype, backend_fn: Callable | None,
               backend_error: BaseException | None, deadline: _Deadline,
               state: dict | None = None, backend_name: str | None = None) -> SampleResult:
    """Run one sample eagerly and compiled; classify.  OpTimeout propagates to the caller
    (which finds the partial result, with its phase, in state["res"]), except when it surfaces
    wrapped inside a compile/run error (then: TIMEOUT)."""
    import torch
    import torch._dynamo

    res = SampleResult(index=index, status=SKIPPED, desc=sample_desc(sample))
    if state is not None:
        state["res"] = res
    t0 = time.perf_counter()
    func = op.op
    tmpl, tensors = split_sample(sample)
    fn = make_fn(func, tmpl)
    accumulating = is_accumulating(op)

    def fresh():
        return [clone_exact(t) for t in tensors]

    try:
        # ---- eager reference (twice: random / nondeterministic ops are not comparable) ----
        res.phase = "eager"
        eager_in = fresh()
        try:
            expected = fn(*eager_in)
        except Exception as e:
            res.message = f"eager failed: {_exc_summary(e)}"
            return res
        why = output_skip_reason(expected)
        if why:
            res.message = why
            return res
        eager_in2 = fresh()
        detector = _SeededOpDetector()
        try:
            with detector:
                expected2 = fn(*eager_in2)
        except Exception as e:
            res.message = f"eager failed on rerun: {_exc_summary(e)}"
            return res
        if detector.seen:
            # OpInfo wraps many random ops in wrapper_set_seed, so two eager runs agree; compiled
            # code need not draw from the RNG the same way.
            res.message = f"random: uses RNG op {detector.seen[0]}"
            return res
        if compare(expected, expected2, accumulating, dtype) is not None:
            res.message = "eager is nondeterministic (two eager runs differ)"
            return res

        # ---- compiled ----
        res.phase = "compile"
        if backend_fn is None:
            res.status = COMPILE_ERROR
            res.message = (f"backend {backend_name or BACKEND!r} unavailable: "
                           f"{_exc_summary(backend_error)}")
            return res
        probe = _BackendProbe(backend_fn)
        compiled_in = fresh()
        torch._dynamo.reset()
        try:
            compiled = torch.compile(fn, backend=probe.backend, fullgraph=False, dynamic=False)
            actual = compiled(*compiled_in)
        except Exception as e:
            res.graphs, res.nodes = probe.graphs, probe.nodes
            inner = _unwrap_exc(e)
            if deadline.expired or isinstance(inner, OpTimeout):
                res.status = TIMEOUT
                res.message = "timed out inside the compiled call"
                return res
            res.status = _classify_error(e, probe)
            res.phase = "run" if res.status == RUNTIME_ERROR else "compile"
            res.message = _exc_summary(inner)
            res.detail = _tb_tail(e)
            return res
        finally:
            res.graphs, res.nodes = probe.graphs, probe.nodes

        # ---- compare outputs and (possibly mutated) inputs ----
        res.phase = "compare"
        diff = compare(expected, actual, accumulating, dtype)
        if diff is None:
            for i, (e_in, c_in) in enumerate(zip(eager_in, compiled_in)):
                diff = compare(e_in, c_in, accumulating, dtype, what=f"input {i} after call")
                if diff:
                    break
        if diff is None:
            res.status, res.message = PASS, ""
        else:
            res.status, res.message = MISMATCH, diff
        return res
    finally:
        res.time_s = round(time.perf_counter() - t0, 3)


def _classify_error(exc: BaseException, probe: _BackendProbe) -> str:
    if probe.err_phase == "run":
        return RUNTIME_ERROR
    if probe.err_phase == "compile":
        return COMPILE_ERROR
    try:
        from torch._dynamo.exc import TorchDynamoException
        if isinstance(exc, TorchDynamoException):
            return COMPILE_ERROR  # Dynamo tracing / fake-tensor propagation failed
    except Exception:  # pragma: no cover
        pass
    # Raised outside the backend and outside Dynamo: code Dynamo left to run eagerly around
    # the compiled graphs failed on the compiled graphs' outputs.
    return RUNTIME_ERROR if probe.graphs else COMPILE_ERROR


_BACKEND_CACHE: dict[str, tuple[Callable | None, BaseException | None]] = {}


def get_backend(name: str | None = None) -> tuple[Callable | None, BaseException | None]:
    name = name or BACKEND
    if name not in _BACKEND_CACHE:
        try:
            _BACKEND_CACHE[name] = (resolve_backend(name), None)
        except Exception as e:
            _BACKEND_CACHE[name] = (None, e)
    return _BACKEND_CACHE[name]


def run_op(op, samples: int = 2, dtype="float32", op_timeout: float | None = DEFAULT_OP_TIMEOUT_S,
           backend: str | None = None, seed: int = 0, pick: str = "first") -> OpResult:
    """Run up to `samples` samples of OpInfo `op` (or its full name) through the backend."""
    import torch
    dtype = parse_dtype(dtype)
    if isinstance(op, str):
        name = op
        op = get_op(name)
        if op is None:
            return OpResult(name=name, skip_reason="not in op_db")
    result = OpResult(name=op_full_name(op))
    why = static_skip_reason(op, dtype)
    if why:
        result.skip_reason = why
        return result
    backend_fn, backend_error = get_backend(backend)
    t0 = time.perf_counter()
    current: dict[str, Any] = {}
    with warnings.catch_warnings(), time_limit(op_timeout) as deadline:
        warnings.simplefilter("ignore")
        try:
            picked, filtered = collect_samples(op, dtype, samples, seed, pick)
            if not picked:
                result.skip_reason = ("no applicable sample"
                                      + (f" ({dict(filtered)})" if filtered else ""))
            for n, sample in picked:
                current.clear()
                current["sample"] = sample
                r = run_sample(op, n, sample, dtype, backend_fn, backend_error, deadline,
                               current, backend)
                result.samples.append(r)
                if deadline.expired:
                    break
        except OpTimeout:
            r = current.get("res")
            if r is None:
                result.skip_reason = f"timed out generating samples ({op_timeout:g}s)"
            else:
                r.time_s = round(time.perf_counter() - t0, 3)
                if r.phase == "eager":  # eager itself too slow: not the backend's fault
                    r.status = SKIPPED
                    r.message = f"eager exceeded the op's {op_timeout:g}s budget"
                else:
                    r.status = TIMEOUT
                    r.message = f"op exceeded its {op_timeout:g}s wall-clock budget ({r.phase})"
                result.samples.append(r)
        except Exception as e:  # sample generation itself failed
            result.skip_reason = f"sample generation failed: {_exc_summary(e)}"
        finally:
            try:
                torch._dynamo.reset()
            except Exception:
                pass
    result.time_s = round(time.perf_counter() - t0, 3)
    return result


# --------------------------------------------------------------------------------------------
# Selection, reporting, CLI
# --------------------------------------------------------------------------------------------

def select_ops(n: int, filt: str | None, dtype, select: str = "first"):
    """-> (runnable ops, [(name, reason)] for ops not applicable).  Deterministic."""
    ops = load_op_db()
    if filt:
        pats = [p.strip() for p in filt.split(",") if p.strip()]
        ops = [o for o in ops if any(op_full_name(o) == p[1:] if p.startswith("=")
                                     else p in op_full_name(o) for p in pats)]
    runnable, skipped = [], []
    for o in ops:
        why = static_skip_reason(o, dtype)
        (skipped.append((op_full_name(o), why)) if why else runnable.append(o))
    if n and n < len(runnable):
        if select == "spread":
            step = len(runnable) / n
            runnable = [runnable[int(i * step)] for i in range(n)]
        else:
            runnable = runnable[:n]
    return runnable, skipped


def summarize(results: Iterable[OpResult]) -> dict:
    results = list(results)
    c = Counter()
    for r in results:
        c.update(r.counts())
    ran = [r for r in results if r.samples]
    denom = sum(c[s] for s in COUNTED_STATUSES)
    no_graph_pass = sum(1 for r in results for s in r.samples if s.status == PASS and not s.graphs)
    return {
        "ops_selected": len(results),
        "ops_with_samples": len(ran),
        "ops_all_pass": sum(1 for r in ran if r.worst() == PASS),
        "ops_with_mismatch": sorted(r.name for r in ran if r.counts().get(MISMATCH)),
        "ops_with_error": sorted(r.name for r in ran
                                 if any(r.counts().get(s) for s in ERROR_STATUSES)),
        "samples": sum(c.values()),
        "counts": {s: c.get(s, 0) for s in STATUSES},
        "errors": sum(c.get(s, 0) for s in ERROR_STATUSES),
        "pass_rate": (c[PASS] / denom) if denom else None,
        "pass_without_backend_graph": no_graph_pass,
    }


def format_op_line(i: int, total: int, r: OpResult, width: int = 44) -> str:
    w = len(str(total))
    head = f"[{i:>{w}}/{total}] {r.name:<{width}}"
    if not r.samples:
        return f"{head} SKIPPED (op)  {r.skip_reason or ''}"
    c = r.counts()
    parts = " ".join(f"{s}={c[s]}" for s in STATUSES if c.get(s))
    line = f"{head} {r.worst():<13} {parts:<28} {r.time_s:6.1f}s"
    for s in r.samples:
        if s.status in ERROR_STATUSES + (MISMATCH,):
            line += f"\n      sample {s.index} {s.status}: {s.message[:300]}\n        [{s.desc}]"
    return line


def format_summary(summary: dict, cfg: dict, skipped_ops: list, elapsed: float) -> str:
    c = summary["counts"]
    rate = summary["pass_rate"]
    lines = [
        "",
        "=" * 72,
        f"OpInfo peer suite  backend={cfg['backend']}  dtype={cfg['dtype']}  "
        f"samples/op<={cfg['samples']}  torch={cfg['torch']}",
        "=" * 72,
        f"  ops selected              {summary['ops_selected']:>6}",
        f"  ops not applicable        {len(skipped_ops):>6}   (sparse/random/dtype/...; not run)",
        f"  ops with samples run      {summary['ops_with_samples']:>6}",
        f"  ops fully passing         {summary['ops_all_pass']:>6}",
        f"  samples                   {summary['samples']:>6}",
        f"    PASS                    {c[PASS]:>6}",
        f"    COMPILE_ERROR           {c[COMPILE_ERROR]:>6}",
        f"    RUNTIME_ERROR           {c[RUNTIME_ERROR]:>6}",
        f"    TIMEOUT                 {c[TIMEOUT]:>6}",
        f"    MISMATCH                {c[MISMATCH]:>6}   <- wrong numbers",
        f"    SKIPPED                 {c[SKIPPED]:>6}",
        f"  pass rate                 {'n/a' if rate is None else f'{100 * rate:6.2f}%'}"
        f"   PASS / (PASS + ERRORS + MISMATCH)",
        f"  PASS with no backend graph {summary['pass_without_backend_graph']:>5}"
        "   (Dynamo ran it all eagerly)",
        f"  wall time                 {elapsed:6.1f}s",
    ]
    if summary["ops_with_mismatch"]:
        lines.append(f"  MISMATCH ops: {', '.join(summary['ops_with_mismatch'])}")
    if summary["ops_with_error"]:
        lines.append(f"  ERROR ops:    {', '.join(summary['ops_with_error'])}")
    return "\n".join(lines)


def _quiet_torch_logs():
    import torch
    try:
        torch._logging.set_logs(dynamo=logging.CRITICAL, aot=logging.CRITICAL,
                                inductor=logging.CRITICAL)
    except Exception:  # pragma: no cover
        pass


def _worker_init(threads: int, quiet: bool):
    import torch
    if threads:
        torch.set_num_threads(threads)
    if quiet:
        _quiet_torch_logs()
    try:
        import faulthandler
        faulthandler.enable()
    except Exception:  # pragma: no cover
        pass
    load_op_db()


def _worker_run(name: str, cfg: dict) -> OpResult:
    return run_op(name, samples=cfg["samples"], dtype=cfg["dtype"],
                  op_timeout=cfg["op_timeout"], backend=cfg["backend"], seed=cfg["seed"],
                  pick=cfg["pick"])


def _run_parallel(names: list[str], cfg: dict, jobs: int, on_result: Callable) -> None:
    """Run ops in `jobs` spawned worker processes.  A worker that dies (segfault in generated
    code, OOM) takes its in-flight ops with it; those are retried one op per fresh process so
    the op that crashes is pinned down and recorded as RUNTIME_ERROR."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    init = (_worker_init, (threads, cfg["quiet"]))
    pending = list(names)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=init[0], initargs=init[1]) as ex:
        futs = {ex.submit(_worker_run, n, cfg): n for n in pending}
        broken: list[str] = []
        for f in as_completed(futs):
            n = futs[f]
            try:
                on_result(f.result())
            except BrokenProcessPool:
                broken.append(n)
            except Exception as e:  # pickling etc.
                on_result(OpResult(name=n, samples=[SampleResult(
                    index=-1, status=RUNTIME_ERROR, message=f"harness: {_exc_summary(e)}")]))
    for n in sorted(broken):
        with ProcessPoolExecutor(1, mp_context=ctx, initializer=init[0], initargs=init[1]) as ex:
            try:
                on_result(ex.submit(_worker_run, n, cfg).result())
            except BrokenProcessPool:
                on_result(OpResult(name=n, samples=[SampleResult(
                    index=-1, status=RUNTIME_ERROR, phase="run",
                    message="worker process died (crash in compiled code?)")]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=150, help="max ops to run (0: all applicable)")
    p.add_argument("--samples", type=int, default=2, help="max samples per op")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--json", metavar="PATH", help="write a JSON report here")
    p.add_argument("--filter", help="only ops whose full name contains this; '=name' matches "
                                    "exactly; comma-separated: any of them")
    p.add_argument("--select", choices=("first", "spread"), default="first",
                   help="with --ops N: the first N applicable ops by name, or N spread evenly")
    p.add_argument("--pick", choices=("first", "spread"), default="first",
                   help="which samples of an op: its first K, or K spread over its first "
                        f"{MAX_SAMPLES_SCANNED}")
    p.add_argument("--backend", default=None,
                   help="override COMMFUSE_TEST_BACKEND (default: that, else commfuse)")
    p.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S,
                   help="wall-clock seconds per op (all its samples); 0: none")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (0: run in this process, no crash isolation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the selected ops and exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any sample is MISMATCH or an error")
    p.add_argument("-v", "--verbose", action="store_true", help="keep torch's logging")
    args = p.parse_args(argv)

    global BACKEND
    if args.backend:
        BACKEND = args.backend
        os.environ["COMMFUSE_TEST_BACKEND"] = args.backend  # spawned workers read it too
    import torch
    dtype = parse_dtype(args.dtype)
    if not args.verbose:
        _quiet_torch_logs()
    t_start = time.perf_counter()
    ops, skipped_ops = select_ops(args.ops, args.filter, dtype, args.select)
    names = [op_full_name(o) for o in ops]
    if args.list:
        print("\n".join(names))
        print(f"# {len(names)} ops selected, {len(skipped_ops)} not applicable", file=sys.stderr)
        return 0

    cfg = {"backend": BACKEND, "dtype": args.dtype, "samples": args.samples,
           "op_timeout": args.op_timeout, "seed": args.seed, "quiet": not args.verbose,
           "torch": torch.__version__, "ops": args.ops, "filter": args.filter,
           "select": args.select, "pick": args.pick, "jobs": args.jobs}
    backend_fn, backend_error = get_backend(BACKEND)
    status = "ok" if backend_fn else "UNAVAILABLE: " + _exc_summary(backend_error)
    print(f"# backend={BACKEND} ({status})  ops={len(names)}  samples/op<={args.samples}  "
          f"dtype={args.dtype}  pick={args.pick}  jobs={args.jobs}", flush=True)

    results: dict[str, OpResult] = {}

    def on_result(r: OpResult):
        results[r.name] = r
        print(format_op_line(len(results), len(names), r), flush=True)

    try:
        if args.jobs and args.jobs > 0 and len(names) > 1:
            _run_parallel(names, cfg, args.jobs, on_result)
        else:
            for n in names:
                on_result(_worker_run(n, cfg))
    except KeyboardInterrupt:
        print("\n# interrupted: reporting what finished", flush=True)

    elapsed = time.perf_counter() - t_start
    ordered = [results[n] for n in names if n in results]
    summary = summarize(ordered)
    print(format_summary(summary, cfg, skipped_ops, elapsed))
    if args.json:
        report = {
            "config": cfg,
            "summary": summary,
            "elapsed_s": round(elapsed, 1),
            "ops": [r.to_json() for r in ordered],
            "not_applicable_ops": [{"name": n, "reason": why} for n, why in skipped_ops],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"# JSON report: {args.json}")
    if args.strict and (summary["counts"][MISMATCH] or summary["errors"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
