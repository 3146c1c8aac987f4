"""What HBM allows a tensor-parallel decode step (bench/model_tp.py's decode): the floor, and each
commfuse kernel's achieved bandwidth against it.

floor = bytes each rank must read per step / read bandwidth + all-reduces per step x one-shot latency
- bytes: the rank's weight shards (its parameters' local shapes) plus the whole static KV cache (the
  cache buffers' shapes: eager's SDPA with a mask reads all of it); the prefix floor reads only the
  valid prefix of the cache (positions <= pos), as a kernel that knows the position can;
- read bandwidth: bytes over the time of torch.sum over a 1 GiB tensor, measured in the same run;
- all-reduces: one per row-parallel module (a weight sharded along its input dimension, Shard(1)),
  each of the step's activation (B x H in the model's dtype), timed as torch symm_mem's
  one_shot_all_reduce (NCCL's all_reduce where symmetric memory is not there: on CPU, gloo).
"""
from __future__ import annotations

import collections
import math
import re

import torch
import torch.distributed as dist

import commfuse.choices
from bench import timing


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def row_parallel(model) -> int:
    """Modules whose weight is sharded along its input dimension: each output is all-reduced."""
    from torch.distributed.tensor import DTensor, Shard
    return sum(isinstance(w, DTensor) and w.device_mesh.size() > 1 and any(p == Shard(1) for p in w.placements)
               for w in (getattr(m, "weight", None) for m in model.modules()))


def read_bandwidth(dev, size=1 << 30) -> float:
    """Bytes per second of a read-only reduction (torch.sum) over `size` bytes."""
    x = torch.ones(size // 2, dtype=torch.bfloat16, device=dev)
    if dev.type == "cuda":
        t = timing.cuda_graph_time_us(lambda: torch.sum(x), iters=10, reps=5) * 1e-6
    else:
        t = min(timing.wall_time_s(lambda: torch.sum(x), dev) for _ in range(3))
    del x
    return size / t


def all_reduce_us(numel, dtype, dev) -> float:
    """µs of one all-reduce of `numel` elements over the world: torch symm_mem's one-shot on
    GPUs, else the process group's all_reduce."""
    group = dist.group.WORLD
    if dev.type == "cuda":
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(numel, dtype=dtype, device=dev)
        symm_mem.rendezvous(buf, group.group_name)
        buf.fill_(1)
        return timing.cuda_graph_time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name))
    x = torch.ones(numel, dtype=dtype)
    return min(timing.wall_time_s(lambda: dist.all_reduce(x), dev) for _ in range(5)) * 1e6


def kv_caches(model) -> list:
    """The model's static KV caches, (b, kv heads, positions, d) each: its buffers named so."""
    return [b for n, b in model.named_buffers() if "cache" in n]


