"""The `commfuse` torch.compile backend.

Dynamo hands us a torch-level FX graph; AOTAutograd traces it to aten forward (and
backward) graphs with our decomposition table; each aten graph is compiled by
`compile_graph`: lower -> schedule/fuse -> generate Triton + wrapper -> load.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import re
import time
import weakref

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.compile_utils import fx_graph_cse, rand_ops
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

from commfuse.codegen.wrapper import WrapperCodegen

from . import choices, config, dump, graph_cache, ir, sizevars
from .compiled import AtenGraph, CompiledGraph, aot_caching, next_graph_id, serializable, summaries  # noqa: F401
from .passes.async_tp import async_tp
from .passes.attention import contiguous_masks, use_decode_attention, use_sdpa_gqa
from .passes.bucketing import bucket_collectives, bucketable_groups
from .passes.comm_sums import all_reduce_sums, summable_groups
from .decompositions import decomposition_table
from .passes.dtensor_params import call_with_shards, local_shard_inputs
from .passes.fx_rewrite import copied, program_collectives
from .graph import GraphLowering
from .passes.host_scalars import scalars_to_device
from .passes.one_hot import sum_one_hot
from .passes.reinplace import reinplace_input_updates
from .passes.saved_order import saved_in_runtime_order
from .remat import cross_kernel_bytes
from .runtime import precompile
from .runtime.plan_check import announce
from .runtime.cudagraphs import input_roles
from .scheduler import Scheduler
from .virtualized import V

log = logging.getLogger("commfuse")


def commfuse_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                     mode: str | None = None):
    """Entry point registered as `backend="commfuse"`."""
    options = dict(options or {})
    if mode == "reduce-overhead":
        options.setdefault("cuda_graphs", True)
    elif mode in ("max-autotune", "max-autotune-no-cudagraphs"):  # Inductor's autotuning: ours is by tables
        log.warning("commfuse: mode=%r is not supported; compiling with defaults", mode)
    elif mode not in (None, "default"):  # a typo, as Inductor refuses one
        raise ValueError(f"commfuse: unknown mode={mode!r}; commfuse takes 'default' and 'reduce-overhead' "
                         "(CUDA graphs), and compiles Inductor's 'max-autotune' modes with its defaults")
    options = _from_inductor(options)
    config.check_names(options)
    announce()
    settings = {**config.snapshot(), **options}
    if settings["sdpa_gqa"]:
        use_sdpa_gqa(gm)
    contiguous_masks(gm)
    with config.patch(settings):
        use_decode_attention(gm)
    inputs, shards = local_shard_inputs(gm, example_inputs)
    at_break = _ends_at_graph_break()  # (a backward compiles later, outside Dynamo's trace)
    with config.patch(settings), aot_caching(gm, example_inputs, at_break) as cached:
        precompile.warm()  # the workers start while AOTAutograd traces the graph

        def compiler(kind):
            def compile_fn(graph_module, inputs):
                graph_module.meta["commfuse_break"] = at_break
                with config.patch(settings):
                    return compile_graph(graph_module, inputs, kind)
            return serializable(compile_fn) if cached else compile_fn

        # Dynamo's own AOTAutograd entry for backends, not aot_module_simplified directly: DDP's graph
        # split (DDPOptimizer) learns from it that AOTAutograd compiled a bucket, and then makes the
        # fake first call whose fake outputs a user would otherwise receive from the first real one.
        return call_with_shards(aot_autograd(
            fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            decompositions=decomposition_table(tuple(sorted(settings["fallback_ops"]))),
            partition_fn=_partition,
            keep_inference_input_mutations=True,
        )(gm, inputs), shards)


def _ends_at_graph_break() -> bool | None:
    """Did Dynamo end the graph it is compiling at a graph break (the frame goes on in another
    graph)? The plan check tells a cut on one rank from extra collectives by it. None outside a
    Dynamo trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return bool(InstructionTranslator.current_tx().output.compile_subgraph_reason.graph_break)
    except Exception:  # no trace running, or another torch's internals: unknown
        return None


def graph_id_for(gm: torch.fx.GraphModule, kind: str) -> str:
    """Stable across ranks running the same program: a counter plus the graph's code, with the
    rank's own device index taken out (each rank runs on its own GPU)."""
    code = re.sub(r"(cuda:)\d+|(index=)\d+", r"\1\2#", gm.code)
    return next_graph_id(kind, hashlib.sha256(code.encode()).hexdigest()[:8])


