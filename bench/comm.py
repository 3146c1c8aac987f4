"""All-reduce and tensor-parallel decode benchmarks, side by side in one run (GPU, torchrun).

    torchrun --standalone --nproc-per-node 2 bench/comm.py [--out bench/results/comm_2xh200.md]

1. All-reduce latency under CUDA graphs, bf16, 4 KiB ... 64 MiB: commfuse's one-shot and two-shot
   Triton kernels and the algorithm its compiler would pick (tuned table or built-in thresholds) vs
   torch's symm_mem one_shot / two_shot vs NCCL. Inputs already live in symmetric memory for the
   symmetric-memory kernels (as they do when commfuse's producers write the pool); NCCL reduces a
   plain tensor in place.
2. The TP MLP decode step (B=8, H=4096, F=14336 split over ranks, bf16; all-reduce, residual add,
   RMSNorm): eager, Inductor, Inductor with _collective.auto_select, commfuse; each captured in a CUDA
   graph after warm-up, and without graphs; and Inductor's and commfuse's own CUDA-graph modes
   (mode="reduce-overhead", options={"cuda_graphs": True}), whose plain time is their graph time.
3. All-reduce + residual add + RMSNorm at B = 1 ... 128 rows x H = 4096, 8192 under CUDA graphs:
   commfuse's choice ("auto picks", from the tuned table's fused measurements) against each of its
   algorithms forced, Inductor with auto_select, and NCCL + Inductor's fused norm; the variants are
   timed in interleaved rounds, so that they see the same drift.
4. An L-layer TP MLP stack, forward + backward: step time and planned comm-buffer bytes.
5. All-gather and reduce-scatter (sum) latency under CUDA graphs, bf16, 4 KiB ... 64 MiB gathered:
   `x * 2` then the collective, compiled by commfuse with its symmetric-memory kernel forced ("ours":
   the producer writes the comm buffer, the collective is one fused kernel) and with its c10d plan
   forced (the producer's kernel, then NCCL), against NCCL and torch symm_mem's low-contention
   (copy-engine) kernels on an input already in place; every output checked against NCCL's.
   `--only-gather` runs this table alone; `--cpu` runs it on gloo ranks (Triton's interpreter,
   4 and 16 KiB, wall-clock loops), a check that the path runs rather than a measurement.
Set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (multicast stays off).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from bench.timing import cuda_graph_time_us, interleaved_times_us, loop_time_us  # noqa: E402
from commfuse.tune import ar_norm_step, rms_norm  # noqa: E402
from commfuse.tuned_tables import FUSED_ALGORITHMS as FUSED  # noqa: E402


def all_reduce_table(sizes, rank, world, group) -> list[dict]:
    """Every all-reduce we can run, per size: ours (one-shot, two-shot — timed as `commfuse.tune`
    times them — and the one the compiler's choice runs), torch's symm_mem one_shot / two_shot, NCCL."""
    import torch.distributed._symmetric_memory as symm_mem
    from commfuse.choices import Choices
    choices = Choices()
    from commfuse.tune import measure
    dev = torch.device("cuda", torch.cuda.current_device())
    tsym = symm_mem.empty(max(sizes) // 2, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(tsym, group.group_name)
    names = {"one_shot": "ours one-shot", "two_shot": "ours two-shot", "c10d": "NCCL"}
    rows = []
    for measured in measure(sizes):
        nbytes = measured["bytes"]
        row = {"bytes": nbytes, **{names[k]: measured[k] for k in names}}
        x_t = tsym[: nbytes // 2]
        for name, fn in (("torch one_shot", lambda: torch.ops.symm_mem.one_shot_all_reduce(x_t, "sum", group.group_name)),
                         ("torch two_shot", lambda: torch.ops.symm_mem.two_shot_all_reduce_(x_t, "sum", group.group_name))):
            try:
                row[name] = cuda_graph_time_us(fn)
            except Exception as e:  # report, keep going
                row[name] = None
                if rank == 0:
                    print(f"{name} at {nbytes} B failed: {type(e).__name__}: {e}", file=sys.stderr)
        # the compiler's choice runs one of our kernels or NCCL: its time is that kernel's
        pick, _ = choices.all_reduce_algorithm(world, nbytes, dev)
        row["auto pick"], row["ours auto"] = pick, row[names[pick]]
        rows.append(row)
    return rows


SELF_GRAPHED = ("inductor reduce-overhead", "commfuse cuda_graphs")


def decode_table(rank, world, group, B=8, H=4096, F=14336) -> list[dict]:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    f = F // world
    w_up = torch.randn(H, f, device=dev, dtype=torch.bfloat16) / H ** 0.5
    w_down = torch.randn(f, H, device=dev, dtype=torch.bfloat16) / f ** 0.5
    norm_w = torch.ones(H, device=dev, dtype=torch.bfloat16)
    x = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
    res = torch.randn(B, H, device=dev, dtype=torch.bfloat16)

    def step(x, res):
        y = torch.nn.functional.silu(x @ w_up) @ w_down
        y = funcol.all_reduce(y, "sum", group)
        h = y + res
        return rms_norm(h, norm_w), h

    variants = {"eager": step}
    torch._dynamo.reset()
    variants["inductor"] = torch.compile(step)
    try:
        import torch._inductor.config as ic
        if hasattr(ic, "_collective") and hasattr(ic._collective, "auto_select"):
            def with_auto_select():
                torch._dynamo.reset()
                ic._collective.auto_select = True
                fn = torch.compile(step)
                fn(x, res)
                ic._collective.auto_select = False
                return fn
            variants["inductor+auto_select"] = with_auto_select()
    except Exception as e:
        print("auto_select unavailable:", e, file=sys.stderr)
    torch._dynamo.reset()
    variants["inductor reduce-overhead"] = torch.compile(step, mode="reduce-overhead")
    variants["commfuse"] = torch.compile(step, backend="commfuse")
    torch._dynamo.reset()
    variants["commfuse, aten mm"] = torch.compile(step, backend="commfuse", options={"mm_template": False})
    torch._dynamo.reset()
    variants["commfuse cuda_graphs"] = torch.compile(step, backend="commfuse", options={"cuda_graphs": True})
    ref = step(x, res)
    rows = []
    for name, fn in variants.items():
        out = fn(x, res)
        torch.testing.assert_close(out[0].float(), ref[0].float(), atol=5e-2, rtol=5e-2)
        row = {"variant": name}
        row["plain µs"] = loop_time_us(lambda: fn(x, res))
        if name in SELF_GRAPHED:  # replays its own graph: its plain time is the graph time
            row["cuda graph µs"] = None
            rows.append(row)
            continue
        try:
            row["cuda graph µs"] = cuda_graph_time_us(lambda: fn(x, res))
        except Exception as e:
            row["cuda graph µs"] = None
            if rank == 0:
                print(f"{name}: CUDA graph capture failed: {type(e).__name__}: {e}", file=sys.stderr)
        rows.append(row)
    return rows


def ar_norm_table(rank, world, group, batches=(1, 8, 32, 128), hiddens=(4096, 8192)) -> list[dict]:
    """All-reduce + residual add + RMSNorm under CUDA graphs: commfuse (one fused kernel) vs Inductor
    with auto_select vs NCCL + Inductor's fused add+norm kernel."""
    from commfuse.choices import Choices
    choices = Choices()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for H in hiddens:
        step = ar_norm_step(group, torch.ones(H, device=dev, dtype=torch.bfloat16))

        def produce(x):  # the all-reduce input comes from a producer in the graph, as after a matmul
            return x * 1.0
        variants = {}
        torch._dynamo.reset()
        # one code object, compiled by every variant at every batch size: past dynamo's default
        # recompile limit, the later ones would silently run eager
        torch._dynamo.config.recompile_limit = 8 * len(batches)
        # static shapes: each batch size gets its own graph (a dynamic one would take c10d)
        variants["commfuse fused"] = torch.compile(lambda x, r: step(produce(x), r), backend="commfuse", dynamic=False)
        for algo in FUSED:  # each algorithm with the epilogue fused, whatever the table says
            variants[f"commfuse {algo}"] = torch.compile(
                lambda x, r: step(produce(x), r), backend="commfuse", dynamic=False,
                options={"comm.algorithm": algo})
        variants["NCCL + inductor"] = torch.compile(lambda x, r: step(produce(x), r), dynamic=False)
        try:
            import torch._inductor.config as ic
            ic._collective.auto_select = True
            variants["inductor auto_select"] = torch.compile(lambda x, r: step(produce(x), r), dynamic=False)
        except Exception:
            ic = None
        for B in batches:
            x = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
            res = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
            nbytes = B * H * 2
            pick, _ = choices.all_reduce_algorithm(world, nbytes, dev)
            fused_pick = choices.all_reduce_with_epilogue(world, B, nbytes, dev, pick, prologue=True, row_numel=H)
            row = {"B": B, "H": H, "auto pick": fused_pick[0] if fused_pick else pick}
            ref = step(produce(x), res)
            runs, failed = {}, {}
            for name, fn in variants.items():
                try:
                    out = fn(x, res)
                    torch.testing.assert_close(out[0].float(), ref[0].float(), atol=5e-2, rtol=5e-2)
                    runs[name] = functools.partial(fn, x, res)
                except Exception as e:
                    failed[name] = e
            row.update(dict.fromkeys(variants), **interleaved_times_us(runs, failed=failed))
            if rank == 0:
                for name, e in failed.items():
                    print(f"{name} B={B} H={H}: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append(row)
        if ic is not None:
            ic._collective.auto_select = False
    return rows


def tp_stack_table(rank, world, layers=8, B=8, H=1024, F=4096) -> dict:
    """An L-layer tensor-parallel MLP stack, forward + backward: step time (eager vs commfuse) and
    the planned symmetric pool vs one buffer per all-reduce callsite."""
    import glob
    import tempfile
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import commfuse

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.ModuleList(torch.nn.Linear(H, F, bias=False) for _ in range(layers))
            self.down = torch.nn.ModuleList(torch.nn.Linear(F, H, bias=False) for _ in range(layers))

        def forward(self, x):
            for up, down in zip(self.up, self.down):
                x = x + down(torch.nn.functional.silu(up(x)))
            return x
    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,))
    plan = {f"up.{i}": ColwiseParallel() for i in range(layers)}
    plan.update({f"down.{i}": RowwiseParallel() for i in range(layers)})
    torch.manual_seed(0)
    model = parallelize_module(Stack().to(dev, torch.bfloat16), mesh, plan)
    x = torch.randn(B, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dump = tempfile.mkdtemp() if rank == 0 else None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="commfuse", options={"dump_dir": dump})

    def step(fn):
        def run():
            fn(x).sum().backward()
        return run
    out = {"layers": layers, "B": B, "H": H, "F": F}
    out["eager µs"] = loop_time_us(step(model), iters=20)
    out["commfuse µs"] = loop_time_us(step(compiled), iters=20)
    if rank == 0:
        pools = [p for path in glob.glob(f"{dump}/rank0/*/summary.json") for p in json.load(open(path))["comm_pools"]]
        out["planned bytes (largest graph)"] = max((p["planned_bytes"] for p in pools), default=0)
        out["per-callsite bytes (all graphs)"] = sum(p["sum_of_buffers"] for p in pools)
        out["process pool bytes"] = sum(v for d in commfuse.comm_report().values() for v in d.values())
    return out


