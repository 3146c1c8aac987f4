"""Memory: which buffers a graph owns, how long each lives, the peak an order implies, orders that
lower it, and kernels that write their output over an input they are the last to read.
"""
from __future__ import annotations

from . import ir
from .virtualized import V


def owned(name: str) -> bool:
    """Does the graph allocate (and so could free) this buffer? Inputs, constants and persistent
    comm buffers are alive whatever the graph does; a multi-output op's tuple has no storage."""
    buf = V.graph.name_to_buffer.get(name)
    return buf is not None and not isinstance(buf.layout, ir.CommLayout) and \
        not getattr(buf, "multi_output", False) and not getattr(buf, "side_effect", False)


def buffer_bytes(name: str) -> int:
    return V.graph.get_buffer(name).layout.nbytes_hint()


def owned_bytes(names) -> int:
    """Bytes of the buffers among `names` that the graph owns."""
    return sum(buffer_bytes(n) for n in set(names) if owned(n))