def _cse_would_merge_draws(gm: torch.fx.GraphModule) -> bool:
    """torch's common-subexpression pass keeps apart only the random ops of its own list: two
    `randn_like(x)` (or `uniform_`, `normal_`, `exponential_` of fresh tensors) become one draw.
    Attention is tagged random for its dropout; with `dropout_p` 0 it draws nothing."""
    def draws(n):
        op = n.target
        if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags \
                or op.overloadpacket in rand_ops:
            return False
        names = [a.name for a in op._schema.arguments]
        if "dropout_p" not in names:
            return True
        i = names.index("dropout_p")
        return (n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", 0.0)) != 0
    return any(draws(n) for n in gm.graph.nodes)


def _cse_would_merge_sizes(gm: torch.fx.GraphModule) -> bool:
    """Two ops whose sizes come from the data (`x[x > 0]` twice) bind two symbols: merged, the
    users of the second keep sizes in a symbol nobody binds (torch's pass spares only item())."""
    return any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes)


def _partition(joint, inputs, **kwargs):
    with torch._functorch.config.patch(cse=not _cse_would_merge_draws(joint) and not _cse_would_merge_sizes(joint)):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
    saved_in_runtime_order(fw, bw, kwargs["num_fwd_outputs"])
    return fw, bw


def compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str = "inference"):
    graph_id = graph_id_for(gm, kind)
    try:
        compiled = _compile(gm, example_inputs, graph_id, kind, donated_inputs(gm, kind), saved_outputs(gm, kind))
        compiled.donation_at_first_call = _donation_at_first_call(kind)
        return compiled
    except Exception as e:
        if not config.fallback_on_error:
            raise
        reason = f"{type(e).__name__}: {e}"
        log.warning("commfuse: graph %s failed to compile (%s); the whole graph runs through aten, "
                    "op by op. Set fallback_on_error=False to raise instead, or list the op in "
                    "fallback_ops to run only it through aten.", graph_id, reason)
        summary = {"graph_id": graph_id, "compiled": False, "fallback_reason": reason}
        summaries.append(summary)
        dump.write(graph_id, {"fx_graph.txt": gm.print_readable(print_output=False)}, summary)
        return AtenGraph(gm)


# The forward's outputs (fake tensors) holding their storage alone among its inputs and outputs:
# saved activations the user cannot see. The backward's placeholders carry the same fake tensors.
_unseen_outputs = weakref.WeakValueDictionary()  # by id: tensors compare elementwise


