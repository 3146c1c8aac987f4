"""Thread-local context: the graph being lowered, the active `ops` handler, and the policy.

Loop bodies are written against `ops`; whoever runs them (code generation,
dependency analysis) installs its own handler with `V.set_ops(handler)`. Every heuristic is
asked of `V.choices` (commfuse/choices.py installs it for each compile).
"""
from __future__ import annotations

import contextlib
import threading


class _Context(threading.local):
    def __init__(self):
        self.graph = None
        self.ops = None
        self.choices = None

    @contextlib.contextmanager
    def _swap(self, attr, value):
        old = getattr(self, attr)
        setattr(self, attr, value)
        try:
            yield value
        finally:
            setattr(self, attr, old)

    def set_graph(self, graph):
        return self._swap("graph", graph)

    def set_ops(self, handler):
        return self._swap("ops", handler)

    def set_choices(self, choices):
        return self._swap("choices", choices)


V = _Context()

# Every op a loop body may call on `ops`, declared once. The handlers (dependencies.RecordingOps,
# codegen/triton_ops.TritonOps) implement these names, and `ops` refuses any other.
OPS = frozenset("""
    load store store_reduction reduction peer_reduce peer_load index_expr indirect_indexing masked
    constant to_dtype where random
    add sub mul truediv floordiv truncdiv remainder fmod pow neg abs square maximum minimum
    fmax fmin relu sign copysign signbit hypot atan2
    eq ne lt le gt ge logical_and logical_or logical_xor logical_not isnan isinf
    bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift
    exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh
    asinh acosh atanh sigmoid erf erfc reciprocal floor ceil trunc round
""".split())


class _OpsProxy:
    """`ops.add(a, b)` dispatches to the handler installed in `V`."""

    def __getattr__(self, name):
        if name not in OPS:
            raise AttributeError(f"ops.{name} is not an op of the ops handler (virtualized.OPS)")
        return getattr(V.ops, name)


ops = _OpsProxy()
