"""Small collectives of one kind, group and dtype, merged into one over a packed buffer.

FSDP-style programs all-gather each parameter and reduce-scatter each gradient on their own; a
small collective costs its latency, not its bytes, so N of them cost N latencies. A bucket packs its
members' inputs into one flat buffer, runs one collective and gives each member its result back as
views (an all-gather's gathered buffer holds rank r's packed chunk in row r, so member i is a column
range of every row). The bucket is issued right after its last member's input is ready and
waited before the first use of any member's result: members never read each other's results, and
no bucket moves a collective across an op that may communicate or has side effects. An input is
ready once the last op it needs that computes values is done, and a result used where an op that
computes values first reads it: the views, pads and cats between (what DTensor adds around a short
shard and its result, on some ranks only) move with the bucket's collective and wait, so what
merges is the same on every rank.
"""
from __future__ import annotations

import bisect
import operator

import torch
import torch.fx

from .. import choices, config, ir
from ..collectives import CommRequest
from .fx_rewrite import call, finish

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
# op -> (kind, index of the group name, of the reduce op, of the group size) in its arguments
_KINDS = {c10d.all_gather_into_tensor.default: ("all_gather", 2, None, 1),
          c10d.reduce_scatter_tensor.default: ("reduce_scatter", 3, 1, 2),
          c10d.all_reduce.default: ("all_reduce", 2, 1, None)}


def _barrier(node: torch.fx.Node) -> bool:
    """An op that may meet other ranks (`ir.meets_ranks`) in an order of their own, or that mutates.
    A collective that every rank runs is none (a send or receive is one): this pass moves it the same way on all ranks."""
    t = node.target
    if node.op != "call_function" or t is operator.getitem:
        return False
    return ir.meets_ranks(t) and not (ir.is_collective(t) and not ir.is_p2p(t)) or t._schema.is_mutable


# ops that only lay values out: DTensor adds them around a short shard on some ranks only
_LAYOUT = (aten.constant_pad_nd.default, aten.cat.default, aten.clone.default)


def _layout_only(node: torch.fx.Node) -> bool:
    """A view, pad, cat or copy: it may run as soon as its inputs exist, earlier than placed."""
    t = node.target
    return node.op == "call_function" and (t is operator.getitem or t in _LAYOUT or getattr(t, "is_view", False))


def _ready(x, pos: dict, memo: dict) -> tuple[int, bool]:
    """Where `x` can be computed at the earliest: after the last op it needs that computes values
    (or input); and whether it reads a collective's result (then it stays: it may be a member's use)."""
    if x not in memo:
        deps = [_ready(d, pos, memo) for d in x.all_input_nodes]
        moves = _layout_only(x)
        reads = ir.is_wait(x.target) or moves and any(r for _, r in deps)
        memo[x] = (max((p for p, _ in deps), default=0), False) if moves and not reads else (pos[x], reads)
    return memo[x]


def _candidate(node: torch.fx.Node, pos: dict, end: int):
    """(key, input, bytes, first use of the result) for a collective that may join a bucket."""
    kind = _KINDS.get(node.target)
    if kind is None or node.kwargs or node.meta.get("bucket") or len(node.users) != 1:
        return None
    (wait,) = node.users
    x = node.args[0]
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if wait.target is not c10d.wait_tensor.default or not isinstance(v, torch.Tensor) \
            or not all(isinstance(s, int) for s in v.shape) or not v.is_contiguous() or v.numel() == 0:
        return None
    name, g, op, w = kind
    world = node.args[w] if w else 0
    if name == "reduce_scatter" and v.shape[0] % world:
        return None
    request = CommRequest(name, node.args[op] if op else "", str(node.args[g]), v.dtype, v.device, tuple(v.shape))
    if not choices.current().bucket_member(request):
        return None
    key = (name, str(node.args[g]), node.args[op] if op else None, world, v.dtype, v.device)
    return key, x, request.nbytes, min((pos[u] for u in _users(wait) if not _layout_only(u)), default=end)


def _users(node: torch.fx.Node) -> list:
    """The nodes that read `node`, and through layout ops its value: a view or slice of a result (a
    short shard's unpadding, on some ranks only) is no use of it; it moves down with the wait."""
    out, stack = [], list(node.users)
    while stack:
        out.append(u := stack.pop())
        if _layout_only(u):
            stack.extend(u.users)
    return out


