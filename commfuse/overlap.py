"""Overlap: c10d collectives issued as early as their inputs allow, waited at their first use.

A c10d functional collective runs asynchronously on c10d's stream from the line that issues it to
its `wait_tensor`, so its place in the wrapper is what hides it behind compute. After the
peak-memory order (memory.py), each collective, in program order, is moved up together with the
groups it needs that come after the last group that meets other ranks before it
(`memory.communicates`: collectives, our comm kernels, externs we cannot see into); then each of
its waits, with what needs its result, goes after the groups the program runs before the wait and
that do not need it (a memory order may have pulled the wait's users up before them), and the wait
alone sinks to just before the first group that needs it (or to the end). Nothing that meets
other ranks crosses another, so every rank issues its collectives in the program's order; a
collective is only ever moved earlier. Where that raises the estimated peak past the policy's
bound (`Choices.overlap_within_peak`: the program order's peak, or a share over the memory
order's), the collective is issued as early as the bound allows; where none does, it keeps its
place in the memory order.
Our own symmetric comm kernels run on the compute stream and stay where they are.
"""
from __future__ import annotations

import collections
import operator
import weakref

import torch

from . import config, ir, memory
from .virtualized import V


def schedule(sched, order: list, inplace: dict, program: list) -> tuple[list, dict]:
    """(order, {collective: how it was placed}) for the groups in `order` (a valid order);
    `program`: the program's own order of the same groups."""
    collectives = [g for g in order if memory.is_collective(g)]
    if not config.overlap_collectives or not collectives:
        return order, {}
    preds, succs = _preds(sched, order), collections.defaultdict(set)
    for gid, ps in preds.items():
        for p in ps:
            succs[p].add(gid)
    at = {id(g): i for i, g in enumerate(program)}
    estimate = memory.peak_estimator(sched, inplace)
    base, program_peak, notes = estimate(order), estimate(program), {}
    for c in collectives:
        ancestors, name = _reach(c, preds), c.nodes[0].name
        lo, hi = _earliest(order, c, ancestors), order.index(c)
        place = lambda p: _sink_waits(_hoist(order, c, ancestors, p), c, preds, succs, at)  # noqa: E731
        fits = lambda peak: V.choices.overlap_within_peak(peak, base, program_peak)  # noqa: E731
        candidate = place(lo)
        if fits(peak := estimate(candidate)):
            order, notes[name] = candidate, "issued early, waited at first use"
            continue
        # as early as the bound allows: held gathered weights grow the further ahead it is issued
        # (FSDP's all-gathers, one block ahead rather than every one at the start or none)
        if not fits(estimate(place(hi))):
            notes[name] = f"kept in the memory order: overlapped, the estimated peak would be {peak}, not {base}"
            continue
        while hi - lo > 1:  # the peak grows (about) monotonically with how early it is issued
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(estimate(place(mid))) else (mid, hi)
        order, notes[name] = place(hi), f"issued {order.index(c) - hi} groups early (within the estimated peak's " \
                                         "bound), waited at first use"
    done = set()
    for g in order:
        assert preds[id(g)] <= done, f"overlap order runs {g!r} before what it needs"
        done.add(id(g))
    return order, notes


def _preds(sched, order) -> dict:
    """Group id -> the groups it must follow: its data dependencies; the groups that meet other
    ranks, chained in program order; the other pinned groups (random, mutating), chained too.
    Waits are pinned in memory.py's orders but free here: a wait meets no other rank."""
    preds = {id(g): set(sched.group_deps(g)) for g in order}
    comm = [g for g in order if memory.communicates(g)]  # as the program has them: memory orders keep that
    other = [g for g in order if memory.pinned(g) and not memory.communicates(g) and not memory.is_wait(g)]
    for chain in (comm, other):
        for a, b in zip(chain, chain[1:]):
            preds[id(b)].add(id(a))
    return preds


def _reach(g, edges) -> set:
    """The groups reached from `g` through `edges` (preds: its ancestors; succs: its descendants)."""
    seen, todo = set(), list(edges[id(g)])
    while todo:
        gid = todo.pop()
        if gid not in seen:
            seen.add(gid)
            todo.extend(edges[gid])
    return seen


