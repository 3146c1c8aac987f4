"""Memory-bound fusion patterns: eager vs torch.compile Inductor vs commfuse, side by side in one run.

    python bench/patterns.py                                  # GPU, all patterns, 32768x4096 bf16
    python bench/patterns.py --out bench/results/patterns_h100.md   # also writes ..._h100.json
    python bench/patterns.py --cpu-smoke --backends eager,inductor  # validate the script on CPU

For every pattern and backend: torch._dynamo.reset(), a fresh compiled callable, a first call whose
output is checked against eager, then the median time of many calls (triton.testing.do_bench, which
flushes L2 between calls; CUDA events if triton is missing). The table gives times in microseconds,
commfuse's speed relative to Inductor and to eager (t_other / t_commfuse: above 1 means commfuse is
faster), and commfuse's achieved bandwidth over the minimal bytes the pattern must move (each input
read once, each output written once; the formula is printed under the table).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(REPO_ROOT)  # bench.common; and commfuse from the checkout where it is not installed
try:  # before torch._dynamo imports triton: on CPU, commfuse selects Triton's interpreter at import
    import commfuse  # noqa: F401
except ImportError:
    pass

import torch
import torch.nn.functional as F

from bench.common import add_run_args, commfuse_options, run_meta, write_results
BACKENDS = ("eager", "inductor", "commfuse")


# --------------------------------------------------------------------------------------------- patterns
def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_rms_norm(x, r, w):  # the residual stream is returned too, as in a transformer layer
    h = x + r
    return h, rms_norm(h, w)


def loaf(x):  # loop ordering after fusion: one kernel reads x for both the row sums and z
    return torch.sum(torch.sum(x, dim=-1)), (x / 10.0).t().contiguous().t()


def fuser_2473(x, w, dy):  # rematerialization: a, rs, g are recomputed by the column reductions
    xf, dyf = x.float(), dy.float()
    a = xf * w
    rs = torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dyf * a * rs
    s1, s2 = (g * a).sum(-1, keepdim=True), (g * rs).sum(-1, keepdim=True)
    dx = (g - a * s1 * rs * rs / x.shape[-1] - s2 * rs).to(x.dtype)
    return dx, (g * xf).sum(0), (a * rs).sum(0), (g * g).sum(0)


def rms_norm_bw(x, w, dy):  # dx by rows, dw by columns: one pass over x and dy where they mix
    xf, dyf = x.float(), dy.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dyf * w
    dx = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)


def layer_norm_bw(x, w, dy):  # as rms_norm_bw, with the mean taken out and a bias gradient
    xf, dyf = x.float(), dy.float()
    mean = xf.mean(-1, keepdim=True)
    rs = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
    xhat, g = (xf - mean) * rs, dyf * w
    dx = rs * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype), dyf.sum(0).to(w.dtype)


@dataclass
class Pattern:
    name: str
    fn: Callable
    inputs: Callable  # (M, N, dtype, device) -> tuple of tensors
    nbytes: Callable  # (M, N, e) -> minimal bytes moved; e = element size
    formula: str
    wide: bool = False  # uses the cross-entropy shape (vocab-sized rows)


def _rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


PATTERNS = [
    Pattern("softmax", lambda x: torch.softmax(x, dim=-1),
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev),),
            lambda M, N, e: 2 * M * N * e, "read x + write y: 2·M·N·e"),
    Pattern("log_softmax", lambda x: torch.log_softmax(x, dim=-1),
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev),),
            lambda M, N, e: 2 * M * N * e, "read x + write y: 2·M·N·e"),
    Pattern("layer_norm", lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, dtype=dt, device=dev),
                                   _rand(N, dtype=dt, device=dev)),
            lambda M, N, e: (2 * M * N + 2 * N) * e, "x, weight, bias, y: (2·M·N + 2·N)·e"),
    Pattern("rms_norm", rms_norm,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, dtype=dt, device=dev)),
            lambda M, N, e: (2 * M * N + N) * e, "x, weight, y: (2·M·N + N)·e"),
    Pattern("add_rms_norm", add_rms_norm,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(M, N, dtype=dt, device=dev),
                                   _rand(N, dtype=dt, device=dev)),
            lambda M, N, e: (4 * M * N + N) * e, "x, residual, weight; writes h=x+r and y: (4·M·N + N)·e"),
    Pattern("gelu_mul", lambda a, b: F.gelu(a) * b,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(M, N, dtype=dt, device=dev)),
            lambda M, N, e: 3 * M * N * e, "a, b, y: 3·M·N·e"),
    Pattern("cross_entropy", lambda logits, target: F.cross_entropy(logits, target),
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev, scale=2.0),
                                   torch.randint(0, N, (M,), device=dev)),
            lambda M, N, e: M * N * e + M * 8 + e, "logits, int64 targets, scalar loss: M·N·e + 8·M + e",
            wide=True),
    Pattern("loaf", loaf,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev),),
            lambda M, N, e: 2 * M * N * e, "read x once + write z (transposed): 2·M·N·e"),
    Pattern("fuser_2473", fuser_2473,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, dtype=torch.float32, device=dev),
                                   _rand(M, N, dtype=dt, device=dev)),
            lambda M, N, e: 3 * M * N * e + 4 * N * 4, "x, dy, dx; w and 3 fp32 column sums: 3·M·N·e + 16·N"),
    Pattern("rms_norm_bw", rms_norm_bw,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, dtype=dt, device=dev),
                                   _rand(M, N, dtype=dt, device=dev)),
            lambda M, N, e: (3 * M * N + 2 * N) * e, "x, dy, dx; w, dw: (3·M·N + 2·N)·e"),
    Pattern("layer_norm_bw", layer_norm_bw,
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, dtype=dt, device=dev),
                                   _rand(M, N, dtype=dt, device=dev)),
            lambda M, N, e: (3 * M * N + 3 * N) * e, "x, dy, dx; w, dw, db: (3·M·N + 3·N)·e"),
    Pattern("transpose_add", lambda a, b: a + b.t(),
            lambda M, N, dt, dev: (_rand(M, N, dtype=dt, device=dev), _rand(N, M, dtype=dt, device=dev)),
            lambda M, N, e: 3 * M * N * e, "a (M×N), b (N×M, read transposed), y: 3·M·N·e"),
]


# --------------------------------------------------------------------------------------------- timing
def time_ms(fn, device: str, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call."""
    if device == "cpu":  # --cpu-smoke: one timed call, to exercise the path, not to measure
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    try:
        from triton.testing import do_bench
    except ImportError:  # commfuse's timer: a loop of calls between CUDA events
        from bench.timing import loop_time_us
        return loop_time_us(fn, iters=max(1, int(rep_ms / 10)), reps=10, warmup=3) / 1e3
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


