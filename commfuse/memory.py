"""Memory: which buffers a graph owns, how long each lives, the peak an order implies, orders that
lower it, and kernels that write their output over an input they are the last to read.

Plain functions over the scheduler (`sched.groups` are fused groups in some order). The model:
each stored buffer the graph owns lives in a *storage* (its own allocation, or the one it shares:
an output written in place over an input, an extern output written into its slice of a cat); a
storage is allocated at the first group that touches it and freed after the last, or kept to the
end when it holds a graph output. A backward's donated inputs (the saved activations) are owned
too, alive from the start; other inputs, constants and the persistent comm pools are not counted.
The comm pools are planned here too: `pack_intervals` gives buffers offsets by live range.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

import torch

from . import ir, sizevars
from .runtime.symm import ALIGN
from .virtualized import V


# ----------------------------------------------------------------------------- what the graph owns
def owned(name: str) -> bool:
    """Does the graph allocate (and so could free) this buffer? Inputs, constants and persistent
    comm buffers are alive whatever the graph does, but for donated inputs (saved activations
    a backward holds alone), alive when it starts and freed by it; a multi-output op's tuple
    has no storage."""
    if donated(name):
        return True
    buf = V.graph.name_to_buffer.get(name)
    return buf is not None and not isinstance(buf.layout, (ir.CommLayout, ir.MutationLayout)) and \
        not getattr(buf, "multi_output", False) and not getattr(buf, "side_effect", False)


def donated(name: str) -> bool:
    return isinstance(V.graph.graph_inputs.get(name), ir.DonatedBuffer)


def buffer_bytes(name: str) -> int:
    return V.graph.get_buffer(name).layout.nbytes_hint()


def owned_bytes(names) -> int:
    """Bytes of the buffers among `names` that the graph owns."""
    return sum(buffer_bytes(n) for n in set(names) if owned(n))


def aliased_by_externs(groups) -> set:
    """Buffers an extern op's output may alias (a view returned by aten, a wait's input:
    `extern.returns_alias`): their memory must outlive that output, so it is never handed to
    another buffer."""
    return {name for g in groups for n in g.nodes if getattr(n.buf, "aliases", False) for name in n.read_names}


def recyclable(sched) -> set:
    """Buffers whose memory may go to another buffer once their last user has run (a pooled
    allocation, or a kernel writing its output in place): plain allocations of ours, not graph
    outputs, that nothing else aliases."""
    aliased = aliased_by_externs(sched.groups)
    out = set()
    for g in sched.groups:
        for n in g.nodes:
            buf = n.buf
            if not owned(n.name) or n.name in sched.output_names or n.name in sched.internal \
                    or n.name in aliased or isinstance(buf, ir.MultiOutput):
                continue
            if isinstance(buf, ir.ExternKernel) and (not buf.out_variant or buf.out_view is not None):
                continue  # aten allocated it (it may be a view), or it is a slice of another buffer
            out.add(n.name)
    out |= {name for name in sched.graph.graph_inputs
            if donated(name) and name not in sched.output_names and name not in aliased}
    return out


# ----------------------------------------------------------------------------- liveness
def storage_basis(sched) -> tuple:
    """What `storage_of` needs that no order changes: the graph's own aliases (an extern writing
    into a view of another buffer, a view returned by aten, a wait returning its input), the
    stored buffers the graph owns, in order, and which buffers it owns; and a cache of sizes."""
    alias = {}
    for g in sched.groups:
        for n in g.nodes:
            buf = n.buf
            if isinstance(buf, ir.ExternKernel) and buf.out_view is not None:
                alias[n.name] = buf.out_view.base.name
            elif getattr(buf, "aliases", False) and not buf.multi_output:
                alias[n.name] = next((r for r in sorted(n.read_names) if owned(r)), None)
    names = dict.fromkeys(name for g in sched.groups for name in g.read_names | g.write_names)
    is_owned = {name: owned(name) for name in [*names, *alias.values()] if name is not None}
    return alias, [n for n in names if n not in sched.internal and is_owned[n]], is_owned, {}


def storage_of(sched, inplace: dict | None = None, basis: tuple | None = None) -> dict:
    """{buffer: the buffer whose allocation holds it}, for every stored buffer the graph owns."""
    graph_alias, names, is_owned, _ = basis or storage_basis(sched)
    alias = {**(inplace or {}), **graph_alias}
    out = {}
    for name in names:
        root = name
        while root in alias:
            root = alias[root]
        if root is not None and (is_owned[root] if root in is_owned else owned(root)):
            out[name] = root
    return out


def lifetimes(sched, order, inplace: dict | None = None, basis: tuple | None = None) -> dict:
    """{storage: (first step, last step)}; donated inputs live from the start, storages holding
    graph outputs to the end."""
    storage = storage_of(sched, inplace, basis)
    span = {}
    for step, g in enumerate(order):
        for name in g.read_names | g.write_names:
            s = storage.get(name)
            if s is not None:
                span[s] = (0 if donated(s) else span.get(s, (step,))[0], step)
    kept = {storage[n] for n in sched.output_names if n in storage}
    return {s: (a, len(order) - 1 if s in kept else b) for s, (a, b) in span.items()}


def live_bytes(sched, order, inplace: dict | None = None, basis: tuple | None = None) -> list:
    """Bytes alive while each group runs: its inputs, its outputs and everything still needed."""
    sizes = basis[3] if basis else {}
    delta = [0] * (len(order) + 1)
    for s, (first, last) in lifetimes(sched, order, inplace, basis).items():
        n = sizes[s] if s in sizes else sizes.setdefault(s, buffer_bytes(s))
        delta[first] += n
        delta[last + 1] -= n
    return list(itertools.accumulate(delta[:-1]))


def peak_memory(sched, order, inplace: dict | None = None) -> int:
    """Liveness-based estimate of the peak bytes the graph's own buffers take in this order."""
    return max(live_bytes(sched, order, inplace), default=0)


