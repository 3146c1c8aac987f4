"""GraphLowering: walks an aten FX graph, calls lowering/, owns the buffers.

Every FX node becomes a TensorBox (or a size expression / python value). Ops
without a lowering, and lowerings that raise `Unsupported`, become ExternKernels
calling the aten op, so anything we do not understand still runs.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch._prims_common import is_contiguous_or_false
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from commfuse.codegen.common import TRITON_DTYPES
from commfuse.lowering import load_all, lowerings
from commfuse.lowering.extern import fallback

from . import config, ir, memory, sizevars
from .ir import TensorBox, meta_layout
from .runtime.loader import interpreting
from .virtualized import V

log = logging.getLogger("commfuse")


class LoweringError(RuntimeError):
    """Lowering stopped at an FX node; the message names it."""


class GraphLowering(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, example_inputs, graph_id: str = "graph",
                 donated: set = frozenset(), saved: tuple = (), kind: str = "forward"):
        super().__init__(gm)
        self.graph_id = graph_id
        self.donated = _whole_storages(gm, donated)  # inputs that become DonatedBuffers
        self.channels_last = V.choices.conv_layout(gm)
        self.free_outputs = _free_outputs(gm, saved) if self.channels_last else set()  # FX nodes
        # whether a user-visible output may leave eager's strides: AOTAutograd restrides the
        # backward's inputs to the strides we report (the same value may be saved for it too).
        # Not in DDP's split graphs, whose outputs feed graphs compiled for their fake strides.
        ctx = torch._guards.TracingContext.try_get()
        self.restrided_outputs = (kind == "inference" or bool(saved)) and not (ctx and ctx.fakify_first_call)
        self.buffers: list[ir.Buffer] = []
        self.name_to_buffer: dict[str, ir.Buffer] = {}
        self.graph_inputs: dict[str, Any] = {}       # placeholder name -> InputBuffer / symbol / value
        self.placeholder_names: list[str] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.padded_operands: dict = {}              # matmul operands' zero-padded copies (lowering/matmul.py)
        self.graph_outputs: list = []
        self.comm_plans: list = []                   # every collective, decided (commfuse/collectives.py)
        self.fallback_ops: list[str] = []             # aten ops run as they are, in graph order
        self.fallback_reasons: dict[str, str] = {}    # ... and why each was not lowered
        self.scalar_nodes: list[tuple] = []           # (symbol, fn, args, kwargs) computed at run time (first,
                                                      # unless in symbol_defs: then by an extern in the schedule)
        self.float_scalars: set = set()               # ... those of them that are floats
        self.derived_sizes: dict = {}                 # torch's size with float steps -> its symbol (sizevars)
        self.symbol_defs: dict = {}                   # data-dependent symbol (u0, sv0 after it) -> the extern binding it
        self.device_types: set[str] = set()
        self.random_seeds: dict = {}                  # device -> this call's seed (lowering/random.py)
        self.random_streams = 0                       # random ops lowered: each draws its own stream
        self.example_inputs = example_inputs
        self.size_hints = size_hints(gm, example_inputs)  # read by sizevars.hint, while lowering too
        fake = (ctx and ctx.fake_mode) or torch._guards.detect_fake_mode(example_inputs)
        self.shape_env = getattr(fake, "shape_env", None)  # what Dynamo's guards proved (sizevars.equal)
        self.current_node = None
        self.loops_values: dict = {}  # id(a node's Loops) -> (it, kept alive for a unique id; eager's value)

    # buffers ------------------------------------------------------------------

    def comm_plan(self, buffer: str):
        """The plan whose input is placed in `buffer`, else None."""
        return next((p for p in self.comm_plans if p.buffer == buffer), None)

    def comm_results(self) -> set:
        """Buffers our collectives produce: ordered on the stream, no wait needed."""
        return {p.result for p in self.comm_plans if p.result is not None}

    def register_buffer(self, cls, layout, **fields) -> ir.Buffer:
        name = f"buf{len(self.buffers)}"
        buf = cls(name=name, layout=layout, **fields)
        self.buffers.append(buf)
        self.name_to_buffer[name] = buf
        self.device_types.add(layout.device.type)
        return buf

    def get_buffer(self, name: str):
        if name in self.name_to_buffer:
            return self.name_to_buffer[name]
        b = self.graph_inputs.get(name)
        if isinstance(b, ir.Buffer):
            return b
        raise KeyError(name)

    def get_dtype(self, name: str) -> torch.dtype:
        return self.get_buffer(name).get_dtype()

    # FX handlers --------------------------------------------------------------
    def run(self):
        load_all()
        with V.set_graph(self):
            super().run(*self.example_inputs)
        return self

    def run_node(self, n):
        self.current_node = n
        try:
            return super().run_node(n)
        except LoweringError:
            raise
        except Exception as e:
            raise LoweringError(f"lowering {n.format_node()}: {type(e).__name__}: {e}") from e

    def placeholder(self, target, args, kwargs):
        example = super().placeholder(target, args, kwargs)
        self.placeholder_names.append(target)
        node = self.current_node
        val = node.meta.get("val", example)
        if isinstance(val, torch.Tensor) and _restrided(val, example):
            val = example  # a saved activation that the forward stored in other strides
        if isinstance(val, torch.Tensor):
            layout = meta_layout(val)
            cls = ir.DonatedBuffer if target in self.donated else ir.InputBuffer
            buf = cls(name=target, layout=layout)
            self.device_types.add(val.device.type)
            self.graph_inputs[target] = buf
            return TensorBox(buf)
        if isinstance(val, torch.SymInt):
            expr = sizevars.from_torch(val)
            self.graph_inputs[target] = expr
            return expr
        if not (example is None or isinstance(example, (bool, int, float, str))):
            example = ir.OpaqueInput(target, example)
        self.graph_inputs[target] = example
        return example

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            name = f"const_{target.replace('.', '_')}"
            self.constants[name] = value
            buf = ir.ConstantBuffer(name=name, layout=meta_layout(value))
            self.graph_inputs[name] = buf
            return TensorBox(buf)
        return value

    def call_function(self, target, args, kwargs):
        node = self.current_node
        val = node.meta.get("val")
        if val is None and isinstance(target, torch._ops.HigherOrderOperator):
            val = node.meta["val"] = _fake_value(node)  # checkpointed RNG (run_and_save_rng_state) has none
        binds = self.unbacked_bindings(node)
        if not binds and (isinstance(val, torch.SymInt) or (isinstance(val, (int, bool)) and target is not operator.getitem)):
            return sizevars.from_torch(val) if isinstance(val, torch.SymInt) else val
        if not binds and isinstance(val, (torch.SymFloat, torch.SymBool)):
            return self.runtime_scalar(target, args, kwargs)
        if target is operator.getitem:
            return args[0][args[1]]
        self._store_reads_before_mutation(target, args, kwargs)
        first = len(self.buffers)
        result, reason = None, "data-dependent output size" if binds else _why_not_lowered(target, lowerings, args, kwargs, val)
        if reason is None:
            self._bound_read_bytes(args, kwargs)
            try:
                result = lowerings[target](*args, **kwargs)
            except ir.Unsupported as e:
                reason = str(e) if isinstance(e, ir.Declined) else f"unsupported: {e}"
            except ir.NoOpFallback:
                raise
            except Exception as e:  # a lowering bug costs this op, not the graph
                if not config.fallback_on_error:
                    raise
                reason = f"lowering failed: {type(e).__name__}: {e}"
                log.warning("commfuse: lowering %s failed (%s); running it through aten", target, reason)
        if result is None:
            reason = reason or "the lowering declined"
            result = fallback(target, args, kwargs, val)
            self.fallback_ops.append(str(target))
            self.fallback_reasons.setdefault(str(target), reason)
        if binds:
            self.bind_symbols(next(b for b in self.buffers[first:] if isinstance(b, ir.ExternKernel)), binds, val)
        if isinstance(result, TensorBox) and isinstance(result.data, ir.Loops):
            self.loops_values[id(result.data)] = (result.data, val)
        self._maybe_realize(node, result)
        return result

    def unbacked_bindings(self, node) -> dict:
        """{data-dependent symbol this node's value introduces: where in the value it is}, under the
        names the graph's values use (torch renames them after tracing)."""
        binds = node.meta.get("unbacked_bindings")
        if not binds:
            return {}
        renamed = getattr(self.shape_env, "unbacked_renamings", {})
        return {renamed.get(s, s): path for s, path in binds.items()}

    def bind_symbols(self, kernel: ir.ExternKernel, binds: dict, val=None) -> None:
        """The wrapper reads `binds`' symbols from `kernel`'s result right after it runs; kernels
        using them are scheduled after it. Heuristics size them as torch's fallback hint does."""
        kernel.binds = {**kernel.binds, **binds}
        for sym in binds:
            self.symbol_defs[sym] = kernel.name
            try:
                self.size_hints[sym] = int(self.shape_env.optimization_hint(sym, fallback=8192))
            except Exception:  # no shape env, or a float
                self.size_hints[sym] = 8192
            if isinstance(val, torch.SymFloat):
                self.float_scalars.add(sym)

    def _store_reads_before_mutation(self, target, args, kwargs):
        """Values not stored yet are computed where they are used, which may be after this op
        writes a buffer they read (`add = count + 1; copy_(count, add); ... add`): store them now,
        while they read what they were defined on."""
        schema = getattr(target, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        written = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                written |= {n for x in torch.utils._pytree.tree_leaves(v) if isinstance(x, TensorBox)
                            for n in inlined_reads(x)}
        if not written:
            return
        for value in self.env.values():
            for box in torch.utils._pytree.tree_leaves(value):
                if isinstance(box, TensorBox) and isinstance(ir.view_root(box).data, ir.Loops) \
                        and inlined_reads(box) & written:
                    ir.view_root(box).realize()

    def runtime_scalar(self, target, args, kwargs):
        """A SymFloat/SymBool: the wrapper computes it at run time and passes it to kernels."""
        sym = sympy.Symbol(f"sv{len(self.scalar_nodes)}")
        if isinstance(self.current_node.meta.get("val"), torch.SymFloat):
            self.float_scalars.add(sym)  # a kernel takes it as fp64 (Triton would type a float fp32)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, TensorBox) or isinstance(a, sympy.Basic) and a.free_symbols & set(self.symbol_defs)
               for a in leaves):  # computed after what it reads, where the schedule has it
            dev = next((a.get_device() for a in leaves if isinstance(a, TensorBox)), torch.device("cpu"))
            kernel = self.register_buffer(ir.ExternKernel, layout=ir.Layout(dev, torch.uint8, [], []), op=target,
                                          args=tuple(args), kwargs=dict(kwargs), side_effect=True)
            self.bind_symbols(kernel, {sym: ()})
        self.scalar_nodes.append((sym, target, args, kwargs))
        return sym

    def _maybe_realize(self, node, result):
        """A value with several users is recomputed by each (free inside one kernel, and a
        saved round trip through memory across kernels) unless recomputing costs too much;
        a value that has accumulated too many reads is stored whatever its users, and so is a
        graph output that has other users."""
        if isinstance(result, TensorBox) and isinstance(result.data, ir.Pointwise):
            output = any(u.op == "output" for u in node.users)
            if V.choices.should_realize(result.data, len(node.users), output):
                if output:
                    realize_output(result, None if node in self.free_outputs else node.meta.get("val"))
                else:
                    result.realize()

    def _bound_read_bytes(self, args, kwargs):
        """Store pointwise operands, the heaviest first, while a value built from them would read
        more bytes than choices allows: it then starts from stored values instead of keeping every
        buffer its chain of inlined ops reads alive until one kernel at the end."""
        if config.realize_acc_reads_size_threshold is None:
            return
        boxes = [ir.view_root(x) for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, TensorBox)]
        reads = {id(b): inlined_reads(b) for b in boxes}
        while V.choices.read_bytes_exceeded(set().union(*reads.values())):
            pointwise = [b for b in boxes if isinstance(b.data, ir.Pointwise) and memory.owned_bytes(reads[id(b)])]
            if not pointwise:
                return
            heaviest = max(pointwise, key=lambda b: memory.owned_bytes(reads[id(b)]))
            heaviest.realize()
            reads[id(heaviest)] = {heaviest.data.name}

    def output(self, target, args, kwargs):
        vals = self.current_node.args[0]
        outs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nodes = vals if isinstance(vals, (list, tuple)) else [vals]
        # with eager's strides, but for a free one
        metas = [node.meta.get("val") if isinstance(node, torch.fx.Node) and node not in self.free_outputs else None
                 for node in nodes]
        _store_shared_bases(outs, metas, self.loops_values)
        for value, meta in zip(outs, metas):
            if isinstance(value, TensorBox):
                value = realize_output(value, meta)
            self.graph_outputs.append(value)
        return self.graph_outputs