# --------------------------------------------------------------------------------------------- running
def resolve_backend(name: str):
    if name != "commfuse":
        return name
    try:
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(name)  # pip-installed: the torch_dynamo_backends entry point
    except Exception:
        from commfuse.backend import commfuse_backend

        return commfuse_backend


def check(out, ref, atol: float, rtol: float) -> str:
    outs, refs = (out, ref) if isinstance(ref, (tuple, list)) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"MISMATCH shape/dtype {tuple(o.shape)} {o.dtype} vs {tuple(r.shape)} {r.dtype}"
        try:
            torch.testing.assert_close(o, r, atol=atol, rtol=rtol)
        except AssertionError:
            return f"MISMATCH max|diff| {(o.float() - r.float()).abs().max().item():.3g}"
    return "ok"


def run_pattern(p: Pattern, M: int, N: int, args) -> dict:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    inputs = p.inputs(M, N, dtype, args.device)
    nbytes = p.nbytes(M, N, torch.empty((), dtype=dtype).element_size())
    ref = p.fn(*inputs)
    row = {"pattern": p.name, "shape": f"{M}x{N}", "dtype": args.dtype, "bytes": nbytes,
           "bytes_formula": p.formula, "us": {}, "check": {}}
    for backend in args.backends:
        try:
            if backend == "eager":
                fn = p.fn
            else:
                torch._dynamo.reset()
                options = args.options if backend == "commfuse" and args.options else None
                fn = torch.compile(lambda *a, _f=p.fn: _f(*a), backend=resolve_backend(backend), dynamic=False,
                                   options=options)
            row["check"][backend] = "ok" if backend == "eager" else check(fn(*inputs), ref, args.atol, args.rtol)
            row["us"][backend] = 1e3 * time_ms(lambda: fn(*inputs), args.device, args.warmup, args.rep)
        except Exception as e:  # report and go on with the other backends and patterns
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            row["check"][backend] = f"ERROR {msg}"
            row["us"][backend] = None
            print(f"[{p.name}/{backend}] {msg}", file=sys.stderr)
            if args.verbose:
                traceback.print_exc()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    us = row["us"]
    cf, ind, eag = us.get("commfuse"), us.get("inductor"), us.get("eager")
    row["commfuse_vs_inductor"] = ind / cf if cf and ind else None
    row["commfuse_vs_eager"] = eag / cf if cf and eag else None
    row["commfuse_gbps"] = nbytes / (cf * 1e-6) / 1e9 if cf else None
    return row


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(rows, args, meta) -> str:
    head = ["pattern", "shape"] + [f"{b} µs" for b in args.backends]
    head += ["commfuse vs inductor (×)", "commfuse vs eager (×)", "commfuse GB/s", "MB moved", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bad = {b: c for b, c in r["check"].items() if c != "ok"}
        cells = [r["pattern"], r["shape"]] + [fmt(r["us"].get(b), ".1f") for b in args.backends]
        cells += [fmt(r["commfuse_vs_inductor"], ".2f"), fmt(r["commfuse_vs_eager"], ".2f"),
                  fmt(r["commfuse_gbps"], ".0f"), f"{r['bytes'] / 1e6:.1f}",
                  "ok" if not bad else "; ".join(f"{b}: {c}" for b, c in bad.items())]
        lines.append("| " + " | ".join(cells) + " |")
    g_ind = geomean(r["commfuse_vs_inductor"] for r in rows)
    g_eag = geomean(r["commfuse_vs_eager"] for r in rows)
    lines.append("| **geomean** | | " + " | ".join("" for _ in args.backends)
                 + f" | **{fmt(g_ind, '.2f')}** | **{fmt(g_eag, '.2f')}** | | | |")
    notes = [
        "",
        f"{meta['device_name']}, torch {meta['torch']}, triton {meta['triton']}, dtype {args.dtype}, "
        f"commit {meta['commit']}. Times: median µs per call ({meta['timer']}). "
        "Ratios: t_other / t_commfuse (above 1: commfuse faster). "
        "GB/s: minimal bytes / commfuse time (e = bytes per element):"
        + (f" commfuse options {meta['commfuse_options']}." if meta["commfuse_options"] else ""),
        "",
    ]
    notes += [f"- {r['pattern']}: {r['bytes_formula']}" for r in rows]
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, from eager,inductor,commfuse")
    ap.add_argument("--patterns", default="all", help="comma-separated names, or all: "
                    + ",".join(p.name for p in PATTERNS))
    ap.add_argument("--shape", default="32768x4096", help="MxN for all patterns but cross_entropy")
    ap.add_argument("--ce-shape", default="8192x32000", help="MxN (tokens x vocab) for cross_entropy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=float, default=25, help="ms of warm-up (do_bench)")
    ap.add_argument("--rep", type=float, default=100, help="ms of timed calls (do_bench)")
    ap.add_argument("--atol", type=float, default=1e-2)
    ap.add_argument("--rtol", type=float, default=2e-2)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, one call each: checks the script")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    add_run_args(ap, "use_block_ptr=1")
    args = ap.parse_args()

    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.options = commfuse_options(ap, args.set)
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    names = [p.name for p in PATTERNS] if args.patterns == "all" else args.patterns.split(",")
    pats = [p for p in PATTERNS if p.name in names]
    if len(pats) != len(names):
        ap.error(f"unknown patterns {sorted(set(names) - {p.name for p in PATTERNS})}")

    if args.cpu_smoke:
        args.device, args.shape, args.ce_shape = "cpu", "64x256", "32x512"
    elif torch.cuda.is_available():
        args.device = "cuda"
    else:
        print("bench/patterns.py measures GPU kernels and no CUDA device is visible.\n"
              "Run it on a GPU machine (see bench/README.md), or pass --cpu-smoke to check the script "
              "on CPU with tiny sizes.", file=sys.stderr)
        return 2

    meta = run_meta(torch.cuda.get_device_name() if args.device == "cuda"
                    else f"CPU ({platform.processor() or 'cpu'}, smoke run)", args.commit)
    meta["timer"] = "one call, not a measurement" if args.device == "cpu" \
        else ("triton.testing.do_bench" if meta["triton"] != "none" else "CUDA events")
    meta["commfuse_options"] = args.options

    rows = []
    for p in pats:
        M, N = map(int, (args.ce_shape if p.wide else args.shape).lower().split("x"))
        print(f"running {p.name} {M}x{N} ...", file=sys.stderr, flush=True)
        rows.append(run_pattern(p, M, N, args))

    g = {"commfuse_vs_inductor": geomean(r["commfuse_vs_inductor"] for r in rows),
         "commfuse_vs_eager": geomean(r["commfuse_vs_eager"] for r in rows)}
    write_results(args.out, markdown(rows, args, meta), {"meta": meta, "args": vars(args), "rows": rows, "geomean": g})
    failed = [(r["pattern"], b) for r in rows for b, c in r["check"].items() if c != "ok"]
    if failed:
        print(f"{len(failed)} pattern/backend pair(s) failed the check or errored: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
