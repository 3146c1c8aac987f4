"""Peak memory: eager vs torch.compile Inductor vs commfuse, side by side in one run.

    python bench/memory.py                          # GPU, all workloads
    python bench/memory.py --workloads accumulate   # one of: accumulate, mlp, gpt_block
    python bench/memory.py --cpu                    # measured on CPU, small sizes (KiB)
    python bench/memory.py --cpu-smoke              # validate the script on CPU (tiny sizes)

For every workload and backend: torch._dynamo.reset(), a fresh model from the same seed, a first
call (compilation, checked against eager), then one measured step: the peak of
torch.cuda.max_memory_allocated over the step, less what was allocated before it (inputs and
parameters), in MiB.

With --cpu the step runs under torch.profiler(profile_memory=True), which records every CPU
allocation and free, those inside aten and Inductor's C++ included; replayed in time order they
give the peak of live bytes over the step less what was live before it, in KiB. Two figures: all
allocations, and less the workspaces of single aten ops (bytes an op allocates and frees before it
returns, as oneDNN's bf16 matmuls do on CPU; cuBLAS keeps its workspace across calls), which is the
one to compare with the GPU. For the compiled backends also each AOTAutograd graph's own peak:
forward, and backward above the bytes alive when it starts. Workloads:
  accumulate  total = x; total = total + x @ w_i for r weights (commfuse with
              realize_acc_reads_size_threshold = k·N²·e: at most k matmul outputs alive per kernel)
  mlp         L x (Linear -> GELU -> Linear) forward + backward
  gpt_block   tests/test_models.py Block (embedding, attention, MLP, cross entropy) forward + backward
commfuse's own estimate (summary.json "peak_memory_estimate", the largest over the step's graphs)
is printed beside its measurement. On CPU (--cpu-smoke) nothing is measured: the script runs each
workload once per backend, checks the values and prints the estimate.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # for tests.test_models.Block
import commfuse  # noqa: E402,F401  (before torch._dynamo imports triton: picks the interpreter on CPU)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

BACKENDS = ("eager", "inductor", "commfuse")


# --------------------------------------------------------------------------------------------- workloads
def accumulate_setup(a, device, dtype):
    N, r = a.n, a.r
    x = torch.randn(N, N, device=device, dtype=dtype)
    ws = [torch.randn(N, N, device=device, dtype=dtype) / N ** 0.5 for _ in range(r)]

    def fn(x, ws):
        total = x
        for w in ws:
            total = total + x @ w
        return total
    options = {"realize_acc_reads_size_threshold": a.k * N * N * dtype.itemsize}
    return fn, (x, ws), options


class MLP(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.float().square().mean()


def mlp_setup(a, device, dtype):
    model = MLP(a.dim, a.layers).to(device, dtype)
    x = torch.randn(a.batch * a.seq, a.dim, device=device, dtype=dtype)
    return model, (x,), {}


def gpt_block_setup(a, device, dtype):
    from tests.test_models import Block
    model = Block(vocab=a.vocab, dim=a.dim, heads=a.heads).to(device, dtype)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    return model, (tokens, targets), {}


WORKLOADS = {"accumulate": accumulate_setup, "mlp": mlp_setup, "gpt_block": gpt_block_setup}


# --------------------------------------------------------------------------------------------- running
def compiled(fn, backend, options):
    if backend == "eager":
        return fn
    torch._dynamo.reset()
    if backend == "inductor":
        return torch.compile(fn)
    from commfuse.backend import commfuse_backend
    return torch.compile(fn, backend=commfuse_backend, options=options)


def step(fn, inputs):
    """One forward (and backward, for a module): the value to check and the gradients."""
    out = fn(*inputs)
    if isinstance(fn, nn.Module) or isinstance(getattr(fn, "_orig_mod", None), nn.Module):
        out.backward()
        module = getattr(fn, "_orig_mod", fn)
        grads = [p.grad.detach().clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return [out.detach()] + grads
    return [out]


def cpu_peaks(prof) -> dict:
    """Replay a profile's CPU [memory] events (bytes allocated, negative when freed) in time order.
    peak: the most bytes alive at once, less those alive at the start. less_workspace: the same,
    but inside each outermost aten op only what is alive when it returns counts. forward,
    backward: the peak inside each AOTAutograd graph (less workspaces) above what was alive
    when it started."""
    events = list(prof.profiler.kineto_results.events())
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    ops = sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::"))
    outer, end = [], -1  # outermost aten op intervals
    for a, b in ops:
        if a > end:
            outer.append((a, b))
            end = b
    live, steps = 0, []  # (time, bytes alive after the event, outermost op index or None)
    k = 0
    for t, nbytes in mem:
        live += nbytes
        while k < len(outer) and outer[k][1] < t:
            k += 1
        steps.append((t, live, k if k < len(outer) and outer[k][0] <= t else None))
    counted = [lv for i, (_, lv, op) in enumerate(steps)  # the last event inside an op: what it keeps
               if op is None or i + 1 == len(steps) or steps[i + 1][2] != op]
    out = {"peak": max([0] + [lv for _, lv, _ in steps]), "less_workspace": max([0] + counted)}
    for name, key in (("CompiledFunction", "forward"), ("CompiledFunctionBackward", "backward")):
        for e in events:
            if e.name() == name:
                a, b = e.start_ns(), e.end_ns()
                start = max([0] + [lv for t, lv, _ in steps if t < a][-1:])
                inside = [lv for i, (t, lv, op) in enumerate(steps) if a <= t <= b and
                          (op is None or i + 1 == len(steps) or steps[i + 1][2] != op)]
                out[key] = max(inside, default=start) - start
    return out


def measure(name, backend, args, device, dtype) -> dict:
    torch.manual_seed(0)
    fn, inputs, options = WORKLOADS[name](args, device, dtype)
    ref = step(fn, inputs)
    with tempfile.TemporaryDirectory() as dumps:
        options = {**options, "dump_dir": dumps} if backend == "commfuse" else options
        run = compiled(fn, backend, options)
        got = step(run, inputs)  # compiles; the measured step below reuses the compiled graphs
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            got = step(run, inputs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        elif args.cpu:
            from torch.profiler import profile
            with profile(profile_memory=True, record_shapes=False) as prof:
                got = step(run, inputs)
            peak = cpu_peaks(prof)
        else:
            peak = None
        estimates = [json.load(open(f))["peak_memory_estimate"] for f in glob.glob(f"{dumps}/rank*/*/summary.json")]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=args.atol, rtol=args.rtol)
    return {"peak": peak, "estimate": max(estimates) if estimates else None}


def fmt(x, scale):
    return "—" if x is None else f"{x / scale:.4g}"


def print_table(rows, backends, key, unit, scale, title):
    """One row per workload: each backend's peak (`key` of a CPU measurement), commfuse's estimate, ratios."""
    head = ["workload"] + [f"{b} {unit}" for b in backends]
    head += [f"commfuse estimate {unit}", "commfuse / eager", "commfuse / inductor"]
    print(f"\n{title}:\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        peaks = {b: row[b]["peak"] for b in backends}
        if key is not None:
            peaks = {b: p and p[key] for b, p in peaks.items()}
        cf = peaks.get("commfuse")
        ratio = lambda o: f"{cf / o:.2f}" if cf and o else "—"  # noqa: E731
        cells = [row["workload"]] + [fmt(peaks[b], scale) for b in backends]
        cells += [fmt(row.get("commfuse", {}).get("estimate"), scale), ratio(peaks.get("eager")),
                  ratio(peaks.get("inductor"))]
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=4096, help="accumulate: N (x and each weight are NxN)")
    ap.add_argument("--r", type=int, default=16, help="accumulate: number of matmuls summed")
    ap.add_argument("--k", type=int, default=2, help="accumulate: matmul outputs one kernel may read")
    ap.add_argument("--dim", type=int, default=1024, help="mlp, gpt_block: model width")
    ap.add_argument("--layers", type=int, default=4, help="mlp: layers")
    ap.add_argument("--batch", type=int, default=8, help="gpt_block: sequences; mlp: rows = batch * seq")
    ap.add_argument("--seq", type=int, default=1024, help="gpt_block: tokens per sequence")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--atol", type=float, default=5e-2)
    ap.add_argument("--rtol", type=float, default=5e-2)
    ap.add_argument("--cpu", action="store_true", help="measure on CPU through the profiler (small sizes, "
                    "the GPU run's proportions: --dim 64 --batch 4 --seq 256 --heads 4 --vocab 512 --n 256 --r 8)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: checks the script, measures nothing")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    names = args.workloads.split(",")
    backends = args.backends.split(",")
    if set(names) - set(WORKLOADS) or set(backends) - set(BACKENDS):
        ap.error(f"workloads from {list(WORKLOADS)}, backends from {list(BACKENDS)}")
    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        args.n, args.r, args.dim, args.layers, args.batch, args.seq, args.heads, args.vocab = 32, 6, 32, 2, 2, 8, 2, 64
    elif args.cpu:  # sizes given on the command line win
        device, dtype = "cpu", getattr(torch, args.dtype)
        small = dict(n=256, r=8, dim=64, batch=4, seq=256, heads=4, vocab=512,
                     atol=0.2)  # bf16 sums at N=256 differ by more than 5e-2 between backends
        for k, v in small.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    elif torch.cuda.is_available():
        device, dtype = "cuda", getattr(torch, args.dtype)
    else:
        print("bench/memory.py measures CUDA memory and no CUDA device is visible; "
              "--cpu-smoke checks the script on CPU.", file=sys.stderr)
        return 2
    rows, failed = [], []
    for name in names:
        row = {"workload": name}
        for backend in backends:
            print(f"running {name} / {backend} ...", file=sys.stderr, flush=True)
            try:
                row[backend] = measure(name, backend, args, device, dtype)
            except Exception as e:  # report, go on with the others
                failed.append((name, backend))
                row[backend] = {"peak": None, "estimate": None, "error": f"{type(e).__name__}: {e}"[:200]}
                print(f"[{name}/{backend}] {row[backend]['error']}", file=sys.stderr)
                if args.verbose:
                    traceback.print_exc()
        rows.append(row)
    cpu = device == "cpu" and args.cpu
    unit, scale = ("KiB", 2**10) if cpu else ("MiB", 2**20)
    if cpu:
        print_table(rows, backends, "less_workspace", unit, scale, "peak less op workspaces")
        print_table(rows, backends, "peak", unit, scale, "peak, all allocations")
        graphs = [b for b in backends if b != "eager"]
        head = ["workload"] + [f"{b} {g} {unit}" for b in graphs for g in ("forward", "backward")]
        print("\nEach graph's own peak (less op workspaces), backward above what is alive when it starts:\n")
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in rows:
            cells = [row["workload"]] + [fmt((row[b]["peak"] or {}).get(g), scale) for b in graphs
                                         for g in ("forward", "backward")]
            print("| " + " | ".join(cells) + " |")
    else:
        print_table(rows, backends, None, unit, scale, "peak")
    where = f"CPU (torch.profiler), {unit}" if cpu else "CPU smoke run: nothing measured" if device == "cpu" \
        else torch.cuda.get_device_name()
    print(f"\n{where}, torch {torch.__version__}, {dtype}. Peak: the most bytes allocated at once over one step "
          "less what was allocated before it. Ratios below 1: commfuse needs less.")
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
