"""Distributed Llama decoder layers (tensor-parallel, and FSDP2): eager, Inductor and commfuse
side by side in one run.

    torchrun --standalone --nproc-per-node 2 bench/model_tp.py [--out bench/results/model_tp_2xh200.md]
    torchrun --standalone --nproc-per-node 2 bench/model_tp.py --workloads sp --variants "eager,inductor,inductor async-TP,commfuse" --trace
    torchrun --standalone --nproc-per-node 2 bench/model_tp.py --workloads decode --variants inductor,commfuse --kernels --sweep 1:2048,32:2048,8:512,8:8192
    torchrun --standalone --nproc-per-node 2 bench/model_tp.py --cpu --tiny     # checks the script on CPU (fp32)

The model (bench/llama.py, which tests/test_tp_llama.py checks): Llama-3-8B-shaped decoder layers (H 4096, 32 query / 8 KV heads of 128, SwiGLU F 14336,
RMSNorm, rotary embedding; attention through SDPA with HF's repeat_kv), 4 of them, bf16,
tensor-parallel over the ranks with DTensor's parallelize_module (torchtitan's plan:
column-parallel q/k/v and gate/up, row-parallel o and down, whose outputs are all-reduced).
Variants: eager, Inductor, Inductor mode="reduce-overhead", Inductor async-TP (options
{"_micro_pipeline_tp": True}, symmetric memory enabled for the TP group; sequence-parallel training
only, skipped on CPU and at world 1), commfuse, commfuse with options={"cuda_graphs": True},
commfuse unhidden (options {"comm.hide_behind_compute": False}: each collective by the tuned table
alone, for an A/B of the c10d-where-hidden choice; not run by default), commfuse single-buffered
(options {"comm.double_buffer_max_bytes": 0}: every comm kernel closes with its own barrier; not
run by default), commfuse serial launch (options {"dependent_launch": False}; not run by default); all
share one model per workload (its weights and its KV cache). On one rank (torchrun
--nproc-per-node 1) the model is the plain one, no DTensor: the single-GPU row.

Workloads:
- decode: B=8 sequences, one token each at position `pos`, over a static KV cache of 2048 positions
  (module buffers written in place by index_copy_; the mask is positions <= pos). GPU time per step:
  10 steps captured in a CUDA graph and replayed (bench/timing.py: interleaved_times_us, variants in
  interleaved rounds); the self-graphing variants cannot be captured inside another graph, their
  per-call time is their graph time. Per call: CUDA events around a loop of calls, as a user loops it;
  host per call: the same loop's time on the host, not waiting for the GPU (near the per-call time,
  the loop is host-bound: Dynamo's guards, AOTAutograd's wrappers, the backend's own Python).
  The timed steps write position --pos (default: the cache's middle). The floor (bench/decode_floor.py):
  the bytes each rank reads per step (its weight shards and the whole KV cache, from the model's
  parameter and buffer shapes) over the read bandwidth measured in the run (torch.sum over 1 GiB),
  plus the row-parallel all-reduces times torch symm_mem's one-shot latency at the step's size; the
  prefix floor reads the cache only up to the position; each variant's GPU time per step (per call
  where self-graphing) over both. --kernels: commfuse's step per kernel (rank 0, the other ranks'
  times beside; on GPUs, 5 replays of a CUDA graph of --graph-steps steps, the ranks starting
  each together on their GPUs (bench/timing.py), so that host time does not show as waiting in
  the all-reduces; on CPU 5 plain calls), with the bytes it moved (a generated kernel's tensor
  arguments; a matmul's or attention's aten inputs; other aten kernels without) and its GB/s
  against the measured bandwidth, under 80% flagged.
  --sweep B:C,...: after the workloads, decode again at each batch B and cache length C (position
  C/2 unless --pos), each on a model of its own, the --sweep-variants only (default Inductor and
  commfuse): GPU time, per call, floors and ratios, error.
- train: tensor-parallel forward + backward of B=2 x S=1024 tokens (loss: mean square of the output, taken
  eagerly), CUDA events around a loop of steps; host ms per step: one step's time on the host, started
  with the GPU idle and not waiting for it (near the step time, the step is host-bound). Gradients
  exist from the steps before (accumulated in place), so "peak above weights" is
  torch.cuda.max_memory_allocated over one step less what was allocated before it (weights,
  gradients, KV cache, inputs): activations and temporaries. Not for
  the self-graphing variants, whose graph pools are allocated when they record, before that step.
- sp: sequence-parallel TP training, torchtitan's plan (bench/llama.py tp_llama(sequence_parallel=True):
  SequenceParallel norms, PrepareModuleInput all-gathering each block's input, row-parallel o and
  down reduce-scattered to Shard(1)), each rank's input its B=2 x S/world shard of the hidden states;
  loss and figures as for `train`, its own model.
- fsdp: FSDP2 training, data parallel over the ranks (fully_shard per layer and at the root, each
  layer compiled on its own as torchtitan does): Llama-3.2-1B-shaped layers (H 2048, 32 query / 8
  KV heads, F 8192), 4 of them, B=4 x S=2048 tokens per rank. Each variant builds its own sharded
  model with the same weights; timed and measured as `train` is.
- cold compile: the first call of each variant, per workload, with Inductor's, Triton's and
  commfuse's on-disk caches pointed at a new folder (unless TORCHINDUCTOR_CACHE_DIR /
  TRITON_CACHE_DIR / COMMFUSE_CACHE_DIR are set). The second variant of a backend may reuse what
  the first compiled in this process.
- warm compile (Inductor and commfuse, plain mode): after a workload's timings, torch._dynamo.reset()
  and the first call again, in the same process, with the on-disk caches that the cold compile filled
  (Inductor's FX graph and AOTAutograd caches, commfuse's graph cache, Triton's kernels).
- --trace [WORKLOADS]: after each workload's timings (or the listed ones': the profiler slows what
  runs after it, so trace the last workload), one step of each variant under torch.profiler, the
  ranks started together: a Chrome / Perfetto trace per rank in --trace-dir, "exposed comm" in the
  table (bench/trace_summary.py: the share of the step during which a comm kernel runs and no
  compute kernel does, from the GPU intervals; the worst rank's), and on rank 0 a line per variant
  and the step's timeline as a PNG where matplotlib is (else: python bench/plot.py TRACE.json.gz).
- max |error| vs eager, in the run's dtype (bf16; fp32 with --cpu): decode, over the outputs of 4 steps (a self-graphing variant replays
  from its third call) and every layer's K/V cache after them, each variant starting from the same
  cache; training, over the loss and every parameter gradient (local shards).

The table gives each variant's figure and commfuse's ratios, other / commfuse (above 1: commfuse is
better): plain commfuse against Inductor and against Inductor async-TP, and commfuse cuda_graphs
against reduce-overhead. A
variant that fails is listed under the table and the others go on; the exit status is then 1, as it
is when a commfuse variant's error is above max(5 x Inductor's (else eager's), 1e-2, 4 ulps of the dtype at the
largest reference value) (marked `!`).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import traceback

# Multicast stays off (no multimem instructions); set before NCCL and symmetric memory start.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
import commfuse  # noqa: E402,F401  (before torch._dynamo imports triton: Triton's interpreter on CPU)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.llama import Config, fsdp_llama, llama, tp_llama  # noqa: E402
from commfuse import backend  # noqa: E402
from bench import decode_floor, timing, trace_summary  # noqa: E402
from bench.model_tp_report import report  # noqa: E402
from bench.tp_variants import ASYNC_TP, OPT_IN, SELF_GRAPHED, VARIANTS, WORKLOADS, compile_options, compiled  # noqa: E402,F401

FULL = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=4, batch=8, cache=2048, train_batch=2, seq=1024)
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, batch=2, cache=16, train_batch=2, seq=8)
FSDP_FULL = dict(hidden=2048, heads=32, kv_heads=8, ffn=8192, layers=4, batch=4, seq=2048)  # Llama-3.2-1B's layers
FSDP_TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, batch=2, seq=8)
WARM = ("inductor", "commfuse")  # variants whose warm compile is measured


# ------------------------------------------------------------------------------------------ model
def build(a, world, dev, dtensor=False):
    """bench/llama.py's decoder layers on hidden states (no embedding or head), in a.dtype; on one
    rank the plain model (no DTensor) unless `dtensor`."""
    cfg = Config(dim=a.hidden, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn=a.ffn, n_layers=a.layers,
                 max_batch=a.batch, max_seq=a.cache)
    return llama(cfg, 1, dev, a.dtype) if world == 1 and not dtensor else tp_llama(cfg, world, dev, a.dtype)


def variants_for(workload, variants, dev) -> list:
    """The variants a workload runs: async-TP only where there are all-gathers and
    reduce-scatters to fuse (sequence parallel) and a GPU's symmetric memory (else skipped, said once)."""
    if ASYNC_TP not in variants or workload != "sp":
        return [v for v in variants if v != ASYNC_TP]
    why = "no symmetric memory on CPU" if dev.type != "cuda" else "world 1" if dist.get_world_size() == 1 else None
    if why:
        if dist.get_rank() == 0:
            print(f"{ASYNC_TP} skipped: {why}", flush=True)
        return [v for v in variants if v != ASYNC_TP]
    return variants


