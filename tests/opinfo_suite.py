"""OpInfo runner: PyTorch's own op database (`op_db`) through a torch.compile backend, forward
and backward, compared with eager.

For each OpInfo entry, up to K float32 samples (spread over its first samples: the first ones
are often 0-d) are run eagerly and through `torch.compile(fn, backend=...)`, where `fn` takes the
sample's tensors as inputs and closes over everything else. Forward: outputs and mutated inputs.
Backward (differentiable ops, inputs that OpInfo marks as requiring grad): the gradients of
`sum(output * cotangent)` w.r.t. those inputs, with one fixed random cotangent per output.

Each sample gets a status (PASS, COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT, MISMATCH, SKIPPED), and
each op, per direction, a class:
    lowered  every sample passes and no compiled graph ran an aten fallback
    extern   every sample passes, but some graph ran an aten op as a fallback (`fallback_ops` of
             commfuse's per-graph summary)
    failed   an error (compile, run, timeout): a clear error, never a value
    wrong    a MISMATCH: wrong values, shapes or dtypes. Must never happen.
    skipped  not applicable: random, sparse, complex, eager fails, no graph reached the backend...

commfuse runs with fallback_on_error=False, as in the tests: a lowering bug is an error here,
not a silent whole-graph fallback. The backend is COMMFUSE_TEST_BACKEND (default commfuse); any
registered name works (`aot_eager` validates the harness).

    python -m tests.opinfo_suite --filter =softmax,=cumsum -v
    python -m tests.opinfo_suite --samples 2 --jobs 1 --json bench/results/opinfo_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections import Counter
from pathlib import Path

import commfuse  # noqa: F401  (Triton's interpreter without CUDA: before triton is imported)
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from commfuse import config

BACKEND = os.environ.get("COMMFUSE_TEST_BACKEND", "commfuse")
DEVICE = os.environ.get("COMMFUSE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float32

PASS, COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT, MISMATCH, SKIPPED = (
    "PASS", "COMPILE_ERROR", "RUNTIME_ERROR", "TIMEOUT", "MISMATCH", "SKIPPED")
ERROR_STATUSES = (COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT)
CLASSES = ("lowered", "extern", "failed", "wrong", "skipped")
DIRECTIONS = ("fw", "bw")
SAMPLES_SCANNED = 64  # samples looked at per op when spreading the K picked ones

# Ops not applicable as a whole. Ops random for some samples only (dropout, rrelu in training)
# are caught per sample by watching eager for RNG ops.
_NOT_APPLICABLE = {
    "random op": {"bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
                  "normal", "normal.in_place", "normal.number_mean", "uniform", "rand_like",
                  "randint", "randint_like", "randn", "randn_like", "pca_lowrank", "svd_lowrank",
                  "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d"},
    "uninitialized memory": {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                             "new_empty_strided", "resize_", "resize_as_"},
    "data-dependent output shape": {"nonzero", "argwhere", "unique", "unique_consecutive",
                                    "masked_select", "bincount", "repeat_interleave"},
    "non-tensor output": {"item", "equal", "allclose", "broadcast_shapes"},
}
_SPARSE_RE = re.compile(r"(^|\.)sparse(\.|_|$)|to_sparse")


# ---------------------------------------------------------------------------------------------
# op_db
# ---------------------------------------------------------------------------------------------

def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@contextlib.contextmanager
def _op_db_import():
    """common_utils imports `expecttest` (not a dependency of ours) only to subclass its TestCase,
    and freezes torch.backends flags at import: stand in for the one, undo the other."""
    if "expecttest" not in sys.modules:
        import unittest
        try:
            import expecttest  # noqa: F401
        except ImportError:
            sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase, ACCEPT=False)
    was_frozen = torch.backends.flags_frozen()
    yield
    if not was_frozen and torch.backends.flags_frozen():
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)


_OPS: dict | None = None


def ops_by_name() -> dict:
    global _OPS
    if _OPS is None:
        with _op_db_import():
            import torch.testing._internal.common_methods_invocations as cmi
        # Dropout, SDPA, rrelu... call their op through wrapper_set_seed, whose RNG state juggling
        # makes Dynamo run the whole call eagerly: nothing compiled. Seeding is not needed here
        # (samples that draw random numbers are skipped), so the wrapper just calls the op.
        cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
        op_db = cmi.op_db
        _OPS = {full_name(o): o for o in sorted(op_db, key=full_name)}
    return _OPS


def op_skip_reason(op) -> str | None:
    name = full_name(op)
    if _SPARSE_RE.search(name):
        return "sparse op"
    if name.startswith("jiterator_"):
        return "CUDA-only op"
    for why, names in _NOT_APPLICABLE.items():
        if name in names:
            return why
    if DTYPE not in op.supported_dtypes(DEVICE):
        return f"float32 not supported on {DEVICE}"
    return None


# ---------------------------------------------------------------------------------------------
# Samples: tensors become inputs, everything else is a constant
# ---------------------------------------------------------------------------------------------

def split_sample(sample):
    """-> (fn(*tensors) calling the op with the sample's other arguments, [tensors]). The same
    tensor twice stays one input, so aliasing is kept."""
    tensors: list = []
    slots: dict = {}

    def to_slot(x):
        if isinstance(x, torch.Tensor):
            slots.setdefault(id(x), len(tensors))
            if slots[id(x)] == len(tensors):
                tensors.append(x)
            return ("__input__", slots[id(x)])
        return x

    is_slot = lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "__input__"  # noqa: E731
    tmpl = pytree.tree_map(to_slot, ((sample.input, *sample.args), dict(sample.kwargs)))

    def make_fn(func):
        def fn(*inputs):
            args, kwargs = pytree.tree_map(lambda x: inputs[x[1]] if is_slot(x) else x, tmpl,
                                           is_leaf=is_slot)
            return func(*args, **kwargs)
        return fn

    return make_fn, tensors


def clone_exact(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A copy with the same sizes, strides and storage offset: non-contiguous, expanded and offset
    inputs reach the backend as they reach eager."""
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())
    return out.requires_grad_(requires_grad and t.requires_grad)


