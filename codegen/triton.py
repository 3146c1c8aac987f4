"""Triton kernels for fused groups.

A kernel walks X rows (program axis 0, XBLOCK at a time) and, for reductions, R
elements per row: in one block when the row fits (persistent), else in a loop.
Each node body runs under `TritonOps`, which turns `ops` calls into Triton lines
with common-subexpression elimination. A value produced inside the kernel and read
at the same index is taken from registers; a buffer nobody outside reads is never
stored.
"""
from __future__ import annotations

import dataclasses
import itertools

import sympy
import torch

from commfuse import choices, config, ir, sizevars
from commfuse.dependencies import index_vars, run_node_body
from commfuse.scheduler import RSYM, XSYM
from commfuse.sizevars import index_symbol
from commfuse.virtualized import V

from .common import IndentedBuffer, compute_dtype, literal, texpr, triton_dtype

XNAME, RNAME = sympy.Symbol("xindex", integer=True, nonnegative=True), \
    sympy.Symbol("rindex", integer=True, nonnegative=True)

IDENTITY = {"sum": 0, "prod": 1, "any": False, "all": True}


@dataclasses.dataclass
class Var:
    name: str
    dtype: torch.dtype   # logical dtype; low-precision floats are held as fp32

    def __str__(self):
        return self.name


class Section:
    """Straight-line code at row level (`loop=False`) or one pass over R (`loop=True`)."""

    def __init__(self, loop: bool, sid: int):
        self.loop, self.id = loop, sid
        self.init = IndentedBuffer()
        self.body = IndentedBuffer()
        self.final = IndentedBuffer()
        self.cache: dict[str, Var] = {}


