"""Dependency analysis: run a loop body under a handler that records every load and store.

The same handler renders the body as text for the IR dumps.
"""
from __future__ import annotations

import dataclasses
import itertools

import sympy

from .sizevars import index_symbol
from .virtualized import OPS, V


@dataclasses.dataclass
class MemoryAccess:
    name: str
    index: sympy.Expr
    indirect: bool = False  # the index depends on loaded data
    peer: bool = False      # every rank's copy is read (an all-reduce): at `index`, never from registers


@dataclasses.dataclass
class BodyTrace:
    reads: list
    writes: list
    lines: list  # (format string, its arguments): rendered only when asked, printing sympy is slow

    @property
    def text(self) -> str:
        return "; ".join(fmt.format(*args) for fmt, args in self.lines)

    @property
    def op_count(self) -> int:
        return len(self.lines)


class RecordingOps:
    """An ops handler that records accesses; values are the names of temporaries."""

    def __init__(self):
        self.reads: list[MemoryAccess] = []
        self.writes: list[MemoryAccess] = []
        self.lines: list[tuple] = []
        self._tmp = itertools.count()
        self._ind = itertools.count()
        self._indirect: set = set()

    def _emit(self, fmt: str, *args) -> str:
        name = f"t{next(self._tmp)}"
        self.lines.append((name + " = " + fmt, args))
        return name

    def load(self, name, index):
        self.reads.append(MemoryAccess(name, index, bool(index.free_symbols & self._indirect)))
        return self._emit("load({}, {})", name, index)

    def peer_reduce(self, name, index, reduce_op, shard=0):
        # peers' copies: never taken from the producer's registers, nor recomputed elsewhere
        # (a reduce-scatter's `shard`: each rank reads its own shard, `rank * shard` on)
        self.reads.append(MemoryAccess(name, index, indirect=True, peer=True))
        return self._emit("peer_reduce({}, {}, {}" + (", shard={})" if shard else "{})"), name, index, reduce_op, shard or "")

    def peer_load(self, name, index, peer):  # an all-gather's element: peer `peer`'s copy at `index`
        self.reads.append(MemoryAccess(name, index, indirect=True, peer=True))
        return self._emit("peer_load({}, {}, peer={})", name, index, peer)

    def store(self, name, index, value, mode=None):
        self.writes.append(MemoryAccess(name, index, bool(index.free_symbols & self._indirect)))
        self.lines.append(("store({}, {}, {}{})", (name, index, value, ", " + mode if mode else "")))

    def store_reduction(self, name, index, value):
        self.store(name, index, value)

    def indirect_indexing(self, value, size, check=True, wrap=True):
        sym = index_symbol("ind", next(self._ind))
        self._indirect.add(sym)
        self.lines.append(("{} = indirect({}, size={}, check={}, wrap={})", (sym, value, size, check, wrap)))
        return sym

    def masked(self, mask, body, other):
        self.lines.append(("masked({}):", (mask,)))
        result = body()
        return self._emit("masked_value({}, other={})", result, other)

    def __getattr__(self, op):
        if op not in OPS:
            raise AttributeError(op)

        def fn(*args, **kwargs):
            fmt = ", ".join(["{}"] * len(args) + [f"{k}={{}}" for k in kwargs])
            return self._emit(f"{op}({fmt})", *args, *kwargs.values())
        return fn


class InlineLoads:
    """Wraps an ops handler: a load of one of `buffers` runs that buffer's body at the loaded
    element instead, so the value is recomputed rather than read (rematerialization)."""

    def __init__(self, inner, buffers: dict):
        self.inner, self.buffers = inner, buffers

    def load(self, name, index):
        buf = self.buffers.get(name)
        if buf is None:
            return self.inner.load(name, index)
        return buf.data.inner_fn(buf.layout.unravel(index))  # its loads come back through here

    def __getattr__(self, name):
        return getattr(self.inner, name)


def index_vars(prefix: str, sizes) -> list:
    return [sympy.Integer(0) if s == 1 else index_symbol(prefix, i) for i, s in enumerate(sizes)]


def trace_body(loops, store_name=None, layout=None, inline=None) -> BodyTrace:
    """Record a loop body (ir.Loops) with symbolic indices i*, r*; loads of `inline` are recomputed."""
    handler = RecordingOps()
    index = index_vars("i", loops.ranges)
    with V.set_ops(InlineLoads(handler, inline) if inline else handler):
        value = loops.value(index, index_vars("r", loops.reduction_ranges))
        if store_name is not None:
            handler.store(store_name, layout.store_index(index), value)
        else:
            handler.lines.append(("return {}", (value,)))
    return BodyTrace(handler.reads, handler.writes, handler.lines)
