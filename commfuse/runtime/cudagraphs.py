"""CUDA-graph mode: capture a compiled graph after warm-up and replay it.

The first call runs normally (it allocates and rendezvouses the comm pools, checks plans across
ranks, compiles the kernels); the second captures the call into a graph. Inputs are of two kinds:
- static (parameters and module buffers, as AOTAutograd reports them, and inputs the graph writes
  that came at one address on two calls in a row: a caller's KV cache, as transformers' StaticCache):
  captured at their own address, so a replay reads and writes them in place, with no copy; so are
  another graph's lent outputs (below). Should
  one move, or a symmetric pool be reallocated larger (its comm buffers move: another graph's first
  call needed more), the graph is captured again; after `Choices.cuda_graph_captures()` captures in a row,
  each replayed fewer than `Choices.cuda_graph_paid_replays()` times, it runs without one.
- the others (activations, token ids, positions): copied into a static copy before each replay
  when their address differs from it, and copied back after it when the graph writes them. A
  graph that copies more than `Choices.cuda_graph_copy_limit` bytes (these inputs, and its
  outputs) at each of 3 replays in a row runs without a graph from then on: a training step's
  saved activations cost more to copy than the launches save.
Outputs are lent: returned over the graph's own memory, with no copy, for as long as nothing holds
one when the graph is next replayed (its storage's use count is back where the capture left it: a
training step's saved activations are freed by its backward). The backward's inputs that are a
forward's lent outputs (the saved activations) are used in place, at the forward's addresses. An
output still held at the next call (a logits tensor kept, a gradient accumulated into, a second
forward before the backward) would be overwritten by the replay: that call runs without the graph,
the graph is captured again, and the output is returned as a copy from then on. Views of static
inputs are taken on this call's input (an address is reused: FSDP2's next layer's weights land
where the last one's were). A graph with
symbolic sizes runs without the graph when a call's shapes or scalars differ from the captured.
A graph that cannot be captured (an op that synchronizes, one torch refuses to capture) runs
without one from then on, with a warning that says why.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

import torch

from .symm import shared_pools

log = logging.getLogger("commfuse")

_lenders: dict[int, weakref.ref] = {}  # storage address of a lent output -> its graph


def _uses(t: torch.Tensor) -> int:
    """References to `t`'s storage (tensors over it, its temporary Python storage included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _lent(t) -> bool:
    """Is `t` over a live graph's lent output?"""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return False
    owner = _lenders.get(t.untyped_storage().data_ptr(), lambda: None)()
    return owner is not None and owner.graph is not None


@dataclasses.dataclass(frozen=True)
class InputRoles:
    """What the replay does with each input: indices into the graph's arguments."""
    static: frozenset    # used in place: parameters and module buffers
    mutated: frozenset   # written by the graph (copied back after a replay unless static)
    dynamic: bool        # sizes or scalars may change between calls

    def copy_in(self, n: int) -> list[int]:
        return [i for i in range(n) if i not in self.static]

    def copy_back(self) -> list[int]:
        return sorted(self.mutated - self.static)