class SequenceParallelLayers(torch.nn.Module):
    """A sequence-parallel TP model's layers on this rank's shard of the hidden states (B, S/world,
    H): the rotary tables cover the whole sequence, which attention sees after its all-gather."""
    def __init__(self, model, world):
        super().__init__()
        self.model, self.world = model, world

    def forward(self, x):
        s = x.shape[1] * self.world
        cos, sin = self.model.cos[:s], self.model.sin[:s]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return x


def fsdp_model(a, dev, name):
    """A fresh FSDP2 model (the same weights for every variant), each layer compiled on its own."""
    f = a.fsdp
    cfg = Config(dim=f["hidden"], n_heads=f["heads"], n_kv_heads=f["kv_heads"], ffn=f["ffn"], n_layers=f["layers"],
                 max_batch=1, max_seq=f["seq"])
    model = fsdp_llama(cfg, dev, a.dtype)
    kw = compile_options(name)
    if kw is not None:
        for layer in model.layers:
            layer.compile(**kw)
    return model


# ----------------------------------------------------------------------------------------- timing
def per_call_us(fn, a, dev, iters) -> float:
    """µs per call as a user loops it: CUDA events on the GPU; on CPU one timed loop (a smoke check)."""
    if dev.type == "cuda":
        return timing.loop_time_us(fn, iters=iters, reps=max(a.rounds, 3))
    return sum(timing.wall_time_s(fn, dev) for _ in range(iters)) * 1e6 / iters