def cache_prefixes(model, pos) -> dict:
    """{a KV cache's address: its bytes up to position `pos`}: what a kernel that reads it up to
    the position moves (kernel_bytes' `read_at_most`)."""
    return {b.data_ptr(): nbytes(b) * (pos + 1) // b.shape[2] for b in kv_caches(model)}


def floors(model, batch, hidden, pos, dtype, dev) -> dict:
    """The floor's terms and the two floors (µs), for a decode step at position `pos`."""
    weights = sum(nbytes(p) for p in model.parameters())
    caches = kv_caches(model)
    cache = sum(nbytes(b) for b in caches)
    prefix = cache * (pos + 1) / caches[0].shape[2] if caches else 0  # (b, kv heads, positions, d)
    size = 1 << 30 if dev.type == "cuda" else 1 << 26  # (the CPU check: a smaller read)
    bw = read_bandwidth(dev, size)
    count = row_parallel(model) if dist.get_world_size() > 1 else 0
    ar = all_reduce_us(batch * hidden, dtype, dev) if count else 0.0
    return {"floor weight MB": weights / 1e6, "floor cache MB": cache / 1e6, "floor prefix cache MB": prefix / 1e6,
            "floor read GB/s": bw / 1e9, "floor read MiB": size / 2**20, "floor all-reduces": count, "floor all-reduce µs": ar,
            "floor µs": (weights + cache) / bw * 1e6 + count * ar, "prefix floor µs": (weights + prefix) / bw * 1e6 + count * ar}


def describe(r: dict, key="decode") -> str:
    """A line of the floor's terms, from `r` holding floors()'s figures under `key`."""
    r = {k.removeprefix(key + " "): v for k, v in r.items()}
    return (f"{key[0].upper() + key[1:]} floor per rank: ({r['floor weight MB']:.4g} MB of weight shards + {r['floor cache MB']:.4g} MB of "
            f"KV cache ({r['floor prefix cache MB']:.4g} MB up to the position)) / {r['floor read GB/s']:.0f} GB/s "
            f"(torch.sum over {r['floor read MiB']:.0f} MiB) + {r['floor all-reduces']:.0f} all-reduces x "
            f"{r['floor all-reduce µs']:.1f} µs "
            f"(one-shot) = {r['floor µs']:.1f} µs; prefix floor {r['prefix floor µs']:.1f} µs.")


# ------------------------------------------------------------------------ per-kernel breakdown
def kernel_bytes(call, read_at_most: dict | None = None) -> dict:
    """{kernel name: bytes of its tensor arguments, summed over its launches} for one `call()` of
    commfuse-generated code (every launch goes through commfuse.runtime.launch.Site): each tensor
    argument counted once, whole (what a kernel that reads or writes all of it moves), or at most
    `read_at_most[its address]` (a KV cache, which decode attention reads up to the position);
    arguments at one address once (the few-row matmul passes its weight again where it needs no
    workspace)."""
    read_at_most = read_at_most or {}
    from commfuse.runtime import launch
    seen: dict[str, int] = {}
    plain = launch.Site.__call__

    def counting(site, stream, grid, *args):
        k = site.kernel
        name = getattr(k, "__name__", None) or getattr(getattr(k, "fn", None), "__name__", str(k))
        per_ptr: dict[int, int] = {}  # a tensor passed twice (a placeholder argument) moves once
        for a in args:
            if isinstance(a, torch.Tensor):
                whole = min(a.numel() * a.element_size(), read_at_most.get(a.data_ptr(), math.inf))
                per_ptr[a.data_ptr()] = max(per_ptr.get(a.data_ptr(), 0), whole)
        seen[name] = seen.get(name, 0) + sum(per_ptr.values())
        return plain(site, stream, grid, *args)
    launch.Site.__call__ = counting
    try:
        call()
    finally:
        launch.Site.__call__ = plain
    return seen


BYTES_OPS = re.compile(r"aten::(mm|addmm|bmm|_?scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)$")
ELEMENT = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "bool": 1, "int": 4, "long int": 8}


def aten_bytes(events, elem: int, cpu=False) -> dict:
    """{kernel: bytes of its aten op's tensor inputs} for the ops whose kernels read all of their
    inputs (matmuls, attention); an op's bytes go to its longest kernel (`cpu`: to the op itself,
    which stands in for its kernel there). Dtypes from the profiler where it records them, else
    `elem` bytes each."""
    out: dict[str, float] = {}
    for e in events:
        if not ((e.kernels or cpu) and BYTES_OPS.match(e.name)):
            continue
        dtypes = list(getattr(e, "input_dtypes", None) or [])
        b = sum(math.prod(shape) * ELEMENT.get(dtypes[i] if i < len(dtypes) else "", elem)
                for i, shape in enumerate(e.input_shapes) if shape and all(isinstance(d, int) for d in shape))
        k = max(e.kernels, key=lambda k: k.duration).name if e.kernels else e.name
        out[k] = out.get(k, 0) + b
    return out