class CudaGraphed:
    def __init__(self, call, graph_id: str, roles: InputRoles, max_captures: int, copy_limit: int,
                 paid_replays: int):
        self.call, self.graph_id, self.roles, self.max_captures = call, graph_id, roles, max_captures
        self.copy_limit, self.paid_replays = copy_limit, paid_replays
        self.calls = self.captures = self.costly = self.replays = 0
        self.graph = None
        self.last_ptrs, self.kept = {}, set()  # written inputs' addresses; those seen twice in a row
        self.in_place = frozenset()  # inputs the capture uses at their own address
        self.pools_replaced = shared_pools.replaced
        self.copied = set()  # outputs once held past the next call: returned as copies
        self.lent, self.base_uses = set(), {}  # outputs returned over the graph's memory; their storages' uses
        self.lent_in = set()  # inputs that are other graphs' lent outputs, read in place

    def _stop(self, why: str):
        self.captures = self.max_captures + 1
        self._drop()
        log.warning("commfuse: graph %s: %s: it runs without a CUDA graph from now on", self.graph_id, why)

    def __call__(self, args):
        self.calls += 1
        for i in self.roles.mutated - self.roles.static:
            if isinstance(args[i], torch.Tensor):
                p = args[i].data_ptr()
                if self.last_ptrs.get(i) == p:
                    self.kept.add(i)
                self.last_ptrs[i] = p
        if self.calls == 1 or self.captures > self.max_captures:
            return self.call(args)
        held = {i for i in self.lent if _uses(self.outputs[i]) > self.base_uses[i]}
        if held:  # a replay would overwrite an output still in use: copies from the next capture on
            self.copied |= held
            self._drop()
            self.replays = self.paid_replays  # once per output: not a capture that failed to pay
            return self.call(args)
        if self.graph is None or not self._static_in_place(args) or not self.kept <= self.in_place \
                or self.pools_replaced != shared_pools.replaced:
            self.captures = 1 + (self.captures if self.replays < self.paid_replays else 0)
            if self.captures > self.max_captures:
                self._stop(f"its parameters or buffers moved at {self.max_captures} captures in a row, each "
                           f"replayed < {self.paid_replays} times (one compiled code run by several layers, FSDP)")
                return self.call(args)
            if not self._capture(args):
                return self.call(args)
        if self.roles.dynamic and self._signature(args) != self.captured_signature:
            return self.call(args)
        moved = [i for i in self.copy_in if args[i].data_ptr() != self.inputs[i].data_ptr()]
        copied = sum(args[i].nbytes for i in moved) + self.out_bytes
        self.costly = self.costly + 1 if copied > self.copy_limit else 0
        if self.costly == 3:
            self._stop(f"each replay copied {copied >> 20} MiB (inputs that came at new addresses, "
                       "outputs), more than its launches cost")
            return self.call(args)
        for i in moved:
            self.inputs[i].copy_(args[i])
        back = [(args[i], self.inputs[i]) for i in self.copy_back]
        caller = {j: args[j] for j in set(self.aliases.values())}
        args.clear()
        self.graph.replay()
        self.replays += 1
        for a, static in back:
            if a.data_ptr() != static.data_ptr():
                a.copy_(static)
        return [on_input(o, self.inputs[self.aliases[i]], caller[self.aliases[i]]) if i in self.aliases
                else o.detach() if i in self.lent else copy_out(o) if i in self.cloned else o
                for i, o in enumerate(self.outputs)]

    def _drop(self):
        """Forget the graph (its memory back, but for lent outputs still held: theirs is their holders')."""
        for i in self.lent:
            key = self.outputs[i].untyped_storage().data_ptr()
            if _lenders.get(key, lambda: None)() is self:
                del _lenders[key]
        self.graph = self.inputs = self.outputs = None
        self.lent, self.base_uses = set(), {}

    def _static_in_place(self, args) -> bool:
        return all(args[i].data_ptr() == p for i, p in self.static_ptrs)

    def _signature(self, args):
        return [(tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else a for a in args]

    def _plan(self, args):
        """The inputs a capture uses in place (static ones, and other graphs' lent outputs), and those
        it copies in before a replay and back after."""
        self.replays = 0
        self.lent_in = {i for i, a in enumerate(args) if i not in self.roles.static and _lent(a)}
        self.in_place = frozenset(self.roles.static | self.kept | self.lent_in)
        self.captured_signature = self._signature(args)
        self.copy_in = [i for i in self.roles.copy_in(len(args)) if isinstance(args[i], torch.Tensor)
                        and i not in self.in_place]
        self.copy_back = [i for i in self.roles.copy_back() if isinstance(args[i], torch.Tensor)
                          and i not in self.in_place]
        self.inputs = [a.clone() if i in self.copy_in else a for i, a in enumerate(args)]
        self.static_ptrs = [(i, args[i].data_ptr()) for i in sorted(self.in_place)
                            if isinstance(args[i], torch.Tensor)]

    def _capture(self, args) -> bool:
        """Capture this call's graph; False where it cannot be (it runs without one from then on: the
        warm run wrote only copies of the caller's tensors, so the plain call that follows is this call)."""
        self._drop()
        self._plan(args)
        self.pools_replaced = shared_pools.replaced  # the comm buffers' addresses it captures
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # one more warm run on the capture stream, writing copies of the caller's tensors it
        # mutates (this call's update is the replay's)
        warm = [a.clone() if i in self.roles.mutated and i in self.in_place else a
                for i, a in enumerate(self.inputs)]
        with torch.cuda.stream(stream):
            self.call(warm)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=stream):
                self.outputs = self.call(list(self.inputs))
        except Exception as e:  # an op that syncs, a capture torch refuses: the graph runs as compiled
            self._stop(f"it cannot be captured in a CUDA graph ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            return False
        self._lend()
        log.info("commfuse: captured graph %s in a CUDA graph", self.graph_id)
        return True

    def _lend(self):
        """Sort the captured outputs: views of static inputs, outputs lent (their storages' use counts
        now, with nothing else holding them), and those copied out."""
        self.aliases = static_aliases(self.outputs, self.inputs, self.in_place - self.lent_in)
        own = {i for i, o in enumerate(self.outputs) if isinstance(o, torch.Tensor)} - set(self.aliases)
        borrowed = {self.inputs[j].untyped_storage().data_ptr() for j in self.lent_in}
        self.copied |= {i for i in own if self.outputs[i].untyped_storage().data_ptr() in borrowed}
        self.lent, self.cloned = own - self.copied, own & self.copied
        for j in self.lent_in:  # held here, the lender would see them in use: the capture read their addresses
            self.inputs[j] = None
        self.base_uses = {i: _uses(self.outputs[i]) for i in self.lent}
        for i in self.lent:
            _lenders[self.outputs[i].untyped_storage().data_ptr()] = weakref.ref(self)
        self.out_bytes = sum(self.outputs[i].nbytes for i in self.cloned)


def static_aliases(outputs, inputs, static) -> dict:
    """{output index: static input index} for the outputs that are a static input or a view of
    one (their storage is the input's): the caller's tensors, never copied."""
    owner = {a.untyped_storage().data_ptr(): j for j, a in enumerate(inputs)
             if j in static and isinstance(a, torch.Tensor)}
    return {i: owner[o.untyped_storage().data_ptr()] for i, o in enumerate(outputs)
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in owner}


def on_input(o: torch.Tensor, captured: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Output `o` of the capture, a view of the static input `captured`, taken on this call's
    input `a` at the same place (`a` itself where `o` is the whole of it), over `a`'s storage."""
    delta = o.data_ptr() - captured.data_ptr()  # bytes from the input's first element
    if delta == 0 and (o.dtype, o.shape, o.stride()) == (a.dtype, a.shape, a.stride()):
        return a
    offset = a.storage_offset() * a.element_size() + delta
    return o.new_empty(0).set_(a.untyped_storage(), offset // o.element_size(), o.shape, o.stride())


def copy_out(o: torch.Tensor) -> torch.Tensor:
    """A copy of a replay's output for the caller, in the output's own strides: a backward reads a
    saved activation by the strides its forward reported (padded rows, which `clone` would make
    contiguous). An expanded output (a stride 0) is copied dense: every slice read is the same."""
    if any(s == 0 and n > 1 for s, n in zip(o.stride(), o.shape)):
        return o.clone()
    return torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(o)


def input_roles(gm: torch.fx.GraphModule, kind: str) -> InputRoles:
    """Each placeholder's role, from the graph (which inputs it writes, whether sizes are symbolic)
    and AOTAutograd (which forward inputs are parameters or buffers)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    index = {p: i for i, p in enumerate(placeholders)}
    mutated = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                for v in torch.utils._pytree.tree_leaves(value):
                    if v in index:
                        mutated.add(index[v])
    static = set()
    ctx = torch._guards.TracingContext.try_get()
    if kind != "backward" and ctx is not None and ctx.fw_metadata is not None:
        static = set(ctx.fw_metadata.static_input_indices or ())
    dynamic = False
    for p in placeholders:
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor):
            dynamic |= any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
        elif val is not None and not isinstance(val, torch.Tensor):
            dynamic = True  # a scalar argument
    return InputRoles(frozenset(static), frozenset(mutated), dynamic)