def max_diff(got, want) -> float:
    from torch.distributed.tensor import DTensor
    got, want = (t.to_local() if isinstance(t, DTensor) else t for t in (got, want))
    return (got.detach().float() - want.detach().float()).abs().max().item() if want.numel() else 0.0


# -------------------------------------------------------------------------------------- workloads
def decode(model, a, dev, variants, res, failed, check_steps=4, key="decode"):
    """The decode figures under `key` ("decode", or a --sweep configuration's: no warm compile,
    kernels or trace there)."""
    main = key == "decode"
    variants = variants_for("decode", variants, dev)
    caches = decode_floor.kv_caches(model)
    torch.manual_seed(1)  # the same context on every rank and for every variant
    start = [torch.randn_like(c) for c in caches]

    def reset():
        with torch.no_grad():
            for c, s in zip(caches, start):
                c.copy_(s)  # in place: self-graphing variants keep the addresses they captured
    xs = [torch.randn(a.batch, 1, a.hidden, device=dev, dtype=a.dtype) for _ in range(check_steps)]
    positions = [torch.tensor([a.pos - check_steps + 1 + i], device=dev) for i in range(check_steps)]

    def run(fn):
        outs = []
        with torch.no_grad():
            for x, pos in zip(xs, positions):
                outs.append(fn(x, pos).clone())
        return outs, [c.clone() for c in caches]
    reset()
    ref_outs, ref_caches = run(model)
    a.scales[f"err {key}"] = max(max_diff(t, torch.zeros_like(t)) for t in ref_outs + ref_caches)
    fns = {}
    for name in variants:
        try:
            reset()
            fn = compiled(model, name)
            with torch.no_grad(), _profiled(f"cold_{key}_{name}"):
                res[name][f"compile {key} s"] = timing.wall_time_s(lambda: fn(xs[0], positions[0]), dev)
            reset()  # the check starts from the same cache as eager's
            outs, after = run(fn)
            res[name][f"err {key}"] = max(max(map(max_diff, outs, ref_outs)), max(map(max_diff, after, ref_caches)))
            fns[name] = fn
        except Exception as e:  # report, go on with the others
            failed[f"{name}, {key}"] = _why(e)
    x, pos = xs[-1], positions[-1]  # steady state: every call writes the last position again
    step = {name: (lambda fn=fn: fn(x, pos)) for name, fn in fns.items()}
    with torch.no_grad():
        for name, fn in step.items():
            try:
                res[name][f"{key} µs/call"] = per_call_us(fn, a, dev, iters=200 if dev.type == "cuda" else 1)
                with _profiled(f"{key}_host_{name}"):
                    res[name][f"{key} host µs/call"] = timing.host_time_us(fn, dev, iters=200 if dev.type == "cuda" else 1)
            except Exception as e:
                failed[f"{name}, {key} per call"] = _why(e)
        if dev.type == "cuda":
            graphable = {n: f for n, f in step.items() if n not in SELF_GRAPHED}
            errors = {}
            times = timing.interleaved_times_us(graphable, rounds=a.rounds, iters=a.graph_steps, failed=errors)
            for name, t in times.items():
                res[name][f"{key} GPU µs/step"] = t
            failed.update({f"{n}, {key} CUDA graph": _why(e) for n, e in errors.items()})
        try:  # what HBM allows, measured beside the variants
            floor = decode_floor.floors(model, a.batch, a.hidden, a.pos, a.dtype, dev)
            for name in variants:
                res[name].update({f"{key} {k}": v for k, v in floor.items()})
        except Exception as e:
            failed[f"{key} floor"] = _why(e)
        if main and a.kernels and "commfuse" in step:
            try:
                bw = res[variants[0]].get("decode floor read GB/s") or decode_floor.read_bandwidth(dev) / 1e9
                a.kernel_tables["decode, commfuse"] = decode_floor.kernel_table(
                    step["commfuse"], 5, dev, bw, a.dtype.itemsize, graph_steps=a.graph_steps,
                    read_at_most=decode_floor.cache_prefixes(model, a.pos))
            except Exception as e:
                failed["commfuse, decode kernels"] = _why(e)
        if main and "decode" in a.trace:
            trace_steps("decode", step, a, dev, res, failed)

    if not main:
        return

    def first_call(name):
        fn = compiled(model, name)
        with torch.no_grad():
            return timing.wall_time_s(lambda: fn(xs[0], positions[0]), dev)
    warm_compiles("decode", variants, res, failed, first_call)


