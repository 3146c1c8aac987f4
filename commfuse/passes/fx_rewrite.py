"""What the FX-graph rewrites (attention.py, async_tp.py, bucketing.py, reinplace.py, ...) share."""
from __future__ import annotations

import torch
import torch.fx

from .. import ir
from ..overlap import forget_positions


def erase_unused(graph: torch.fx.Graph, nodes) -> None:
    """Erase those of `nodes` (given users first) that nothing reads any more."""
    for n in dict.fromkeys(nodes):
        if not n.users:
            graph.erase_node(n)


def give_example_values(gm: torch.fx.GraphModule, old) -> None:
    """In Dynamo's graph every node carries its fake value (`example_value`): AOTAutograd's cache
    refuses a method called on a node without one. The nodes a rewrite added (those not in `old`)
    get theirs; Dynamo's own nodes without one (a context manager's calls) are not run."""
    def value(n):
        if "example_value" not in n.meta:
            raise LookupError(n.name)
        return n.meta["example_value"]
    for node in gm.graph.nodes:
        if node in old or node.op != "call_function" or "example_value" in node.meta:
            continue
        try:  # under the values' own fake mode, not the context's; without a value, the graph
            # only misses AOTAutograd's cache
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            with next(v.fake_mode for v in torch.utils._pytree.tree_leaves(args) if hasattr(v, "fake_mode")):
                node.meta["example_value"] = node.target(*args, **kwargs)
        except Exception:
            continue


def call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """A node computing target(*args), with its fake value (`val`), at the graph's insertion point."""
    node = graph.call_function(target, args)
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals)):
        node.meta["val"] = target(*vals)
    return node


def finish(gm: torch.fx.GraphModule, changed: int) -> int:
    """After `changed` rewrites of gm's graph: check it and regenerate its code; returns changed."""
    if changed:
        forget_positions(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return changed


def program_collectives(gm: torch.fx.GraphModule) -> list:
    """The collectives the program issues, in its order, as its peers see them: [op, reduce op,
    group, elements of each result, dtype]. Taken before the rewrites that sum, merge or chunk them
    (comm_sums, bucketing, async_tp), which each rank applies to its own graph: a value only one
    rank logs keeps its all-reduce apart there (runtime/plan_check.py compares these)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and ir.is_collective(n.target) and not ir.is_p2p(n.target):
            args = dict(zip((a.name for a in n.target._schema.arguments), n.args), **n.kwargs)
            vals = [v for v in torch.utils._pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
            out.append([n.target._opname, str(args.get("reduce_op", "")), str(args.get("group_name", "")),
                        [str(v.numel()) for v in vals if ir.sizes_agree(n.target)], str(vals[0].dtype) if vals else ""])
    return out


def copied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm whose graph a rewrite may change (the nodes' metadata shared, not copied)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = torch.fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out
