"""Random tensors drawn inside the kernels that read them (Philox counters: Triton's `tl.rand` and
`tl.randn`). A dropout mask is computed where it is applied, never written out by aten and read
back; a draw recomputed in two kernels is the same draw. Values differ from eager's, as every
generator but eager's own does; seeded by `torch.manual_seed` all the same."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.virtualized import V, ops

from . import register
from .common import to_size
from .extern import fallback

aten = torch.ops.aten


def _seed(device) -> TensorBox:
    """One seed per call of the graph, drawn by aten from the device's generator: reproducible
    under manual_seed, and new at each CUDA-graph replay, as eager's draws are."""
    seeds = V.graph.random_seeds
    if device not in seeds:
        with FakeTensorMode():
            meta = torch.empty(1, dtype=torch.int64, device=device)
        seeds[device] = fallback(aten.randint.low, (0, 2**31 - 1, [1]), {"dtype": torch.int64, "device": device}, meta)
    return seeds[device]


@register(aten.rand.default, aten.rand_like.default, aten.randn.default, aten.randn_like.default, with_op=True)
def random_like(op, *args, **kwargs):
    meta = V.graph.current_node.meta["val"]
    if not meta.dtype.is_floating_point or meta.dtype == torch.float64:
        raise ir.Unsupported(f"draws of {meta.dtype}")  # fp32 draws would lose fp64's low bits
    size = to_size(meta.shape)
    numel = sizevars.product(size)
    if numel.is_number and int(numel) >= 2**31:
        raise ir.Unsupported("more draws than a 32-bit counter")
    normal = op.overloadpacket in (aten.randn, aten.randn_like)
    load_seed, stream = _seed(meta.device).make_loader(), V.graph.random_streams
    V.graph.random_streams += 1

    def inner(idx):  # stream k of the call keys Philox with seed + k; the element is the counter
        key = ops.add(load_seed([sizevars.from_torch(0)]), ops.constant(stream, torch.int64))
        draw = ops.random(key, ops.index_expr(sizevars.ravel(idx, size), torch.int32), normal)
        if not normal:  # below 1 in the dtype too: a bf16 draw above 1 - 2**-9 rounded up to 1.0
            draw = ops.minimum(draw, ops.constant(1 - torch.finfo(meta.dtype).eps / 2, torch.float32))
        return ops.to_dtype(draw, meta.dtype)
    return TensorBox(Pointwise(meta.device, meta.dtype, inner, size))
