"""Scalars made on the host, read on the GPU.

Traced code leaves 0-dim CPU tensors in a CUDA graph: a Python number in `torch.where(mask, x,
min_value)` or `masked_fill` decomposes into `scalar_tensor(v, device='cpu')`, and `t[..., 0] = 0`
copies a lifted CPU constant into `t`. An op that reads a CPU tensor runs through aten on a GPU
host, so each is an unfused kernel of its own, and the copy into a GPU tensor is a host-to-device
transfer, which a CUDA graph cannot capture. Their values are known when compiling: each GPU op
reads a constant made on its own device instead, which fuses like any other constant.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx

from .fx_rewrite import erase_unused, finish

aten = torch.ops.aten

_SAME_VALUE = {aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, aten.detach.default}


def scalars_to_device(gm: torch.fx.GraphModule) -> int:
    """Give every non-CPU op that reads a 0-dim CPU constant a copy of it on its own device;
    returns how many reads changed."""
    changed = 0
    made: dict = {}  # (scalar node, device) -> the constant on that device
    for node in list(gm.graph.nodes):
        readers = [(u, d) for u in node.users if u.target not in _SAME_VALUE
                   for d in [_device_of(u)] if d is not None and d.type != "cpu"]
        value = _host_scalar(gm, node) if readers else None
        if value is None:
            continue
        for user, device in readers:
            if (node, device) not in made:
                with gm.graph.inserting_after(node):
                    made[node, device] = _scalar(gm.graph, value, node.meta["val"].dtype, device, user.meta["val"])
            user.replace_input_with(node, made[node, device])
            changed += 1
        erase_unused(gm.graph, _chain(node))
    return finish(gm, changed)


def _host_scalar(gm, node) -> bool | int | float | None:
    """The value of node when it is a 0-dim CPU tensor known at compile time."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0 or val.device.type != "cpu" or val.dtype.is_complex:
        return None
    if node.op == "get_attr":
        const = gm
        for part in node.target.split("."):
            const = getattr(const, part)
        real = isinstance(const, torch.Tensor) and not isinstance(const, torch._subclasses.FakeTensor)
        if not real:
            return None
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return const.item()
    if node.op != "call_function":
        return None
    if node.target == aten.scalar_tensor.default or node.target == aten.full.default and list(node.args[0]) == []:
        value = node.args[0 if node.target == aten.scalar_tensor.default else 1]
        return value if type(value) in (bool, int, float) else None
    if node.target in _SAME_VALUE and isinstance(node.args[0], torch.fx.Node):
        return _host_scalar(gm, node.args[0])
    return None


def _chain(node):
    """node and the nodes that it reads its value through, users first (for erasing)."""
    while True:
        yield node
        if node.op != "call_function" or node.target not in _SAME_VALUE:
            return
        node = node.args[0]


def _device_of(node) -> torch.device | None:
    """The one device of node's tensor outputs."""
    leaves = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    devices = {x.device for x in leaves if isinstance(x, torch.Tensor)}
    return devices.pop() if len(devices) == 1 else None


def _scalar(graph, value, dtype, device, user_val) -> torch.fx.Node:
    node = graph.call_function(aten.scalar_tensor.default, (value,), {"dtype": dtype, "device": device})
    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(user_val)) or contextlib.nullcontext():
        node.meta["val"] = torch.empty((), dtype=dtype, device=device)
    return node
