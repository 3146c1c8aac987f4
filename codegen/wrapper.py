"""The per-graph Python module: kernels, then `call(args)` that binds sizes, allocates,
launches kernels and extern ops in schedule order, frees and reuses buffers."""
from __future__ import annotations

import ast
import collections
import re

import sympy
import torch

from commfuse import config, ir, memory, sizevars
from commfuse.choices import group_size_or_0
from commfuse.runtime.compile_worker import HOST_CODE
from commfuse.virtualized import V

from .common import AFTER_PREDECESSOR, IndentedBuffer, pexpr
from . import comm as comm_codegen
from . import decode_attention as attention_codegen
from . import matmul as matmul_codegen
from .triton import TritonKernel, debug_code

KERNEL_HEADER = """\
# commfuse generated code: graph {graph_id}
import triton
import triton.language as tl
from commfuse.runtime import triton_helpers
"""
HOST_HEADER = """\
import math
import torch
from commfuse.runtime.support import empty_strided, empty_strided_cuda, reinterpret_tensor, cdiv, workspace, as_meta_layout, Ops
from commfuse.runtime.launch import Launches, Site
import commfuse.runtime.scatter, commfuse.runtime.attention, commfuse.runtime.async_tp  # noqa: F401,E401  (register torch.ops.commfuse*.*: a graph from the cache runs first)
aten = Ops(torch.ops.aten)
prims = Ops(torch.ops.prims)
constants = {}  # filled by the loader: tensor constants and non-tensor objects
_workspaces = {}  # scratch of split-K matmuls, kept zeroed between calls
"""