def peak_estimator(sched, inplace: dict):
    """order -> its estimated peak, counting the in-place updates that order allows (`inplace`
    from `inplace_candidates`), with what no order changes worked out once: a schedule compares
    many orders of the same groups."""
    basis = storage_basis(sched)
    return lambda order: max(live_bytes(sched, order, inplace_updates(order, inplace), basis), default=0)


# ----------------------------------------------------------------------------- in-place updates
def inplace_updates(order, candidates: dict) -> dict:
    """{output: input it overwrites} in this order. A kernel may store its output over a buffer
    it reads when that buffer is one of its `inplace_candidates` and the kernel is its last user:
    every other user has run, earlier in the order or as an ancestor."""
    last = {}
    for step, g in enumerate(order):
        for name in g.read_names | g.write_names:
            last[name] = step
    plan = {}
    for step, g in enumerate(order):
        out, names = candidates.get(id(g), (None, ()))
        name = next((n for n in names if last[n] == step and n not in plan.values()), None)
        if name is not None:
            plan[out] = name
    return plan


def inplace_candidates(sched) -> dict:
    """{group id: (its output, inputs it could overwrite)}, whatever the order: the input's memory
    is recyclable, of the output's dtype and size, and every access of the kernel to it is at the
    very index the output is written at, so each element is read before it is overwritten, by the
    program that overwrites it. The output must be the kernel's last node: no later node of the
    kernel reads the input after the store. (An input produced in the same kernel is never one:
    the kernel writes it.)"""
    if not V.choices.inplace_buffers():
        return {}
    reusable, out = recyclable(sched), {}
    for g in sched.groups:
        node = g.nodes[-1]
        if g.is_extern() or node.name in sched.internal or not owned(node.name):
            continue
        names = {n for n in g.read_names - g.write_names if n in reusable and _same_storage_size(n, node.name)}
        if not names:
            continue
        accesses = list(g.kernel_accesses(names | {node.name}))
        windex = next(index for n, kind, _, index in accesses if n is node and kind == "write")
        names = [name for name in sorted(names) if all(
            index is not None and sizevars.equal(index, windex) for _, _, n, index in accesses if n == name)]
        if names:
            out[id(g)] = (node.name, names)
    return out


def _same_storage_size(a: str, b: str) -> bool:
    la, lb = V.graph.get_buffer(a).layout, V.graph.get_buffer(b).layout
    return la.dtype == lb.dtype and la.device == lb.device and \
        sizevars.equal(la.storage_numel(), lb.storage_numel())


# ----------------------------------------------------------------------------- orders
def reorder_for_peak_memory(sched, order: list, inplace: dict) -> tuple[list, dict]:
    """(order, {method: estimated peak}): tries memory-aware topological orders and keeps the one
    with the lowest estimated peak, counting the in-place updates each allows (`inplace` from
    `inplace_candidates`); the given order wins ties, so the result is never worse than it."""
    estimate = peak_estimator(sched, inplace)
    best, best_peak = order, estimate(order)
    peaks = {"original": best_peak}
    for method in V.choices.peak_memory_orders():
        candidate = ORDERS[method](sched, order)
        _check_order(sched, candidate, order)
        peaks[method] = estimate(candidate)
        if peaks[method] < best_peak:
            best, best_peak = candidate, peaks[method]
    return best, peaks


def _check_order(sched, candidate, order):
    preds, _ = _graph(sched, order)
    done = set()
    for g in candidate:
        assert preds[id(g)] <= done, f"memory order runs {g!r} before its producers"
        done.add(id(g))
    assert len(candidate) == len(order)


