"""Scheduler: IR buffers -> fused groups in a valid order.

A group is one kernel (or one extern call). Every loop node is placed in the
group's iteration space (X rows x R reduction elements): its own index variables
become expressions of the kernel's `x` and `r`. Two groups fuse when policy allows
(choices.py), no third group lies between them, and every buffer one writes and the
other reads is accessed at the same kernel index — then the value never leaves
registers and, if nobody else reads it, is never stored.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import sympy
import torch

from . import collectives, config, ir, loop_order, memory, mix_order, mm_group, overlap, remat, sizevars
from .dependencies import InlineLoads, MemoryAccess, index_vars, trace_body
from .sizevars import RSYM, XSYM, index_symbol  # noqa: F401  (codegen imports the kernel's indices from here)
from .virtualized import V

LANE_ACCUMULATORS = {"welford_m2": 3, "softmax_sum": 2, "argmax": 2, "argmin": 2}  # else 1


class SchedulerNode:
    """One IR buffer: a loop nest or an extern call."""

    def __init__(self, buf: ir.Buffer, order: int):
        self.buf, self.name, self.order = buf, buf.name, order
        self.device = buf.get_device()
        self.inlined: dict = {}  # stored buffers whose loads this node recomputes (remat.py)
        self.column_partial = False  # a column sum's first stage in a row kernel (mix_order.py)
        self.half_swaps: dict = {}  # as a matmul group's epilogue: member -> block (mm_group.epilogue_shifts)
        if isinstance(buf, ir.ComputedBuffer):
            self.body_ranges = list(buf.data.ranges)
            self.rranges = list(buf.data.reduction_ranges) if buf.is_reduction() else []
            self._trace()
        else:
            self.reads = [_whole(n) for n in _extern_reads(buf)]
            self.writes = [_whole(buf.name)] + [_whole(n) for n in getattr(buf, "mutates", [])]
            self.body_ranges, self.rranges = [], []
            self.read_names = {r.name for r in self.reads}
            self.write_names = {w.name for w in self.writes}
        self.reorder_loops(self._storage_order())

    def _trace(self):
        trace = trace_body(self.buf.data, self.name, self.buf.layout, self.inlined)
        self.reads, self.writes = trace.reads, trace.writes + [  # a graph input stored into (MutationLayout)
            dataclasses.replace(w, name=m) for m in self.buf.mutates for w in trace.writes]
        self.read_names = {r.name for r in self.reads}
        self.write_names = {w.name for w in self.writes}

    def inline(self, buffers: dict) -> None:
        """Recompute these stored buffers where the body loads them, instead of loading them."""
        self.inlined = {**self.inlined, **buffers}
        self._trace()

    def run_body(self, index, rindex=None):
        """Run the body at `index` under the active ops handler, recomputing inlined buffers."""
        if not self.inlined:
            return self.buf.store_body(index, rindex)
        with V.set_ops(InlineLoads(V.ops, self.inlined)):
            return self.buf.store_body(index, rindex)

    def _storage_order(self) -> list:
        """Loops of a pointwise node in the order its output is stored (outermost: largest
        stride), so that its writes are contiguous; identity for reductions and externs."""
        if self.is_extern() or self.rranges:
            return list(range(len(self.body_ranges)))
        return self.buf.layout.stride_order()

    def reorder_loops(self, order: list) -> None:
        """Iterate the body's dims in `order` (outermost first); accesses keep their indices."""
        self.loop_order = list(order)
        self.ranges = [self.body_ranges[d] for d in order]
        self._index_maps = {}  # placements computed for the old order are stale

    def loop_vars(self) -> list:
        """The body's index variable of each loop, outermost first (0 for loops of size 1)."""
        ivars = index_vars("i", self.body_ranges)
        return [ivars[d] for d in self.loop_order]

    def body_index(self, m) -> list:
        """The index the body is run at, with its variables placed by `m` (kernel_index_map)."""
        return [sympy.sympify(v).xreplace(m) for v in index_vars("i", self.body_ranges)]

    def is_extern(self):
        return not isinstance(self.buf, ir.ComputedBuffer)

    def is_reduction(self):
        return bool(self.rranges)

    def numel(self):
        return sizevars.product(self.ranges)

    def kernel_index_map(self, X, R):
        """{own index var: expression in x, r} placing this node in a (X, R) kernel, or None."""
        key = (X, R)
        if key not in self._index_maps:
            self._index_maps[key] = self._kernel_index_map(X, R)
        return self._index_maps[key]

    def place(self, shape, m) -> None:
        """Use placement `m` in kernels of `shape` (X, R); None: derive it again (mix_order.py)."""
        if m is None:
            self._index_maps.pop(shape, None)
        else:
            self._index_maps[shape] = m

    def _kernel_index_map(self, X, R):
        ivars = self.loop_vars()
        if self.is_reduction():
            if not (sizevars.equal(self.numel(), X) and sizevars.equal(self.rranges[0], R)):
                return None
            m = dict(zip(ivars, sizevars.unravel(XSYM, self.ranges)))
            m[index_symbol("r", 0)] = RSYM
            return _drop_constants(m)
        if R == 1 or sizevars.equal(self.numel(), X):  # a row-wise (x only) node
            if not sizevars.equal(self.numel(), X):
                return None
            return _drop_constants(dict(zip(ivars, sizevars.unravel(XSYM, self.ranges))))
        # an elementwise node over X*R elements: its leading dims must span exactly X
        prefix = sympy.Integer(1)
        for k in range(len(self.ranges) + 1):
            if sizevars.equal(prefix, X) and sizevars.equal(sizevars.product(self.ranges[k:]), R):
                m = dict(zip(ivars[:k], sizevars.unravel(XSYM, self.ranges[:k])))
                m.update(zip(ivars[k:], sizevars.unravel(RSYM, self.ranges[k:])))
                return _drop_constants(m)
            if k < len(self.ranges):
                prefix = prefix * self.ranges[k]
        return None

    def __repr__(self):
        return f"SchedulerNode({self.name})"


