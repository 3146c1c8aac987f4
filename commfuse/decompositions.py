"""The decomposition table: composite ops broken into what lowering/ handles."""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

# Composites that core ATen keeps but we would rather see as their parts.
_EXTRA = [
    aten.native_layer_norm, aten.native_group_norm,
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional,
    aten._fused_rms_norm, aten.gelu, aten.silu, aten.mish, aten.elu, aten.celu, aten.selu,
    aten.softplus, aten.hardtanh, aten.hardswish, aten.hardsigmoid, aten.leaky_relu,
    aten.var, aten.var_mean, aten.std, aten.std_mean, aten.logsumexp, aten.linalg_vector_norm,
    aten.native_dropout, aten.embedding, aten.index_select, aten.repeat, aten.flip, aten.roll,
    aten.tril, aten.triu, aten.frac, aten.mse_loss, aten.binary_cross_entropy_with_logits,
    aten.nll_loss_forward, aten.split_with_sizes, aten.unbind,
]

# Ops we lower better ourselves than their decompositions would, and ops whose decomposition is
# wrong for us: the CPU flash attention's is for export only (its second output is not the
# logsumexp its backward reads, so gradients through it would be silently wrong).
_KEEP = {aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


@functools.lru_cache(None)
def decomposition_table(keep: tuple = ()) -> dict:
    """`keep`: names of ops (overloads or packets) left whole, as in `config.fallback_ops`."""
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    for op in list(table):
        if op in _KEEP or str(op) in keep or str(op.overloadpacket) in keep:
            del table[op]
    return table