def _graph(sched, order):
    """(predecessors, successors) by group id, with ops that must keep their relative order
    (random numbers, side effects, collectives) chained one after the other."""
    preds = {id(g): set(sched.group_deps(g)) for g in order}
    chain = [g for g in order if pinned(g)]
    for a, b in zip(chain, chain[1:]):
        preds[id(b)].add(id(a))
    succs = collections.defaultdict(set)
    for g in order:
        for p in preds[id(g)]:
            succs[p].add(id(g))
    return preds, succs


def pinned(g) -> bool:
    """Must the group keep its place relative to the other pinned groups (random numbers, mutation,
    side effects, whatever meets other ranks, waits)?"""
    if communicates(g) or is_wait(g):
        return True
    buf = g.nodes[0].buf
    if not isinstance(buf, ir.ExternKernel):
        return False
    op = buf.op
    return bool(buf.mutates) or isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


# ----------------------------------------------------------------------------- what meets other ranks
def extern_op(g):
    """The op of a group that is one extern call (not an item of a result, a cat or our matmul), else None."""
    buf = g.nodes[0].buf
    return buf.op if type(buf) is ir.ExternKernel else None


def is_collective(g) -> bool:
    return ir.is_collective(extern_op(g))


def is_wait(g) -> bool:
    return ir.is_wait(extern_op(g))


def communicates(g) -> bool:
    """May the group meet other ranks, for all we can see? Our comm kernels, and an extern call that
    may (`ir.meets_ranks`). These keep their program order (all ranks must meet the same collectives
    in the same order) and no collective crosses one."""
    buf, op = g.nodes[0].buf, extern_op(g)
    return isinstance(buf, ir.CommKernel) or not g.is_extern() and g.reads_peers() or \
        op is not None and ir.meets_ranks(op, buf.side_effect)


def _stored(sched, order) -> tuple[dict, dict]:
    """(the storages each group touches, the number of groups touching each storage)."""
    storage = storage_of(sched)
    touches = {id(g): {storage[n] for n in g.read_names | g.write_names if n in storage} for g in order}
    users = collections.Counter(s for ss in touches.values() for s in ss)
    return touches, users


def order_least_peak_first(sched, order: list) -> list:
    """Greedy: of the groups ready to run, the one that brings the least memory alive while it
    runs, then the one that frees the most, then program order."""
    preds, succs = _graph(sched, order)
    touches, users = _stored(sched, order)
    storage = storage_of(sched)
    kept = {storage[n] for n in sched.output_names if n in storage}
    waiting = {id(g): len(preds[id(g)]) for g in order}
    ready = [g for g in order if not waiting[id(g)]]
    allocated = {s for s in users if donated(s)}  # alive from the start
    live, out = sum(buffer_bytes(s) for s in allocated), []
    by_id = {id(g): g for g in order}
    while ready:
        def cost(g):
            new = sum(buffer_bytes(s) for s in touches[id(g)] - allocated)
            freed = sum(buffer_bytes(s) for s in touches[id(g)] if users[s] == 1 and s not in kept)
            return live + new, new - freed, g.order
        g = min(ready, key=cost)
        ready.remove(g)
        out.append(g)
        new = touches[id(g)] - allocated
        allocated |= new
        live += sum(buffer_bytes(s) for s in new)
        for s in touches[id(g)]:
            users[s] -= 1
            if not users[s] and s not in kept:
                live -= buffer_bytes(s)
        for c in succs[id(g)]:
            waiting[c] -= 1
            if not waiting[c]:
                ready.append(by_id[c])
    return out


def order_bfs(sched, order: list) -> list:
    """Breadth first: groups in the order they become ready (a producer's users soon after it,
    so its output dies early), then program order."""
    preds, succs = _graph(sched, order)
    waiting = {id(g): len(preds[id(g)]) for g in order}
    by_id = {id(g): g for g in order}
    heap = [(0, g.order, id(g)) for g in order if not waiting[id(g)]]
    heapq.heapify(heap)
    out = []
    while heap:
        level, _, gid = heapq.heappop(heap)
        out.append(by_id[gid])
        for c in succs[gid]:
            waiting[c] -= 1
            if not waiting[c]:
                heapq.heappush(heap, (level + 1, by_id[c].order, c))
    return out


