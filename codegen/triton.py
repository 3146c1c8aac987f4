"""Triton kernels for fused groups.

A kernel walks X rows (program axis 0, XBLOCK at a time) and, for reductions, R
elements per row: in one block when the row fits (persistent), else in a loop.
Each node body runs under `TritonOps`, which turns `ops` calls into Triton lines
with common-subexpression elimination. A value produced inside the kernel and read
at the same index is taken from registers; a buffer nobody outside reads is never
stored.
"""
from __future__ import annotations

import contextlib
import functools
import itertools

import sympy
import torch

from commfuse import config, ir, sizevars
from commfuse.scheduler import RSYM, XSYM
from commfuse.virtualized import V

from . import comm as comm_codegen
from .block_ptr import Axis, block_ptr
from .common import AFTER_PREDECESSOR, IndentedBuffer, compute_dtype, literal, texpr, triton_dtype
from .triton_ops import TritonOps, Var, store_text

XNAME, RNAME = sympy.Symbol("xindex", integer=True, nonnegative=True), \
    sympy.Symbol("rindex", integer=True, nonnegative=True)
XPID, RBASE = sympy.Symbol("xpid", integer=True, nonnegative=True), \
    sympy.Symbol("rbase", integer=True, nonnegative=True)  # a mixed-order kernel's program, columns

IDENTITY = {"sum": 0, "prod": 1, "any": False, "all": True}


class Section:
    """Straight-line code at row level (`loop=False`) or one pass over R (`loop=True`)."""

    def __init__(self, loop: bool, sid: int):
        self.loop, self.id = loop, sid
        self.init = IndentedBuffer()
        self.body = IndentedBuffer()
        self.final = IndentedBuffer()
        self.cache: dict[str, Var] = {}
        self.row_values: dict[tuple, Var] = {}  # (reduction, source) -> row value already computed


