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


class _OpsProxy:
    """`ops.add(a, b)` dispatches to the handler installed in `V`."""

    def __getattr__(self, name):
        return getattr(V.ops, name)


ops = _OpsProxy()
