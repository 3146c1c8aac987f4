"""Where a model's step spends its GPU time, per kernel, Inductor beside commfuse (1 GPU).

    python bench/profile_model.py --models gpt2 --modes inference
    python bench/profile_model.py --models gpt2,resnet18 --top 30 --out bench/results/profile_h100.md
    python bench/profile_model.py --cpu --tiny        # checks the script on CPU: measures nothing

Builds the models of bench/models.py, compiles each with every backend, warms it up, and records
`--steps` steps under torch.profiler. Per backend it prints the GPU time of one step by kind of
kernel (generated: commfuse's `cf_*` or Inductor's `triton_*`; gemm; attention; copies; other aten
kernels) and the `--top` kernels by time, with launches per step. The kinds are read from kernel
names, so a row is a guide to where the time goes, not an exact accounting.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench import models as zoo  # noqa: E402  (sets the cache folders and imports commfuse first)
from bench.common import add_run_args, commfuse_options, run_meta, write_results  # noqa: E402
import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

KINDS = (  # first match wins; names are lower-cased
    ("generated", ("cf_", "triton_")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "splitk")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other aten")


def profile_step(step, steps: int, dev: str, host: dict | None = None) -> dict:
    """{kernel name: [µs, launches]} per step, over `steps` profiled steps; and where `host` is
    given, {op or runtime call: [self host µs, calls]} per step into it (where the host waits)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    gpu = DeviceType.CUDA if dev == "cuda" else DeviceType.CPU  # on CPU: aten ops, to check the script
    table = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == gpu and (dev == "cuda" or ev.name.startswith(("aten::", "cf_", "triton_"))):
            table[ev.name][0] += ev.time_range.elapsed_us() / steps
            table[ev.name][1] += 1 / steps
    if host is not None:
        for ev in prof.key_averages():
            if ev.self_cpu_time_total > 0:
                host[ev.key] = [ev.self_cpu_time_total / steps, ev.count / steps]
    return dict(table)


def profile(name, mode, args, dev, dtype) -> dict:
    torch.manual_seed(0)
    with torch.device(dev):
        spec = zoo.MODELS[name](args.tiny, dev)
    base = spec.model.to(dev, dtype).eval()
    out = {}
    for b in args.backends:
        model = base if b == "eager" else copy.deepcopy(base)
        fn = model if b == "eager" else zoo.compile_model(model, b, args.options if b == "commfuse" else None)
        step = zoo.make_step(fn, spec, spec.inputs(model), mode)
        for _ in range(3):
            zoo.zero_grads(model)
            step()
        out[b] = profile_step(step, args.steps, dev)
        torch._dynamo.reset()
    return out


def markdown(name, mode, tables, top) -> str:
    lines = [f"### {name} / {mode}: GPU µs per step", "",
             "| kind | " + " | ".join(tables) + " |", "|---|" + "---|" * len(tables)]
    kinds = [k for k, _ in KINDS] + ["other aten"]
    sums = {b: collections.Counter() for b in tables}
    for b, t in tables.items():
        for k, (us, _) in t.items():
            sums[b][kind_of(k)] += us
    for k in kinds + ["total"]:
        cells = [f"{(sum(sums[b].values()) if k == 'total' else sums[b][k]):.0f}" for b in tables]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    for b, t in tables.items():
        lines += ["", f"{b}, top {top} kernels:", "", "| µs | launches | kind | kernel |", "|---|---|---|---|"]
        for k, (us, n) in sorted(t.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {us:.1f} | {n:g} | {kind_of(k)} | `{k[:110]}` |")
    return "\n".join(lines) + "\n"


def host_markdown(name, tables, top) -> str:
    """Each backend's top host ops and runtime calls by self time (cudaStreamSynchronize and the
    like show the host waiting for the GPU)."""
    lines = []
    for b, t in tables.items():
        lines += ["", f"### {name}, {b}: host µs per step, top {top} by self time", "",
                  "| self µs | calls | op or runtime call |", "|---|---|---|"]
        for k, (us, n) in sorted(t.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {us:.1f} | {n:g} | `{k[:110]}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2", help="comma-separated, from " + ",".join(zoo.MODELS))
    ap.add_argument("--modes", default="inference,training")
    ap.add_argument("--backends", default="inductor,commfuse", help="from eager,inductor,commfuse")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per backend")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny configs")
    ap.add_argument("--cpu", action="store_true", help="on CPU, float32: checks the script")
    add_run_args(ap, "cuda_graphs=False")
    args = ap.parse_args()
    args.backends = args.backends.split(",")
    args.options = commfuse_options(ap, args.set)
    dev = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else getattr(torch, args.dtype)
    meta = run_meta(torch.cuda.get_device_name() if dev == "cuda" else "cpu", args.commit)
    footer = (f"{meta['device_name']}, torch {meta['torch']}, triton {meta['triton']}, {str(dtype)[6:]}, "
              f"commit {meta['commit']}, {meta['date']}.")
    text, data = [], []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            if mode == "training" and name in zoo.INFERENCE_ONLY:
                continue
            tables = profile(name, mode, args, dev, dtype)
            text.append(markdown(name, mode, tables, args.top))
            data.append({"model": name, "mode": mode, "kernels": tables})
            write_results(args.out, "\n".join(text) + "\n" + footer + "\n", {"meta": meta, "profiles": data},
                          partial=True)
    write_results(args.out, "\n".join(text) + "\n" + footer + "\n", {"meta": meta, "profiles": data})
    return 0


if __name__ == "__main__":
    sys.exit(main())
