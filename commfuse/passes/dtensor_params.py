"""Inference graphs take their DTensor parameters and buffers as local shards.

AOTAutograd unwraps every tensor-subclass input on every call. Before torch 2.13 it walks each one
generically: for a tensor-parallel decode step, about half the host time of a call (28 DTensor
weights; bench/results/decode_host_2xh100_2fb7e6e.md). Where the graph needs no autograd, each
DTensor parameter or buffer is rebuilt inside the graph from its local shard (`from_local` over the
mesh, placements, shape and stride Dynamo guards), and the call passes `p._local_tensor`.
"""
from __future__ import annotations

import sys

import torch
import torch.fx

from .fx_rewrite import finish


def local_shard_inputs(gm: torch.fx.GraphModule, example_inputs) -> tuple[list, list[int]]:
    """Rewrite gm to take the local shards of its DTensor parameters and buffers; returns the example
    inputs it now takes and the positions passed as shards. Nothing changes in a graph that needs
    autograd (a shard would cut the parameter off its gradient), nor for symbolic shapes."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none unless imported
    if dtensor is None or (torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)):
        return example_inputs, []
    placeholders, inputs, indices = gm.graph.find_nodes(op="placeholder"), list(example_inputs), []
    for i, (p, x) in enumerate(zip(placeholders, example_inputs)):
        fake = p.meta.get("example_value")
        static = isinstance(x, torch.nn.Parameter) or hasattr(x, "_dynamo_static_input_type")  # Dynamo's mark
        if type(x) is not dtensor or not static or not hasattr(fake, "_local_tensor") or any(
                isinstance(s, torch.SymInt) for s in (*fake.shape, *fake.stride(), *fake._local_tensor.shape)):
            continue
        with gm.graph.inserting_before(p):
            shard = gm.graph.placeholder(f"{p.name}_local")
        shard.meta = {**p.meta, "example_value": fake._local_tensor}
        shard._dynamo_source = getattr(p, "_dynamo_source", None)  # AOTAutograd finds static inputs by it
        with gm.graph.inserting_after(placeholders[-1]):
            rebuilt = gm.graph.call_function(_from_local(x.device_mesh, x.placements, x.shape, x.stride()), (shard,))
        rebuilt.meta["example_value"] = fake
        p.replace_all_uses_with(rebuilt)
        gm.graph.erase_node(p)
        inputs[i] = x._local_tensor
        indices.append(i)
    finish(gm, len(indices))
    return inputs, indices


def call_with_shards(compiled, indices: list[int]):
    """`compiled` (taking shards at `indices`) called as Dynamo calls the graph: with the DTensors."""
    if not indices:
        return compiled

    def call(*args):
        args = list(args)
        for i in indices:
            args[i] = args[i]._local_tensor
        return compiled(*args)
    return call


def _from_local(mesh, placements, shape, stride):
    """The graph input's DTensor over its shard. A closure over its constants, as Dynamo's own
    before torch 2.13: AOTAutograd's cache keys it by what it binds (compiled.py)."""
    from torch.distributed.tensor import DTensor
    placements, shape, stride = tuple(placements), torch.Size(shape), tuple(stride)

    def from_local(local):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return from_local
