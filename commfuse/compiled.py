"""A compiled graph as AOTAutograd receives it, and as AOTAutograd's cache keeps it.

Our graph cache (graph_cache.py) skips lowering, but a warm start would still spend longer in
AOTAutograd's trace and partition than in loading. AOTAutograd caches its whole result, the
forward/backward split and runtime wrappers with the compiled graphs, for a compiler that returns
an `OutputCode` which pickles (its "bundled" mode). `CompiledGraph` is ours: it pickles as what
generated the code (`Generated`), with the aten graph of one that has comm buffers pickled beside
it (what it reruns where the plan check sends its group to c10d), and loads again in `post_compile`.
AOTAutograd's key covers the Dynamo graph, the inputs, grad and autocast modes and torch's configs;
`aot_caching` adds, as `cache_key_tag`, what our key covers besides (config, commfuse's files,
versions, devices, the distributed context).
"""
from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import itertools
import json
import logging
import pickle
import re
import sys
import time

import torch
from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache, check_cacheable,
                                                          should_use_local_autograd_cache)
from torch._functorch.aot_autograd import SerializableAOTDispatchCompiler
from torch._inductor.output_code import OutputCode

from . import choices, config, dump, graph_cache
from .runtime import precompile
from .runtime.cudagraphs import CudaGraphed
from .runtime.loader import check_triton_mode, load_module
from .runtime.plan_check import PlansSplit

log = logging.getLogger("commfuse")
summaries: list[dict] = []  # every graph this process compiled, loaded or fell back on, in order (as summary.json)
_graph_counter = itertools.count()


def next_graph_id(kind: str, digest: str) -> str:
    return f"g{next(_graph_counter):03d}_{kind}_{digest}"


