"""The decomposition table: composite ops broken into what lowering/ handles."""
from __future__ import annotations

import functools

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten
_prepare_softmax = torch.ops.prims.prepare_softmax_online.default

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


def _softmax_from_stats(log: bool):
    """Softmax as its row statistics (max, sum of exp(x - max): torch's `prepare_softmax_online`
    prim, one pass in lowering/softmax.py) and pointwise ops. AOTAutograd's partitioner knows the
    prim: it saves the two small results and recomputes the pointwise softmax in the backward,
    where for `_softmax`, which it may not recompute, it saves the whole probability matrix (a
    language model's vocabulary-wide rows)."""
    def decompose(x, dim, half_to_float):
        if x.dim() == 0 or x.numel() == 0 or not x.dtype.is_floating_point:
            return NotImplemented  # the op stays whole (lowered or run through aten)
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        result = torch.float32 if half_to_float else x.dtype
        x = x.to(compute)
        # The pointwise part reads x through an alias taken before the statistics: partitioners
        # that do not know the prim (torch 2.11's) take it for an unfusible op and will not
        # recompute a use of its input that comes after it; they saved the whole output.
        xp = aten.alias(x)
        mx, total = _prepare_softmax(x, dim)
        out = (xp - mx) - torch.log(total) if log else torch.exp(xp - mx) / total
        return out.to(result)
    return decompose


def _conv_backward_bias_apart(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                              output_padding, groups, output_mask):
    """A convolution's bias gradient as the sum it is, over every dim but the channels: a
    reduction we generate, fused with what produces the gradient, where aten spends a pass of
    its own on it (a squeeze-excitation block's two 1x1 convolutions, per block)."""
    if not output_mask[2]:
        return NotImplemented
    grad_x, grad_w, _ = aten.convolution_backward.default(
        grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
        [output_mask[0], output_mask[1], False])
    return grad_x, grad_w, aten.sum.dim_IntList(grad, [0, *range(2, grad.dim())])


_OURS = {aten._softmax.default: _softmax_from_stats(log=False),
         aten._log_softmax.default: _softmax_from_stats(log=True),
         aten.convolution_backward.default: _conv_backward_bias_apart}


@functools.lru_cache(None)
def decomposition_table(keep: tuple = ()) -> dict:
    """`keep`: names of ops (overloads or packets) left whole, as in `config.fallback_ops`."""
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    table.update(_OURS)
    for op in list(table):
        if op in _KEEP or str(op) in keep or str(op.overloadpacket) in keep:
            del table[op]
    return table
