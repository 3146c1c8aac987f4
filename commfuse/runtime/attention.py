"""`commfuse::decode_attention`: SDPA of one query token per sequence over a cache, what
passes/attention.py puts where the policy wants the generated decode kernel (codegen/
decode_attention.py). Its eager form is SDPA itself, so a graph that runs it through aten (a
lowering that declines) computes exactly what the model asked for."""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("commfuse::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """q [B, Hq, 1, D], k / v [B, Hkv, S, D] with Hq a multiple of Hkv (query head h reads K/V
    head h // (Hq / Hkv)), mask broadcastable to [B, Hq, 1, S] (bool: keys kept; float: added)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