class CompiledGraph(OutputCode):
    """The boxed callable AOTAutograd calls: `compiled(args_list)`."""
    __eq__, __hash__ = object.__eq__, object.__hash__  # OutputCode is a dataclass: by identity
    donation_at_first_call, donating = False, None  # a backward's choice, see `kept`
    aten_pickle = None  # the aten graph, as AOTAutograd's cache kept it (`_aten_graph`)

    def __init__(self, gen: graph_cache.Generated, kind: str, roles, cache_key: str | None):
        self._boxed_call = True  # on the instance: wrappers (Dynamo's `disable`) copy its __dict__
        self.gen, self.kind, self.roles, self.cache_key = gen, kind, roles, cache_key
        self.call = None

    def load(self, started: float, cache: str | None, skipped: str | None = None) -> CompiledGraph:
        """Load the generated module; `cache`: the one it came from, None where it was compiled."""
        gen = self.gen
        for level, message in gen.messages if cache else ():  # what compiling it said, said again
            log.log(level, "%s", message)
        check_triton_mode(gen.computed_device_types)
        self.module, self.path = load_module(gen.source, gen.constants)
        self.pending = precompile.start(self.module)  # lowering the next graph overlaps with these compiles
        self.graph_id, self.call = gen.graph_id, self.module.call
        # the backend gives the aten graph a failed first run may rerun, and how to lower it again
        self.ran, self.aten_gm, self.regenerate = False, None, None
        if self.roles is not None:  # CUDA-graph mode, and the graph is all on CUDA
            launches = len(gen.summary["kernels"]) + len(gen.summary["extern_calls"])
            policy = choices.current()
            self.call = CudaGraphed(self.call, gen.graph_id, self.roles, policy.cuda_graph_captures(),
                                    policy.cuda_graph_copy_limit(launches), policy.cuda_graph_paid_replays())
        seconds = time.time() - started
        self._time_taken_ns = int(seconds * 1e9)
        self.summary = {"graph_id": gen.graph_id, **gen.summary, "compile_seconds": round(seconds, 3),
                        "cache_hit": cache is not None, "cache": cache, "cache_key": self.cache_key,
                        **({"cache_skipped": skipped} if skipped else {})}
        summaries.append(self.summary)
        dump.publish(gen.graph_id, gen.source, gen.pre_fusion, gen.post_fusion, self.summary)
        stats = getattr(gen, "stats", {})  # compiled here: the stages' seconds; the rest is rewrites, key, load
        stages = {} if cache else {**stats.get("seconds", {}), "other": seconds - sum(stats.get("seconds", {}).values())}
        dump.progress(gen.graph_id, self.summary, stats.get("nodes"), stages, cache)
        if config.debug:
            log.warning("commfuse: %s %s: %d kernels, %d extern calls (not lowered: %s) -> %s", gen.graph_id,
                        f"loaded from the {cache} cache" if cache else "compiled", len(gen.summary["kernels"]),
                        len(gen.summary["extern_calls"]), gen.summary["fallback_reasons"] or "none", self.path)
        return self

    def __call__(self, args):
        if self.pending is not None:
            self.pending = self.pending.wait()
        if self.donation_at_first_call:
            self.kept(args)
        if self.ran:
            return self.call(args)
        inputs = list(args)  # the call clears `args`: kept, should the first run be rerun through aten
        try:
            out = self.call(args)
        except PlansSplit as e:  # met no peer and ran nothing: lowered again, c10d on the group
            if self.cache_key:
                graph_cache.pass_over(self.cache_key, f"its ranks cut their graphs apart on group {e.group}")
            log.log(logging.WARNING if e.found else logging.INFO, "%s", e)
            if self.regenerate is None and self._aten_graph() is None:
                e.add_note("commfuse: this graph came from AOTAutograd's cache, with no graph to lower again; "
                           "the next start compiles it afresh")
                raise
            if self.regenerate is None:  # from AOTAutograd's cache: its c10d collectives meet the peers' in order
                self.summary.update(compiled=False, comm_fallbacks=[{"reason": f"{e}; from AOTAutograd's cache, "
                                                                     "it runs through aten in this process"}])
                return self._through_aten()(inputs)
            fresh, self.regenerate = self.regenerate(), None
            self.module, self.path, self.call, self.pending = fresh.module, fresh.path, fresh.call, fresh.pending
            return self(inputs)
        except Exception as e:
            rerun = self._first_run_failed(e)
            if rerun is None:
                raise
            return rerun(inputs)
        self.ran, self.aten_gm, self.aten_pickle, self.regenerate = True, None, None, None
        return out

    def _aten_graph(self) -> torch.fx.GraphModule | None:
        """The aten graph to rerun: this process's, or the one AOTAutograd's cache kept (None where
        it could not be pickled or loaded)."""
        if self.aten_gm is None and self.aten_pickle is not None:
            with contextlib.suppress(Exception):
                self.aten_gm = pickle.loads(self.aten_pickle)
            self.aten_pickle = None
        return self.aten_gm

    def _through_aten(self):
        """From now on, the aten graph runs, op by op, in the output strides the compiled graph reported."""
        strides = self.gen.summary.get("output_strides")
        aten, self.aten_gm, self.ran = AtenGraph(self.aten_gm), None, True
        self.call = lambda args: _in_strides(aten(args), strides)
        return self.call

    def _first_run_failed(self, e: Exception):
        """A first run that raised: where, and the aten graph to rerun it by (None: why not, in a
        note on `e`). Not past a line that wrote an input (the update would apply twice) or met
        the other ranks (this one would meet them again, on another path)."""
        op, done = _failure_site(e, self.path, self.gen.source)
        where = f"commfuse: graph {self.graph_id} failed at its first run, in {op}"
        why = ("fallback_on_error is off" if not config.fallback_on_error else
               f"it had already run a line that {done[-1]}" if done else
               "its all-reduces meet the peers in symmetric memory" if hasattr(self.module, "_setup_comm") else
               "it came from AOTAutograd's cache, without its aten graph" if self._aten_graph() is None else None)
        if why is not None:
            note = f"{where}; not rerun through aten: {why}"
            e.add_note(note) if hasattr(e, "add_note") else log.error(note)  # Python 3.10 has no notes
            return None
        def rerun(args):
            out = _in_strides(AtenGraph(self.aten_gm)(args), self.gen.summary.get("output_strides"))
            # it ran: the error was ours, not the program's (that one would have raised again)
            log.warning("%s (%s: %s); it runs through aten, op by op, from now on. Set "
                        "fallback_on_error=False to raise instead.", where, type(e).__name__, e)
            self.summary.update(compiled=False, first_run_error=f"{op}: {type(e).__name__}: {e}")
            if self.cache_key:
                graph_cache.pass_over(self.cache_key, f"its first run failed ({self.summary['first_run_error']})")
            self._through_aten()
            return out
        return rerun

    def kept(self, args: list) -> None:
        """AOTAutograd's rule for a backward compiled at its first call (backend._donation_at_first_call):
        saved tensors are donated unless that call keeps the graph (`retain_graph=True`), and once
        donated, a kept graph is refused. Where it is not refused, our writes over donated inputs
        go to copies: the next backward reads the saved tensors again."""
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        if self.donating is None:
            self.donating = not keep
        if not keep:
            return
        if self.donating and torch._functorch.config.donated_buffer:  # AOTAutograd's own words
            raise RuntimeError(
                "This backward function was compiled with non-empty donated buffers which requires "
                "create_graph=False and retain_graph=False. Please keep backward(create_graph=False, "
                "retain_graph=False) across all backward() function calls, or set "
                "torch._functorch.config.donated_buffer=False to disable donated buffer.")
        for i in self.gen.summary.get("overwritten_inputs", ()):
            t = args[i]
            args[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)

    # ---- AOTAutograd's cache: pickled (a copy, after prepare_for_serialization), loaded on a hit
    def __getstate__(self):
        return {"gen": self.gen, "kind": self.kind, "roles": self.roles, "cache_key": self.cache_key,
                "donation_at_first_call": self.donation_at_first_call, "aten_gm": getattr(self, "aten_gm", None),
                "aten_pickle": getattr(self, "aten_pickle", None)}

    def __setstate__(self, state):
        self.__dict__.update(state, _boxed_call=True, call=None)

    def prepare_for_serialization(self) -> None:
        try:
            constants = {n: graph_cache.constant_ref(None, n, v) for n, v in self.gen.constants.items()}
        except graph_cache.Uncacheable as e:
            raise BypassAOTAutogradCache(f"commfuse: {e}") from e
        self.gen = dataclasses.replace(self.gen, constants=constants)
        with contextlib.suppress(Exception):  # as its code (GraphModule's pickling), loaded where a rerun needs it;
            # only with comm pools, which a cut apart needs (40-100 ms for a graph of 700-1500 nodes)
            self.aten_pickle = pickle.dumps(self.aten_gm) if self.aten_gm is not None and self.gen.summary["comm_pools"] else None
        self.aten_gm = None  # (an attribute that does not pickle: no rerun)

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.call is not None:  # compiled in this process, already loaded
            return
        if self.cache_key and (why := graph_cache.passed_over(self.cache_key)):
            # compiled afresh, it can be lowered again or rerun through aten if that happens again;
            # nothing else is carried over (the peers may run another program now)
            raise BypassAOTAutogradCache(f"commfuse: in a run before, {why}: compiled again")
        started = time.time()
        graph_id = next_graph_id(self.kind, self.gen.graph_id.rsplit("_", 1)[-1])  # the same on every rank
        self.gen = graph_cache.loaded(self.gen, graph_id, None)
        self.load(started, "AOTAutograd")

    def set_triton_bundle(self, triton_bundle) -> None:
        pass  # Triton keeps its own cache of our kernels


