"""The values a forward saves for its backward, in the order AOTAutograd's runtime reads them:
tensors, opaque objects (a DTensor graph's DeviceMesh), symbolic ints; the backward takes symbolic
ints, tensors, opaque objects, then its tangents. Under activation checkpointing torch's partitioner
(2.13) appends the RNG states that the recomputation replays after the opaque objects, and every
backend, Inductor's too, then fails on a tensor-parallel model ("expected all
tensors_saved_with_vc_check to be Tensors"). Sorting by kind, each kind in its order, mends it."""
from __future__ import annotations

import torch.fx as fx
from torch._functorch.partitioners import is_sym_node

try:
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node
except ImportError:  # a torch whose forward saves no opaque objects: nothing to reorder
    is_opaque_node = None


def _kind(node) -> int:
    return 2 if is_sym_node(node) else 1 if is_opaque_node(node) else 0


def saved_in_runtime_order(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    if is_opaque_node is None:
        return
    output = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    saved = outs[num_fwd_outputs:]
    if [_kind(n) for n in saved] == sorted(_kind(n) for n in saved):
        return
    output.args = (tuple(outs[:num_fwd_outputs] + sorted(saved, key=_kind)),)
    fw.recompile()
    inputs = list(bw.graph.find_nodes(op="placeholder"))
    taken, rest = inputs[:len(saved)], inputs[len(saved):]  # the saved values, then the tangents
    before = rest[0] if rest else next(n for n in bw.graph.nodes if n.op != "placeholder")
    for node in sorted(taken, key=lambda n: (1, 2, 0)[_kind(n)]):  # symbolic ints, tensors, opaque objects
        before.prepend(node)
    bw.recompile()