def _profiled(run, gpu, shapes=False):
    """torch.profiler's events of `run()`, GPU kernels included on a GPU."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []), record_shapes=shapes) as prof:
        run()
    return prof.events()


def _kernels(events, gpu) -> list:
    """The step's kernels among the events: GPU kernels (on CPU, the script's check, aten's ops
    stand in), NCCL's (the barriers) and annotations left out."""
    from torch.autograd import DeviceType
    return [e for e in events if e.device_type == (DeviceType.CUDA if gpu else DeviceType.CPU)
            and (gpu or e.name.startswith("aten::")) and not any(k in e.name.lower() for k in timing.RENDEZVOUS_KERNELS)
            and not getattr(e, "is_user_annotation", False) and not re.fullmatch(r"[\w.]+:[\w.]+", e.name)]


def per_kernel(events, steps, gpu) -> dict:
    """{kernel: [µs, launches]} per step over `steps` steps' events."""
    per: dict[str, list] = {}
    for e in _kernels(events, gpu):
        t = per.setdefault(e.name, [0.0, 0.0])
        t[0] += e.time_range.elapsed_us() / steps
        t[1] += 1 / steps
    return per


def in_order(events, steps) -> list | None:
    """[(kernel, µs, idle µs before it)] of one step, each the mean over `steps` steps launched one
    after another (the idle time before a step's first kernel left out; kernels that not every step
    runs, such as a fill once a replay, left out); None where the steps did not run the same kernels."""
    ks = _kernels(events, True)
    count = collections.Counter(e.name for e in ks)
    ks = sorted((e for e in ks if count[e.name] % steps == 0), key=lambda e: e.time_range.start)
    n = len(ks) // steps
    if not ks or n * steps != len(ks) or any(ks[i].name != ks[i % n].name for i in range(len(ks))):
        return None
    rows = [[ks[i].name, 0.0, 0.0] for i in range(n)]
    for i, e in enumerate(ks):
        rows[i % n][1] += e.time_range.elapsed_us() / steps
        if i % n:
            rows[i % n][2] += (e.time_range.start - ks[i - 1].time_range.end) / steps
    return rows


def graph_kernels(call, dev, graph_steps, replays) -> tuple:
    """per_kernel() and in_order() of `replays` replays of a CUDA graph of `graph_steps` calls, each
    replay started on every rank at once (`timing.start_together`), the GPU idle before."""
    graph = timing.capture(call, graph_steps)

    def replayed():
        for _ in range(replays):
            timing.sync(dev)
            timing.start_together()
            graph.replay()
        timing.sync(dev)
    events = _profiled(replayed, True)
    return per_kernel(events, replays * graph_steps, True), in_order(events, replays * graph_steps)