def sample_skip_reason(sample) -> str | None:
    if "out" in sample.kwargs:
        return "out= sample"
    for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)):
        if isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_complex() or t.is_quantized):
            return "sparse, complex or quantized input"
    return None


def pick_samples(op, k: int, seed: int) -> list:
    """Up to k applicable samples as (index, sample), spread over the first SAMPLES_SCANNED;
    inputs require grad where OpInfo says the op differentiates them."""
    torch.manual_seed(seed)
    found = []
    for n, s in enumerate(op.sample_inputs(DEVICE, DTYPE, requires_grad=op.supports_autograd)):
        if n >= SAMPLES_SCANNED:
            break
        if sample_skip_reason(s) is None:
            found.append((n, s))
    step = max(1.0, len(found) / k)
    return [found[int(i * step)] for i in range(min(k, len(found)))]


def describe(obj, limit: int = 200) -> str:
    def d(o):
        if isinstance(o, torch.Tensor):
            nc = ":nc" if o.numel() > 1 and not o.is_contiguous() else ""
            dt = "" if o.dtype == DTYPE else ":" + str(o.dtype).replace("torch.", "")
            return f"T{list(o.shape)}{dt}{nc}"
        if type(o) in (list, tuple):
            return ("[%s]" if type(o) is list else "(%s)") % ", ".join(d(x) for x in o)
        if type(o) is dict:
            return "{" + ", ".join(f"{k}={d(v)}" for k, v in o.items()) + "}"
        return repr(o)
    s = d(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------

# assert_close's float32 defaults times 10, times 5 again where the op accumulates (summation
# order legitimately differs from aten's).
_RTOL, _ATOL, _ACCUM_FACTOR = 1.3e-5, 1e-4, 5.0
_ACCUM_RE = re.compile(
    r"sum|prod|mean|var|std|norm|cum|logsumexp|logaddexp|softmax|softmin|matmul|mm|mv|dot|inner|"
    r"outer|einsum|tensordot|linear|conv|linalg|pool|loss|entropy|fft|interpolate|upsample|trace|"
    r"dist|cov|corrcoef|kron|trapz|trapezoid|grid_sample|attention|embedding_bag|addbmm|addr|"
    r"chain|det|inverse|solve|cholesky|pinv|lstsq|svd|qr|eig|lu|matrix|quantile|median|histc|"
    r"renorm|normalize|local_response|scatter_reduce|index_reduce|cross|lerp|polygamma|gradient|diff")


def is_accumulating(op) -> bool:
    from torch.testing._internal.opinfo.core import ReductionOpInfo
    return isinstance(op, ReductionOpInfo) or bool(_ACCUM_RE.search(full_name(op)))


def compare(expected, actual, accumulating: bool, what: str = "output") -> str | None:
    """None if `actual` matches `expected`, else the first difference, in short."""
    exp, act = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    if len(exp) != len(act):
        return f"{what}: {len(exp)} values expected, got {len(act)}"
    f = _ACCUM_FACTOR if accumulating else 1.0
    for i, (e, a) in enumerate(zip(exp, act)):
        where = f"{what}[{i}]" if len(exp) > 1 else what
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            exact = not (e.dtype.is_floating_point or e.dtype.is_complex)
            try:
                torch.testing.assert_close(a, e, rtol=0 if exact else _RTOL * f,
                                           atol=0 if exact else _ATOL * f, equal_nan=True)
            except AssertionError as ex:
                return f"{where}: " + " | ".join(ln.strip() for ln in str(ex).splitlines() if ln.strip())[:500]
        elif isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            return f"{where}: expected {type(e).__name__}, got {type(a).__name__}"
        elif e != a and not (isinstance(e, float) and (abs(e - a) <= 1e-6 + 1e-5 * abs(e) or e != e and a != a)):
            return f"{where}: expected {e!r}, got {a!r}"
    return None


def output_skip_reason(out) -> str | None:
    tensors = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    if not tensors:
        return "non-tensor output"
    if any(t.layout != torch.strided or t.is_complex() or t.is_quantized for t in tensors):
        return "sparse, complex or quantized output"
    return None


class _RngWatch(TorchDispatchMode):
    """Records aten ops tagged nondeterministic_seeded (bernoulli, native_dropout, ...): compiled
    code need not draw random numbers as eager does."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            names = [a.name for a in func._schema.arguments]  # attention without dropout is not random
            p = (kwargs or {}).get("dropout_p", args[names.index("dropout_p")] if "dropout_p" in names[:len(args)] else 0)
            if "dropout_p" not in names or p:
                self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

class OpTimeout(BaseException):
    """From SIGALRM; a BaseException so that `except Exception` in Dynamo does not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise OpTimeout(f"over the op's {seconds:g}s budget")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclasses.dataclass
class SampleResult:
    index: int
    desc: str
    fw: str = SKIPPED
    bw: str = SKIPPED
    fw_msg: str = ""
    bw_msg: str = ""
    fw_fallbacks: dict = dataclasses.field(default_factory=dict)  # aten op run as a fallback -> why
    bw_fallbacks: dict = dataclasses.field(default_factory=dict)
    graphs: int = 0          # FX graphs Dynamo handed the backend (forward run)
    detail: str = ""         # traceback tail of the first error
    stage: str = ""          # eager / fw / bw: where a timeout struck


@dataclasses.dataclass
class OpResult:
    name: str
    fw: str = "skipped"
    bw: str = "skipped"
    skip_reason: str = ""
    samples: list = dataclasses.field(default_factory=list)
    time_s: float = 0.0

    def classify(self):
        for d in DIRECTIONS:
            st = [getattr(s, d) for s in self.samples]
            ran = [s for s in self.samples if getattr(s, d) == PASS]
            cls = ("wrong" if MISMATCH in st else "failed" if set(st) & set(ERROR_STATUSES)
                   else "skipped" if not ran
                   else "extern" if any(getattr(s, f"{d}_fallbacks") for s in ran) else "lowered")
            setattr(self, d, cls)
        return self


class _Probe:
    """Wraps the Dynamo backend: counts the graphs it gets, and tells a compile error (raised
    while the backend compiles) from one raised by running what it compiled."""

    def __init__(self, inner):
        self.inner, self.graphs, self.phase = inner, 0, None

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        try:
            compiled = self.inner(gm, example_inputs)
        except BaseException:
            self.phase = self.phase or "compile"
            raise

        def run(*args):
            try:
                return compiled(*args)
            except BaseException:
                self.phase = self.phase or "run"
                raise
        return run


class _Summaries:
    """commfuse's per-graph summaries (summary.json in a dump folder of our own)."""

    def __init__(self, root: str):
        self.root, self.seen = root, set()

    def new(self) -> list[dict]:
        out = []
        for path in sorted(glob.glob(os.path.join(self.root, "rank0", "*", "summary.json"))):
            if path not in self.seen:
                self.seen.add(path)
                with open(path) as f:
                    out.append(json.load(f))
        return out


def _fallbacks(summaries: list[dict]) -> dict[str, str]:
    return {op: s.get("fallback_reasons", {}).get(op, "") for s in summaries for op in s.get("fallback_ops", ())}


def _error(exc: BaseException, ran: bool) -> tuple[str, str]:
    """(status, message); `ran`: the error came from running compiled code, not compiling it."""
    inner = getattr(exc, "inner_exception", None) or exc
    if isinstance(inner, OpTimeout) or isinstance(exc, OpTimeout):
        raise OpTimeout(str(inner))  # ends the op, whichever layer wrapped it
    status = RUNTIME_ERROR if ran else COMPILE_ERROR
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    return status, f"{type(inner).__name__}: {' | '.join(lines[:3])[:400]}"


def run_sample(op, index: int, sample, backend, summaries: _Summaries, backward: bool,
               res: SampleResult) -> SampleResult:
    make_fn, tensors = split_sample(sample)
    fn = make_fn(op.op)
    accumulating = is_accumulating(op)

    def fresh(grad=False):
        return [clone_exact(t, grad) for t in tensors]

    # Eager, twice: random and nondeterministic ops are not comparable.
    res.stage = "eager"
    eager_in = fresh()
    try:
        expected = fn(*eager_in)
        watch = _RngWatch()
        with watch:
            expected2 = fn(*fresh())
    except Exception as e:
        res.fw_msg = f"eager failed: {type(e).__name__}"
        return res
    why = (output_skip_reason(expected) or (watch.seen and f"random: uses {watch.seen[0]}")
           or (compare(expected, expected2, accumulating) and "eager is nondeterministic"))
    if why:
        res.fw_msg = why
        return res

    # Forward: the inference graph.
    res.stage = "fw"
    probe, compiled_in = _Probe(backend), fresh()
    torch._dynamo.reset()
    try:
        actual = torch.compile(fn, backend=probe, dynamic=False)(*compiled_in)
    except Exception as e:
        dynamo = isinstance(e, torch._dynamo.exc.TorchDynamoException)
        res.fw, res.fw_msg = _error(e, probe.phase == "run" or (probe.phase is None and not dynamo))
        res.detail = "".join(traceback.format_exception(e))[-2500:]
    else:
        res.fw_fallbacks = _fallbacks(summaries.new())
        diff = compare(expected, actual, accumulating) or next(
            (d for i, (e, c) in enumerate(zip(eager_in, compiled_in))
             if (d := compare(e, c, accumulating, f"input {i} after the call"))), None)
        if diff:
            res.fw, res.fw_msg = MISMATCH, diff
        elif not probe.graphs:
            res.fw_msg = "Dynamo handed the backend no graph"
        else:
            res.fw = PASS
    res.graphs = probe.graphs
    summaries.new()  # what a failed forward left is not the backward's
    res.stage = "bw"
    if backward:
        _backward(fn, tensors, fresh, backend, summaries, accumulating, res)
    else:
        res.bw_msg = "not differentiable" if not op.supports_autograd else "backward not run"
    return res


def _backward(fn, tensors, fresh, backend, summaries, accumulating, res):
    """Gradients of sum(output * cotangent) w.r.t. the inputs requiring grad, eager vs compiled."""
    if not any(t.requires_grad for t in tensors):
        res.bw_msg = "no input requires grad"
        return

    def grads(f, inputs):
        outs = [o for o in pytree.tree_leaves(f(*inputs))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [t for t in inputs if t.requires_grad]
        if not outs:
            return outs, None
        gen = torch.Generator(device=DEVICE).manual_seed(1234)  # same cotangents both times
        cots = [torch.randn(o.shape, generator=gen, device=DEVICE, dtype=o.dtype) for o in outs]
        return outs, torch.autograd.grad(outs, wrt, cots, allow_unused=True)

    try:
        exp_outs, expected = grads(fn, fresh(grad=True))
    except Exception as e:
        res.bw_msg = f"eager backward failed: {type(e).__name__}"
        return
    if expected is None:
        res.bw_msg = "no output requires grad"
        return
    probe = _Probe(backend)
    torch._dynamo.reset()
    try:
        act_outs, actual = grads(torch.compile(fn, backend=probe, dynamic=False), fresh(grad=True))
    except Exception as e:
        # AOTAutograd compiles the backward at the first backward call: it ran if it compiled.
        compiled = probe.phase == "run" or any("_backward_" in s.get("graph_id", "") for s in summaries.new())
        res.bw, res.bw_msg = _error(e, compiled)
        res.detail = res.detail or "".join(traceback.format_exception(e))[-2500:]
        return
    graphs = summaries.new()
    res.bw_fallbacks = _fallbacks([s for s in graphs if "_backward_" in s.get("graph_id", "")])
    diff = (compare(exp_outs, act_outs, accumulating, "forward output (training graph)")
            or compare(expected, actual, True, "grad"))
    if diff:
        res.bw, res.bw_msg = MISMATCH, diff
    elif not probe.graphs or (graphs and not any("_backward_" in s["graph_id"] for s in graphs)):
        res.bw_msg = "no backward graph reached the backend"
    else:
        res.bw = PASS


def run_op(op, samples: int = 2, op_timeout: float | None = 120, backward: bool = True,
           seed: int = 0) -> OpResult:
    """Run up to `samples` samples of OpInfo `op` (or its full name), forward and backward."""
    if isinstance(op, str):
        op = ops_by_name().get(op) or op
        if isinstance(op, str):
            return OpResult(op, skip_reason="not in op_db")
    result = OpResult(full_name(op), skip_reason=op_skip_reason(op) or "")
    if result.skip_reason:
        return result
    backend = torch._dynamo.lookup_backend(BACKEND)
    backward = backward and op.supports_autograd
    t0 = time.perf_counter()
    with (tempfile.TemporaryDirectory() as dumps, warnings.catch_warnings(),
          config.patch(dump_dir=dumps, fallback_on_error=False)):
        warnings.simplefilter("ignore")
        summaries = _Summaries(dumps)
        res = None
        try:
            with time_limit(op_timeout):
                picked = pick_samples(op, samples, seed)
                for n, sample in picked:
                    res = SampleResult(n, describe(((sample.input, *sample.args), sample.kwargs)))
                    result.samples.append(res)
                    run_sample(op, n, sample, backend, summaries, backward, res)
                if not picked:
                    result.skip_reason = "no applicable sample"
        except OpTimeout as e:
            if res is None:
                result.skip_reason = f"timed out generating samples: {e}"
            elif res.stage == "eager":  # eager too slow: not the backend's doing
                res.fw_msg = f"eager {e}"
            else:
                for d in DIRECTIONS[DIRECTIONS.index(res.stage):]:
                    setattr(res, d, TIMEOUT)
                    setattr(res, f"{d}_msg", str(e))
        except Exception as e:  # OpInfo's sample generation itself
            result.skip_reason = f"sample generation failed: {type(e).__name__}: {e}"[:300]
        finally:
            torch._dynamo.reset()
    result.time_s = round(time.perf_counter() - t0, 2)
    return result.classify()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def summarize(results: list[OpResult]) -> dict:
    out = {"ops": len(results)}
    for d in DIRECTIONS:
        by = Counter(getattr(r, d) for r in results)
        out[d] = {c: by.get(c, 0) for c in CLASSES}
        for c in ("wrong", "failed"):
            out[f"{d}_{c}"] = {r.name: next(getattr(s, f"{d}_msg") for s in r.samples
                                            if getattr(s, d) in (MISMATCH,) + ERROR_STATUSES)
                               for r in results if getattr(r, d) == c}
        out[f"{d}_extern_ops"] = dict(Counter(f"{op}: {why}" for r in results if getattr(r, d) == "extern"
                                              for s in r.samples for op, why in getattr(s, f"{d}_fallbacks").items()
                                              ).most_common())
    return out


def _line(r: OpResult) -> str:
    line = f"{r.name:<48} fw={r.fw:<8} bw={r.bw:<8} {r.time_s:6.1f}s  {r.skip_reason}"
    for s in r.samples:
        for d in DIRECTIONS:
            if getattr(s, d) in (MISMATCH,) + ERROR_STATUSES:
                line += f"\n    sample {s.index} {d} {getattr(s, d)}: {getattr(s, f'{d}_msg')[:300]}\n      [{s.desc}]"
    return line


def _op_record(r: OpResult) -> dict:
    """One op in the JSON report: its classes, the aten ops it fell back on, and the samples that
    did not pass (passing ones add nothing the command cannot rerun)."""
    rec = {"name": r.name, "fw": r.fw, "bw": r.bw, "time_s": r.time_s}
    if r.skip_reason:
        rec["skip"] = r.skip_reason
    for d in DIRECTIONS:
        if ops := sorted({op for s in r.samples for op in getattr(s, f"{d}_fallbacks")}):
            rec[f"{d}_extern"] = ops
    keep = ("index", "desc", "fw", "bw", "fw_msg", "bw_msg", "detail")
    rec["samples"] = [{k: v for k, v in dataclasses.asdict(s).items() if k in keep and v != ""}
                      for s in r.samples if (s.fw, s.bw) != (PASS, PASS)]
    return rec


def _worker(name: str, cfg: dict) -> OpResult:
    return run_op(name, cfg["samples"], cfg["op_timeout"], cfg["backward"])


def _quiet():
    import logging
    torch._logging.set_logs(dynamo=logging.CRITICAL, aot=logging.CRITICAL, inductor=logging.CRITICAL)
    logging.getLogger("commfuse").setLevel(logging.ERROR)


def run_all(names: list[str], cfg: dict, jobs: int, on_result) -> None:
    """In `jobs` spawned workers, fresh ones every 50 ops (memory). A worker that dies (a crash in
    generated code) takes its ops with it; they are rerun one per process to pin the culprit."""
    if not jobs:
        for n in names:
            on_result(_worker(n, cfg))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # (not max_tasks_per_child: Python 3.11's executor hangs when it renews a worker)
    batches = [names[i:i + 50] for i in range(0, len(names), 50)]
    while batches:
        batch = batches.pop(0)
        with ProcessPoolExecutor(jobs, mp.get_context("spawn"), initializer=_quiet) as ex:
            futures = {n: ex.submit(_worker, n, cfg) for n in batch}
            broken = []
            for n, f in futures.items():
                try:
                    on_result(f.result())
                except BrokenProcessPool:
                    broken.append(n)
        if len(batch) > 1:
            batches[:0] = [[n] for n in broken]
        elif broken:
            r = OpResult(batch[0], samples=[SampleResult(-1, "", fw=RUNTIME_ERROR, fw_msg="worker died")])
            on_result(r.classify())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--filter", help="ops whose full name contains this ('=name': exactly); "
                                    "comma-separated: any of them")
    p.add_argument("--samples", type=int, default=2, help="samples per op")
    p.add_argument("--op-timeout", type=float, default=120, help="seconds per op, all its samples")
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (0: this process)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--list", action="store_true", help="list the selected ops and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="keep torch's logging")
    args = p.parse_args(argv)

    names = list(ops_by_name())
    if args.filter:
        pats = [x.strip() for x in args.filter.split(",") if x.strip()]
        names = [n for n in names if any(n == x[1:] if x.startswith("=") else x in n for x in pats)]
    if args.list:
        print("\n".join(names))
        return 0
    if not args.verbose:
        _quiet()
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=Path(__file__).parent.parent).stdout.strip()
    cfg = {"backend": BACKEND, "samples": args.samples, "op_timeout": args.op_timeout,
           "backward": args.backward, "dtype": "float32", "device": DEVICE, "torch": torch.__version__,
           "commit": git("rev-parse", "--short", "HEAD"),
           "uncommitted": git("status", "--porcelain", "--untracked-files=no", "--", "commfuse", "lowering", "codegen")}
    print(f"# {len(names)} ops  {cfg}", flush=True)
    t0, results = time.perf_counter(), {}

    def write():
        if args.json:
            ordered = [results[n] for n in names if n in results]
            report = {"config": cfg, "elapsed_s": round(time.perf_counter() - t0), "summary": summarize(ordered)}
            ops = ",\n  ".join(json.dumps(_op_record(r)) for r in ordered)  # one line per op
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1)[:-2] + f',\n "ops": [\n  {ops}\n ]\n}}\n')

    def on_result(r):
        results[r.name] = r
        print(f"[{len(results)}/{len(names)}] " + _line(r), flush=True)
        if len(results) % 20 == 0:
            write()  # a long run keeps what it finished

    try:
        run_all(names, cfg, args.jobs, on_result)
    except KeyboardInterrupt:
        print("# interrupted: reporting what finished")
    write()
    summary = summarize([results[n] for n in names if n in results])
    print(f"\n{'':10}" + "".join(f"{c:>9}" for c in CLASSES))
    for d in DIRECTIONS:
        print(f"{d:10}" + "".join(f"{summary[d][c]:>9}" for c in CLASSES))
    for d in DIRECTIONS:
        for c in ("wrong", "failed"):
            if summary[f"{d}_{c}"]:
                print(f"{d} {c}: {', '.join(summary[f'{d}_{c}'])}")
    print(f"# {time.perf_counter() - t0:.0f}s")
    return 1 if summary["fw"]["wrong"] or summary["bw"]["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
