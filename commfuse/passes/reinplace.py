"""Functional updates of graph inputs, done in place.

AOTAutograd functionalizes `cache.index_copy_(dim, pos, new)` on a module buffer into
`updated = index_put(cache, indices, new)` ... `copy_(cache, updated)`: every call copies the whole
cache once into `updated` and once back. When nothing else reads the input, the update can write
into it directly: `updated = index_put_(cache, ...)` (an alias of `cache`, which its readers still
read, so they stay ordered after the write) and no copy back. For a decode step, that is the KV cache not read and written twice more per layer.
"""
from __future__ import annotations

import torch
import torch.fx

from .fx_rewrite import finish

aten = torch.ops.aten

# functional op -> its in-place form, for ops whose first argument is the tensor updated
_INPLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.index_copy.default: aten.index_copy_.default,
    aten.slice_scatter.default: None,  # no in-place form in aten: left as is
}


def reinplace_input_updates(gm: torch.fx.GraphModule) -> int:
    """Rewrite `copy_(x, f(x, ...))` on a placeholder x into `f_(x, ...)` where x has no other
    reader; returns how many updates changed."""
    changed = 0
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        dst, src = copy.args[:2]
        if dst.op != "placeholder" or not isinstance(src, torch.fx.Node) or src.op != "call_function":
            continue
        inplace = _INPLACE.get(src.target)
        if inplace is None or src.args[0] is not dst or set(dst.users) != {src, copy}:
            continue
        if copy.users:  # the copy's result is used: keep the graph's shape simple, skip
            continue
        src.target = inplace
        gm.graph.erase_node(copy)
        changed += 1
    return finish(gm, changed)