def _may_walk_both_ways(g) -> bool:
    """Cheap necessary condition for a tile (`choose_tile` tries every split of the loops, each
    access simplified, 40% of a CNN's lowering time): an access contiguous along an outer loop
    but strided along the innermost, and one contiguous along the innermost. Steps are finite
    differences at the origin, equal to an affine index's coefficients."""
    produced, rows, cols = set(g.names), False, False
    for n in g.nodes:
        ivars = [v for v in n.loop_vars() if isinstance(v, sympy.Symbol)]
        if not ivars:
            continue
        origin = {v: 0 for v in ivars}
        for acc in [a for a in n.reads if a.name not in produced] + n.writes:
            at0 = acc.index.xreplace(origin)
            steps = [acc.index.xreplace({**origin, v: 1}) - at0 for v in ivars]
            cols |= steps[-1] == 1 and not acc.indirect
            # a gather contiguous along an outer loop walks the innermost through what it loaded
            rows |= steps[-1] not in ((1,) if acc.indirect else (0, 1)) and any(s == 1 for s in steps[:-1])
    return rows and cols


def _drop_constants(m):
    return {k: v for k, v in m.items() if isinstance(k, sympy.Symbol)}


def _whole(name):
    return MemoryAccess(name, sympy.Symbol("whole"), indirect=True)


def _extern_reads(buf) -> list[str]:
    if isinstance(buf, ir.MultiOutput):
        return [buf.parent.name]
    return [ir.stored(x).name for x in buf.inputs()]


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """How a group's kernel walks its space, decided by the scheduler (`kernel_shape`) and
    rendered as is by codegen: `kind` pointwise, tiled (2-D pointwise), persistent (whole rows in
    a block), looped, or looped_tiles (a reduction that also walks a buffer transposed)."""
    kind: str
    X: object
    R: object
    blocks: dict  # XBLOCK, RBLOCK, num_warps; `programs` for a kernel that reads its peers

    @property
    def persistent(self) -> bool:
        return self.kind in ("persistent", "tiled")