def _fake_value(node: torch.fx.Node):  # its value on fake tensors, from its arguments' values
    args, kwargs = torch.utils._pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves((args, kwargs))) or contextlib.nullcontext():
        return node.target(*args, **kwargs)


def size_hints(gm, example_inputs) -> dict:
    """{size symbol: its value in the example inputs}, for the heuristics that need a concrete size
    (`sizevars.hint`): the symbols of the placeholders' sizes, strides and SymInts."""
    hints = {}
    for node, example in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        val = node.meta.get("val", example)
        if isinstance(val, torch.Tensor) and isinstance(example, torch.Tensor):
            pairs = zip([*val.shape, *val.stride()], [*example.shape, *example.stride()])
        elif isinstance(val, torch.SymInt):
            pairs = [(val, example)]
        else:
            continue
        for s, e in pairs:
            if isinstance(e, torch.SymInt):
                e = e.node.hint
            if isinstance(s, torch.SymInt) and isinstance(e, int):
                expr = sizevars.from_torch(s)
                if isinstance(expr, sympy.Symbol):
                    hints[expr] = e
    return hints


def _free_outputs(gm, saved) -> set:
    """The FX nodes that are graph outputs only at `saved` positions (activations the backward
    reads, which AOTAutograd restrides to the strides we report): stored in whatever layout."""
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    visible = {n for i, n in enumerate(outs) if i not in saved}
    return {outs[i] for i in saved if isinstance(outs[i], torch.fx.Node)} - visible