class WrapperCodegen:
    def __init__(self, graph, scheduler):
        self.graph, self.sched, self.cuda = graph, scheduler, None
        scheduler.code_renderer = self.debug_code
        self.kernel_sources: dict[int, str] = {}  # group id -> its kernel, as generated
        self.kernels = IndentedBuffer()
        self.kernel_names: dict[str, str] = {}  # a kernel's code, its own name taken out -> its name
        self.body = IndentedBuffer(1)
        self.kernel_info: list[dict] = []   # for the summary
        self.launches: dict[str, None] = {}  # every distinct kernel launch, as `_launches` lists it
        self.sites: list[str] = []  # each launch line's `Site` (runtime/launch.py): `<kernel>_launch<k>`
        self.comm_protocol: list[dict] = []  # each comm kernel's collectives, grid and barriers, in order
        self.c10d: dict[str, dict] = {}  # each c10d collective: where it is issued and waited, and why
        self.extern_calls: list[str] = []
        self.allocations: list[dict] = []
        self.constants: dict[str, object] = dict(graph.constants)
        self.bound: set = set()
        self.comm_placements, self.pool_sizes = memory.plan_comm_pools(scheduler, graph.comm_plans)
        self.names: dict[str, str] = {}     # buffer -> variable holding it (after reuse)
        self.allocated: set = set()

    # ------------------------------------------------------------------ helpers
    def expr(self, e) -> str:
        return pexpr(sympy.sympify(e))

    def shape(self, values) -> str:
        inner = ", ".join(self.expr(v) for v in values)
        return f"({inner}{',' if len(values) == 1 else ''})"

    def ref(self, name: str) -> str:
        return self.names.get(name, name)

    def value(self, x) -> str:
        """Python source for an extern-call argument."""
        if isinstance(x, ir.ReinterpretView):
            lay = x.layout
            return (f"reinterpret_tensor({self.ref(x.base.name)}, {self.shape(lay.size)}, "
                    f"{self.shape(lay.stride)}, {self.expr(lay.offset)})")
        if isinstance(x, ir.Buffer):
            return self.ref(x.name)
        if isinstance(x, ir.TensorBox):
            return self.value(x.data)
        if isinstance(x, sympy.Expr):
            return self.expr(x)
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self.value(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        if isinstance(x, torch.dtype):
            return str(x)
        if isinstance(x, torch.device):
            return f"torch.device({x.type!r}, {x.index})" if x.index is not None else f"torch.device({x.type!r})"
        if isinstance(x, (torch.layout, torch.memory_format)):
            return str(x)
        if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
            return f"float({str(x)!r})"
        if x is None or isinstance(x, (bool, int, float, str)):
            return repr(x)
        if isinstance(x, ir.OpaqueInput):
            return x.name
        name = f"obj{len(self.constants)}"
        self.constants[name] = x
        return f"constants[{name!r}]"

    def launch(self, name: str, grid: str, args: list, specs: list, consts: str, src: str = "") -> str:
        """A kernel launch's line; the launch is listed in `_launches` with `specs` for its `args`:
        a tensor's dtype, an integer's value (its hint if dynamic). A kernel whose source `src`
        waits for the kernel ahead launches as its programmatic dependent."""
        if AFTER_PREDECESSOR in src:
            consts += ", launch_pdl=True"
        self.launches[f"({name}, ({', '.join(map(str, specs))},), dict({consts})),"] = None
        # a site of its own per line, even for a kernel launched twice: each launch's pointers
        # may be aligned differently, and its site keeps the kernel compiled for its own
        site = f"{name}_launch{sum(line.startswith(name + '_launch') for line in self.sites)}"
        self.sites.append(f"{site} = Site({name}, dict({consts}))")
        dims = [ast.unparse(e) for e in ast.parse(grid, mode="eval").body.elts]
        return f"{site}(_stream, ({', '.join(dims + ['1'] * (3 - len(dims)))}), {', '.join(args)})"

    def define(self, name: str, src: str) -> str:
        """The name to launch kernel `name` (source `src`) by. A kernel whose code is one already
        defined under another name (the same layer repeated) is that one: Triton compiles each
        distinct kernel once, not once per layer."""
        code = re.sub(rf"\b{re.escape(name)}\b", "KERNEL", src)
        header = re.search(r"def KERNEL\((.*?)\):", code, re.S)
        params = [p.strip() for p in header.group(1).split(",")] if header else []
        for i, p in enumerate(p for p in params if p.isidentifier()):  # buffers' names, not constexprs
            code = re.sub(rf"\b{p}\b", f"_arg{i}", code)
        first = self.kernel_names.setdefault(code, name)
        if first == name:
            self.kernels.splice(_lines(src))
            self.kernels.writeline()
        return first

    def effect(self, what: str) -> None:
        """Marks the next line as writing a graph input or meeting other ranks: a first run that
        fails there or later cannot be rerun through aten (compiled.py)."""
        self.body.writeline(f"# effect: {what}")

    def is_input(self, name: str) -> bool:
        return isinstance(self.graph.graph_inputs.get(name), ir.InputBuffer)

    def dtype(self, name: str) -> str:
        return str(self.graph.get_dtype(name))

    # ------------------------------------------------------------------ generation
    def generate(self) -> str:
        g = self.graph
        self.body.writeline(f"{', '.join(g.placeholder_names)}{',' if len(g.placeholder_names) == 1 else ''} = args"
                            if g.placeholder_names else "pass")
        self.body.writeline("args.clear()")
        for name in g.constants:
            self.body.writeline(f"{name} = constants[{name!r}]")
        if self.comm_placements or self.checked_groups():
            self.body.writeline("if _comm is None:")
            self.body.writeline("    _setup_comm()  # first call: check plans across ranks, take the pools")
            self.body.writeline("comm = _comm.current()")
        self.bind_sizes()
        for sym, fn, args, kwargs in g.scalar_nodes:
            if sym in g.symbol_defs:  # computed where the schedule has its extern
                continue
            call_args = ", ".join([self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()])
            self.body.writeline(f"{sym} = {self.value(fn)}({call_args})")
        inputs = {name for name, b in g.graph_inputs.items() if isinstance(b, ir.InputBuffer)}
        cuda = self.cuda = self.cuda_device()
        stream_line = len(self.body.lines)
        self.body.writeline("_stream = None")  # filled in below once the launches are known
        last_use = self.last_uses()
        # Our references to the input tensors go as soon as they are last read: in a backward
        # graph they are the only ones left to the saved activations (AOTAutograd hands them
        # over in `args` and clears its own), so each is freed there, not when `call` returns.
        unused = [n for n in g.placeholder_names if n in inputs and n not in self.sched.output_names
                  and not any(n in names for names in last_use.values())]
        if unused:
            self.body.writeline(f"del {', '.join(unused)}")
        pool = collections.defaultdict(list)
        recyclable = memory.recyclable(self.sched) - set(self.sched.inplace.values())
        for step, grp in enumerate(self.sched.groups):
            self.note_c10d(grp, step)
            if isinstance(grp.nodes[0].buf, ir.CommKernel):
                self.comm_kernel(grp.nodes[0].buf, step, pool)
            elif isinstance(grp.nodes[0].buf, ir.MatmulTemplate):
                self.matmul(grp, pool)
            elif grp.is_extern():
                self.extern(grp.nodes[0], pool)
            else:
                self.kernel(grp, step, pool)
            for name in last_use.get(step, []):
                if name in self.sched.output_names or name in self.sched.internal \
                        or name not in g.name_to_buffer and name not in inputs \
                        or getattr(g.name_to_buffer.get(name), "side_effect", False):
                    continue
                self.body.writeline(f"del {self.ref(name)}")
                if name in recyclable:  # the del goes if a later buffer takes the memory over
                    pool[self.alloc_key(g.get_buffer(name))].append((self.ref(name), len(self.body.lines) - 1))
        if cuda is not None and self.sites and not g.symbol_defs:  # the JIT's key would miss the data's sizes
            self.body.lines[stream_line] = self.launch_key(inputs)
        self.body.lines = [line for line in self.body.lines if line is not None]
        outs = [self.output(o) for o in g.graph_outputs]
        self.body.writeline(f"return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        code = IndentedBuffer()
        code.writelines(KERNEL_HEADER.format(graph_id=g.graph_id).splitlines())
        code.writeline()
        code.splice(self.kernels)
        code.writeline(HOST_CODE)
        code.writelines(HOST_HEADER.splitlines())
        code.writeline()
        code.writeline("# each launch of `call`, to compile its kernel ahead of the first call (runtime/precompile.py):")
        code.writeline("# tensors as their dtypes, integers as their values (a dynamic size as its hint)")
        code.writeline("_launches = [")
        with code.indent():
            code.writelines(self.launches)
        code.writeline("]")
        code.writeline()
        if self.comm_placements or self.checked_groups():
            code.splice(self.comm_setup())
            code.writeline()
        if cuda is not None and self.sites:
            code.writeline(f"_sites = Launches({cuda})")
        code.writelines(self.sites)
        code.writeline()
        code.writeline("def call(args):")
        if cuda is not None:
            with code.indent():
                code.writeline(f"with torch.cuda.device({cuda}):")
                with code.indent():
                    code.writeline("return _call(args)")
            code.writeline()
            code.writeline("def _call(args):")
        code.splice(self.body)
        return code.getvalue()

    def cuda_device(self) -> int | None:
        """The index of the graph's CUDA device, where it has exactly one."""
        g = self.graph
        devices = {b.get_device() for b in g.buffers} | {b.get_device() for b in g.graph_inputs.values()
                                                          if isinstance(b, ir.Buffer)}
        cuda = {d.index or 0 for d in devices if d.type == "cuda"}
        return cuda.pop() if len(cuda) == 1 else None

    def launch_key(self, inputs: set) -> str:
        """The line that starts a call's launches (runtime/launch.py): its key is what Triton
        specializes on that can change between calls, the inputs' alignment and the sizes."""
        parts = [f"{n}.data_ptr() % 16" for n in self.graph.placeholder_names if n in inputs]
        parts += [str(s) for s in sorted(self.bound, key=str)] + [str(s) for s, *_ in self.graph.scalar_nodes]
        return f"    _stream = _sites.begin(({', '.join(parts)}{',' if len(parts) == 1 else ''}))"

    def bind_sizes(self):
        g = self.graph
        for name in g.placeholder_names:
            v = g.graph_inputs[name]
            if isinstance(v, sympy.Symbol) and v not in self.bound:
                self.body.writeline(f"{v} = {name}")
                self.bound.add(v)
            elif isinstance(v, ir.InputBuffer):
                for what, values in (("size", v.layout.size), ("stride", v.layout.stride)):
                    for i, e in enumerate(values):
                        if isinstance(e, sympy.Symbol) and e not in self.bound:
                            self.body.writeline(f"{e} = {name}.{what}({i})")
                            self.bound.add(e)
        self.bind_derived_sizes()

    def bind_derived_sizes(self):
        """Sizes torch computes through floats, once their symbols are bound: the inputs' sizes,
        or values an extern's result gives (after it)."""
        g = self.graph
        for e, sym in g.derived_sizes.items():
            if sym in self.bound or sym in g.symbol_defs and not e.free_symbols <= self.bound:
                continue
            if not e.free_symbols <= self.bound:
                raise ir.Unsupported(f"size {e}: its symbols are not among the inputs' sizes")
            self.body.writeline(f"{sym} = {pexpr(e)}")
            self.bound.add(sym)

    def last_uses(self) -> dict:
        last, waited = {}, {}
        for step, grp in enumerate(self.sched.groups):
            for name in sorted(grp.read_names | grp.write_names):  # sets: their order varies by process
                last[name] = step
            if memory.is_wait(grp):
                waited.update((name, step) for name in grp.read_names)
        for grp in self.sched.groups:  # a c10d collective may read its input until its wait: not reused before
            if memory.is_collective(grp):
                end = max((waited.get(n, -1) for n in grp.write_names), default=-1)
                for name in grp.read_names:
                    last[name] = max(last[name], end)
        out = collections.defaultdict(list)
        for name, step in last.items():
            out[step].append(name)
        return out

    @staticmethod
    def alloc_key(buf):
        """Freed buffers are reused by the next buffer of the same device, dtype and bytes, if no
        other allocation comes in between."""
        lay = buf.layout
        return str(lay.device), lay.dtype, str(sizevars.simplify(lay.storage_numel()))

    def allocate(self, buf: ir.Buffer, pool):
        lay = buf.layout
        if isinstance(lay, ir.CommLayout):
            p = self.comm_placements[buf.name]
            self.body.writeline(f"{buf.name} = comm[{buf.name!r}]  # {p['pool']} [{p['offset']}, +{p['bytes']})")
            return
        if isinstance(lay, ir.MutationLayout):
            self.effect(f"stores into input {lay.target}")
            self.body.writeline(f"{buf.name} = {self.ref(lay.target)}  # stored into in place")
            return
        nbytes = lay.nbytes_hint()
        self.allocated.add(buf.name)
        if buf.name in self.sched.inplace:
            old = self.sched.inplace[buf.name]
            if self.is_input(old):
                self.effect(f"overwrites input {old}")
            self.body.writeline(f"{buf.name} = {self.view_as(self.ref(old), old, buf)}  # in place over {old}")
            self.allocations.append({"name": buf.name, "bytes": nbytes, "in_place_of": old})
            return
        if pool.get(self.alloc_key(buf)):
            old, free_line = pool[self.alloc_key(buf)].pop()
            self.body.lines[free_line] = None
            if self.is_input(old):
                self.effect(f"overwrites input {old}")
            self.body.writeline(f"{buf.name} = {self.view_as(old, old, buf)}; del {old}  # reuse")
            self.allocations.append({"name": buf.name, "bytes": nbytes, "reuses": old})
            return
        # a freed buffer held for a later reuse would be counted while this one is allocated: past
        # a fresh allocation, the ones freed before it are freed for good (the caching allocator
        # recycles them anyway)
        pool.clear()
        cuda = lay.device.type == "cuda" and (lay.device.index or 0) == self.cuda  # the device `call` makes current
        where = f"{lay.dtype}" if cuda else f"device={self.value(lay.device)}, dtype={lay.dtype}"
        self.body.writeline(f"{buf.name} = empty_strided{'_cuda' * cuda}({self.shape(lay.size)}, {self.shape(lay.stride)}, {where})")
        self.allocations.append({"name": buf.name, "bytes": nbytes})

    def allocate_once(self, buf: ir.Buffer, pool):
        if buf.name not in self.allocated:
            self.allocate(buf, pool)

    def view_as(self, var: str, old: str, buf: ir.Buffer) -> str:
        """`var` (holding buffer `old`'s memory) seen with `buf`'s size and strides."""
        a, b = self.graph.get_buffer(old).layout, buf.layout
        if [str(x) for x in a.size + a.stride] == [str(x) for x in b.size + b.stride]:
            return var
        return f"reinterpret_tensor({var}, {self.shape(b.size)}, {self.shape(b.stride)}, 0)"

    def kernel(self, grp, step, pool):
        kind = "red" if grp.is_reduction() else "poi"
        plans = [p for p in self.graph.comm_plans if p.result in grp.names]
        if plans:  # a fused collective with its neighbours
            kind = {"all_gather_into_tensor": "allgather", "reduce_scatter_tensor": "reducescatter"}.get(
                plans[0].collective, "allreduce")
        ops_names = "_".join(sorted({_short(n) for n in grp.nodes}))[:40]
        name = f"cf_{kind}_{ops_names}_{step}"
        shape = self.sched.kernel_shape(grp)
        k = TritonKernel(grp, self.sched, name, shape)
        src, meta = k.render()
        self.kernel_sources[id(grp)] = src
        name = self.define(name, src)
        for n in grp.nodes:
            if n.name not in self.sched.internal:
                self.allocate(n.buf, pool)
        X, R = k.X, k.R
        comm = meta["comm"]
        pool = comm and self.comm_placements[next(a.split("@")[0] for a in k.args if "@peer" in a)]["pool"]
        blocks = shape.blocks
        args = [comm_codegen.arg_value(a, pool) if "@" in a else self.ref(a) for a in k.args]
        specs = [comm_codegen.arg_spec(a, self.dtype, comm.group) if "@" in a else self.dtype(a) for a in k.args]
        sizes = meta["size_symbols"] + [X] + ([R] if meta["reduction"] else [])
        args += [self.expr(s) for s in sizes]
        specs += [sizevars.hint(s) for s in sizes]
        consts = f"XBLOCK={blocks['XBLOCK']}" + (f", RBLOCK={blocks['RBLOCK']}" if meta["reduction"] else "")
        grid = f"({blocks['programs']},)" if "programs" in blocks else f"(cdiv({self.expr(X)}, {blocks['XBLOCK']}),)" if not meta["tiled"] else \
            f"(cdiv({self.expr(X)}, {blocks['XBLOCK']}), cdiv({self.expr(R)}, {blocks['RBLOCK']}))"
        if meta["asserts"]:  # debug mode keeps the bounds asserts; no overflow check on every int op
            consts += ", sanitize_overflow=False"
        if meta["recomputes"]:  # the same rounding in both walks: a product fused into an FMA in one walk
            # only left a masked (finfo.min) softmax row's x - max at ±1e31 (exp 0 or inf, not 1)
            consts += ", enable_fp_fusion=False"
        if sizevars.is_static(X) and int(X) == 0:
            self.body.writeline(f"# {name} skipped: empty")
        else:
            launch = self.launch(name, grid, args, specs, f"{consts}, num_warps={blocks['num_warps']}", src)
            if plans:
                self.effect("issues a collective")
            if not sizevars.is_static(X):
                self.body.writeline(f"if {self.expr(X)} > 0:")
            with self.body.indent(0 if sizevars.is_static(X) else 1):
                self.body.writeline(launch)
        writes = [n.name for n in grp.nodes if n.name not in self.sched.internal]
        reads = sorted({a.split("@")[0] for a in k.args if not a.startswith("@")} - set(writes))
        info = {"name": name, "reads": reads, "writes": writes, "nodes": grp.names,
                "reduction": grp.is_reduction(), "persistent": meta["persistent"] and not meta["tiled"],
                "tiled": meta["tiled"], "block_ptrs": meta["block_ptrs"]}
        if comm:
            algo = plans[0].algorithm  # how it reads
            info.update(collective=plans[0].collective, group=comm.group, fused_nodes=len(grp.nodes),
                        algorithm="two_shot" if algo.gathers_shares else "one_shot" if algo.collective == "all_reduce" else algo.name)
            self.note_comm_kernel(name, info["algorithm"], blocks["programs"], src, plans,
                                  xnumel=sizevars.hint(X), rnumel=sizevars.hint(R) if meta["reduction"] else None,
                                  XBLOCK=blocks["XBLOCK"], RBLOCK=blocks.get("RBLOCK"),
                                  prologue=bool(k.published))
        self.kernel_info.append(info)

    def debug_code(self, scheduler, group) -> str:
        """The scheduler's code renderer: a generated kernel as is, anything else rendered."""
        return self.kernel_sources.get(id(group)) or debug_code(scheduler, group)

    def extern(self, node, pool):
        buf = node.buf
        if isinstance(buf, ir.MultiOutput):
            item = self.ref(buf.parent.name) + "".join(f"[{i}]" for i in buf.index)
            self.body.writeline(f"{buf.name} = {self.checked_layout(item, buf, _returns_view(buf.parent))}")
            return
        if isinstance(buf, ir.ConcatBuffer):
            self.allocate_once(buf, pool)
            self.body.writeline(f"# {buf.name}: cat written in place by {', '.join(p.name for p in buf.parts)}")
            return
        if isinstance(buf, ir.DecodeAttention):
            self.decode_attention(buf, pool)
            return
        op = buf.op
        call = _op_path(op) if _is_aten(op) else self.value(op)
        args = ", ".join([self.value(a) for a in buf.args] +
                         [f"{k}={self.value(v)}" for k, v in buf.kwargs.items()])
        self.extern_calls.append(str(op))
        if "c10d" in getattr(op, "namespace", ""):
            self.effect("issues a collective")
        elif any(self.is_input(n) for n in buf.mutates):
            self.effect(f"updates input {', '.join(n for n in buf.mutates if self.is_input(n))}")
        if buf.out_variant:
            self.allocate_out(buf, pool)
            self.body.writeline(f"{call}({args}{', ' if args else ''}out={buf.name})")
        elif buf.side_effect or buf.multi_output or buf.binds:
            self.body.writeline(f"{buf.name if buf.multi_output or buf.binds else '_'} = {call}({args})")
        else:
            self.body.writeline(f"{buf.name} = {self.checked_layout(f'{call}({args})', buf, _returns_view(buf))}")
        for sym, path in buf.binds.items():  # data-dependent sizes, read off the result before any use
            self.body.writeline(f"{sym} = {_keypath(buf.name, path)}")
            self.bound.add(sym)
        if buf.binds:
            self.bind_derived_sizes()
        if buf.binds and not (buf.side_effect or buf.multi_output or buf.out_variant or buf.aliases):
            self.body.writeline(f"{buf.name} = {self.checked_layout(buf.name, buf, False)}")

    def checked_layout(self, value: str, buf: ir.Buffer, aliases: bool) -> str:
        """An aten result in the layout its meta function promised, which the kernels after it
        index by (and its dtype, where a kernel of ours reads it: aten's own ops, and the caller,
        take aten's). An aten view of an input is taken as is: a copy would lose the alias."""
        if aliases:
            return value
        lay = buf.layout
        ours = any(type(self.sched.node_of[n].buf) not in (ir.ExternKernel, ir.MultiOutput)
                   for n in self.sched.node_readers.get(buf.name, ()))
        return f"as_meta_layout({value}, {self.shape(lay.size)}, {self.shape(lay.stride)}{f', {lay.dtype}' * ours})"

    def allocate_out(self, buf: ir.ExternKernel, pool):
        if buf.out_view is not None:  # its slice of a cat
            self.allocate_once(buf.out_view.base, pool)
            self.body.writeline(f"{buf.name} = {self.value(buf.out_view)}  # slice of {buf.out_view.base.name}")
        else:
            self.allocate(buf, pool)

    def matmul(self, grp, pool):
        """A group of few-row matmuls of one `a` (mm_group.py), with their epilogues: one launch."""
        name = f"cf_mm_{grp.nodes[0].name}"
        src, meta = matmul_codegen.render(grp.nodes, self.sched.internal, name)
        self.kernel_sources[id(grp)] = src
        kernel = self.define(name, src)
        for n in grp.nodes:
            if n.name not in self.sched.internal:
                (self.allocate_out if n.is_extern() else self.allocate)(n.buf, pool)
        cfg, members, stored = meta["cfg"], meta["members"], meta["stored"]
        b0 = members[0].args[1]
        if cfg["SPLIT_K"] > 1:  # zeroed once, left zeroed by every call
            dev = f"{self.value(b0)}.device"
            scratch = [f"workspace(_workspaces, {name + '_sums'!r}, {meta['m'] * meta['ws_columns']}, torch.float32, {dev})",
                       f"workspace(_workspaces, {name + '_count'!r}, {meta['programs']}, torch.int32, {dev})"]
            scratch_dtypes = [torch.float32, torch.int32]
        else:
            scratch, scratch_dtypes = [self.value(b0)] * 2, [b0.get_dtype()] * 2  # not read
        sizes = meta["size_symbols"]
        args = [self.ref(a) for a in meta["loader_args"]] + [self.expr(s) for s in sizes]
        specs = [self.dtype(a) for a in meta["loader_args"]] + [sizevars.hint(s) for s in sizes]
        ints = [meta["m"], meta["k"]]
        for buf, keep in zip(members, stored):
            b = buf.args[1]
            args += [self.value(b)] + [buf.name] * keep
            specs += [b.get_dtype()] + [buf.get_dtype()] * keep
            ints += [buf.layout.size[1], *b.layout.stride] + list((buf.out_view or buf).layout.stride) * keep
        args += [*scratch, *map(self.expr, ints)]
        specs += [*scratch_dtypes, *(sizevars.hint(i) for i in ints)]
        consts = (f"XBLOCK={cfg['BLOCK_M']}, RBLOCK={cfg['BLOCK_K']}, BLOCK_N={cfg['BLOCK_N']}, "
                  f"SPLIT_K={cfg['SPLIT_K']}, num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']}")
        self.body.writeline(self.launch(kernel, f"({meta['programs']}, {cfg['SPLIT_K']})", args, specs, consts, src))
        writes = [n.name for n in grp.nodes if n.name not in self.sched.internal]
        reads = sorted({r for n in grp.nodes for r in n.read_names} - set(grp.names))
        self.kernel_info.append({"name": kernel, "reads": reads, "writes": writes, "nodes": grp.names,
                                 "template": "mm", "prologue": members[0].prologue, "members": len(members),
                                 "epilogues": [n.name for n in grp.nodes if not n.is_extern()],
                                 "reduction": False, "persistent": False, "tiled": False, "config": cfg})

    def decode_attention(self, buf: ir.DecodeAttention, pool):
        cfg, kernels = attention_codegen.launches(buf, self.value)
        self.allocate_out(buf, pool)
        reads = [getattr(r, "base", r).name for r in buf.inputs()]
        for name, src, grid, args, specs, consts in kernels:
            name = self.define(name, src)
            self.body.writeline(self.launch(name, grid, args, specs, consts, src))
            self.kernel_info.append({"name": name, "reads": reads, "writes": [buf.name], "nodes": [buf.name], "config": cfg,
                                     "template": "decode_attention", "reduction": False, "persistent": False, "tiled": False})

    # ------------------------------------------------------------------ collectives
    def pool_summary(self) -> list:
        return [{"pool": p, "group": g, "device": d, "planned_bytes": n,
                 "sum_of_buffers": sum(b["bytes"] for b in self.comm_placements.values() if b["pool"] == p)}
                for p, (g, d, n) in self.pool_sizes.items()]

    def note_c10d(self, grp, step: int) -> None:
        """A c10d collective in the order the ranks must all issue it, part of the plan they check where
        the graph has symmetric pools, and for the summary where it is issued and waited; or the wait of
        one. (A graph of c10d collectives alone is not checked, but for the groups whose collectives a
        rewrite may change on some ranks only (`checked_groups`): c10d serves dynamic shapes, where
        ranks may recompile apart and would then wait at a check the others never reach.)"""
        buf = grp.nodes[0].buf
        if memory.is_wait(grp):
            for name in grp.read_names:
                src = self.graph.name_to_buffer.get(name)
                src = src.parent if isinstance(src, ir.MultiOutput) else src
                if src is not None and src.name in self.c10d:
                    self.c10d[src.name]["waited_at"] = step
        if not memory.is_collective(grp):
            return
        op, names = buf.op, [a.name for a in buf.op._schema.arguments]
        arg = dict(zip(names, buf.args), **buf.kwargs)
        group = str(getattr(arg.get("group_name"), "group_name", arg.get("group_name")))
        elements = str(buf.layout.numel()) if isinstance(buf, ir.LaidOut) and ir.sizes_agree(op) else None
        record = {"collective": op._opname, "reduce_op": arg.get("reduce_op", ""), "algorithm": "c10d",
                  "group": group, "ranks": group_size_or_0(group), "pool": None, "offset": None,
                  "elements": elements}  # (a bucket's, a sum's)
        if not ir.is_p2p(op):
            self.comm_protocol.append({"kernel": f"c10d_{op._opname}_{step}", "reads": "c10d", "programs": 0,
                                       "barriers": 0, "collectives": [record]})
        self.c10d[buf.name] = {"name": buf.name, "collective": op._opname, "group": group, "issued_at": step,
                               "waited_at": None, "placed": self.sched.overlap.get(buf.name, "as the program has it")}

    def checked_groups(self) -> list:
        """The groups checked across ranks without comm buffers: a rewrite may change their c10d
        collectives on some ranks only (passes/comm_sums.py, passes/bucketing.py)."""
        return [g for g in self.graph.module.meta.get("commfuse_checked", []) if group_size_or_0(g) > 1]

    def comm_setup(self) -> IndentedBuffer:
        code = IndentedBuffer()
        code.writeline("_comm = None")
        code.writeline()
        code.writeline("def _setup_comm():")
        with code.indent():
            code.writeline("global _comm")
            code.writeline("from commfuse.runtime.symm import CommState")
            pools = {p: (g, d, n) for p, (g, d, n) in self.pool_sizes.items()}
            bufs = []
            for name, p in self.comm_placements.items():
                lay = self.graph.name_to_buffer[name].layout
                bufs.append(f"dict(name={name!r}, pool={p['pool']!r}, offset={p['offset']}, bytes={p['bytes']}, "
                            f"size={self.shape(lay.size)}, stride={self.shape(lay.stride)}, "
                            f"numel={int(lay.numel())}, dtype={lay.dtype})")
            code.writeline(f"_comm = CommState({self.graph.graph_id!r}, {pools!r}, [")
            with code.indent():
                code.writelines(f"{b}," for b in bufs)
            # the check runs at the first call, outside the compile's options: it takes its timeout now
            timeouts = [f"float({str(t)!r})" if isinstance(t, float) else repr(t)  # (inf: no name for it)
                        for t in (config.comm.plan_check_timeout_s, config.comm.barrier_timeout_s)]
            program = self.graph.module.meta.get("commfuse_program", [])  # the program's own collectives
            at_break = self.graph.module.meta.get("commfuse_break")  # (Dynamo ended the graph at a graph break)
            code.writeline(f"], {self.comm_protocol!r}, {program!r}, {self.checked_groups()!r}, timeout_s={timeouts[0]}, "
                           f"barrier_timeout_s={timeouts[1]}, at_break={at_break!r})")
        return code

    def comm_kernel(self, buf: ir.CommKernel, step: int, pool):
        """A collective as its plan says: one line the algorithm gives (`call`), or its standalone
        Triton kernel launched over the peers' copies of the placed input."""
        plan, src = buf.plan, buf.input.name
        algo = plan.algorithm
        self.effect("issues a collective")
        if algo.call is not None:
            if plan.inplace:
                self.body.writeline(f"{buf.name} = {src}")
            self.body.writeline(algo.call(plan, src, buf.name if not plan.inplace else f"_{buf.name}"))
            if plan.inplace:
                self.body.writeline(f"{buf.name}.copy_(_{buf.name})")
            self.extern_calls.append(f"{algo.name} all_reduce")
            self.note_comm_kernel(buf.name, algo.name, 0, "", [plan])
            return
        name = f"cf_{algo.name}_all_reduce_{plan.reduce_op}_{step}"
        src_code = algo.kernel(name, plan.world, plan.reduce_op, buf.get_dtype(), plan.inplace)
        name = self.define(name, src_code)
        if plan.inplace:
            self.body.writeline(f"{buf.name} = {src}  # reduced in place")
        else:
            self.allocate(buf, pool)
        numel = int(sizevars.product(buf.input.get_size()))
        cfg = V.choices.comm_launch(numel)
        p = self.comm_placements[src]["pool"]
        keys = [f"{src}@peer{r}" for r in range(plan.world)] + [buf.name] + \
            [f"@sig{r}" for r in range(plan.world)] + ["@sig_own", "@rank"]
        args = [comm_codegen.arg_value(a, p) if "@" in a else a for a in keys] + [str(numel)]
        specs = [comm_codegen.arg_spec(a, self.dtype, plan.group) if "@" in a else self.dtype(a) for a in keys]
        self.body.writeline(self.launch(name, f"({cfg['NPROG']},)", args, specs + [numel],
                                        f"BLOCK={cfg['BLOCK']}, NPROG={cfg['NPROG']}, num_warps={cfg['num_warps']}"))
        self.kernel_info.append({"name": name, "reads": [src], "writes": [buf.name], "nodes": [buf.name],
                                 "reduction": False, "persistent": False, "tiled": False,
                                 "collective": plan.collective, "reduce_op": plan.reduce_op,
                                 "algorithm": algo.name})
        self.note_comm_kernel(name, algo.name, cfg["NPROG"], src_code, [plan], xnumel=numel, XBLOCK=cfg["BLOCK"])

    def note_comm_kernel(self, name: str, algorithm: str, programs: int, src: str, plans: list, **shape) -> None:
        """What the ranks must agree on for their barriers to meet and their reads to find the
        peers' values: which comm kernels run, in which order, with how many programs (one barrier
        slot each), barriers and blocks, and which collectives (reduce op, group, pool slice)."""
        where = [self.comm_placements.get(p.buffer, {}) for p in plans]
        collectives = [{"collective": p.collective, "reduce_op": p.reduce_op, "algorithm": p.algorithm.name,
                        "group": p.group, "ranks": p.world, "pool": w.get("pool"), "offset": w.get("offset")}
                       for p, w in zip(plans, where)]
        self.comm_protocol.append({"kernel": name, "reads": algorithm, "programs": programs,
                                   "barriers": src.count(comm_codegen.BARRIER_STEP), "collectives": collectives,
                                   **shape})
        if programs and comm_codegen.interpreting():  # a wait that gave up raises here, before its
            self.body.writeline(f"comm.check({name!r})")  # outputs are used (a GPU's host learns later)

    def output(self, o) -> str:
        if isinstance(o, (ir.Buffer, ir.ReinterpretView)):
            return self.value(o)
        if isinstance(o, ir.TensorBox):
            return self.value(o.data)
        return self.value(o)


def _short(node) -> str:
    buf = node.buf
    if isinstance(buf, ir.ComputedBuffer) and isinstance(buf.data, ir.Reduction):
        return buf.data.reduction_type
    return "pw"


def _lines(src: str) -> IndentedBuffer:
    b = IndentedBuffer()
    b.lines = src.rstrip("\n").split("\n")
    return b


def _keypath(value: str, path) -> str:
    """Python for the part of `value` that torch's keypath (an unbacked binding) names."""
    for k in path:
        kind = type(k).__name__
        if kind == "CallMethodKey":
            value = f"{value}.{k.name}()"
        elif kind == "SequenceKey":
            value = f"{value}[{k.idx}]"
        elif kind == "DivideByKey":
            value = f"({value} // {k.divisor})"
        elif kind == "ConvertIntKey":
            value = f"int({value})"
        else:
            raise ir.Unsupported(f"a data-dependent size at {k!r}")
    return value


def _is_aten(op) -> bool:
    return isinstance(op, torch._ops.OpOverload)


def _op_path(op) -> str:
    ns = op.namespace
    base = "aten" if ns == "aten" else "prims" if ns == "prims" else f"torch.ops.{ns}"
    return f"{base}.{op._opname}.{op._overloadname}"


def _returns_view(kernel: ir.ExternKernel) -> bool:
    """An aten op's result that may be a view of an input (its schema says so). A higher-order op's
    may be an input too (ExternKernel.aliases), but only as a value: its layout is checked."""
    return kernel.aliases and _is_aten(kernel.op)