@dataclasses.dataclass(eq=False)
class Group:
    """A kernel to be: nodes in program order plus its iteration space (X, R)."""
    nodes: list
    X: sympy.Expr
    R: sympy.Expr
    order: int
    mixed_programs: int = 0  # a row kernel with column sums: its programs (mix_order.py); 0: one per block

    @property
    def device(self):
        return self.nodes[0].device

    def is_extern(self):
        return self.nodes[0].is_extern()

    def is_reduction(self):
        return self.R != 1

    def lane_accumulators(self) -> int:  # values each lane of a looped reduction carries
        return sum(LANE_ACCUMULATORS.get(n.buf.data.reduction_type, 1) for n in self.nodes
                   if isinstance(getattr(n.buf, "data", None), ir.Reduction))

    @property
    def read_names(self):
        return set().union(*(n.read_names for n in self.nodes))

    @property
    def write_names(self):
        return set().union(*(n.write_names for n in self.nodes))

    @property
    def names(self):
        return [n.name for n in self.nodes]

    def kernel_accesses(self, names=None, gathers=False):
        """Reads/writes of each node with indices in kernel coordinates (of nodes touching `names`);
        an indirect read's index is None, or with `gathers` a "gather", its loaded terms symbols."""
        for n in self.nodes:
            if names is not None and not (n.read_names | n.write_names) & names:
                continue
            m = n.kernel_index_map(self.X, self.R)
            for acc in n.reads:
                if acc.peer:  # an all-reduce reads every rank's copy at this index
                    yield n, "peer", acc.name, sizevars.simplify(acc.index.xreplace(m))
                elif acc.indirect and gathers:
                    yield n, "gather", acc.name, sizevars.simplify(acc.index.xreplace(m))
                else:
                    yield n, "read", acc.name, (None if acc.indirect else sizevars.simplify(acc.index.xreplace(m)))
            for acc in n.writes:
                yield n, "write", acc.name, sizevars.simplify(acc.index.xreplace(m))

    def reads_peers(self) -> bool:
        return any(a.peer for n in self.nodes for a in n.reads)

    def peer_groups(self) -> set:  # the process groups whose ranks' copies the kernel reads
        return {V.graph.comm_plan(a.name).group for n in self.nodes for a in n.reads if a.peer}

    def walked_transposed(self) -> set:
        """The buffers some access walks along the rows (stride 1 in x) but jumps along the reduction."""
        return {name for _, _, name, index in self.kernel_accesses() if sizevars.walks_columns(index, XSYM, RSYM)}

    def __repr__(self):
        return f"Group({'+'.join(self.names)}, X={self.X}, R={self.R})"