def _restrided(val: torch.Tensor, example) -> bool:
    """An example input (static) in other strides than its placeholder was traced with."""
    if not isinstance(example, torch.Tensor):
        return False
    return all(isinstance(s, int) for s in (*val.stride(), *example.stride())) and val.stride() != example.stride()


def _whole_storages(gm, names) -> set:
    """Those of `names` (placeholders) whose tensor is its storage, whole and dense, shared with
    no other input: overwriting or freeing it touches nothing else. (Saved activations may be
    views of one another; the fake tensors of aliasing placeholders share their storage.) Not a
    conjugate or negative view (a complex RoPE's saved `_conj`): what is written into it keeps the
    bit and reads back conjugated."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")}
    storages = collections.Counter(StorageWeakRef(v.untyped_storage()) for v in vals.values()
                                   if isinstance(v, torch.Tensor))
    out = set()
    for name in names:
        v = vals.get(name)
        if not isinstance(v, torch.Tensor) or storages[StorageWeakRef(v.untyped_storage())] != 1 \
                or v.is_conj() or v.is_neg():
            continue
        if _dense(v) and statically_known_true(v.storage_offset() == 0) and \
                statically_known_true(v.untyped_storage().nbytes() == v.numel() * v.element_size()):
            out.add(name)
    return out


def _dense(v: torch.Tensor) -> bool:
    """Strides a permutation of contiguous ones (with symbolic sizes: contiguous)."""
    dims = [(st, sz) for st, sz in zip(v.stride(), v.shape) if not statically_known_true(sz == 1)]
    if not all(isinstance(x, int) for d in dims for x in d):
        return is_contiguous_or_false(v)  # no guard on a data-dependent size
    expected = 1
    for st, sz in sorted(dims):
        if st != expected:
            return False
        expected *= sz
    return True


def inlined_reads(box: TensorBox) -> set:
    """Buffers that inlining this value into a user makes the user read."""
    d = ir.view_root(box).data
    if isinstance(d, ir.Loops):
        return ir.body_reads(d)
    if isinstance(d, ir.ReinterpretView):
        return {d.base.name}
    return {d.name} if isinstance(d, ir.Buffer) else set()


def _why_not_lowered(target, lowerings, args, kwargs, meta) -> str | None:
    if str(target) in config.fallback_ops or str(getattr(target, "overloadpacket", "")) in config.fallback_ops:
        return "listed in config.fallback_ops"
    if target not in lowerings:
        return "no lowering"
    if (dtype := _dtype_without_kernels(args, kwargs, meta)) is not None:
        return f"{dtype}: no kernel of ours computes in it"
    if _touches_cpu_on_gpu_host(args, kwargs, meta):
        return "CPU tensors on a GPU host (Triton runs compiled for the GPU)"
    return None


def _touches_cpu_on_gpu_host(args, kwargs, meta) -> bool:
    """Small CPU tensors in a CUDA program (positions, scalars, masks built on the host) run
    through aten: our kernels there are compiled for the GPU."""
    if interpreting() or not torch.cuda.is_available():
        return False
    for x in torch.utils._pytree.tree_leaves((args, kwargs, meta)):
        dev = x.device if isinstance(x, torch.Tensor) else x.get_device() if isinstance(x, TensorBox) else None
        if dev is not None and dev.type == "cpu":
            return True
    return False


def _dtype_without_kernels(args, kwargs, meta) -> torch.dtype | None:
    """A dtype our kernels have no arithmetic for (complex, float8, wide unsigned) that the op
    reads or makes: such ops run through aten."""
    for x in torch.utils._pytree.tree_leaves((args, kwargs, meta)):
        dtype = x.dtype if isinstance(x, torch.Tensor) else x.get_dtype() if isinstance(x, TensorBox) else None
        if dtype is not None and dtype not in TRITON_DTYPES:
            return dtype
    return None


def _store_shared_bases(outs: list, metas: list, loops_values: dict) -> None:
    """Outputs that view one value not stored yet (`h[0]` and `h.view(-1)`, unbind's parts, `h`
    and `h.t()`) alias each other in eager: a write through one shows in the others. That value is
    stored once, as eager lays it out (as an output, else as the node that made it), so that each
    output is a strided view of it, rather than each computed into a buffer of its own."""
    boxes = [(v, m) for v, m in zip(outs, metas) if isinstance(v, TensorBox)]
    shared = collections.Counter(id(ir.view_root(v)) for v, _ in boxes)
    own_meta = {id(v): m for v, m in boxes if not isinstance(v.data, ir.View)}
    for v, _ in boxes:
        root = ir.view_root(v)
        meta = own_meta.get(id(root), loops_values.get(id(root.data), (None, None))[1])
        if shared[id(root)] > 1 and isinstance(root.data, ir.Loops) and _store_dense(root, meta) is None:
            root.realize()


def _store_dense(box: TensorBox, meta) -> ir.Buffer | None:
    """Loops stored with the layout of `meta` (eager's value) where that is dense; else None."""
    if isinstance(box.data, ir.Loops) and isinstance(meta, torch.Tensor):
        layout = meta_layout(meta)
        if layout.is_dense():
            box.data = V.graph.register_buffer(ir.ComputedBuffer, layout=layout, data=box.data)
            return box.data
    return None


def realize_output(box: TensorBox, meta) -> ir.IRNode:
    """Store a graph output with the strides eager would have given it."""
    d = box.data
    if isinstance(d, ir.Buffer) and isinstance(d.layout, ir.CommLayout):
        # pool memory is rewritten by the next call: an output gets its own copy
        box = TensorBox(ir.Pointwise(d.get_device(), d.get_dtype(), d.make_loader(), list(d.get_size())))
        d = box.data
    if isinstance(d, ir.View) and isinstance(meta, torch.Tensor) and ir.as_strided_view(box) is None:
        # a view of values not stored yet (e.g. `y.t()` of a pointwise y): computed in its
        # logical order and stored with eager's strides
        box.data = d = ir.Pointwise(d.get_device(), d.get_dtype(), d.make_loader(), list(d.get_size()))
    if (buf := _store_dense(box, meta)) is not None:
        return buf
    stored = box.realize()
    if isinstance(meta, torch.Tensor) and not stored.layout.has_strides([sizevars.from_torch(s) for s in meta.stride()]):
        if V.graph.restrided_outputs and V.choices.keep_padded_output(stored, meta):
            return stored
        # Other graphs index this output by its meta strides (a backward reads a saved activation
        # by them, a user sees them): a view of ours in another order is copied into them.
        layout = meta_layout(meta)
        if layout.is_dense():
            data = ir.Pointwise(stored.get_device(), stored.get_dtype(), stored.make_loader(), list(stored.get_size()))
            return V.graph.register_buffer(ir.ComputedBuffer, layout=layout, data=data)
    return stored