def order_dfs(sched, order: list) -> list:
    """Depth first from the smallest groups (bytes they allocate and read), each one's
    predecessors first, smallest first: a chain runs to its end before the next one starts."""
    preds, _ = _graph(sched, order)
    touches, _ = _stored(sched, order)
    by_id = {id(g): g for g in order}
    size = {id(g): sum(buffer_bytes(s) for s in touches[id(g)]) for g in order}
    key = lambda gid: (size[gid], by_id[gid].order)  # noqa: E731
    seen, out = set(), []
    for root in sorted(by_id, key=key):
        stack = [(root, False)]
        while stack:
            gid, expanded = stack.pop()
            if expanded:
                out.append(by_id[gid])
                continue
            if gid in seen:
                continue
            seen.add(gid)
            stack.append((gid, True))
            stack.extend((p, False) for p in sorted(preds[gid], key=key, reverse=True) if p not in seen)
    return out


ORDERS = {"least_peak_first": order_least_peak_first, "bfs": order_bfs, "dfs": order_dfs}


# ----------------------------------------------------------------------------- interval packing
@dataclasses.dataclass
class Interval:
    name: str
    nbytes: int
    start: int   # first step the buffer is live (its producer)
    end: int     # last step it is read


def pack_intervals(items: list[Interval], align: int) -> tuple[dict[str, int], int]:
    """Offsets for buffers so that two never live at the same time may share bytes.

    Largest first, each into the lowest gap that fits among the buffers already placed whose
    live ranges overlap it (best fit on address order). Deterministic: the same items give the
    same plan on every rank. Returns ({name: offset}, total bytes)."""
    def up(n):
        return -(-n // align) * align
    placed: list[tuple[int, int, Interval]] = []
    offsets = {}
    for it in sorted(items, key=lambda i: (-i.nbytes, i.start, i.name)):
        size = up(max(it.nbytes, 1))
        busy = sorted((o, o + up(p.nbytes)) for o, _, p in placed if p.start <= it.end and it.start <= p.end)
        best, cursor, best_gap = None, 0, None
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offset = best if best is not None else cursor
        placed.append((offset, size, it))
        offsets[it.name] = offset
    total = max((o + s for o, s, _ in placed), default=0)
    return offsets, total


def plan_comm_pools(sched, plans) -> tuple[dict, dict]:
    """Each symmetric comm buffer's slice of its group's pool, packed by live range in the final
    schedule (buffers never live together share bytes). A small buffer stays live until the next
    comm kernel of its pool: that kernel's first barrier is passed only once every peer has ended
    the kernel that read this one, so its own closing barrier can go (`sched.comm_exit_covered`;
    `Choices.comm_exit_by_next_entry`). A deterministic function of the graph,
    so every rank places every buffer at the same offset; checked at first call. Returns
    ({buffer: placement}, {pool: (group, device, bytes)}), placements in schedule order."""
    step_of = {n.name: i for i, g in enumerate(sched.groups) for n in g.nodes}
    last = {}
    for i, g in enumerate(sched.groups):
        for name in g.read_names:
            last[name] = i
    by_pool, plan_of, covered = {}, {}, set()
    for plan in plans:
        if not plan.algorithm.symmetric or plan.buffer is None or plan.buffer in sched.removed:
            continue
        buf = V.graph.get_buffer(plan.buffer)
        start = step_of[plan.buffer]
        nbytes = int(buf.layout.storage_numel()) * buf.get_dtype().itemsize
        by_pool.setdefault((plan.group, str(buf.get_device())), []).append(
            Interval(plan.buffer, nbytes, start, max(last.get(plan.buffer, start), start)))
        plan_of[plan.buffer] = plan
    for items in by_pool.values():  # a buffer kept until the next comm kernel of its pool has begun
        kernel_step = {it.name: step_of.get(plan_of[it.name].result, it.end) for it in items}
        for it in items:  # (after every kernel that reads it; ours: a Triton kernel that opens with a barrier)
            later = [kernel_step[o.name] for o in items
                     if kernel_step[o.name] > it.end and plan_of[o.name].algorithm.call is None]
            if later and V.choices.comm_exit_by_next_entry(it.nbytes):
                it.end = max(it.end, min(later))
                covered.add(it.name)
    placements, pools = {}, {}
    for i, (key, items) in enumerate(sorted(by_pool.items())):
        pool = f"pool_{i}"
        offsets, total = pack_intervals(items, ALIGN)
        pools[pool] = (key[0], key[1], total)
        for it in items:
            plan = plan_of[it.name]
            placements[it.name] = {"name": it.name, "group": plan.group, "kind": plan.collective,
                                   "algorithm": plan.algorithm.name, "pool": pool, "device": key[1],
                                   "offset": offsets[it.name], "bytes": it.nbytes, "live": [it.start, it.end],
                                   "feeds": plan.result, "copy_in": plan.copy_in, "exit_covered": it.name in covered}
    sched.comm_exit_covered = covered
    return dict(sorted(placements.items(), key=lambda kv: step_of[kv[0]])), pools
