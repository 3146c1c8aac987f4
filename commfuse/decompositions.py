"""The decomposition table: composite ops broken into what lowering/ handles."""
from __future__ import annotations

import functools

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online, max-pool's offsets)
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._prims_common import suggest_memory_format
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true

aten = torch.ops.aten
_prepare_softmax = torch.ops.prims.prepare_softmax_online.default


def _prim(name: str, args: str):
    """torch's prim `name` if this torch has it with these arguments, else None."""
    op = getattr(torch.ops.prims, name, None)
    return op if op is not None and [a.name for a in op.default._schema.arguments] == args.split() else None


# torch's low-memory max-pool prims (older releases name them and their arguments otherwise)
_max_pool_offsets = _prim("_low_memory_max_pool_with_offsets", "self kernel_size stride padding dilation ceil_mode")
_offsets_to_indices = _prim("_low_memory_max_pool_offsets_to_indices",
                            "self kernel_size input_size stride padding dilation")

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
_KEEP = {aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._unsafe_index.Tensor,  # lowered without bounds asserts
         aten.select_scatter.default}  # its source read only where it lands


def _softmax_from_stats(log: bool):
    """Softmax as its row statistics (max, sum of exp(x - max): torch's `prepare_softmax_online`
    prim, one pass in lowering/softmax.py) and pointwise ops. AOTAutograd's partitioner knows the
    prim: it saves the two small results and recomputes the pointwise softmax in the backward,
    where for `_softmax`, which it may not recompute, it saves the whole probability matrix (a
    language model's vocabulary-wide rows)."""
    def decompose(x, dim, half_to_float):
        # (nor over a size known only at run time, x[mask]'s: its max would assert a nonzero size)
        if x.dim() == 0 or not statically_known_true(x.numel() != 0) or not x.dtype.is_floating_point:
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


_core_index_add = core_aten_decompositions()[aten.index_add.default]


def _index_add_in_fp32(x, dim, index, source, *, alpha=1):
    """A half-precision index_add (the gradient of index_select and repeat_interleave: an MoE's
    expert biases) sums in fp32 and rounds once. As the accumulating index_put it decomposes to,
    each add rounded: three times eager's error."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return _core_index_add(x, dim, index, source, alpha=alpha)
    return _core_index_add(x.float(), dim, index, source.float(), alpha=alpha).to(x.dtype)


def _max_pool_via_offsets(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """max-pool's indices as each output's int8 offset within its window, made into indices by a
    prim that AOTAutograd's partitioner recomputes in the backward: the forward saves 1 byte per
    output where it saved 8 (ResNet-18's at batch 64: 13 MB for 103). Not for windows of more than
    127 taps, dilation, or a channels_last input on CUDA (whose all -inf windows aten indexes 0)."""
    k, d = (_pair(v) for v in (kernel_size, dilation))
    s, p = _pair(stride or kernel_size), _pair(padding)
    cuda_nhwc = x.is_cuda and suggest_memory_format(x) == torch.channels_last
    if x.dim() != 4 or k[0] * k[1] > 127 or d != [1, 1] or cuda_nhwc or not x.dtype.is_floating_point \
            or _max_pool_offsets is None or _offsets_to_indices is None:
        return NotImplemented
    values, offsets = _max_pool_offsets.default(x, k, s, p, d, ceil_mode)
    return values, _offsets_to_indices.default(offsets, k, x.shape[-2:], s, p, d)


def _pair(v) -> list:
    return [v, v] if isinstance(v, int) else list(v) * (2 // len(v))


# foreach ops whose per-tensor op we lower (the rest keep their one aten call), and those whose
# argument at a position is keyword-only in the per-tensor op
_FOREACH = ("add sub mul div addcmul addcdiv lerp pow maximum minimum clamp_min clamp_max abs neg exp sqrt rsqrt "
            "reciprocal sign sigmoid tanh log log1p log2 expm1 sin cos erf floor ceil round trunc copy zero norm").split()
_KEYWORD = {"addcmul": (3, "value"), "addcdiv": (3, "value"), "norm": (2, "dtype")}


def _foreach(name: str):
    """`aten._foreach_<name>(lists, ...)` as the per-tensor ops it stands for: each tensor's chain
    of an optimizer step (clip, EMA) then fuses into one kernel, as in Inductor's foreach lowering."""
    base = {"zero": aten.zeros_like, "norm": aten.linalg_vector_norm}.get(name, getattr(aten, name))
    of_number = {"maximum": aten.clamp_min, "minimum": aten.clamp_max}.get(name, base)  # maximum takes no number

    def decompose(*args, **kwargs):
        k, key = _KEYWORD.get(name, (len(args), None))
        args, kwargs = args[:k], {**kwargs, **({key: args[k]} if len(args) > k else {})}
        if set(kwargs) - {"alpha", key} or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return NotImplemented  # addcmul's tensor of scalars, or arguments named unlike the op's
        op = base if len(args) < 2 or isinstance(args[1], (list, tuple, torch.Tensor)) else of_number
        pick = lambda v, i: v[i] if isinstance(v, (list, tuple)) else v  # noqa: E731
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        return [op(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return decompose


_OURS = {aten._softmax.default: _softmax_from_stats(log=False),
         aten.max_pool2d_with_indices.default: _max_pool_via_offsets,
         aten._log_softmax.default: _softmax_from_stats(log=True),
         aten.convolution_backward.default: _conv_backward_bias_apart,
         aten.index_add.default: _index_add_in_fp32,
         **{ov: _foreach(name) for name in _FOREACH for p in [getattr(aten, f"_foreach_{name}")]
            for ov in (getattr(p, o) for o in p.overloads()) if not ov._schema.is_mutable}}


def _whole_where_data_dependent(decompose):
    """`decompose`, or the op left whole where it would branch on a size known only at run time
    (`x.repeat(n.item(), 1)`: torch's reference of repeat tests each count; the whole op is run
    through aten, as Inductor, which does not decompose it, runs it)."""
    @functools.wraps(decompose)
    def safe(*args, **kwargs):
        try:
            return decompose(*args, **kwargs)
        except GuardOnDataDependentSymNode:
            return NotImplemented
    return safe


# the forward ops whose saved values a backward reads, where their names do not say it
_FORWARDS = {"aten.native_batch_norm_backward": tuple(f"aten.{op}" for op in (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training"))}


@functools.lru_cache(None)
def decomposition_table(keep: tuple = ()) -> dict:
    """`keep`: names of ops (overloads or packets) left whole, as in `config.fallback_ops`. A
    backward kept whole keeps its forward whole too: aten's backward reads what aten's forward
    saves (a mixed-precision norm's fp32 statistics, where the decomposition saves bf16 ones)."""
    keep = set(keep) | {f for name in keep for f in _FORWARDS.get(name, (name.removesuffix("_backward"),))}
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    table.update(_OURS)
    for op in list(table):
        if op in _KEEP or str(op) in keep or str(op.overloadpacket) in keep:
            del table[op]
    return {op: _whole_where_data_dependent(fn) for op, fn in table.items()}