def train(model, a, dev, variants, res, failed):
    """Tensor-parallel training: every variant compiles the one TP model."""
    torch.manual_seed(2)
    x = torch.randn(a.train_batch, a.seq, a.hidden, device=dev, dtype=a.dtype)
    model.zero_grad(set_to_none=True)
    _train("train", lambda name: (compiled(model, name), model), x, a, dev, variants, res, failed)


def sp_train(a, dev, variants, res, failed):
    """Sequence-parallel TP training (torchtitan's plan: the norms and the residual stream sharded
    along the sequence, all-gathered before each block's projections and reduce-scattered after):
    every variant compiles one model's layers, each rank's input its shard of the sequence."""
    world = dist.get_world_size()
    if world == 1:
        print("sp skipped: sequence parallelism needs 2 ranks or more", flush=True)
        return
    if a.seq % world:
        failed["sp"] = f"S={a.seq} does not divide among {world} ranks"
        return
    cfg = Config(dim=a.hidden, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn=a.ffn, n_layers=a.layers,
                 max_batch=1, max_seq=a.seq)
    model = tp_llama(cfg, world, dev, a.dtype, sequence_parallel=True)
    layers = SequenceParallelLayers(model, world)
    torch.manual_seed(4 + dist.get_rank())  # each rank its own positions of the sequence
    x = torch.randn(a.train_batch, a.seq // world, a.hidden, device=dev, dtype=a.dtype)

    def make(name):
        if name == ASYNC_TP:  # its fused ops rendezvous on the TP group's symmetric memory
            import warnings
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            with warnings.catch_warnings():  # deprecated (and a no-op) in later torch; 2.11 needs it
                warnings.simplefilter("ignore")
                enable_symm_mem_for_group(model.layers[0].attention.wq.weight.device_mesh.get_group().group_name)
        return compiled(layers, name), model
    _train("sp", make, x, a, dev, variants, res, failed)


def fsdp_train(a, dev, variants, res, failed):
    """FSDP2 training: each variant a fresh sharded model, its layers compiled one by one."""
    f = a.fsdp
    torch.manual_seed(3 + dist.get_rank())  # data parallel: a batch of its own on each rank
    x = torch.randn(f["batch"], f["seq"], f["hidden"], device=dev, dtype=a.dtype)

    def make(name):
        model = fsdp_model(a, dev, name)
        return model, model
    _train("fsdp", make, x, a, dev, variants, res, failed)


def _train(key, make, x, a, dev, variants, res, failed):
    """The training figures of each variant under `key`; make(name) -> (callable, module)."""
    def step(fn, module=None):
        if module is not None:  # --zero-grad: gradients set to None first, as torchtitan's loop does
            module.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration for reduce-overhead's graphs
        loss = fn(x).float().pow(2).mean()
        loss.backward()
        return loss.detach()

    def grads(module):
        out = {n: p.grad for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        return out
    ref, module = make("eager")
    ref_loss, ref_grads = step(ref), grads(module)
    a.scales[f"err {key}"] = max(max_diff(t, torch.zeros_like(t)) for t in [ref_loss, *ref_grads.values()])
    variants, kept = variants_for(key, variants, dev), {}
    for name in variants:
        fn = module = None
        try:
            fn, module = make(name)
            with _profiled(f"cold_{key}_{name}"):
                res[name][f"compile {key} s"] = timing.wall_time_s(lambda: step(fn), dev)
            grads(module)
            for _ in range(2):  # a self-graphing variant records, then replays: check a replay
                got = None  # (held into the next step, a replay's gradients would be copied from then on)
                loss = step(fn)
                got = grads(module)
            res[name][f"err {key}"] = max([max_diff(loss, ref_loss)] + [max_diff(got[n], g) for n, g in ref_grads.items()])
            del got
            if a.profile:  # the profiler slows what runs after it: a run of its own, without timings
                if name in WARM:
                    host = a.host_profiles.setdefault(key, {}).setdefault(name, {})
                    a.profiles.setdefault(key, {})[name] = _profile(lambda: step(fn), a, dev, host)
                continue
            timed = module if a.zero_grad else None
            step(fn, timed)  # gradients exist from here on, accumulated into (unless --zero-grad)
            res[name][f"{key} ms/step"] = per_call_us(lambda: step(fn, timed), a, dev, iters=20 if dev.type == "cuda" else 1) / 1e3
            # one step from an idle GPU: near the step time, the step is host-bound
            res[name][f"{key} host ms/step"] = timing.host_time_us(lambda: step(fn, timed), dev, iters=1, reps=5) / 1e3
            # a self-graphing variant's pool is allocated when it records: not seen by one replay
            if dev.type == "cuda" and name not in SELF_GRAPHED:
                timing.sync(dev)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(fn)
                timing.sync(dev)
                res[name][f"{key} peak MiB above weights"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if key in a.trace:  # traced after every variant's timings: the profiler slows what runs after it
                kept[name] = (fn, module)
        except Exception as e:
            failed[f"{name}, {key}"] = _why(e)
        finally:
            if module is not None:
                module.zero_grad(set_to_none=True)
            del fn, module
    if a.profile:
        return
    if kept:
        trace_steps(key, {n: (lambda fn=fn: step(fn)) for n, (fn, _) in kept.items()}, a, dev, res, failed)
        for _, module in kept.values():
            module.zero_grad(set_to_none=True)
        kept.clear()

    def first_call(name):
        fn, module = make(name)
        t = timing.wall_time_s(lambda: step(fn), dev)
        module.zero_grad(set_to_none=True)
        return t
    warm_compiles(key, variants, res, failed, first_call)


def _profile(step, a, dev, host) -> dict:
    """{kernel: [µs, launches]} per step over a.profile steps, each started with the ranks in step
    (else a comm kernel's time holds its wait for a late rank)."""
    from bench.profile_model import profile_step  # (imported late: it sets cache folders where unset)

    def synced():
        timing.sync(dev)
        dist.barrier()
        step()
    return profile_step(synced, a.profile, dev.type, host)


def trace_steps(key, steps: dict, a, dev, res, failed):
    """One step of each variant under torch.profiler, with the ranks started together: a Chrome
    trace per rank in a.trace_dir, the exposed comm share of the step (bench/trace_summary.py) into
    res, and on rank 0 a line per variant and, where matplotlib is, the step's timeline (PNG)."""
    from torch.profiler import ProfilerActivity, profile
    rank = dist.get_rank()
    os.makedirs(a.trace_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name, fn in steps.items():
        try:
            with torch.no_grad() if key == "decode" else contextlib.nullcontext():
                fn()  # warm: a self-graphing variant replays
                timing.sync(dev)
                dist.barrier()
                with profile(activities=activities) as prof:
                    fn()
                    timing.sync(dev)
            stem = os.path.join(a.trace_dir, f"{key}_{name.replace(' ', '_')}_rank{rank}")
            path = stem + ".json.gz"  # (torch gzips it; Perfetto opens it as is)
            prof.export_chrome_trace(path)
            s = trace_summary.summarize(path)
            res[name][f"{key} exposed comm %"] = 100 * s["exposed share"]
            res[name][f"{key} traced step µs"] = s["step µs"]
            if rank == 0:
                print(trace_summary.line(f"{key}, {name}, rank 0 ({path})", s), flush=True)
                try:
                    from bench import plot
                except ImportError:  # no matplotlib: bench/plot.py draws it where there is
                    continue
                plot.timeline(path, f"{key}, {name}, rank 0", stem + "_timeline.png")
        except Exception as e:
            failed[f"{name}, {key} trace"] = _why(e)


def warm_compiles(key, variants, res, failed, first_call):
    """Compile time with the on-disk caches that the cold compiles filled: Dynamo forgets its
    compiled code (torch._dynamo.reset(), which also invalidates every variant compiled before;
    run it last), and first_call(name) builds the variant and times its first call."""
    for name in WARM:
        if f"compile {key} s" not in res.get(name, {}):
            continue
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.compilation_time_metrics.clear()
            before = len(backend.summaries)
            with _profiled(f"warm_{key}_{name}"):
                res[name][f"warm compile {key} s"] = first_call(name)
            if name.startswith("commfuse"):  # in the JSON: which cache did the graphs come from?
                summaries = backend.summaries[before:]
                for source in ("graph", "AOTAutograd"):
                    found = sum(s.get("cache") == source for s in summaries)
                    res[name][f"warm compile {key} from the {source} cache"] = found / max(len(summaries), 1)
        except Exception as e:
            failed[f"{name}, warm compile {key}"] = _why(e)


@contextlib.contextmanager
def _profiled(what: str):
    """With MODEL_TP_CPROFILE=<folder>: rank 0's `what` (a workload's cold or warm compile, a
    decode loop's host time) under cProfile, with Dynamo's phase times, written there (where its
    host time goes)."""
    folder = os.environ.get("MODEL_TP_CPROFILE")
    if not folder or dist.get_rank() != 0:
        yield
        return
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{what.replace(' ', '_')}.txt"), "w") as f:
            f.write(str(torch._dynamo.utils.compile_times()) + "\n\n")
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(80)


def _why(e: Exception) -> str:
    if os.environ.get("MODEL_TP_TRACEBACK"):
        traceback.print_exc()
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


# ------------------------------------------------------------------------------------------- main
def add_size_args(ap, full, tiny) -> None:
    """--cpu, --tiny and an int option per size in `full` (None: `full`'s, or `tiny`'s with --tiny)."""
    ap.add_argument("--cpu", action="store_true", help="gloo ranks on CPU, commfuse in Triton's interpreter (checks the script)")
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions and one round (with --cpu: the smoke test)")
    for k, v in full.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} ({tiny[k]} with --tiny)")


def fill_sizes(a, full, tiny) -> None:
    for k, v in (tiny if a.tiny else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, TINY)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                    help="default bfloat16; float32 with --cpu, where Triton's interpreter truncates casts to "
                         "bf16 that a GPU rounds (the mm template's store): fp32 errors there are exact checks")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; 1 with --tiny)")
    ap.add_argument("--graph-steps", type=int, default=10, help="decode steps per captured CUDA graph")
    ap.add_argument("--fsdp-shape", default="", metavar="KEY=N,...",
                    help="fsdp: override its shape (keys: " + ", ".join(FSDP_FULL) + "), e.g. hidden=2048,ffn=5632,seq=1024")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in OPT_IN), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--workloads", default="decode,train,sp,fsdp", help="comma-separated subset of: " + ", ".join(WORKLOADS))
    ap.add_argument("--pos", type=int, default=None,
                    help="decode: the position each timed step writes (default: the cache's middle); the prefix "
                         "floor reads the cache up to it")
    ap.add_argument("--sweep", default="", metavar="B:C,...",
                    help="after the workloads, decode again at each batch B and cache length C listed (e.g. "
                         "1:2048,32:2048,8:512,8:8192), its own model each: GPU time, per call, floors, error")
    ap.add_argument("--sweep-variants", default="inductor,commfuse", help="the variants --sweep runs (default: %(default)s)")
    ap.add_argument("--kernels", action="store_true",
                    help="decode: commfuse's step per kernel (time, bytes of its arguments, GB/s against the "
                         "measured read bandwidth), rank 0's, under the table")
    ap.add_argument("--trace", nargs="?", const="all", default="", metavar="WORKLOADS",
                    help="after each workload's timings (or those listed), one step of each variant under "
                         "torch.profiler: a Chrome trace per rank (--trace-dir), its exposed comm share in the table, "
                         "a PNG timeline where matplotlib is (else: python bench/plot.py TRACE.json.gz)")
    ap.add_argument("--trace-dir", help="folder for the traces (default: beside --out, else ./model_tp_traces)")
    ap.add_argument("--out", help="also write the table here, and the figures as JSON beside it")
    ap.add_argument("--zero-grad", action="store_true",
                    help="timed training steps set gradients to None first (torchtitan's loop), not accumulate into them")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="training: profile STEPS steps of Inductor and commfuse instead of timing them, and "
                         "write rank 0's GPU time per kernel and host time per op beside --out (OUT_profile.md), as "
                         "bench/profile_model.py does")
    a = ap.parse_args(argv)
    a.profiles, a.host_profiles, a.scales, a.kernel_tables = {}, {}, {}, {}
    fill_sizes(a, FULL, TINY)
    a.pos_arg = a.pos
    a.pos = a.cache // 2 if a.pos is None else a.pos
    try:
        sweep = [tuple(map(int, c.split(":"))) for c in a.sweep.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--sweep {a.sweep!r}: B:C pairs, comma-separated")
    a.sweep_keys = [f"decode B={b} C={c}" for b, c in sweep]
    for c in [a.cache] + [c for _, c in sweep]:
        if not 4 <= (c // 2 if a.pos_arg is None else a.pos_arg) + 1 <= c:
            ap.error(f"--pos {a.pos_arg}: the 4 checked decode steps end there, within the cache of {c}")
    a.trace_dir = a.trace_dir or (os.path.splitext(a.out)[0] + "_traces" if a.out else "model_tp_traces")
    a.fsdp = dict(FSDP_TINY if a.tiny else FSDP_FULL)
    for item in filter(None, a.fsdp_shape.split(",")):
        k, _, v = item.partition("=")
        if k not in a.fsdp or not v.isdigit():
            ap.error(f"--fsdp-shape {item!r}: expected KEY=INT with KEY one of {', '.join(a.fsdp)}")
        a.fsdp[k] = int(v)
    a.rounds = a.rounds or (1 if a.tiny else 3)
    a.dtype_name = a.dtype or ("float32" if a.cpu else "bfloat16")
    a.dtype = getattr(torch, a.dtype_name)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.sweep_variants = [v.strip() for v in a.sweep_variants.split(",") if v.strip()]
    unknown = sorted(set(variants + a.sweep_variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}")
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    a.trace = workloads if a.trace == "all" else [w.strip() for w in a.trace.split(",") if w.strip()]  # (a list: JSON)
    if set(a.trace) - set(WORKLOADS):
        ap.error(f"unknown workloads to trace {sorted(set(a.trace) - set(WORKLOADS))}")
    if set(workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}")
    if "train" in workloads and a.seq > a.cache:
        ap.error(f"TP training (S={a.seq}) uses the decode model's rotary table, of {a.cache} positions: --cache >= --seq")
    if "WORLD_SIZE" not in os.environ:
        ap.error("run it under torchrun: torchrun --standalone --nproc-per-node 2 bench/model_tp.py")
    # cold compile means empty on-disk caches (both are read when compiling, not at import): a
    # fresh folder per rank unless the caller chose one
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "COMMFUSE_CACHE_DIR"):
        if var not in os.environ:
            os.environ[var] = tempfile.mkdtemp(prefix=f"model_tp_{var.split('_')[0].lower()}_r{os.environ.get('LOCAL_RANK', '0')}_")
    use_cuda = not a.cpu
    if use_cuda and not torch.cuda.is_available():
        ap.error("no GPU here: use --cpu --tiny to check the script on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if a.heads % world or a.kv_heads % world or a.ffn % world:
        ap.error(f"heads, KV heads and F must divide among {world} ranks")
    # every variant keeps its graphs on the same code objects, for each workload
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(VARIANTS))

    model = build(a, world, dev) if {"decode", "train"} & set(workloads) else None
    columns = variants + [v for v in a.sweep_variants if sweep and v not in variants]
    res, failed = {v: {} for v in columns}, {}
    status = 0
    jobs = workloads + list(zip(a.sweep_keys, sweep))
    for i, w in enumerate(jobs):
        if isinstance(w, tuple):  # a --sweep configuration: a model of its own
            model, sa = None, copy.copy(a)  # (sharing the dicts the figures go to)
            sa.batch, sa.cache = w[1]
            sa.pos = sa.cache // 2 if a.pos_arg is None else a.pos_arg
            try:
                decode(build(sa, world, dev), sa, dev, a.sweep_variants, res, failed, key=w[0])
            except Exception as e:  # (out of memory)
                failed[w[0]] = _why(e)
        elif w == "decode":
            decode(model, a, dev, variants, res, failed)
        elif w == "train":
            train(model, a, dev, variants, res, failed)
        elif w == "sp":
            sp_train(a, dev, variants, res, failed)
        elif w == "fsdp":
            fsdp_train(a, dev, variants, res, failed)
        status = report(a, res, failed, columns, dev, final=i == len(jobs) - 1)  # kept if a later one hangs
    status_t = torch.tensor([status], device=dev)
    dist.broadcast(status_t, 0)
    dist.barrier()
    dist.destroy_process_group()
    return int(status_t.item())


if __name__ == "__main__":
    sys.exit(main())
