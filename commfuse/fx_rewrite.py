"""What the FX-graph rewrites (attention.py, reinplace.py, one_hot.py, host_scalars.py) share."""
from __future__ import annotations

import torch.fx


def erase_unused(graph: torch.fx.Graph, nodes) -> None:
    """Erase those of `nodes` (given users first) that nothing reads any more."""
    for n in dict.fromkeys(nodes):
        if not n.users:
            graph.erase_node(n)


def finish(gm: torch.fx.GraphModule, changed: int) -> int:
    """After `changed` rewrites of gm's graph: check it and regenerate its code; returns changed."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