def donated_inputs(gm: torch.fx.GraphModule, kind: str) -> set:
    """The backward inputs AOTAutograd donates: saved activations aliasing no forward input or
    output, whose references it drops before calling the backward, so the graph's are the last
    ones (none where the backward is compiled at a call that keeps the graph: see
    `_donation_at_first_call`). Its indices are not trusted alone (with effect tokens torch 2.13
    counts them off by one, naming user outputs): each must name a tensor the forward's own graph
    shows nobody else holds."""
    if kind == "forward":
        def vals(op):
            nodes = gm.graph.find_nodes(op=op)
            nodes = nodes[0].args[0] if op == "output" else nodes
            return [v for n in nodes if isinstance(n, torch.fx.Node) and isinstance(v := n.meta.get("val"), torch.Tensor)
                    and v.layout == torch.strided]
        inputs, outputs = vals("placeholder"), vals("output")
        holders = collections.Counter(StorageWeakRef(v.untyped_storage()) for v in inputs + outputs)
        _unseen_outputs.update((id(v), v) for v in outputs if holders[StorageWeakRef(v.untyped_storage())] == 1)
    ctx = torch._guards.TracingContext.try_get()
    if kind != "backward" or ctx is None or ctx.fw_metadata is None:
        return set()
    placeholders = [(n.name, n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    return {name for name, v in map(placeholders.__getitem__, ctx.fw_metadata.bw_donated_idxs or ())
            if _unseen_outputs.get(id(v)) is v}


def _donation_at_first_call(kind: str) -> bool:
    """AOTAutograd compiles a backward at its first call, and donates saved tensors unless that call
    keeps the graph (`retain_graph=True`); once it has, it refuses a kept graph. We compile the
    backward with its forward where AOTAutograd's cache stores the pair (compiled.aot_caching), before
    that call: the check then moves to the graph, which makes the same choice at its first call
    (`CompiledGraph.kept`). A backward AOTAutograd itself compiles early (sizes saved for it) keeps
    its check, as under Inductor."""
    ctx = torch._guards.TracingContext.try_get()
    meta = ctx.fw_metadata if ctx is not None else None
    if kind != "backward" or meta is None or not meta.bw_donated_idxs \
            or getattr(meta, "num_symints_saved_for_bw", 0) or not torch._functorch.config.force_non_lazy_backward_lowering:
        return False
    meta.bw_donated_idxs.clear()  # the list the runtime's own check reads (outer and inner metadata share it)
    return True


def saved_outputs(gm: torch.fx.GraphModule, kind: str) -> tuple:
    """The forward's outputs that only its backward reads (saved activations), where AOTAutograd
    takes the output strides we report and restrides the backward's inputs to them: their layout
    is ours to choose."""
    ctx = torch._guards.TracingContext.try_get()
    if kind != "forward" or ctx is None or ctx.fw_metadata is None or ctx.output_strides is None \
            or ctx.fw_metadata.tokens:
        return ()
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    return tuple(range(len(outputs))[ctx.fw_metadata.tensors_saved_for_backwards_slice])


def _compile(gm, example_inputs, graph_id, kind="inference", donated=frozenset(), saved=()):
    t0 = time.time()
    if kind == "inference" and not _cse_would_merge_draws(gm) and not _cse_would_merge_sizes(gm):  # as the partitioner for training
        gm.graph = fx_graph_cse(gm.graph)  # layers that each compute the same mask: one buffer
        gm.recompile()
    scalars_to_device(gm)
    reinplace_input_updates(gm)
    sum_one_hot(gm)
    program = copied(gm) if program_collectives(gm) else gm  # what a rerun through aten or c10d issues
    program = program if _rewrite_collectives(gm) else gm
    key, description, gen, skipped = _cached(gm, example_inputs, graph_id, kind, donated, saved)
    hit = gen is not None
    if not hit:
        gen = _generate(gm, example_inputs, graph_id, kind, donated, saved)
        if key is not None:
            skipped = graph_cache.store(key, description, gm, gen)
            key = None if skipped else key
    roles = input_roles(gm, kind) if config.cuda_graphs and gen.device_types == {"cuda"} \
        and not gen.summary.get("data_dependent_sizes") else None  # sizes a replay could not change
    compiled = CompiledGraph(gen, kind, roles, key).load(t0, "graph" if hit else None, skipped)
    compiled.aten_gm = program  # what a failed first run reruns
    if gen.summary["comm_pools"] or gm.meta["commfuse_checked"]:  # after a plan check sent a group to c10d
        settings = config.snapshot()
        compiled.regenerate = lambda: _regenerate(program, example_inputs, graph_id, kind, donated, saved, roles, settings)
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.output_strides is not None and compiled.summary["output_strides"]:
        ctx.output_strides.extend(compiled.summary["output_strides"])
    if config.dump_dir:  # printing the graph costs as much as a cache hit
        dump.write(graph_id, {"fx_graph.txt": gm.print_readable(print_output=False),
                              "ir_pre_fusion.txt": gen.pre_fusion + "\n",
                              "ir_post_fusion.txt": gen.post_fusion,
                              "output_code.py": gen.source}, compiled.summary)
    return compiled


# Inductor's option of the same meaning, for a program written for Inductor
_INDUCTOR_NAMES = {"triton.cudagraphs": "cuda_graphs"}


def _from_inductor(options: dict) -> dict:
    """Options with Inductor's names (`options={"triton.cudagraphs": True}`, `{"max_autotune": True}`)
    as commfuse's: the one of the same meaning renamed, Inductor's others (its tuning, padding,
    tracing) left out with a warning, as mode="max-autotune" is. A name neither has raises."""
    import torch._inductor.config as inductor_config
    ours, theirs = config.snapshot(), inductor_config.get_config_copy()
    inductor = {k: v for k, v in options.items() if k not in ours and (k in _INDUCTOR_NAMES or k in theirs)}
    ignored = sorted(k for k in inductor if k not in _INDUCTOR_NAMES or _INDUCTOR_NAMES[k] in options)
    if ignored:
        log.warning("commfuse: Inductor's option(s) %s have no commfuse meaning and are ignored (docs/config.md)", ignored)
    return {**{k: v for k, v in options.items() if k not in inductor},
            **{_INDUCTOR_NAMES[k]: v for k, v in inductor.items() if k not in ignored}}


def _rewrite_collectives(gm) -> int:
    """Sum, chunk and merge gm's collectives where policy says (each rank on its own graph); how many
    changed. Before: the program's own collectives, and the groups whose collectives a rewrite may
    change on some ranks only, which the ranks check whether they have comm kernels or not."""
    gm.meta["commfuse_program"] = program_collectives(gm)
    gm.meta["commfuse_checked"] = sorted(summable_groups(gm) | bucketable_groups(gm))
    return all_reduce_sums(gm) + async_tp(gm) + bucket_collectives(gm)


def _regenerate(program, example_inputs, graph_id, kind, donated, saved, roles, settings) -> CompiledGraph:
    """The graph lowered again from the program's own collectives under its compile's options,
    rewritten only where its groups' ranks agreed."""
    with config.patch(settings):
        gm = copied(program)
        _rewrite_collectives(gm)
        gen = _generate(gm, example_inputs, graph_id, kind, donated, saved)
        return CompiledGraph(gen, kind, roles, None).load(time.time(), None)


def _cached(gm, example_inputs, graph_id, kind, donated, saved):
    """(key, its description, the cached graph or None on a miss, why the graph has no key)."""
    if not config.graph_cache:
        return None, None, None, None
    try:
        description = graph_cache.describe(gm, example_inputs, kind, donated, saved)
    except graph_cache.Uncacheable as e:
        log.debug("commfuse: graph %s not cached: %s", graph_id, e)
        return None, None, None, str(e)
    except Exception as e:  # a bug in the key: compile without the cache
        if not config.fallback_on_error:
            raise
        log.warning("commfuse: graph %s: no cache key (%s: %s); compiling it", graph_id, type(e).__name__, e)
        return None, None, None, f"no key: {type(e).__name__}: {e}"
    key = graph_cache.digest(description)
    gen = graph_cache.lookup(key, description, gm, graph_id, need_ir=dump.ir_wanted())
    return key, description, gen, None


def _generate(gm, example_inputs, graph_id, kind, donated, saved) -> graph_cache.Generated:
    """Lower, schedule and generate the module's source: what a cache hit skips."""
    t = [time.time()]
    with graph_cache.recording_messages() as messages, choices.install():
        graph = GraphLowering(gm, example_inputs, graph_id, donated, saved, kind).run()
        with V.set_graph(graph):
            want_ir = dump.ir_wanted()  # printing costs
            pre_fusion = "\n".join(str(b) for b in graph.buffers) if want_ir else ""
            t.append(time.time())
            sched = Scheduler(graph)
            t.append(time.time())
            wrapper = WrapperCodegen(graph, sched)
            source = wrapper.generate()
            post_fusion = sched.debug_str() if want_ir else ""
            t.append(time.time())
    summary = {
        "compiled": True,
        "kernels": wrapper.kernel_info,
        "extern_calls": wrapper.extern_calls,
        "fallback_ops": graph.fallback_ops,
        "fallback_reasons": graph.fallback_reasons,
        "data_dependent_sizes": sorted(map(str, graph.symbol_defs)),
        "buffers": wrapper.allocations,
        "comm_plans": [p.record() for p in graph.comm_plans],
        "comm_buffers": list(wrapper.comm_placements.values()),
        "comm_pools": wrapper.pool_summary(),
        "comm_fallbacks": [p.record() for p in graph.comm_plans if p.algorithm.name == "c10d"],
        # what meets the other ranks, in the order it runs (and the ranks check); each c10d
        # collective's step, its wait's, and how the overlap step placed it (commfuse/overlap.py)
        "collective_order": [p["kernel"] for p in wrapper.comm_protocol],
        "c10d_overlap": list(wrapper.c10d.values()),
        "peak_memory_estimate": sched.peak_memory,
        "peak_memory_by_order": sched.peak_memory_by_order,
        "overwritten_inputs": [i for i, n in enumerate(graph.placeholder_names) if n in graph.donated and any(
            n in (a.get("in_place_of"), a.get("reuses")) for a in wrapper.allocations)],  # donated ones
        "cross_kernel_bytes": cross_kernel_bytes(sched),
        "rematerialized": sched.remat_log,
        "mixed_order": sched.mixed,
        # every output's strides, which AOTAutograd gives the backward's inputs (saved_outputs)
        "output_strides": [[int(s) for s in o.layout.stride] if isinstance(o, ir.LaidOut) and
                           all(sizevars.is_static(s) for s in o.layout.stride) else None
                           for o in graph.graph_outputs] if saved else None,
    }
    computed = {b.get_device().type for b in graph.buffers if isinstance(b, ir.ComputedBuffer)}
    gen = graph_cache.Generated(graph_id, source, wrapper.constants, summary, set(graph.device_types),
                                computed, pre_fusion, post_fusion, messages)
    gen.stats = {"nodes": len(gm.graph.nodes), "seconds": dict(zip(("lowering", "scheduling", "codegen"), map(
        float.__sub__, t[1:], t)))}  # for the progress line (compiled.py), not the cache key
    return gen