def kernel_table(call, steps, dev, bandwidth_gbs, elem=2, graph_steps=10, replays=5, read_at_most=None) -> str:
    """Markdown: each kernel of `call()` (one decode step) by GPU time per step, with the bytes it
    moved (a generated kernel's tensor arguments; a matmul's or attention's aten inputs), its GB/s
    and its share of the measured read bandwidth, under 80% flagged, beside the other ranks' times
    for it (a collective one rank waits in is the other ranks' lateness). The bytes are the whole of each
    argument: above the bandwidth, the kernel touched a part of one (a KV-cache position), and only
    the bound is shown. On a GPU the times are from
    `replays` replays of a CUDA graph of `graph_steps` steps, started together: launched op by op
    the step is host-bound, the ranks drift apart within it and the all-reduces would hold the
    drift. Else (on CPU; a torch whose profiler sees no kernels in a graph's replays) from `steps`
    plain calls, each after a barrier. A heading line says which. `read_at_most`: kernel_bytes'."""
    gpu = dev.type == "cuda"
    moved = kernel_bytes(call, read_at_most)
    call()
    timing.sync(dev)
    dist.barrier()

    def plain():
        for _ in range(steps):
            dist.barrier()
            timing.sync(dev)
            call()
        timing.sync(dev)
    events = _profiled(plain, gpu, shapes=True)  # also the aten ops' shapes, for their bytes
    moved.update({k: v / steps for k, v in aten_bytes(events, elem, cpu=not gpu).items()})
    per = per_kernel(events, steps, gpu)
    how = f"{steps} steps called one by one, each after a barrier" + ("" if gpu else " (CPU: no CUDA graphs)")
    order = None
    try:
        in_graph, order = graph_kernels(call, dev, graph_steps, replays) if gpu else (None, None)
    except Exception as e:  # (a step that cannot be captured)
        in_graph, how = None, how + f" (capturing a CUDA graph failed: {type(e).__name__})"
    if in_graph is not None and sum(n for _, n in in_graph.values()) >= 0.5 * sum(n for _, n in per.values()):
        per, how = in_graph, f"{replays} replays of a CUDA graph of {graph_steps} steps, the ranks starting each together"
    elif in_graph is not None:  # this torch's profiler does not see the kernels a graph launches
        how += " (the profiler saw no kernels inside CUDA graph replays: host-bound, the all-reduces hold the ranks' drift)"
    ranks = [None] * dist.get_world_size()  # every rank's times: a rank waiting in a collective waits for another
    dist.all_gather_object(ranks, (per, order))
    others = [r for r, _ in ranks[:dist.get_rank()] + ranks[dist.get_rank() + 1:]]
    if gpu and commfuse.choices.current().dependent_launch(dev):
        how += (". Kernels launched as dependents (config.dependent_launch) start before the one ahead has"
                " finished and wait for it, so their times overlap and include that wait: for each kernel's"
                " own time, run with COMMFUSE_DEPENDENT_LAUNCH=0")
    lines = [f"Profiled: {how}; per step.", "",
             f"| kernel | µs per step | other ranks' µs | launches per step | MB per step | GB/s | of {bandwidth_gbs:.0f} GB/s |",
             "|---|---|---|---|---|---|---|"]
    total = 0.0
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        total += us
        theirs = sorted(r[name][0] for r in others if name in r)
        spread = "—" if not theirs else f"{theirs[0]:.1f}" + (f"–{theirs[-1]:.1f}" if len(theirs) > 1 else "")
        b = moved.get(name)
        gbs = b / us / 1e3 if b and us else None
        pct = round(100 * gbs / bandwidth_gbs) if gbs else None
        # it touched a part of an argument (a cache position): bytes unknown. Not on a CPU, whose bf16 sum (the
        # "bandwidth") is bound by its arithmetic and the load beside it: an fp32 matmul there read faster
        if gpu and gbs and gbs > 1.2 * bandwidth_gbs:
            cells = [f"≤ {b / 1e6:.2f}", "—", "— (part of its arguments)"]
        else:
            cells = [f"{b / 1e6:.2f}", f"{gbs:.0f}", f"{pct}%" + (" <80%" if pct < 80 else "")] if gbs else ["—", "—", "—"]
        lines.append(f"| `{name[:90]}` | {us:.1f} | {spread} | {n:g} | " + " | ".join(cells) + " |")
    lines.append(f"| total | {total:.1f} | | | | | |")
    return "\n".join(lines + _skew_lines([o for _, o in ranks]))


def _skew_lines(orders: list) -> list:
    """Where the ranks part in one step, kernel by kernel in launch order: each rank's time in it
    and the GPU's idle time before it, for the kernels where some rank's differ by 2 µs or more
    (a rank that idles or runs slow makes the others wait in the next collective)."""
    if len(orders) < 2 or any(o is None or [k for k, *_ in o] != [k for k, *_ in orders[0]] for o in orders):
        return []
    rows = [f"| {i} | `{orders[0][i][0][:60]}` | " + " | ".join(f"{o[i][1]:.1f} / {o[i][2]:.1f}" for o in orders) + " |"
            for i in range(len(orders[0]))
            if max(o[i][1] for o in orders) - min(o[i][1] for o in orders) >= 2
            or max(o[i][2] for o in orders) - min(o[i][2] for o in orders) >= 2]
    idle = " | ".join(f"{sum(r[2] for r in o):.1f}" for o in orders)
    return ["", "The step in launch order where the ranks differ by 2 µs or more (µs in the kernel / GPU idle before it):", "",
            "| # | kernel | " + " | ".join(f"rank {r}" for r in range(len(orders))) + " |",
            "|---|---|" + "---|" * len(orders)] + rows + [f"| | idle in the step | {idle} |"]