class TritonKernel:
    def __init__(self, group, scheduler, name: str, tile=None):
        self.group, self.scheduler, self.name = group, scheduler, name
        self.X, self.R = tile or (group.X, group.R)
        self.tiled = tile is not None   # a 2-D pointwise tile: rows x columns across programs
        self.is_red = group.is_reduction() or self.tiled
        rn = int(self.R) if sizevars.is_static(self.R) else None
        self.persistent = self.tiled or (self.is_red and choices.is_persistent(rn))
        self.args: dict[str, str] = {}            # buffer -> parameter
        self.size_symbols: set = set()
        self.sections: list[Section] = []
        self.tmp = itertools.count()
        self.values: dict[str, tuple] = {}        # buffer written here -> (section id, Var, index)
        self.producer = {n.name: n for n in group.nodes}
        self.mask_stack: list[str] = []
        self.recompute = False
        self.uses_assert = False
        self.int64 = any(sizevars.hint(self._numel(n)) >= 2**31 for n in group.nodes)
        self.comm = None                          # set by a peer read: the kernel synchronizes ranks
        self.new_section(loop=False)

    @staticmethod
    def _numel(node):
        return node.buf.layout.storage_numel()

    # ------------------------------------------------------------------ sections
    def new_section(self, loop: bool) -> Section:
        s = Section(loop, len(self.sections))
        if self.persistent and self.sections:
            s.cache = self.sections[-1].cache  # one block holds whole rows: values stay valid
        self.sections.append(s)
        return s

    @property
    def cur(self) -> Section:
        return self.sections[-1]

    def in_loop(self) -> bool:
        return self.cur.loop

    def shape(self) -> str:
        if not self.is_red:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if self.in_loop() else "[XBLOCK, 1]"

    def mask(self, loads=True) -> str:
        """Lanes in range; for loads also the masks of `ops.masked` and index bounds."""
        base = "xmask" if not self.in_loop() else "xmask & rmask"
        return " & ".join([base] + ([f"({m})" for m in self.mask_stack] if loads else []))

    # ------------------------------------------------------------------ emitting
    def newvar(self, expr: str, dtype: torch.dtype, cache=True) -> Var:
        key = expr
        if cache and key in self.cur.cache:
            return self.cur.cache[key]
        v = Var(f"tmp{next(self.tmp)}", dtype)
        self.cur.body.writeline(f"{v.name} = {expr}")
        if cache:
            self.cur.cache[key] = v
        return v

    def index_str(self, index: sympy.Expr) -> str:
        index = sizevars.simplify(index)
        for s in index.free_symbols:
            if s not in (XSYM, RSYM) and not s.name.startswith("tmp"):
                self.size_symbols.add(s)
        text = texpr(index.subs({XSYM: XNAME, RSYM: RNAME}))
        want = {XSYM, RSYM} if self.in_loop() else {XSYM}
        if not want <= index.free_symbols:
            text = f"({text}) + tl.zeros({self.shape()}, tl.{'int64' if self.int64 else 'int32'})"
        return text

    def arg(self, name: str) -> str:
        """The kernel parameter for a buffer (or for a comm argument, keyed with an '@')."""
        if name not in self.args:
            self.args[name] = name.replace("@", "_").lstrip("_") if "@" in name else f"ptr_{name}"
        return self.args[name]

    # ------------------------------------------------------------------ node placement
    def node_level_is_row(self, node) -> bool:
        return self.is_red and not self.tiled and not node.is_reduction() and sizevars.equal(node.numel(), self.X) \
            and not sizevars.equal(self.R, 1)

    def emit_node(self, node, recompute=False):
        row = self.node_level_is_row(node)
        if self.is_red and not recompute:
            if row and self.in_loop():
                self.new_section(loop=False)
            elif not row and (not self.in_loop() or self._reads_open_reduction(node)):
                self.new_section(loop=True)
        m = node.kernel_index_map(self.X, self.R)
        index = [sympy.sympify(v).subs(m) for v in index_vars("i", node.ranges)]
        rindex = [RSYM] if node.is_reduction() else None
        old, self.recompute = self.recompute, recompute
        masks = len(self.mask_stack)
        with V.set_ops(TritonOps(self)):
            result = run_node_body(node.buf, index, rindex)
        del self.mask_stack[masks:]  # bounds masks of indirect indices end with their node
        self.recompute = old
        return result

    def _reads_open_reduction(self, node) -> bool:
        """Does `node` need a reduction whose pass over R is still open?"""
        if self.persistent:
            return False
        for name in node.read_names:
            entry = self.values.get(name)
            if entry is not None and self.producer[name].is_reduction() and entry[0] == self.cur.id:
                return True
        return False

    # ------------------------------------------------------------------ loads and stores
    def load(self, name: str, index: sympy.Expr) -> Var:
        if name in self.producer:
            return self._internal_value(name)
        dtype = V.graph.get_dtype(name)
        ptr = self.arg(name)
        text = f"tl.load({ptr} + ({self.index_str(index)}), {self.mask()}, other=0)"
        if dtype == torch.bool:
            text += ".to(tl.int1)"
        elif compute_dtype(dtype) != dtype:
            text += ".to(tl.float32)"
        return self.newvar(text, dtype)

    def _internal_value(self, name: str) -> Var:
        entry = self.values.get(name)
        node = self.producer[name]
        if entry is not None:
            sid, var, _ = entry
            if node.is_reduction():  # a row value, final once its pass is closed
                assert self.persistent or sid < self.cur.id, f"{name} read before its reduction finished"
                return var
            if sid == self.cur.id or self.persistent or not self.sections[sid].loop or not self.is_red:
                return var
        # written in an earlier pass over R: recompute it here from its inputs
        return self.emit_node(node, recompute=True)

    def store(self, name: str, index: sympy.Expr, value: Var):
        self.values[name] = (self.cur.id, value, index)
        if self.recompute or name in self.scheduler.internal:
            return value
        dtype = V.graph.get_buffer(name).get_dtype()
        v = value.name
        if dtype != value.dtype or compute_dtype(dtype) != dtype:
            v = f"{v}.to({triton_dtype(dtype)})"
        self.cur.body.writeline(f"tl.store({self.arg(name)} + ({self.index_str(index)}), {v}, {self.mask(loads=False)})")
        return value

    def peer_reduce(self, name: str, index: sympy.Expr, reduce_op: str) -> Var:
        """Every rank's copy of comm buffer `name` at `index`, combined: an all-reduce element."""
        from . import comm as comm_codegen
        group = V.graph.comm_buffers[name][1]
        if self.comm is None:
            self.comm = comm_codegen.KernelComm(group, choices.group_size(group))
        assert self.comm.group == group, "one process group per kernel"
        idx, mask = self.index_str(index), self.mask()
        loads = [f"tl.load({self.arg(comm_codegen.peer_arg(name, r))} + ({idx}), {mask}, other=0).to(tl.float32)"
                 for r in range(self.comm.world)]
        return self.newvar(comm_codegen.combine(loads, reduce_op, self.comm.world), V.graph.get_dtype(name))

    # ------------------------------------------------------------------ reductions
    def reduction(self, dtype, src_dtype, rtype, value: Var) -> Var:
        acc_dtype = compute_dtype(dtype) if rtype not in ("argmax", "argmin") else compute_dtype(src_dtype)
        tacc = triton_dtype(acc_dtype)
        ident = self._identity(rtype, acc_dtype if rtype not in ("any", "all") else torch.bool)
        sec = self.cur
        masked = f"tl.where({self.mask()}, {value}, {ident})"
        out = Var(f"tmp{next(self.tmp)}", dtype)
        if rtype in ("argmax", "argmin"):
            combine = f"triton_helpers.{rtype}_combine"
            if self.persistent:
                sec.body.writeline(f"_, {out} = tl.reduce(({masked}, rindex + tl.zeros([XBLOCK, RBLOCK], tl.int32)), 1, {combine})")
            else:
                av, ai = f"{out}_val", f"{out}_idx"
                sec.init.writeline(f"{av} = tl.full([XBLOCK, RBLOCK], {ident}, {tacc})")
                sec.init.writeline(f"{ai} = tl.full([XBLOCK, RBLOCK], 2147483647, tl.int32)")
                sec.body.writeline(f"{av}_n, {ai}_n = {combine}({av}, {ai}, {masked}, rindex + tl.zeros([XBLOCK, RBLOCK], tl.int32))")
                sec.body.writeline(f"{av} = {av}_n")
                sec.body.writeline(f"{ai} = {ai}_n")
                sec.final.writeline(f"_, {out} = tl.reduce(({av}, {ai}), 1, {combine})")
            self._finish(sec, f"{out} = {out}[:, None].to(tl.int64)")
            return out
        reduce_fn = {
            "sum": "tl.sum({}, 1)", "prod": "tl.reduce({}, 1, triton_helpers.prod_combine)",
            "max": "tl.reduce({}, 1, triton_helpers.max_nan)", "min": "tl.reduce({}, 1, triton_helpers.min_nan)",
            "any": "(tl.max(({}).to(tl.int8), 1) != 0)", "all": "(tl.min(({}).to(tl.int8), 1) != 0)",
        }[rtype]
        combine = {
            "sum": "{a} + {b}", "prod": "{a} * {b}", "max": "triton_helpers.max_nan({a}, {b})",
            "min": "triton_helpers.min_nan({a}, {b})", "any": "{a} | {b}", "all": "{a} & {b}",
        }[rtype]
        src = masked if value.dtype == acc_dtype or rtype in ("any", "all") else f"{masked}.to({tacc})"
        if self.persistent:
            self._finish(sec, f"{out} = {reduce_fn.format(src)}[:, None]")
        else:
            acc = f"{out}_acc"
            tinit = tacc if rtype not in ("any", "all") else "tl.int1"
            sec.init.writeline(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {tinit})")
            sec.body.writeline(f"{acc} = {combine.format(a=acc, b=src)}")
            self._finish(sec, f"{out} = {reduce_fn.format(acc)}[:, None]")
        if rtype in ("any", "all") or compute_dtype(dtype) == acc_dtype:
            return out
        return out

    def _finish(self, sec: Section, line: str):
        (sec.body if self.persistent else sec.final).writeline(line)

    @staticmethod
    def _identity(rtype, dtype):
        if rtype in ("max", "argmax"):
            v = float("-inf") if dtype.is_floating_point else (0 if dtype == torch.bool else torch.iinfo(dtype).min)
        elif rtype in ("min", "argmin"):
            v = float("inf") if dtype.is_floating_point else (1 if dtype == torch.bool else torch.iinfo(dtype).max)
        else:
            v = IDENTITY[rtype]
        return literal(v, dtype)

    def store_reduction(self, name, index, value: Var):
        # the reduced value is a row-level value, valid from the end of this pass on
        sid = self.cur.id
        if not self.recompute and name not in self.scheduler.internal:
            dtype = V.graph.get_buffer(name).get_dtype()
            v = f"{value}.to({triton_dtype(dtype)})" if dtype != compute_dtype(dtype) or dtype != value.dtype else str(value)
            was = self.cur.loop
            self.cur.loop = False
            line = f"tl.store({self.arg(name)} + ({self.index_str(index)}), {v}, xmask)"
            self.cur.loop = was
            self._finish(self.cur, line)
        self.values[name] = (sid, value, index)
        return value

    # ------------------------------------------------------------------ rendering
    def render(self) -> tuple[str, dict]:
        for node in self.group.nodes:
            self.emit_node(node)
        if self.comm is not None:
            for a in self.comm.sync_args():
                self.arg(a)
        params = list(self.args.values())
        syms = sorted(self.size_symbols, key=str)
        params += [str(s) for s in syms] + ["xnumel"] + (["rnumel"] if self.is_red else [])
        consts = ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.is_red else [])
        code = IndentedBuffer()
        code.writeline("@triton.jit" + ("(debug=True)" if self.uses_assert else ""))
        code.writeline(f"def {self.name}({', '.join(params + consts)}):")
        with code.indent():
            pid = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
            code.writeline(f"xoffset = {pid} * XBLOCK")
            if self.is_red:
                code.writeline("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
                code.writeline("xmask = xindex < xnumel")
                code.writeline("rbase = tl.arange(0, RBLOCK)[None, :]")
            else:
                code.writeline("xindex = xoffset + tl.arange(0, XBLOCK)")
                code.writeline("xmask = xindex < xnumel")
            if self.comm is not None:  # every rank's input is written before anyone reads it
                self.comm.barrier(code, self.args)
            for sec in self.sections:
                if not sec.loop:
                    code.splice(sec.body)
                    continue
                if self.tiled:
                    code.writeline("rindex = tl.program_id(1) * RBLOCK + rbase")
                    code.writeline("rmask = rindex < rnumel")
                    code.splice(sec.body)
                    continue
                if self.persistent:
                    code.writeline("rindex = rbase")
                    code.writeline("rmask = rindex < rnumel")
                    code.splice(sec.body)
                    continue
                code.splice(sec.init)
                code.writeline("for roffset in range(0, rnumel, RBLOCK):")
                with code.indent():
                    code.writeline("rindex = roffset + rbase")
                    code.writeline("rmask = rindex < rnumel")
                    code.splice(sec.body)
                code.splice(sec.final)
            if self.comm is not None:  # nobody rewrites its input while a peer may still read it
                self.comm.barrier(code, self.args)
        meta = {"params": params, "size_symbols": syms, "reduction": self.is_red,
                "persistent": self.persistent, "tiled": self.tiled, "comm": self.comm}
        return code.getvalue(), meta


class TritonOps:
    """The `ops` handler that writes Triton."""

    def __init__(self, kernel: TritonKernel):
        self.k = kernel

    # memory
    def load(self, name, index):
        return self.k.load(name, index)

    def store(self, name, index, value, mode=None):
        return self.k.store(name, index, value)

    def reduction(self, dtype, src_dtype, rtype, value):
        return self.k.reduction(dtype, src_dtype, rtype, value)

    def peer_reduce(self, name, index, reduce_op):
        return self.k.peer_reduce(name, index, reduce_op)

    def store_reduction(self, name, index, value):
        return self.k.store_reduction(name, index, value)

    # values
    def constant(self, value, dtype):
        cd = compute_dtype(dtype)
        return self.k.newvar(f"tl.full({self.k.shape()}, {literal(value, cd)}, {triton_dtype(cd)})", dtype)

    def index_expr(self, expr, dtype):
        cd = compute_dtype(dtype)
        return self.k.newvar(f"({self.k.index_str(sympy.sympify(expr))}).to({triton_dtype(cd)})", dtype)

    def to_dtype(self, x, dtype):
        if x.dtype == dtype:
            return x
        if dtype == torch.bool:
            return self.k.newvar(f"({x} != 0)", dtype)
        cd = compute_dtype(dtype)
        text = f"{x}.to({triton_dtype(dtype)})"
        if cd != dtype:  # round to the narrow type, keep computing in fp32
            src = x if x.dtype.is_floating_point else f"{x}.to(tl.float32)"  # int->bf16 goes via fp32
            text = f"{src}.to({triton_dtype(dtype)}).to(tl.float32)"
        elif compute_dtype(x.dtype) == cd:
            return Var(x.name, dtype)
        return self.k.newvar(text, dtype)

    def indirect_indexing(self, value, size, check=True):
        k = self.k
        size_s = k.index_str(sympy.sympify(size)) if not sympy.sympify(size).is_number else str(size)
        wrapped = k.newvar(f"tl.where({value} < 0, {value} + {size_s}, {value})", value.dtype)
        if check:
            k.uses_assert = True
            k.cur.body.writeline(f"tl.device_assert((({wrapped} >= 0) & ({wrapped} < {size_s})) | ~({k.mask()}), "
                                 f"\"index out of bounds: 0 <= index < {size}\")")
        k.mask_stack.append(f"({wrapped} >= 0) & ({wrapped} < {size_s})")
        return sympy.Symbol(wrapped.name, integer=True)

    def masked(self, mask, body, other):
        k = self.k
        k.mask_stack.append(str(mask))
        saved = dict(k.cur.cache)
        try:
            result = body()
        finally:
            k.mask_stack.pop()
            k.cur.cache.clear()
            k.cur.cache.update(saved)
        other_v = self.constant(other, result.dtype)
        return k.newvar(f"tl.where({mask}, {result}, {other_v})", result.dtype, cache=False)

    def where(self, c, a, b):
        return self._op(f"tl.where({c}, {a}, {b})", _promote(a, b))

    # arithmetic
    def _op(self, text, dtype):
        return self.k.newvar(text, dtype)

    def _bin(self, fmt, a, b, dtype=None):
        return self._op(fmt.format(a=a, b=b), dtype or _promote(a, b))

    def add(self, a, b): return self._bin("{a} | {b}" if _promote(a, b) == torch.bool else "{a} + {b}", a, b)
    def sub(self, a, b): return self._bin("{a} - {b}", a, b)
    def mul(self, a, b): return self._bin("{a} & {b}" if _promote(a, b) == torch.bool else "{a} * {b}", a, b)
    def truediv(self, a, b): return self._bin("{a} / {b}", a, b)
    def neg(self, a): return self._op(f"-{a}", a.dtype)
    def abs(self, a): return self._op(f"tl.abs({a})", a.dtype) if a.dtype != torch.bool else a
    def square(self, a): return self.mul(a, a)

    def floordiv(self, a, b):
        return self._bin("triton_helpers.div_floor({a}, {b})", a, b)

    def truncdiv(self, a, b):
        return self._bin("{a} // {b}", a, b)

    def remainder(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("{a} - {b} * tl.floor({a} / {b})", a, b)
        return self._bin("triton_helpers.remainder_int({a}, {b})", a, b)

    def fmod(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("{a} - {b} * triton_helpers.trunc({a} / {b})", a, b)
        return self._bin("{a} % {b}", a, b)

    def pow(self, a, b):
        return self._bin("triton_helpers.pow_float({a}, {b})", a, b)

    def maximum(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("triton_helpers.max_nan({a}, {b})", a, b)
        return self._bin("tl.maximum({a}, {b})", a, b)

    def minimum(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("triton_helpers.min_nan({a}, {b})", a, b)
        return self._bin("tl.minimum({a}, {b})", a, b)

    def fmax(self, a, b):
        return self._bin("tl.where(({a} >= {b}) | ({b} != {b}), {a}, {b})", a, b)

    def fmin(self, a, b):
        return self._bin("tl.where(({a} <= {b}) | ({b} != {b}), {a}, {b})", a, b)

    def relu(self, a):
        if a.dtype == torch.bool:
            return a
        return self._op(f"tl.where({a} < 0, 0, {a})", a.dtype)

    def sign(self, a):
        if a.dtype == torch.bool:
            return a
        return self._op(f"(({a} > 0).to({triton_dtype(compute_dtype(a.dtype))}) - ({a} < 0).to({triton_dtype(compute_dtype(a.dtype))}))", a.dtype)

    def copysign(self, a, b):
        return self._bin("tl.where(" + self._signbit_text("{b}") + ", -tl.abs({a}), tl.abs({a}))", a, b)

    def _signbit_text(self, x):
        return f"triton_helpers.signbit32({x})"

    def signbit(self, a):
        if not a.dtype.is_floating_point:
            return self._op(f"{a} < 0", torch.bool)
        fn = "signbit64" if a.dtype == torch.float64 else "signbit32"
        return self._op(f"triton_helpers.{fn}({a})", torch.bool)

    def hypot(self, a, b): return self._bin("tl.sqrt({a} * {a} + {b} * {b})", a, b)
    def atan2(self, a, b): return self._bin("triton_helpers.atan2({a}, {b})", a, b)

    # comparisons and logic
    def eq(self, a, b): return self._bin("{a} == {b}", a, b, torch.bool)
    def ne(self, a, b): return self._bin("{a} != {b}", a, b, torch.bool)
    def lt(self, a, b): return self._bin("{a} < {b}", a, b, torch.bool)
    def le(self, a, b): return self._bin("{a} <= {b}", a, b, torch.bool)
    def gt(self, a, b): return self._bin("{a} > {b}", a, b, torch.bool)
    def ge(self, a, b): return self._bin("{a} >= {b}", a, b, torch.bool)
    def logical_and(self, a, b): return self._bin("({a} != 0) & ({b} != 0)", a, b, torch.bool)
    def logical_or(self, a, b): return self._bin("({a} != 0) | ({b} != 0)", a, b, torch.bool)
    def logical_xor(self, a, b): return self._bin("({a} != 0) ^ ({b} != 0)", a, b, torch.bool)
    def logical_not(self, a): return self._op(f"{a} == 0", torch.bool)
    def bitwise_and(self, a, b): return self._bin("{a} & {b}", a, b)
    def bitwise_or(self, a, b): return self._bin("{a} | {b}", a, b)
    def bitwise_xor(self, a, b): return self._bin("{a} ^ {b}", a, b)
    def bitwise_not(self, a):
        return self._op(f"{a} == 0" if a.dtype == torch.bool else f"~{a}", a.dtype)
    def bitwise_left_shift(self, a, b): return self._bin("{a} << {b}", a, b)
    def bitwise_right_shift(self, a, b): return self._bin("{a} >> {b}", a, b)
    def isnan(self, a): return self._op(f"{a} != {a}", torch.bool)
    def isinf(self, a):
        if not a.dtype.is_floating_point:
            return self._op(f"{a} != {a}", torch.bool)
        return self._op(f"tl.abs({a}) == float(\"inf\")", torch.bool)

    # math
    def _f(self, fn, a):
        return self._op(f"{fn}({a})", a.dtype)

    def exp(self, a): return self._f("tl.exp", a)
    def exp2(self, a): return self._f("tl.exp2", a)
    def log(self, a): return self._f("tl.log", a)
    def log2(self, a): return self._f("tl.log2", a)
    def log10(self, a): return self._op(f"tl.log({a}) * 0.4342944819032518", a.dtype)
    def sqrt(self, a): return self._f("tl.sqrt", a)
    def rsqrt(self, a): return self._f("tl.rsqrt", a)
    def sin(self, a): return self._f("tl.sin", a)
    def cos(self, a): return self._f("tl.cos", a)
    def tan(self, a): return self._op(f"tl.sin({a}) / tl.cos({a})", a.dtype)
    def erf(self, a): return self._f("tl.erf", a)
    def floor(self, a): return self._f("tl.floor", a) if a.dtype.is_floating_point else a
    def ceil(self, a): return self._f("tl.ceil", a) if a.dtype.is_floating_point else a
    def reciprocal(self, a): return self._op(f"1.0 / {a}", a.dtype)
    def sigmoid(self, a): return self._f("tl.sigmoid", a)

    def __getattr__(self, name):
        helper = {"tanh", "expm1", "log1p", "atan", "asin", "acos", "sinh", "cosh", "asinh",
                  "acosh", "atanh", "erfc"}
        if name in helper:
            return lambda a: self._f(f"triton_helpers.{name}", a)
        if name == "trunc":
            return lambda a: self._f("triton_helpers.trunc", a) if a.dtype.is_floating_point else a
        if name == "round":
            return lambda a: self._f("triton_helpers.round_half_even", a) if a.dtype.is_floating_point else a
        raise NotImplementedError(f"commfuse cannot generate Triton code for ops.{name}")


def _promote(a, b) -> torch.dtype:
    da = a.dtype if isinstance(a, Var) else torch.float32
    db = b.dtype if isinstance(b, Var) else torch.float32
    return torch.promote_types(da, db)


def choose_tile(group):
    """(rows, columns) for a pointwise group that reads some buffer transposed to how it
    writes: tiling both axes keeps loads and stores coalesced. None keeps it 1-D."""
    if group.is_reduction() or group.is_extern():
        return None
    ranges = group.nodes[0].ranges
    for k in range(1, len(ranges)):
        X, R = sizevars.product(ranges[:k]), sizevars.product(ranges[k:])
        if X == 1 or R == 1 or any(n.kernel_index_map(X, R) is None for n in group.nodes):
            continue
        g = type(group)(group.nodes, X, R, group.order)
        reads_t = writes_c = False
        for _, kind, _, index in g.kernel_accesses():
            aff = index is not None and sizevars.affine_coefficients(index, [XSYM, RSYM])
            if not aff:
                continue
            (cx, cr), _ = aff
            if kind == "read" and cx == 1 and cr != 1:
                reads_t = True
            if kind == "write" and cr == 1:
                writes_c = True
        if reads_t and writes_c and choices.should_tile(sizevars.hint(X), sizevars.hint(R)):
            return X, R
    return None