def _find_bucket(graph: torch.fx.Graph):
    """The first bucket of two or more members, in graph order, or None."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    barriers = [i for i, n in enumerate(nodes) if _barrier(n)]
    last_input = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)
    policy, open_, memo = choices.current(), {}, {}
    for node in nodes:
        c = _candidate(node, pos, len(nodes) - 1)
        if c is None:
            continue
        key, x, nbytes, use = c
        (ready, reads), b = _ready(x, pos, memo), open_.get(key)
        ready = max(ready, last_input)
        if b is not None:
            start = max(b["start"], ready)  # where the merged collective goes
            lo = min(start, pos[b["members"][0]])
            fits = b["bytes"] + nbytes <= policy.bucket_cap_bytes(key[0], key[3])
            crossed = bisect.bisect_right(barriers, lo) < bisect.bisect_left(barriers, max(pos[node], start))
            # (an input laid out from a collective's result may be laid out from a member's)
            if fits and not crossed and not reads and start < min(b["use"], use):
                b["members"].append(node)
                b.update(start=start, use=min(b["use"], use), bytes=b["bytes"] + nbytes)
                continue
            if len(b["members"]) > 1:
                return b, nodes
        open_[key] = {"key": key, "members": [node], "start": ready, "use": use, "bytes": nbytes}
    full = [b for b in open_.values() if len(b["members"]) > 1]
    return (min(full, key=lambda b: pos[b["members"][0]]), nodes) if full else None


def _merge(graph: torch.fx.Graph, bucket: dict, nodes: list) -> None:
    name, _, _, world, _, _ = bucket["key"]
    members = bucket["members"]
    xs = [m.args[0] for m in members]
    sizes = [x.meta["val"].numel() // (world if name == "reduce_scatter" else 1) for x in xs]
    total, offsets = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    pos = {n: i for i, n in enumerate(nodes)}
    with graph.inserting_before(_hoist(xs, nodes, pos, bucket["start"]).next):  # after the last member's input
        if name == "reduce_scatter":  # rank r's share of every member, side by side
            parts = [call(graph, aten.view.default, x, [world, n]) for x, n in zip(xs, sizes)]
            packed = call(graph, aten.view.default, call(graph, aten.cat.default, parts, 1), [world * total])
        else:
            packed = call(graph, aten.cat.default, [call(graph, aten.view.default, x, [-1]) for x in xs])
        merged = call(graph, members[0].target, packed, *members[0].args[1:])
        merged.meta["bucket"] = len(members)
    first_use = nodes[bucket["use"]]
    layout = sorted({u for m in members for u in _users(next(iter(m.users))) if _layout_only(u)}, key=pos.get)
    with graph.inserting_before(first_use):  # waited before any member's result is read
        done = call(graph, c10d.wait_tensor.default, merged)
        rows = call(graph, aten.view.default, done, [world, total]) if name == "all_gather" else None
        for m, n, off in zip(members, sizes, offsets):
            shape = list(next(iter(m.users)).meta["val"].shape)
            if rows is None:
                out = call(graph, aten.view.default, call(graph, aten.slice.Tensor, done, 0, off, off + n), shape)
            else:  # every rank's columns of this member, copied out in the gathered order
                cols = call(graph, aten.slice.Tensor, rows, 1, off, off + n)
                out = call(graph, aten.view.default, call(graph, aten.clone.default, cols), shape)
            (wait,) = m.users
            wait.replace_all_uses_with(out)
            graph.erase_node(wait)
            graph.erase_node(m)
    for u in layout:  # after the results they lay out, in their order
        if pos[u] < bucket["use"]:
            first_use.prepend(u)


def _hoist(xs: list, nodes: list, pos: dict, start: int) -> torch.fx.Node:
    """Move the layout ops that the inputs `xs` need and that come after node `start` to just after
    it, in their order (what they read is computed at or before it: `_ready`); returns the last."""
    late, stack, at = set(), list(xs), nodes[start]
    while stack:
        if pos[n := stack.pop()] > start and n not in late:
            late.add(n)
            stack.extend(n.all_input_nodes)
    for n in sorted(late, key=pos.get):
        at.append(n)
        at = n
    return at


def bucket_collectives(gm: torch.fx.GraphModule) -> int:
    """Merge small collectives into buckets (`choices.bucket_*`); returns how many were merged
    away. One bucket at a time, each found on the graph the previous one left."""
    if not config.comm.bucketing:
        return 0
    changed = 0
    while (found := _find_bucket(gm.graph)) is not None:
        _merge(gm.graph, *found)
        changed += len(found[0]["members"]) - 1
    return finish(gm, changed)


def bucketable_groups(gm: torch.fx.GraphModule) -> set:
    """The groups with two or more collectives that may join one bucket by their kind and size,
    whatever the code between them (which may keep them apart on some ranks only)."""
    if not config.comm.bucketing:
        return set()
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    keys = [c[0] for n in nodes if (c := _candidate(n, pos, len(nodes) - 1)) is not None]
    return {key[1] for key in keys if keys.count(key) > 1}