def gather_scatter_table(sizes, world, group, dev) -> list[dict]:
    """Per collective and gathered size: ours (symmetric kernel) and ours through c10d, as
    `commfuse.tune` times them, NCCL and torch symm_mem's low-contention kernel on an input in
    place; the compiler's pick; every output checked against NCCL's."""
    from commfuse.choices import Choices
    from commfuse.collectives import CommRequest
    from commfuse.tune import measure_gather_scatter
    cuda, c10d = dev.type == "cuda", torch.ops._c10d_functional
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        import torch.distributed._symmetric_memory as symm_mem
        tsym = symm_mem.empty(max(sizes) // dtype.itemsize, dtype=dtype, device=dev)
        symm_mem.rendezvous(tsym, group.group_name)
    torch_ops = {"all_gather_into_tensor": lambda t: torch.ops.symm_mem._low_contention_all_gather(t, group.group_name),
                 "reduce_scatter_tensor": lambda t: torch.ops.symm_mem._low_contention_reduce_scatter(t, "sum", group.group_name)}
    failed, picks = {}, {}

    def extra(op, x, want):
        y, out = x * 2, torch.empty_like(want)
        runs = {"NCCL": (lambda: dist.all_gather_into_tensor(out, y, group=group)) if op == "all_gather_into_tensor"
                else (lambda: dist.reduce_scatter_tensor(out, y, group=group))}
        plan = Choices().gather_scatter_plan(CommRequest(op, "" if op == "all_gather_into_tensor" else "sum",
                                                         group.group_name, dtype, dev, tuple(x.shape)))
        picks[op, max(x.numel(), want.numel()) * dtype.itemsize] = plan.algorithm.name  # by the gathered size
        if cuda:  # its input already in symmetric memory, as ours is
            t = tsym[: y.numel()].view_as(y)
            t.copy_(y)
            try:
                torch.testing.assert_close(c10d.wait_tensor(torch_ops[op](t)).float(), want.float(), atol=5e-2, rtol=5e-2)
                runs["torch symm_mem"] = lambda: c10d.wait_tensor(torch_ops[op](t))
            except Exception as e:
                failed[f"torch symm_mem {op} {y.numel() * dtype.itemsize} B"] = e
        return runs

    def timer(runs):
        if not cuda:
            return {k: cpu_time_us(f) for k, f in runs.items()}
        errors = {}
        times = interleaved_times_us(runs, failed=errors)
        for k, e in errors.items():  # no CUDA graph (torch's kernels fork a stream): a plain loop, marked
            failed[f"{k}: CUDA graph capture, timed in a loop instead"] = e
            times[k] = loop_time_us(runs[k])
            times.setdefault("looped", []).append(names.get(k, k))
        return times
    names = {"symm_all_gather": "ours", "symm_reduce_scatter": "ours", "c10d": "ours c10d"}
    measured = measure_gather_scatter(sizes, dev, dtype, cols=256 if cuda else 64, timer=timer, extra=extra)
    ops = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    rows = [{"collective": section, "auto pick": picks[ops[section], r["bytes"]],
             **dict.fromkeys(("ours", "ours c10d", "NCCL", "torch symm_mem")), **{names.get(k, k): v for k, v in r.items()}}
            for section, measured_rows in measured.items() for r in measured_rows]
    if dist.get_rank() == 0:
        for what, e in failed.items():
            print(f"{what}: {type(e).__name__}: {e}", file=sys.stderr)
    return rows


def cpu_time_us(fn, iters=3, reps=3) -> float:
    """Median µs per call over `reps` loops of `iters` calls, the ranks meeting before each."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return sorted(times)[len(times) // 2]


def gather_scatter_lines(rows, world, name) -> list[str]:
    cols = ("ours", "ours c10d", "NCCL", "torch symm_mem")
    lines = [f"All-gather and reduce-scatter (sum) latency, {world}x {name}, size of the gathered tensor, after a "
             "pointwise producer (µs per call; ours and ours c10d include the producer's pass, NCCL and torch "
             "symm_mem start from their input in place); c10d / ours: commfuse's two plans compared:", "",
             "| collective | size | " + " | ".join(cols) + " | c10d / ours | auto picks |", "|---" * (len(cols) + 4) + "|"]
    for r in rows:
        ratio = f"{r['ours c10d'] / r['ours']:.2f}" if r["ours"] and r["ours c10d"] else "—"
        size = f"{r['bytes'] >> 10} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB"
        lines.append(f"| {r['collective']} | {size} | " + " | ".join(fmt(r[k]) + "*" * (k in r.get("looped", ()))
                                                                   for k in cols) + f" | {ratio} | {r['auto pick']} |")
    if any(r.get("looped") for r in rows):
        lines += ["", "\\* timed in a plain loop (host overhead included): its CUDA graph capture failed"]
    return lines


def fmt(v):
    return "—" if v is None else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-ar", action="store_true", help="no all-reduce latency table")
    ap.add_argument("--only-norm", action="store_true", help="only the all-reduce + RMSNorm table")
    ap.add_argument("--only-stack", action="store_true", help="only the L-layer TP stack (planning)")
    ap.add_argument("--only-ar", action="store_true", help="only the all-reduce latency table")
    ap.add_argument("--only-gather", action="store_true", help="only the all-gather / reduce-scatter table")
    ap.add_argument("--skip-gather", action="store_true", help="no all-gather / reduce-scatter table")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks, the all-gather / reduce-scatter table only")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.cpu else "nccl")
    world = dist.get_world_size()
    group = dist.group.WORLD
    sizes = [4 << 10 << i for i in range(0, 15) if (4 << 10 << i) <= args.max_mib << 20]
    if args.cpu or args.only_gather:
        dev = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
        rows = gather_scatter_table([4 << 10, 16 << 10] if args.cpu else sizes, world, group, dev)
        if rank == 0:
            text = "\n".join(gather_scatter_lines(rows, world, "CPU (gloo)" if args.cpu else torch.cuda.get_device_name()))
            print(text)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text + "\n")
                with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                    json.dump({"gather_scatter": rows, "world": world}, f, indent=1)
        dist.barrier()
        dist.destroy_process_group()
        return
    only = args.only_norm or args.only_stack or args.only_ar
    ar = [] if only and not args.only_ar or args.skip_ar else all_reduce_table(sizes, rank, world, group)
    dec = [] if args.skip_decode or only else decode_table(rank, world, group)
    norm = [] if args.only_stack or args.only_ar else ar_norm_table(rank, world, group)
    stack = tp_stack_table(rank, world) if args.only_stack or not only else None
    dev = torch.device("cuda", torch.cuda.current_device())
    gs = [] if only or args.skip_gather else gather_scatter_table(sizes, world, group, dev)
    if rank == 0:
        name = torch.cuda.get_device_name()
        cols = ("ours one-shot", "ours two-shot", "ours auto", "torch one_shot", "torch two_shot", "NCCL")
        lines = [f"All-reduce latency, {world}x {name}, bf16, CUDA graphs (µs per call, median); auto / best: "
                 "the compiler's choice over the fastest of ours one-shot, two-shot and NCCL:", "",
                 "| size | " + " | ".join(cols) + " | auto picks | auto / best |", "|---" * (len(cols) + 3) + "|"]
        for r in ar:
            best = min((r[k] for k in ("ours one-shot", "ours two-shot", "NCCL") if r[k]), default=None)
            ratio = f"{r['ours auto'] / best:.2f}" if best and r["ours auto"] else "—"
            size = f"{r['bytes'] >> 10} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB"
            lines.append(f"| {size} | " + " | ".join(fmt(r[k]) for k in cols) + f" | {r['auto pick']} | {ratio} |")
        if dec:
            lines += ["", f"TP MLP decode step (B=8, H=4096, F=14336/{world} per rank, bf16, all-reduce + residual "
                          f"+ RMSNorm), {world}x {name}:", "", "| variant | plain µs | CUDA graph µs |", "|---|---|---|"]
            lines += [f"| {r['variant']} | {fmt(r['plain µs'])} | {fmt(r['cuda graph µs'])} |" for r in dec]
        lines += ["", f"All-reduce + residual + RMSNorm, {world}x {name}, bf16, CUDA graphs (µs):", "",
                  "| B | H | commfuse fused (auto) | " + " | ".join(FUSED) + " | inductor auto_select | NCCL + inductor "
                  "| vs auto_select | auto picks | auto / best |", "|---" * (len(FUSED) + 8) + "|"]
        for r in norm:
            c, a = r.get("commfuse fused"), r.get("inductor auto_select")
            ratio = f"{a / c:.2f}" if c and a else "—"
            forced = [r.get(f"commfuse {algo}") for algo in FUSED]
            best = min((t for t in forced if t), default=None)
            vs_best = f"{c / best:.2f}" if c and best else "—"
            lines.append(f"| {r['B']} | {r['H']} | {fmt(c)} | " + " | ".join(fmt(t) for t in forced) +
                         f" | {fmt(a)} | {fmt(r.get('NCCL + inductor'))} | {ratio} | {r['auto pick']} | {vs_best} |")
        if stack:
            lines += ["", f"{stack['layers']}-layer TP MLP stack, forward + backward, {world}x {name} "
                          f"(B={stack['B']}, H={stack['H']}, F={stack['F']}/{world}, bf16):", ""]
            lines += [f"- {k}: {fmt(v) if isinstance(v, float) else v}" for k, v in stack.items()]
        if gs:
            lines += [""] + gather_scatter_lines(gs, world, name)
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                json.dump({"all_reduce": ar, "decode": dec, "ar_norm": norm, "tp_stack": stack, "gather_scatter": gs,
                           "device": name, "world": world}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