def _failure_site(e: Exception, path: str, source: str) -> tuple[str, list]:
    """(the op a generated module's `call` raised in, as its line names it; the effects it ran
    before that, or at it: the wrapper's `# effect:` marks)."""
    line = None
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == path and code.co_name in ("call", "_call"):
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return "its first call, before any op", []
    lines = source.splitlines()
    text = lines[line - 1].strip()
    start = max(i for i in range(line) if lines[i].startswith("def "))
    done = [x.split("# effect: ", 1)[1] for x in lines[start:line] if x.strip().startswith("# effect: ")]
    launch = re.match(r"(\w+)_launch\d+\(", text)
    return (f"kernel {launch.group(1)}" if launch else f"line {line}: {text[:160]}"), done


def _in_strides(outs, strides):
    """aten's outputs in the strides the compiled graph reported (AOTAutograd gave them to the
    backward's inputs)."""
    if not strides or len(strides) != len(outs):
        return outs
    return [torch.empty_strided(o.shape, s, dtype=o.dtype, device=o.device).copy_(o)
            if s is not None and isinstance(o, torch.Tensor) and o.stride() != tuple(s) else o
            for o, s in zip(outs, strides)]


class AtenGraph(OutputCode):
    """A graph we failed to compile, run op by op through aten. Never cached: the next start
    tries to compile it again."""
    __eq__, __hash__ = object.__eq__, object.__hash__

    def __init__(self, gm: torch.fx.GraphModule):
        self._boxed_call, self.gm = True, gm

    def __call__(self, args):
        return torch.fx.Interpreter(self.gm).boxed_run(args)

    def prepare_for_serialization(self) -> None:
        raise BypassAOTAutogradCache("commfuse runs this graph through aten")