class TritonKernel:
    def __init__(self, group, scheduler, name: str, shape):
        self.group, self.scheduler, self.name, self.kernel_shape = group, scheduler, name, shape
        self.internal = scheduler.kernel_internal(group.nodes)  # values never stored
        self.X, self.R = shape.X, shape.R
        self.tiled = shape.kind == "tiled"   # a 2-D pointwise tile: rows x columns across programs
        self.is_red = group.is_reduction() or self.tiled
        self.persistent = shape.persistent
        self.args: dict[str, str] = {}            # buffer -> parameter
        self.size_symbols: set = set()
        self.sections: list[Section] = []
        self.tmp = itertools.count()
        self.values: dict[str, tuple] = {}        # buffer written here -> (section id, Var, index)
        self.producer = {n.name: n for n in group.nodes}
        self.mask_stack: list[str] = []
        self.recompute = False
        self.uses_assert = False
        self.block_ptr_accesses: set[str] = set()
        self.int64 = self._needs_int64(group)
        self.comm = None                          # set by a peer read: the kernel synchronizes ranks
        self.published: set[str] = set()          # comm buffers this kernel wrote, then synchronized on
        self.reads_outside_peers = False          # peer reads of buffers earlier kernels wrote
        self.comm_buffers: set = set()            # the comm buffers whose peers' copies it reads
        self.two_shot: dict[str, tuple] = {}      # comm buffer -> (index, mask, reduce op, value)
        self.partial = False                      # emitting a column sum's partial (mix_order.py)
        self.partials = (IndentedBuffer(), IndentedBuffer())  # their accumulators; their stores
        self.new_section(loop=False)

    @staticmethod
    def _needs_int64(group) -> bool:
        # an index past int32 in a buffer it writes or reads (the last rows of a huge input lie
        # beyond 2**31 however few elements the kernel computes)
        bufs = [n.buf for n in group.nodes] + [V.graph.name_to_buffer.get(r) or V.graph.graph_inputs.get(r)
                                               for r in group.read_names]
        return any(sizevars.hint(b.layout.storage_numel()) >= 2**31 for b in bufs
                   if hasattr(getattr(b, "layout", None), "storage_numel"))

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

    def simplify_index(self, index: sympy.Expr) -> sympy.Expr:
        """Simplified knowing the kernel's ranges; size symbols it uses become parameters."""
        index = sizevars.simplify_with_ranges(index, {XSYM: self.X, RSYM: self.R})
        for s in index.free_symbols:
            if s not in (XSYM, RSYM) and not s.name.startswith("tmp"):
                self.size_symbols.add(s)
        return index

    def past_int32(self, expr: sympy.Expr) -> bool:
        """May `expr` (an integer value computed from the indices) leave int32 over the kernel's
        ranges? At the ranges' ends (and for its constants), by the size hints."""
        ends = [{XSYM: x, RSYM: r} for x in (0, self.X - 1) for r in (0, self.R - 1)]
        values = [abs(int(a)) for a in expr.atoms(sympy.Integer)] + [abs(sizevars.hint(expr.subs(e))) for e in ends]
        return max(values, default=0) >= 2**31

    def index_str(self, index: sympy.Expr) -> str:
        index = self.simplify_index(index)
        text = texpr(index.subs({XSYM: XNAME, RSYM: RNAME}))
        want = {XSYM, RSYM} if self.in_loop() else {XSYM}
        if not want <= index.free_symbols:
            text = f"({text}) + tl.zeros({self.shape()}, tl.{'int64' if self.int64 else 'int32'})"
        return text

    def block_ptr(self, index: sympy.Expr, store=False):
        """The N-D box this access addresses, where block pointers are on and apply."""
        if not config.use_block_ptr or self.mask_stack or not (sizevars.is_static(self.X) and
                                                                sizevars.is_static(self.R)):
            return None
        index = self.simplify_index(index)
        if any(s.name.startswith("tmp") for s in index.free_symbols):  # indirect
            return None
        blocks = self.kernel_shape.blocks
        axes = [Axis(XSYM, int(self.X), "XBLOCK", "xoffset", blocks["XBLOCK"])]
        if not self.is_red:
            target = ["XBLOCK"]
        elif self.in_loop():
            roffset = "roffset" if not self.persistent or self.tiled else "0"
            axes.append(Axis(RSYM, int(self.R), "RBLOCK", roffset, blocks["RBLOCK"]))
            target = ["XBLOCK", "RBLOCK"]
        else:
            target = ["XBLOCK", "1"]
        return block_ptr(index, axes, target, store)

    @property
    def kind(self) -> str:
        return self.kernel_shape.kind

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
        index = node.body_index(m)
        rindex = [m.get(RSYM, RSYM)] if node.is_reduction() else None  # a column partial's: a row
        old, self.recompute, self.partial = self.recompute, recompute, node.column_partial
        masks = len(self.mask_stack)
        with V.set_ops(TritonOps(self)):
            result = node.run_body(index, rindex)
        del self.mask_stack[masks:]  # bounds masks of indirect indices end with their node
        self.recompute, self.partial = old, False
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
        row = self._row_load(ptr, index)
        bp = None if row else self.block_ptr(index)
        if row:
            text = row
        elif bp:
            text = bp.load(ptr)
            self.block_ptr_accesses.add(text)
        else:
            text = f"tl.load({ptr} + ({self.index_str(index)}), {self.mask()}, other=0)"
        if dtype == torch.bool:
            text += ".to(tl.int1)"
        elif compute_dtype(dtype) != dtype:
            text += ".to(tl.float32)"
        if row and not self.persistent and text not in self.cur.cache:  # before the pass: once per row
            body, self.cur.body = self.cur.body, self.cur.init
            try:
                return self.newvar(text, dtype)
            finally:
                self.cur.body = body
        return self.newvar(text, dtype)

    def _row_load(self, ptr: str, index: sympy.Expr) -> str | None:
        """In a pass over R, a load the same for every r (a row's statistic, a scalar) as one
        [XBLOCK, 1] load: broadcast per lane, it issued RBLOCK / threads loads per row and element
        (3x slower for a vocabulary-wide loss backward on H200)."""
        if not self.is_red or self.tiled or not self.in_loop() or self.mask_stack:
            return None
        index = self.simplify_index(index)
        if RSYM in index.free_symbols or any(s.name.startswith("tmp") for s in index.free_symbols):
            return None
        text = texpr(index.subs({XSYM: XNAME}))
        if XSYM not in index.free_symbols:
            text = f"({text}) + tl.zeros([XBLOCK, 1], tl.{'int64' if self.int64 else 'int32'})"
        return f"tl.load({ptr} + ({text}), xmask, other=0)"

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
        if self.recompute or name in self.internal:
            return value
        layout = V.graph.get_buffer(name).layout
        v = store_text(value.name, value.dtype, layout.dtype)
        bp = self.block_ptr(index, store=True)
        if bp:
            if layout.dtype == torch.bool:  # block pointers take the stored type exactly: bools are bytes
                v = f"{v}.to(tl.int8)"
            line = bp.store(self.arg(name), v)
            self.block_ptr_accesses.add(line)
        else:
            scatter = isinstance(layout, ir.ScatterLayout)  # at positions read from the device: in bounds only
            line = f"tl.store({self.arg(name)} + ({self.index_str(index)}), {v}, {self.mask(loads=scatter)})"
        self.cur.body.writeline(line)
        return value

    def _join_comm(self, name: str):
        """The plan of comm buffer `name`, whose peers' copies this kernel reads: it synchronizes
        with the ranks of the plan's group."""
        plan = V.graph.comm_plan(name)
        if self.comm is None:
            self.comm = comm_codegen.KernelComm(plan.group, plan.world)
            for a in self.comm.sync_args():
                self.arg(a)
        assert self.comm.group == plan.group, "one process group per kernel"
        self.comm_buffers.add(name)
        if name not in self.values:
            self.reads_outside_peers = True
        return plan

    def peer_reduce(self, name: str, index: sympy.Expr, reduce_op: str, shard=0) -> Var:
        """Every rank's copy of comm buffer `name` at `index`, combined: an all-reduce element; with
        `shard`, at `rank * shard + index`: this rank's element of a reduce-scatter."""
        plan = self._join_comm(name)
        if plan.algorithm.gathers_shares:
            return self._gather_share(name, index, reduce_op)
        if name in self.values and name not in self.published:
            assert not shard, "a reduce-scatter's input is written by an earlier kernel"
            # the prologue wrote our copy in this kernel: publish it before anyone reads
            self.comm.barrier(self.cur.body, self.args, release=True)
            self.published |= {n for n in self.values if V.graph.comm_plan(n)}
        idx = self.index_str(index)
        if shard:
            idx = f"{self._rank_value()} * {shard} + ({idx})"
        loads = self._peer_loads(name, idx, lambda r: self.mask())
        return self.newvar(comm_codegen.combine(loads, reduce_op, self.comm.world), V.graph.get_dtype(name))

    def _rank_value(self) -> str:
        """This rank in the group, wide enough for the kernel's indices (a specialized 1 is a constexpr)."""
        rank = self.args["@rank"]
        return f"tl.full([], {rank}, tl.int64)" if self.int64 else rank

    def peer_load(self, name: str, index: sympy.Expr, peer: sympy.Expr) -> Var:
        """Rank `peer`'s copy of comm buffer `name` at `index`: an all-gather element. Each lane
        picks its peer's pointer, so one load per element, whichever rank holds it."""
        self._join_comm(name)
        assert name not in self.values, "an all-gather's input is written by an earlier kernel"
        ptrs = [self.arg(comm_codegen.peer_arg(name, r)) for r in range(self.comm.world)]
        peer = self.simplify_index(peer)
        rows = peer.args[1] if isinstance(peer, sizevars.FloorDiv) and peer.args[0] == XSYM else None
        if rows is not None and not self.tiled and rows.is_Integer and int(rows) % self.kernel_shape.blocks["XBLOCK"] == 0:
            who = "(xoffset // " + str(rows) + ")"  # one rank per block: a uniform pointer, loads stay vectorized
        else:
            who = self.newvar(self.index_str(peer), torch.int32)
        ptr = functools.reduce(lambda p, r: f"tl.where({who} == {r}, {ptrs[r]}, {p})", range(len(ptrs) - 2, -1, -1), ptrs[-1])
        dtype = V.graph.get_dtype(name)
        cast = ".to(tl.float32)" if compute_dtype(dtype) != dtype else ""
        return self.newvar(f"tl.load({ptr} + ({self.index_str(index)}), {self.mask()}, other=0){cast}", dtype)

    def _peer_loads(self, name: str, idx: str, mask_of) -> list[str]:
        """Every rank's copy of comm buffer `name` at `idx` (as fp32), rank r's under `mask_of(r)`."""
        return [f"tl.load({self.arg(comm_codegen.peer_arg(name, r))} + ({idx}), {mask_of(r)}, other=0).to(tl.float32)"
                for r in range(self.comm.world)]

    def _share_owner(self) -> str:
        """The rank that reduces an element: a contiguous 1/W of each block's columns (or lanes)."""
        w = self.comm.world
        return f"(rindex * {w}) // rnumel" if self.is_red else f"((xindex - xoffset) * {w}) // XBLOCK"

    def _gather_share(self, name: str, index: sympy.Expr, reduce_op: str) -> Var:
        """Two-shot, as its plan says (the scheduler checked that this kernel can gather the shares:
        `fit_comm_plans`): the element from the rank that reduced it."""
        assert name not in self.values and not self.mask_stack and (not self.is_red or self.persistent and self.in_loop()), \
            f"two-shot read of {name} in a kernel that cannot gather shares (Scheduler.fit_comm_plans)"
        idx, mask = self.index_str(index), self.mask()
        if name in self.two_shot:
            assert self.two_shot[name][0] == idx, f"two-shot buffer {name} read at two indices"
            return self.two_shot[name][3]
        self.arg(name)  # our own copy: where `_reduce_shares` stores this rank's share
        owner = self._share_owner()
        loads = self._peer_loads(name, idx, lambda r: f"{mask} & ({owner} == {r})")  # one of them per lane
        value = self.newvar(functools.reduce(lambda v, r: f"tl.where({owner} == {r}, {loads[r]}, {v})",  # not a sum:
                                             range(len(loads) - 2, -1, -1), loads[-1]), V.graph.get_dtype(name))  # -0 + 0 = +0
        self.two_shot[name] = (idx, mask, reduce_op, value)
        return value

    def _reduce_shares(self, code: IndentedBuffer) -> None:
        """Two-shot's first pass: this rank's share of each block, reduced over the peers, stored
        into its own copy, where the peers gather it from once the barrier after it is passed."""
        with self._block_loop(code):
            code.writeline(f"mine = ({self._share_owner()}) == {self.args['@rank']}")
            for name, (idx, mask, reduce_op, _) in self.two_shot.items():
                loads = self._peer_loads(name, idx, lambda r: f"{mask} & mine")
                acc = comm_codegen.combine(loads, reduce_op, self.comm.world)
                dtype = V.graph.get_dtype(name)
                code.writeline(f"tl.store({self.arg(name)} + ({idx}), {store_text(f'({acc})', torch.float32, dtype)}, "
                               f"{mask} & mine)")

    # ------------------------------------------------------------------ reductions
    def reduction(self, dtype, src_dtype, rtype, value: Var) -> Var:
        if self.partial:
            return self._column_partial(dtype, rtype, value)
        if rtype in ("argmax", "argmin"):
            return self._arg_reduction(src_dtype, rtype, value)
        if rtype == "softmax_sum":
            return self._softmax_sum(dtype, value)
        if rtype == "welford_m2":
            return self._welford_m2(dtype, value)
        acc_dtype = compute_dtype(dtype)
        tacc = triton_dtype(acc_dtype)
        ident = self._identity(rtype, acc_dtype if rtype not in ("any", "all") else torch.bool)
        sec = self.cur
        masked = f"tl.where({self.mask()}, {value}, {ident})"
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
        if self.persistent:  # through the CSE cache: equal reductions of one row are computed once
            return self.newvar(f"{reduce_fn.format(src)}[:, None]", dtype)
        if (rtype, src) in sec.row_values:
            return sec.row_values[(rtype, src)]
        out = Var(f"tmp{next(self.tmp)}", dtype)
        acc = f"{out}_acc"
        tinit = tacc if rtype not in ("any", "all") else "tl.int1"
        sec.init.writeline(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {tinit})")
        sec.body.writeline(f"{acc} = {combine.format(a=acc, b=src)}")
        sec.final.writeline(f"{out} = {reduce_fn.format(acc)}[:, None]")
        sec.row_values[(rtype, src)] = out  # the same reduction of the same values: one accumulator
        return out

    def _arg_reduction(self, src_dtype, rtype, value: Var) -> Var:
        acc_dtype = compute_dtype(src_dtype)
        tacc = triton_dtype(acc_dtype)
        ident = self._identity(rtype, acc_dtype)
        sec = self.cur
        masked = f"tl.where({self.mask()}, {value}, {ident})"
        out = Var(f"tmp{next(self.tmp)}", torch.int64)
        combine = f"triton_helpers.{rtype}_combine"
        if self.persistent:
            sec.body.writeline(f"_, {out} = tl.reduce(({masked}, rindex + tl.zeros([XBLOCK, RBLOCK], tl.int32)), 1, {combine})")
        else:
            av, ai = f"{out}_val", f"{out}_idx"
            self._carry(sec, [(av, f"tl.full([XBLOCK, RBLOCK], {ident}, {tacc})"),
                              (ai, "tl.full([XBLOCK, RBLOCK], 2147483647, tl.int32)")],
                        f"{combine}({av}, {ai}, {masked}, rindex + tl.zeros([XBLOCK, RBLOCK], tl.int32))")
            sec.final.writeline(f"_, {out} = tl.reduce(({av}, {ai}), 1, {combine})")
        self._finish(sec, f"{out} = {out}[:, None].to(tl.int64)")
        return out

    @staticmethod
    def _carry(sec: Section, accs: list, update: str) -> None:
        """Per-lane accumulators (name, initial value) carried through a loop by `update`."""
        for name, init in accs:
            sec.init.writeline(f"{name} = {init}")
        sec.body.writeline(", ".join(f"{name}_n" for name, _ in accs) + f" = {update}")
        for name, _ in accs:
            sec.body.writeline(f"{name} = {name}_n")

    def _welford_m2(self, dtype, value: Var) -> Var:  # sum((v - mean(v))**2) over the row, one pass
        tacc = triton_dtype(compute_dtype(dtype))
        sec = self.cur
        src = str(value) if value.dtype == compute_dtype(dtype) else f"{value}.to({tacc})"
        zeros = f"tl.zeros([XBLOCK, RBLOCK], {tacc})"
        out = Var(f"tmp{next(self.tmp)}", dtype)
        if self.persistent:  # the row is in registers: its mean, then the deviations from it
            v = self.newvar(f"tl.where({self.mask()}, {src}, 0.0)", dtype)
            mean = self.newvar(f"tl.sum({v}, 1)[:, None] / rnumel", dtype)  # every lane below rnumel counts
            sec.body.writeline(f"{out} = tl.sum(tl.where({self.mask()}, ({v} - {mean}) * ({v} - {mean}), 0.0), 1)")
        else:
            mean, m2, count = f"{out}_mean", f"{out}_m2", f"{out}_count"
            self._carry(sec, [(mean, zeros), (m2, zeros), (count, zeros)],
                        f"triton_helpers.welford_update({mean}, {m2}, {count}, {src}, {self.mask()})")
            sec.final.writeline(f"_, {out}, _ = tl.reduce(({mean}, {m2}, {count}), 1, triton_helpers.welford_combine)")
        self._finish(sec, f"{out} = {out}[:, None]")
        return out

    def _softmax_sum(self, dtype, value: Var) -> Var:
        """sum(exp(v - max(v))) over the row. A whole row in registers: its max, then the sum.
        A looped row: one pass keeping per lane a running max and the sum rescaled to it
        (online softmax), combined across lanes at the end."""
        tacc = triton_dtype(compute_dtype(dtype))
        sec = self.cur
        src = f"tl.where({self.mask()}, {value}, float(\"-inf\"))"
        if value.dtype != compute_dtype(dtype):
            src = f"{src}.to({tacc})"
        if self.persistent:
            m = self.newvar(f"tl.reduce({src}, 1, triton_helpers.max_nan)[:, None]", dtype)
            v = self.newvar(src, dtype)
            return self.newvar(f"tl.sum(triton_helpers.exp_shifted({v}, {m}), 1)[:, None]", dtype)
        out = Var(f"tmp{next(self.tmp)}", dtype)
        m, s = f"{out}_max", f"{out}_sum"
        self._carry(sec, [(m, f"tl.full([XBLOCK, RBLOCK], float(\"-inf\"), {tacc})"),
                          (s, f"tl.zeros([XBLOCK, RBLOCK], {tacc})")],
                    f"triton_helpers.online_softmax_update({m}, {s}, {src})")
        rowmax = Var(f"{out}_rowmax", dtype)
        sec.final.writeline(f"{rowmax} = tl.reduce({m}, 1, triton_helpers.max_nan)[:, None]")
        sec.final.writeline(f"{out} = tl.sum(triton_helpers.online_softmax_rescale({s}, {m}, {rowmax}), 1)[:, None]")
        sec.row_values[("max", src)] = rowmax  # a max of the same values in this pass is this one
        return out

    def _column_partial(self, dtype, rtype, value: Var) -> Var:
        """A column sum of a mixed-order kernel (mix_order.py): lane by lane over the blocks of
        rows this program visits, then over the rows of the block, once at the end."""
        assert rtype == "sum", rtype
        tacc = triton_dtype(compute_dtype(dtype))
        out = Var(f"tmp{next(self.tmp)}", dtype)
        src = f"tl.where({self.mask()}, {value}, 0)" + (f".to({tacc})" if value.dtype != compute_dtype(dtype) else "")
        self.partials[0].writeline(f"{out}_acc = tl.zeros([XBLOCK, RBLOCK], {tacc})")
        self.cur.body.writeline(f"{out}_acc = {out}_acc + {src}")
        self.partials[1].writeline(f"{out} = tl.sum({out}_acc, 0)[None, :]")
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
        if self.partial:  # this program's partial: row `xpid` of the parts
            layout = V.graph.get_buffer(name).layout
            index = layout.index([XPID] + sizevars.unravel(RBASE, layout.size[1:]))
            self.partials[1].writeline(f"tl.store({self.arg(name)} + ({texpr(sizevars.simplify(index))}), "
                                       f"{store_text(str(value), value.dtype, layout.dtype)}, rbase < rnumel)")
            return value
        if not self.recompute and name not in self.internal:
            dtype = V.graph.get_buffer(name).get_dtype()
            v = store_text(str(value), value.dtype, dtype)
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
        params = list(self.args.values())
        syms = sorted(self.size_symbols, key=str)
        params += [str(s) for s in syms] + ["xnumel"] + (["rnumel"] if self.is_red else [])
        consts = ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.is_red else [])
        code = IndentedBuffer()
        code.writeline("@triton.jit" + ("(debug=True)" if self.uses_assert else ""))
        typed = [f"{p}: tl.float64" if sympy.Symbol(p) in V.graph.float_scalars else p for p in params]
        code.writeline(f"def {self.name}({', '.join(typed + consts)}):")
        with code.indent():
            if self.comm is None and V.choices.dependent_launch(self.group.nodes[0].device):
                code.writeline(AFTER_PREDECESSOR)
            if self.is_red:
                code.writeline("rbase = tl.arange(0, RBLOCK)[None, :]" + (".to(tl.int64)" if self.int64 else ""))
            if self.comm is None and self.group.mixed_programs:  # programs stride over the rows
                code.writeline("xpid = tl.program_id(0)" + (".to(tl.int64)" if self.int64 else ""))
                code.splice(self.partials[0])
                with self._block_loop(code):
                    self._render_sections(code)
                code.splice(self.partials[1])
            elif self.comm is None:
                pid = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
                self._block_header(code, f"{pid} * XBLOCK")
                self._render_sections(code)
            else:
                # every rank's input is written before anyone reads it
                self.comm.enter(code, self.args, wait=self.reads_outside_peers)
                if self.two_shot:
                    self._reduce_shares(code)
                    self.comm.barrier(code, self.args, release=True)
                with self._block_loop(code):
                    self._render_sections(code)
                # nobody rewrites its input while a peer may still read it, or until the next comm kernel
                self.comm.leave(code, self.args, wait=not self.comm_buffers <= getattr(self.scheduler, "comm_exit_covered", set()))
        meta = {"params": params, "size_symbols": syms, "reduction": self.is_red, "kind": self.kind,
                "persistent": self.persistent, "tiled": self.tiled,
                "block_ptrs": len(self.block_ptr_accesses), "comm": self.comm,
                "two_shot": sorted(self.two_shot), "asserts": self.uses_assert,
                # a looped row walked again after its reduction computes its values a second time
                "recomputes": self.is_red and not self.persistent and sum(s.loop for s in self.sections) > 1}
        return code.getvalue(), meta

    def _block_header(self, code: IndentedBuffer, offset: str) -> None:
        if offset != "xoffset":
            code.writeline(f"xoffset = {offset}")
        code.writeline("xindex = xoffset + tl.arange(0, XBLOCK)" + ("[:, None]" if self.is_red else ""))
        code.writeline("xmask = xindex < xnumel")
        if self.persistent and not self.tiled:
            code.writeline("rindex = rbase")
            code.writeline("rmask = rindex < rnumel")

    @contextlib.contextmanager
    def _block_loop(self, code: IndentedBuffer):
        """A kernel that reads peers keeps its grid small (every program must be resident to meet
        its peers at the barriers): each program strides over the blocks."""
        pid = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        code.writeline(f"for xoffset in range({pid} * XBLOCK, xnumel, tl.num_programs(0) * XBLOCK):")
        with code.indent():
            self._block_header(code, "xoffset")
            yield

    def _render_sections(self, code: IndentedBuffer) -> None:
        for sec in self.sections:
            if not sec.loop:
                code.splice(sec.body)
                continue
            if self.tiled:
                code.writeline("roffset = tl.program_id(1) * RBLOCK")
                code.writeline("rindex = roffset + rbase")
                code.writeline("rmask = rindex < rnumel")
                code.splice(sec.body)
                continue
            if self.persistent:  # whole rows: the block header set rindex
                code.splice(sec.body)
                continue
            code.splice(sec.init)
            code.writeline("for roffset in range(0, rnumel, RBLOCK):")
            with code.indent():
                code.writeline("rindex = roffset + rbase")
                code.writeline("rmask = rindex < rnumel")
                code.splice(sec.body)
            code.splice(sec.final)


def debug_code(scheduler, group) -> str:
    """The Triton kernel a group (or a node alone) becomes: the scheduler's code renderer."""
    if group.is_extern():
        return f"# extern: {group.nodes[0].buf}"
    name = "cf_" + "_".join(group.names)[:60]
    return TritonKernel(group, scheduler, name, scheduler.kernel_shape(group)).render()[0]