class Scheduler:
    def __init__(self, graph):
        self.graph = graph
        self.code_renderer = None  # installed by the codegen backend: (scheduler, group) -> source
        self.groups, self.removed = [], set()
        self.shapes: dict[int, KernelShape] = {}  # group id -> its kernel's shape, once the order is final
        self.nodes = [SchedulerNode(b, i) for i, b in enumerate(graph.buffers)]
        self.output_names = _output_names(graph)
        self.remove_dead_nodes()
        self.compute_dependencies()
        self.node_of = {n.name: n for n in self.nodes}
        self.groups = [self._single(n) for n in self.nodes]
        self.group_of = {n.name: g for g in self.groups for n in g.nodes}
        self.internal = set()  # known once fused (compute_buffer_users): till then, all stored
        self.choose_comm_algorithms()
        self.fuse()
        self.remat_log = remat.rematerialize(self) if config.rematerialize else []
        if self.remat_log:  # kernels now read other buffers: some values died, groups may fuse
            self.compute_dependencies()
            self.remove_dead_nodes()
            self.fuse()
        self.mixed = mix_order.fuse_mixed_orders(self)
        mm_group.group_matmuls(self)  # few-row matmuls of one `a` in one launch, with their epilogues
        self.compute_buffer_users()
        self.fit_comm_plans()
        inplace = memory.inplace_candidates(self)
        program = self.topological_order(self.groups)
        self.groups, self.peak_memory_by_order = memory.reorder_for_peak_memory(self, program, inplace)
        self.groups, self.overlap = overlap.schedule(self, self.groups, inplace, program)  # {collective: how placed}
        self.inplace = memory.inplace_updates(self.groups, inplace)  # output -> input it overwrites
        self.peak_memory = memory.peak_memory(self, self.groups, self.inplace)
        self.shapes = {id(g): self.kernel_shape(g) for g in self.groups if not g.is_extern()}

    # ------------------------------------------------------------------ setup
    def _single(self, n: SchedulerNode) -> Group:
        if n.is_extern():
            return Group([n], sympy.Integer(0), sympy.Integer(1), n.order)
        if n.is_reduction():
            return Group([n], n.numel(), n.rranges[0], n.order)
        return Group([n], n.numel(), sympy.Integer(1), n.order)

    def remove_dead_nodes(self):
        """Drop the nodes whose values nobody needs (from their groups too, once fused)."""
        defs = self.graph.symbol_defs
        needed = set(self.output_names) | {defs[s] for s in _free_symbols(self.graph.graph_outputs) if s in defs}
        for n in self.nodes:
            if getattr(n.buf, "side_effect", False) or getattr(n.buf, "mutates", None):
                needed.add(n.name)
        keep = []
        for n in reversed(self.nodes):
            if n.name in needed or n.write_names & needed:
                keep.append(n)
                needed |= n.read_names | self.symbol_deps(n)
        dead = {n.name for n in self.nodes} - {n.name for n in keep}
        self.removed |= dead
        self.nodes = list(reversed(keep))
        for g in self.groups:
            g.nodes = [n for n in g.nodes if n.name not in dead]
        self.groups = [g for g in self.groups if g.nodes]

    def compute_dependencies(self):
        """In program order: read-after-write, and for in-place writes (mutated inputs, in-place
        collectives) write-after-write and write-after-read too."""
        last_writer, readers = {}, collections.defaultdict(set)
        for n in self.nodes:
            deps = {last_writer[r] for r in n.read_names if r in last_writer}
            for w in n.write_names:
                if w in last_writer:
                    deps.add(last_writer[w])
                deps |= readers[w]
            n.deps = (deps | self.symbol_deps(n)) - {n.name}
            for r in n.read_names:
                readers[r].add(n.name)
            for w in n.write_names:
                last_writer[w] = n.name
                readers[w] = set()

    def symbol_deps(self, n: SchedulerNode) -> set:
        """The externs binding the data-dependent symbols (u0, ...) that `n` uses: in its sizes, its
        indices, its body's values, its arguments."""
        defs = self.graph.symbol_defs
        if not defs:
            return set()
        buf, exprs = n.buf, [n.buf.layout]
        if isinstance(buf, ir.ComputedBuffer):
            exprs += [n.body_ranges, n.rranges, trace_body(buf.data, buf.name, buf.layout, n.inlined).lines]
        else:
            exprs += [getattr(buf, "args", ()), getattr(buf, "kwargs", {})]
        return {defs[s] for s in _free_symbols(exprs) if s in defs}

    def group_deps(self, g: Group) -> set:
        return {id(self.group_of[d]) for n in g.nodes for d in n.deps if self.group_of[d] is not g}

    # ------------------------------------------------------------------ comm
    def choose_comm_algorithms(self):
        """An all-reduce whose rows feed a row reduction (a norm) will have it fused into its
        kernel, whose cost differs from the all-reduce alone: its plan takes the algorithm of the
        fused measurements. Decided before fusion, which follows it (`Choices.comm_prologue`)."""
        readers = self._node_readers()
        for plan in self.graph.comm_plans:
            if not plan.algorithm.fused or plan.inplace or plan.result not in self.node_of:
                continue
            rows = self._epilogue_rows(plan.result, readers)
            buf, producer = self.graph.get_buffer(plan.buffer), self.node_of.get(plan.buffer)
            prologue = producer is not None and not producer.is_extern() and not producer.is_reduction()
            numel = int(buf.get_numel())
            picked = rows and V.choices.all_reduce_with_epilogue(
                plan.world, rows, numel * buf.get_dtype().itemsize, buf.get_device(),
                plan.algorithm.name, prologue, numel // rows)
            if picked:
                plan.algorithm, plan.reason = collectives.algorithm(picked[0]), picked[1]

    def kernel_shape(self, g: Group) -> KernelShape:
        """Tiling, persistence and blocks of a group's kernel, from policy."""
        if id(g) in self.shapes:
            return self.shapes[id(g)]
        tile = self.choose_tile(g)
        X, R = tile or (g.X, g.R)
        peers = g.reads_peers()
        if tile:
            kind = "tiled"
        elif g.mixed_programs:
            kind = "persistent"
        elif not g.is_reduction():
            kind = "pointwise"
        elif g.walked_transposed():
            kind = "looped_tiles"
        else:
            kind = "persistent" if V.choices.is_persistent(int(R) if sizevars.is_static(R) else None, peers) \
                else "looped"
        blocks = V.choices.comm_kernel_config(kind, int(X), int(R)) if peers else \
            V.choices.kernel_config(kind, sizevars.hint(X), sizevars.hint(R), g.lane_accumulators(), g.device)
        if g.mixed_programs:
            blocks = {**blocks, "programs": g.mixed_programs}
        return KernelShape(kind, X, R, blocks)

    def choose_tile(self, g: Group):
        """(rows, columns) for a pointwise group that walks one buffer along the rows and another
        along the columns (a transposed read or write): tiling both axes keeps every access
        coalesced. None keeps it 1-D."""
        if g.is_reduction() or g.is_extern() or g.reads_peers() or not _may_walk_both_ways(g):
            return None  # (a comm kernel's barrier slots are 1-D)
        ranges = g.nodes[0].ranges
        produced = set(g.names)
        for k in range(1, len(ranges)):
            X, R = sizevars.product(ranges[:k]), sizevars.product(ranges[k:])
            if X == 1 or R == 1 or any(n.kernel_index_map(X, R) is None for n in g.nodes):
                continue
            along_rows = along_columns = False
            for _, kind, name, index in Group(g.nodes, X, R, g.order).kernel_accesses(gathers=True):
                if kind in ("read", "gather") and name in produced:  # a value in registers
                    continue
                if kind == "gather":  # its loaded terms make no affine index: steps from the origin
                    steps = sizevars.walk_steps(index, [XSYM, RSYM])
                else:
                    aff = index is not None and sizevars.affine_coefficients(index, [XSYM, RSYM])
                    steps = aff and aff[0]
                if not steps:
                    continue
                cx, cr = steps  # a gather walks the columns through what it loaded, too
                along_rows |= cx == 1 and cr not in ((1,) if kind == "gather" else (0, 1))
                along_columns |= cr == 1
            if along_rows and along_columns and V.choices.should_tile(sizevars.hint(X), sizevars.hint(R)):
                return X, R
        return None

    def fit_comm_plans(self):
        """Two-shot reads each element from the rank that reduced its share, and the shares are
        fixed by the fused kernel's blocks. Where that kernel cannot gather them, the plan takes
        the algorithm policy gives instead, with why; codegen then renders what the plan says."""
        for plan in self.graph.comm_plans:
            if plan.algorithm.gathers_shares and not plan.inplace and plan.result in self.group_of:
                why = self._cannot_gather_shares(plan)
                if why:
                    name, plan.reason = V.choices.algorithm_without_shares(plan, why)
                    plan.algorithm = collectives.algorithm(name)

    def _cannot_gather_shares(self, plan) -> str:
        """Why the kernel that reads this plan's peers cannot gather two-shot's shares ("" if it can):
        the shares must be fixed by the block alone (a pointwise kernel, or whole rows), the input
        read by that one node (it is overwritten) and each element once (its size is the kernel's)."""
        g, buf = self.group_of[plan.result], self.graph.get_buffer(plan.buffer)
        if len(self.node_readers[plan.buffer]) != 1 or plan.buffer in self.output_names:
            return "its input has other readers"
        if not sizevars.equal(buf.get_numel(), g.X * g.R):
            return "the kernel's size is not the input's"
        if g.is_reduction() and (g.walked_transposed() or not sizevars.is_static(g.R)
                                 or not V.choices.is_persistent(int(g.R), reads_peers=True)):
            return "the kernel loops over its rows"
        for _, kind, name, index in g.kernel_accesses():
            if kind == "peer" and name == plan.buffer and (
                    index is None or not (index.has(XSYM) or g.X == 1)
                    or not (index.has(RSYM) or not g.is_reduction())):
                return "the kernel reads it broadcast"
        return ""

    def _epilogue_rows(self, result: str, readers) -> int | None:
        """Rows of `result` when a reduction over its last dim reads it, directly or through
        pointwise nodes of its size (a residual add, a cast): the shape of a norm after it."""
        size = self.graph.get_buffer(result).get_size()
        if not size:  # a 0-d value has no rows
            return None
        numel, row = sizevars.product(size), size[-1]
        seen, todo = set(), [result]
        while todo:
            for n in map(self.node_of.get, readers[todo.pop()]):
                if n.name in seen or n.is_extern():
                    continue
                seen.add(n.name)
                if not n.is_reduction():
                    if sizevars.equal(n.numel(), numel):
                        todo.append(n.name)
                elif sizevars.equal(sizevars.product(n.rranges), row) and sizevars.equal(n.numel() * row, numel):
                    return int(n.numel())
        return None

    # ------------------------------------------------------------------ fusion
    def fuse(self):
        for _ in range(10):
            if not self._fuse_round():
                break

    def _producers(self):
        writer = {}
        for g in self.groups:
            for name in g.write_names:
                writer[name] = g
        return writer

    def _fuse_round(self) -> bool:
        writer = self._producers()
        candidates = {}
        by_read = collections.defaultdict(list)
        for g in self.groups:
            for name in g.read_names:
                by_read[name].append(g)
                p = writer.get(name)
                if p is not None and p is not g:
                    candidates[(p, g)] = True
        for readers in by_read.values():
            for a, b in itertools.combinations(readers, 2):
                candidates.setdefault((a, b) if a.order < b.order else (b, a), False)
        scored = []
        for (a, b), vertical in candidates.items():
            shared = (a.write_names | a.read_names) & b.read_names
            nbytes = sum(self._bytes(n) for n in shared)
            scored.append((V.choices.score_fusion(a, b, nbytes, vertical), a, b))
        scored.sort(key=lambda t: t[0], reverse=True)
        alive, fused_any = set(map(id, self.groups)), False
        self._succ = None
        order = sorted(self.groups, key=lambda g: g.order)  # as the round starts: an estimate
        live, step = memory.live_bytes(self, order), {id(g): i for i, g in enumerate(order)}
        for _, a, b in scored:
            if id(a) not in alive or id(b) not in alive:
                continue
            if self._raises_peak(a, b, live, step, writer):
                continue
            merged = self.try_fuse(a, b)
            if merged is None:
                continue
            alive -= {id(a), id(b)}
            alive.add(id(merged))
            self.groups = [g for g in self.groups if g is not a and g is not b] + [merged]
            for n in merged.nodes:
                self.group_of[n.name] = merged
            self._succ = None
            fused_any = True
        return fused_any

    def _raises_peak(self, a: Group, b: Group, live: list, step: dict, writer: dict) -> bool:
        """Would the fusion raise the estimated peak? The later kernel's outputs are then computed
        once all its inputs are, and held until its own place (an upsample's backward: four 1.26
        GB values from one gradient, each read by its own atomic-add extern)."""
        first, last = sorted((a, b), key=lambda g: step[id(g)])
        ready = max([step[id(first)]] + [step[id(writer[n])] for n in last.read_names if n in writer])
        between = live[ready + 1:step[id(last)]]
        held = sum(self._bytes(n) for n in last.write_names)
        return bool(between) and V.choices.keep_apart_for_peak(held, max(between) + held, max(live))

    def _bytes(self, name) -> int:
        try:
            return self.graph.get_buffer(name).layout.nbytes_hint()
        except KeyError:
            return 0

    def try_fuse(self, a: Group, b: Group):
        ok, why = V.choices.can_fuse(a, b)
        if not ok:
            return None
        if self._path_between(a, b) or self._path_between(b, a):
            return None
        if len(a.peer_groups() | b.peer_groups()) > 1:  # a kernel meets the ranks of one group
            return None
        if (a.reads_peers() or b.reads_peers()) and not all(map(sizevars.is_static, (a.X, a.R, b.X, b.R))):
            return None  # a comm kernel's grid is part of the plan the ranks agree on: static sizes only
        merged, undo = self._merge(a, b), None
        if config.loop_ordering_after_fusion and (merged is None or self._walked_apart(merged, a, b)):
            reordered, undo = self._merge_reordered(a, b)
            merged = reordered or merged
        handed = (a.write_names & b.read_names) | (b.write_names & a.read_names)
        if merged is not None and merged.is_reduction() and handed & merged.walked_transposed() and \
                V.choices.keep_apart_for_memory(self._stored_anyway(merged, handed)):
            if undo:  # a pointwise group left permuted for a fusion that did not happen walks strided
                undo()
            return None
        return merged

    def _stored_anyway(self, merged: Group, handed: set) -> bool:
        """Is a value one side hands the other also read outside the fused kernel (or returned)?"""
        inside = {n.name for n in merged.nodes}
        for name in handed:
            if name in self.output_names or any(
                    name in n.read_names for n in self.nodes if n.name not in inside and n.name not in self.removed):
                return True
        return False

    def _merge_reordered(self, a: Group, b: Group):
        """Fuse after permuting the loops of one side so that both walk a shared buffer alike;
        (the fused group, the undo of the permutation), or (None, None)."""
        shared = (a.read_names | a.write_names) & (b.read_names | b.write_names)
        shared = sorted(shared, key=lambda n: -self._bytes(n))
        for p, o in ((b, a), (a, b)):
            order = loop_order.matching_order(p, o, shared)
            if order is None:
                continue
            undo = loop_order.reorder(p, order)
            merged = self._merge(a, b)
            if merged is not None and not self._walked_apart(merged, a, b):
                return merged, undo
            undo()
        return None, None

    @staticmethod
    def _walked_apart(merged: Group, a: Group, b: Group) -> bool:
        """Do `a` and `b` access some buffer they share at different kernel indices?"""
        seen = collections.defaultdict(dict)
        side = {id(n): 0 if n in a.nodes else 1 for n in merged.nodes}
        for node, _, name, index in merged.kernel_accesses():
            if index is not None:
                seen[name].setdefault(side[id(node)], index)
        return any(len(ix) == 2 and not sizevars.equal(ix[0], ix[1]) for ix in seen.values())

    def _merge(self, a: Group, b: Group):
        """The fused group of `a` and `b` if their nodes fit one kernel with agreeing indices."""
        shape = self._fused_shape(a, b)
        if shape is None:
            return None
        nodes = sorted(a.nodes + b.nodes, key=lambda n: n.order)
        merged = Group(nodes, shape[0], shape[1], min(a.order, b.order))
        if any(n.kernel_index_map(*shape) is None for n in nodes):
            return None
        if not self._indices_agree(merged):
            return None
        return merged

    def _fused_shape(self, a: Group, b: Group):
        red = [g for g in (a, b) if g.is_reduction()]
        if len(red) == 2:
            if sizevars.equal(a.X, b.X) and sizevars.equal(a.R, b.R):
                return a.X, a.R
            return None
        if red:
            r, p = red[0], (b if red[0] is a else a)
            if sizevars.equal(p.X, r.X * r.R) or sizevars.equal(p.X, r.X):
                return r.X, r.R
            return None
        return (a.X, a.R) if sizevars.equal(a.X, b.X) else None

    def _indices_agree(self, g: Group) -> bool:
        """A buffer produced inside the kernel is read at exactly the index it was written."""
        written = {}
        for node, kind, name, index in g.kernel_accesses():
            if kind == "write":
                written[name] = (node, index)
        for node, kind, name, index in g.kernel_accesses():
            if kind in ("read", "peer") and name in written:
                producer, windex = written[name]
                if producer is node:
                    continue
                if index is None or not sizevars.equal(index, windex):
                    return False
                if producer.is_reduction() and index.has(RSYM):  # one feeding a peer read: below
                    return False
                # a pointwise producer of an all-reduce's input: each program writes the very
                # elements it then reads from every rank, after a barrier (the comm prologue)
                if kind == "peer" and not V.choices.comm_prologue(V.graph.comm_plan(name)):
                    return False
        return not g.reads_peers() or not self._reduces_before_comm(g)

    @staticmethod
    def _reduces_before_comm(g: Group) -> bool:
        """Does a reduction in the kernel feed its all-reduce? Its length is each rank's own (an uneven
        shard), and so would the kernel's blocks be, which every rank must share."""
        derived = set()
        for n in g.nodes:
            if n.is_reduction() or n.read_names & derived:
                derived |= n.write_names
        return any(a.peer and a.name in derived for n in g.nodes for a in n.reads)

    def _path_between(self, src: Group, dst: Group) -> bool:
        """Is dst reachable from src through some other group (so fusing them makes a cycle)?"""
        if self._succ is None:  # the groups' successors, until the next merge
            self._succ = collections.defaultdict(list)
            for g in self.groups:
                for d in self.group_deps(g):
                    self._succ[d].append(g)
        succ = self._succ
        seen, stack = set(), [c for c in succ[id(src)] if c is not dst]
        while stack:
            g = stack.pop()
            if g is dst:
                return True
            if id(g) in seen or g is src:
                continue
            seen.add(id(g))
            stack.extend(succ[id(g)])
        return False

    # ------------------------------------------------------------------ order
    def topological_order(self, groups):
        deps = {id(g): self.group_deps(g) for g in groups}
        done, out = set(), []
        pending = sorted(groups, key=lambda g: g.order)
        while pending:
            for g in pending:
                if deps[id(g)] <= done:
                    out.append(g)
                    done.add(id(g))
                    pending.remove(g)
                    break
            else:
                raise AssertionError("cycle in the fused graph: " + "; ".join(
                    f"{g!r} waits for {sorted(n for n in g.nodes for n in n.deps)}" for g in pending))
        return out

    def compute_buffer_users(self):
        """Which groups read each buffer; buffers used only inside their own kernel are not stored."""
        self.readers = collections.defaultdict(list)
        for g in self.groups:
            for name in g.read_names:
                self.readers[name].append(g)
        self.node_readers = self._node_readers()
        self.internal = set()
        for g in self.groups:
            if g.is_extern() and len(g.nodes) == 1:  # (several: matmuls with an epilogue, mm_group.py)
                continue
            for n in g.nodes:
                if n.name in self.output_names or V.graph.comm_plan(n.name) or n.buf.mutates:  # peers, or the input, read those
                    continue
                users = self.readers.get(n.name, [])
                if all(u is g for u in users):
                    self.internal.add(n.name)

    def _node_readers(self) -> dict:
        """Buffer name -> names of the nodes that read it."""
        readers = collections.defaultdict(set)
        for n in self.nodes:
            for name in n.read_names:
                readers[name].add(n.name)
        return readers

    def kernel_internal(self, nodes) -> set:
        """Buffers written by `nodes` that a kernel of exactly these nodes need not store."""
        names = {n.name for n in nodes}
        return {n for n in names & self.internal if self.node_readers[n] <= names}

    # ------------------------------------------------------------------ debug
    def debug_code(self, item) -> str:
        """The code the codegen backend would generate for a group, or for one node alone."""
        if self.code_renderer is None:
            return ""
        return self.code_renderer(self, item if isinstance(item, Group) else self._single(item))

    def debug_str(self) -> str:
        """Each group with its nodes' IR and the code each node and the group would generate."""
        def code(item):
            text = self.debug_code(item).rstrip("\n")
            return "".join(f"\n        | {line}" for line in text.split("\n")) if text else ""
        out = []
        for g in self.groups:
            out.append(repr(g))
            for n in g.nodes:
                recomputes = f"\n        recomputes {', '.join(sorted(n.inlined))}" if n.inlined else ""
                out.append(f"    {n.buf}{recomputes}" + (code(n) if len(g.nodes) > 1 else ""))
            out.append("    kernel:" + code(g))
        return "\n".join(out) + "\n"


def _free_symbols(values) -> set:
    """The symbols of the sizes in `values`: expressions, and the layouts of buffers and views."""
    out = set()
    for x in torch.utils._pytree.tree_leaves(values):
        if isinstance(x, ir.TensorBox):
            x = x.data
        if isinstance(x, (ir.ReinterpretView, ir.Layout)):
            lay = x if isinstance(x, ir.Layout) else x.layout
            out |= _free_symbols([*lay.size, *lay.stride, lay.offset])
        elif isinstance(x, sympy.Basic):
            out |= x.free_symbols
    return out


def _output_names(graph) -> set:
    out = set()
    for o in graph.graph_outputs:
        if isinstance(o, ir.Buffer):
            out.add(o.name)
        elif isinstance(o, ir.ReinterpretView):
            out.add(o.base.name)
        elif isinstance(o, ir.TensorBox):
            d = o.data
            out.add(ir.stored(d).name)
    return out