def serializable(compile_fn):
    """`compile_fn` as AOTAutograd recognises a compiler whose results its cache may keep."""
    return SerializableAOTDispatchCompiler(CompiledGraph, compile_fn)


@contextlib.contextmanager
def aot_caching(gm: torch.fx.GraphModule, example_inputs, at_break: bool | None):
    """Within: AOTAutograd's cache keeps and finds the compile of Dynamo's graph `gm`, under our
    own key besides its own (with `at_break`, baked into the code). Yields whether it does: not
    where our graph cache is off, not with dumps (they need the aten graphs), not where either key
    cannot describe the graph or its context. The backward then compiles with its forward:
    AOTAutograd saves the pair at the backward's compile, otherwise later, outside this context."""
    on = config.graph_cache and not config.dump_dir and should_use_local_autograd_cache()
    try:
        closures = _dtensor_closures(gm) if on else {}
        marked = {**torch._inductor.config.unsafe_marked_cacheable_functions, **closures}  # the user's kept
        if on:  # else the backward compiles when first needed, as without the cache
            with torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked):
                check_cacheable(gm)
        # the cache folder too: a new one starts afresh
        tag = on and graph_cache.digest(json.dumps([graph_cache.cache_dir(), graph_cache.context(example_inputs),
                                                    closures, _meshes(example_inputs), _shared_storages(example_inputs),
                                                    [_subclasses(x) for x in example_inputs], at_break], sort_keys=True))
    except Exception as e:  # a graph or context either key cannot describe
        log.debug("commfuse: not in AOTAutograd's cache: %s: %s", type(e).__name__, e)
        tag = None
    if not tag:
        yield False
        return
    with torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True), \
            torch.compiler.config.patch(cache_key_tag=f"{torch.compiler.config.cache_key_tag}commfuse:{tag}"), \
            torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked), \
            _meshes_pickled_without_their_hash():
        yield True


def _shared_storages(example_inputs) -> list:
    """Inputs that view one storage, each as (its index, its storage's number, the storage's bytes, its offset).
    AOTAutograd compiles them over one synthetic base of the storage's size, which its key leaves
    out: the entry of `b, b[:, :]`, found for `b[:4], b[2:6]`, read a base of another size."""
    plain = {i: x for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)
             and not torch.utils._python_dispatch.is_traceable_wrapper_subclass(x)}
    ids = [x.untyped_storage()._cdata for x in plain.values()]
    return [[i, ids.index(ids[n]), str(x.untyped_storage().nbytes()), str(x.storage_offset())]
            for n, (i, x) in enumerate(plain.items()) if ids.count(ids[n]) > 1]