def _earliest(order: list, c, ancestors: set) -> int:
    """Where `c` may go at the earliest: right after the last group that meets other ranks before
    it (or first). `ancestors`: the groups `c` follows (`_reach(c, preds)`)."""
    i = order.index(c)
    return 1 + max((k for k, g in enumerate(order[:i]) if id(g) in ancestors and memory.communicates(g)), default=-1)


def _hoist(order: list, c, ancestors: set, p: int) -> list:
    """`c` at place `p` (at least its earliest), with the groups it needs that lie between moved
    up before it, in their order."""
    i = order.index(c)
    between = order[p:i]
    return order[:p] + [g for g in between if id(g) in ancestors] + [c] + \
        [g for g in between if id(g) not in ancestors] + order[i + 1:]


def _sink_waits(order: list, c, preds, succs, at: dict) -> list:
    """Each wait on `c`'s result, with what needs it, after the groups it does not need that the
    program runs before it; then the wait alone just before the first group that needs it, or
    last. Never past an extern we cannot see into: it might wait for what the peers do next."""
    results = {id(c)} | {id(g) for g in order if isinstance(g.nodes[0].buf, ir.MultiOutput)
                         and id(c) in preds[id(g)]}  # the items of a coalesced collective's result
    for w in [g for g in order if memory.is_wait(g) and preds[id(g)] & results]:
        i = order.index(w)
        stop = next((k for k in range(i + 1, len(order)) if _opaque(order[k])), len(order))
        after = _reach(w, succs) | {id(w)}
        q = max((k for k in range(i + 1, stop) if id(order[k]) not in after and at[id(order[k])] < at[id(w)]),
                default=i)
        span = order[i:q + 1]
        order = order[:i] + [g for g in span if id(g) not in after] + [g for g in span if id(g) in after] + \
            order[q + 1:]
        rest = [g for g in order if g is not w]
        i = order.index(w)
        first = next((k for k in range(i, len(rest)) if id(rest[k]) in succs[id(w)] or _opaque(rest[k])), len(rest))
        order = rest[:first] + [w] + rest[first:]
    return order


def _opaque(g) -> bool:
    """An extern that may communicate and is neither a collective nor our comm kernel."""
    return memory.communicates(g) and g.is_extern() and not memory.is_collective(g) and \
        not isinstance(g.nodes[0].buf, ir.CommKernel)


# ------------------------------------------------- what a collective can hide behind (FX, lowering)
_MATMULS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}  # which argument is `a` (its last dim: K)


def _fx_meets_ranks(n) -> bool:
    return n.op == "call_function" and n.target is not operator.getitem and ir.meets_ranks(n.target)


def independent_flops(node) -> int:
    """FLOPs of the matmuls that neither feed the collective `node` (FX) nor need its result, between
    the collectives (or opaque ops) before and after it: what the overlap order can run while a c10d
    collective is in flight (its issue moves up past them, its wait sinks below them)."""
    nodes, pos = _positions(node.graph)
    i = pos[node]
    lo = next((k for k in range(i - 1, -1, -1) if _fx_meets_ranks(nodes[k])), -1)
    hi = next((k for k in range(i + 1, len(nodes)) if _fx_meets_ranks(nodes[k])), len(nodes))
    related, todo = {node}, list(node.all_input_nodes) + list(node.users)
    while todo:  # ancestors through inputs, descendants through users, within the window
        n = todo.pop()
        if n not in related and lo < pos[n] < hi:
            related.add(n)
            todo.extend(n.all_input_nodes if pos[n] < i else n.users)
    flops = 0
    for n in nodes[lo + 1: hi]:  # 2 x the output's elements x K
        a = _MATMULS.get(getattr(n.target, "_opname", None))
        out, a = n.meta.get("val"), a is not None and getattr(n.args[a], "meta", {}).get("val")
        if n not in related and isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor):
            flops += 2 * out.numel() * a.shape[-1]
    return flops


_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> (its nodes, {node: place})


def _positions(graph) -> tuple[list, dict]:
    cached = _POSITIONS.get(graph)
    if cached is None or len(cached[0]) != len(graph.nodes):  # once per graph: lowering asks per collective
        nodes = list(graph.nodes)
        cached = _POSITIONS[graph] = (nodes, {n: k for k, n in enumerate(nodes)})
    return cached


def forget_positions(graph) -> None:
    """After a rewrite of `graph` (passes/): its cached node positions are stale."""
    _POSITIONS.pop(graph, None)