def _subclasses(x):
    """A tensor subclass input and, recursively, those of its inner tensors (None: a plain tensor or
    not a tensor). AOTAutograd's key does not tell a DTensor over an AsyncCollectiveTensor (the
    output of an async redistribute) from one over a plain tensor: the entry of one, found for the
    other, unwrapped `.elem` of a plain tensor."""
    if not torch.utils._python_dispatch.is_traceable_wrapper_subclass(x):
        return None
    inner, _ = x.__tensor_flatten__()
    return [f"{type(x).__module__}.{type(x).__qualname__}", [_subclasses(getattr(x, a)) for a in inner]]


def _meshes(example_inputs) -> list:
    """The meshes of the inputs (DTensors', or a DeviceMesh itself) by ranks and process groups:
    AOTAutograd's key knows a mesh by its ranks and dimension names, and a mesh over the same
    ranks on another process group found the graph whose collectives run on the first group."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())  # none unless imported
    found = [graph_cache.mesh_description(x.device_mesh if isinstance(x, dtensor) else x) for x in example_inputs]
    return [mesh for mesh in found if mesh is not None]


_DTENSOR_CLOSURES = ("torch._dynamo.variables.torch.prim from_local", "torch._dynamo.variables.tensor.prim_redistribute",
                     "torch._dynamo.variables.tensor.prim_to_local", "commfuse.passes.dtensor_params.from_local")


def _dtensor_closures(gm) -> dict:
    """Before torch 2.13, Dynamo puts DTensor's from_local, redistribute and to_local in the graph
    as closures over their constant arguments (mesh, placements); dtensor_params does so in every
    version. AOTAutograd's cache refuses them, and could not name them in its key (pickle finds no
    local function). Each is named here by what it binds, as an attribute of this module (kept for
    the process: one per meaning), and marked cacheable under that digest: {its name: the digest}."""
    marked = {}
    for node in gm.graph.nodes:
        fn = node.target
        if node.op == "call_function" and f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}" in _DTENSOR_CLOSURES:
            bound = json.dumps([fn.__name__, graph_cache.plain_value([c.cell_contents for c in fn.__closure__], {})])
            if " object>" in bound:  # named by its address alone: no key can tell two apart
                raise graph_cache.Uncacheable(f"{fn.__name__} binds {bound}")
            bound = graph_cache.digest(bound)
            name = f"_dtensor_{fn.__name__.split('_')[-1]}_{bound[:16]}"
            if globals().setdefault(name, fn) is fn:  # where pickle and FX's import lines find it
                fn.__name__ = fn.__qualname__ = name
                fn.__module__, fn.commfuse_bound = __name__, bound
            node.target = fn = globals()[name]  # one per meaning: the same arguments bound
        if getattr(fn, "commfuse_bound", None):
            marked[f"{fn.__module__}.{fn.__name__}"] = fn.commfuse_bound
    if marked:
        gm.recompile()
    return marked


@contextlib.contextmanager
def _meshes_pickled_without_their_hash():
    """A DeviceMesh pickles its cached hash(), which varies with PYTHONHASHSEED. AOTAutograd's key
    of a DTensor graph, whose inputs hold the mesh, then differed in every process; the keying
    pickler starts from copyreg's table, so within: everything else of the mesh, as it pickles."""
    from torch.distributed.device_mesh import DeviceMesh

    def reduce(mesh):
        rebuild, args, state, *rest = mesh.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return (rebuild, args, {k: v for k, v in state.items() if k != "_hash"}, *rest)
    copyreg.dispatch_table[DeviceMesh] = reduce
    try:
        yield
    finally:
        copyreg.dispatch_table.pop(DeviceMesh, None)
