"""Attention rewrites on the graph Dynamo hands us, before AOTAutograd.

Grouped-query attention: models repeat each K/V head for the query heads that share it (HF's
`repeat_kv`, an unsqueeze + expand + reshape, or `repeat_interleave` on the head dim) and pass the
copies to `scaled_dot_product_attention`. The copies are as large as K and V times the group size
and are written and read once per call (in decode: the whole KV cache, every step). SDPA takes
the unrepeated K/V with `enable_gqa=True` and maps query head h to K/V head h // group, which is
exactly what both repeats compute, so the rewrite is exact; aten then picks a kernel that reads K/V
in place (flash on CPU and CUDA) or repeats them itself where none can.

Masks: CUDA's fused attention kernels read the mask's rows as contiguous, so aten falls back to
its math kernel (fp32 scores written out, softmax, a second matmul) when the mask's last dim has
another stride. Models build such masks: T5's position bias is gathered [q, k, heads] and permuted,
HF's bidirectional mask broadcasts along the keys. The mask is made contiguous first, which
changes no value; the kernel that computes it then writes it in rows (with one exception,
handled in `contiguous_masks`).

Decode: SDPA of one query token per sequence over a K/V cache, where the policy chooses our
split-KV kernel (`Choices.use_decode_attention`), becomes `commfuse::decode_attention`, which
lowering/attention.py turns into that kernel (its eager form is SDPA itself).
"""
from __future__ import annotations

import logging

import torch
import torch.fx
import torch.nn.attention
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from commfuse import choices
from commfuse.runtime import attention as _decode_op  # noqa: F401  (registers commfuse::decode_attention)

from .fx_rewrite import erase_unused, finish, give_example_values

log = logging.getLogger("commfuse")

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_calls(gm: torch.fx.GraphModule):
    """(node, its arguments by name) for each SDPA call, in graph order."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SDPA:
            yield node, dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)


def _call_with(node, bound: dict) -> None:
    """Give the call these arguments: q, k, v positional, the rest by name."""
    node.args = tuple(bound.pop(n) for n in _SDPA_ARGS[:3])
    node.kwargs = bound


def _shape(node) -> tuple | None:
    v = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is(node, *names) -> bool:
    """A call of a torch function or tensor method by one of these names."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in names


def repeated_heads(node):
    """(the unrepeated K/V, the group size, the nodes that only served the repeat) when `node` is
    K/V repeated along the head dim (dim 1 of b, h, s, d), else None."""
    out = _shape(node)
    if out is None or len(out) != 4:
        return None
    if _is(node, "repeat_interleave"):
        src = node.args[0]
        reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if isinstance(reps, int) and dim in (1, -3) and not node.kwargs.get("output_size") \
                and _shape(src) is not None and _shape(src)[1] * reps == out[1]:
            return src, reps, [node]
        return None
    if _is(node, "reshape", "view") and _is(node.args[0], "expand"):
        expand = node.args[0]
        unsq, big = expand.args[0], _shape(expand)
        small = _shape(unsq)
        if big is None or small is None or len(big) != 5 or len(small) != 5 or small[2] != 1:
            return None
        b, kvh, group, s, d = big
        if small != (b, kvh, 1, s, d) or out != (b, kvh * group, s, d):
            return None
        return (unsq, 2), group, [node, expand]
    return None


def _open_rows(graph, mask, boolean):
    """(which queries have a key left to attend, the mask with the others' rows open, contiguous)."""
    kept = mask if boolean else graph.call_function(torch.gt, (mask, float("-inf")))
    live = graph.call_function(torch.any, (kept, -1), {"keepdim": True})
    if boolean:
        opened = graph.call_function(torch.logical_or, (mask, graph.call_function(torch.logical_not, (live,))))
    else:
        opened = graph.call_function(torch.where, (live, mask, 0.0))
    return live, graph.call_function(torch.clone, (opened,), {"memory_format": torch.contiguous_format})


def contiguous_masks(gm: torch.fx.GraphModule) -> int:
    """Give each SDPA whose mask's last dim is strided a contiguous mask; returns how many changed.

    Exact against the math kernel eager ran: where a query's keys are all masked, the math kernel
    gives 0 and the fused ones do not. Such rows are unmasked in the mask passed, and their output
    is set to 0 after; their gradients are then 0 too, as the math kernel's are."""
    changed, done = 0, {}  # mask -> (its rows with a key left, the mask passed): layers share one mask
    graph, old = gm.graph, set(gm.graph.nodes)
    for node, bound in _sdpa_calls(gm):
        mask = bound.get("attn_mask")
        value = mask.meta.get("example_value") if isinstance(mask, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() == 0 \
                or statically_known_true(value.size(-1) == 1) or statically_known_true(value.stride(-1) == 1):
            continue
        if mask not in done:  # before its first SDPA, which any other follows
            with graph.inserting_before(node):
                done[mask] = _open_rows(graph, mask, value.dtype == torch.bool)
        live, bound["attn_mask"] = done[mask]
        _call_with(node, bound)
        with graph.inserting_after(node):
            out = graph.call_function(torch.where, (live, node, 0.0))
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
        changed += 1
    if changed:
        give_example_values(gm, old)
    return finish(gm, changed)


def _with_math(gm: torch.fx.GraphModule) -> set:
    """The SDPA calls that run with the math backend enabled: the state at compile time, changed
    where the graph enters or leaves an `sdpa_kernel` region (Dynamo keeps its `_sdpa_kernel` calls;
    each names every backend it enables, by `_backend_from_string` or as a constant)."""
    def name(b):
        if isinstance(b, torch.fx.Node) and b.target is torch.nn.attention._backend_from_string:
            return b.args[0]
        return getattr(b, "name", None)
    on, calls = torch.backends.cuda.math_sdp_enabled(), set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.nn.attention._sdpa_kernel:
            backends = node.args[0] if node.args else node.kwargs.get("backends", ())
            on = "MATH" in map(name, backends if isinstance(backends, (list, tuple)) else [backends])
        elif on and node.op == "call_function" and node.target in _SDPA:
            calls.add(node)
    return calls


def use_sdpa_gqa(gm: torch.fx.GraphModule) -> int:
    """Pass unrepeated K/V to SDPA with `enable_gqa=True`; returns how many calls changed. Only
    where the math backend is enabled: it takes grouped K/V whatever the dtype, so no backend choice
    (`sdpa_kernel([EFFICIENT_ATTENTION])`, which refuses them) is left without a kernel."""
    changed, old, math = 0, set(gm.graph.nodes), _with_math(gm)
    for node, bound in _sdpa_calls(gm):
        if node not in math:
            continue
        q = _shape(bound["query"])
        k, v = repeated_heads(bound["key"]), repeated_heads(bound["value"])
        if bound.get("enable_gqa") or q is None or k is None or v is None or k[1] != v[1] or len(q) != 4:
            continue
        with gm.graph.inserting_before(node):
            for name, (src, _, _) in (("key", k), ("value", v)):
                if isinstance(src, tuple):  # x[:, :, None] of the repeat: squeeze the None back out
                    src = gm.graph.call_function(torch.squeeze, src)
                bound[name] = src
        _call_with(node, {**bound, "enable_gqa": True})
        erase_unused(gm.graph, k[2] + v[2])  # each repeat's nodes, users first
        changed += 1
    if changed:
        log.debug("commfuse: %d attention call(s) take unrepeated K/V (enable_gqa)", changed)
        give_example_values(gm, old)
    return finish(gm, changed)


def _decode_call(bound):
    """(q, k, v, mask, scale) when this SDPA call is decode attention the policy gives our kernel."""
    q, k, v, mask = (bound.get(n) for n in ("query", "key", "value", "attn_mask"))
    vals = [x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None for x in (q, k, v)]
    m = mask.meta.get("example_value") if isinstance(mask, torch.fx.Node) else None
    fake = torch._subclasses.FakeTensor  # plain tensors only: a DTensor's op would need a sharding rule
    if not all(isinstance(x, fake) and x.dim() == 4 and not x.requires_grad for x in vals) \
            or bound.get("dropout_p") or bound.get("is_causal") or (mask is not None and not isinstance(m, fake)):
        return None
    qv, kv, vv = vals
    sizes = [*qv.shape, *kv.shape, *vv.shape] + ([] if m is None else list(m.shape))
    if not all(isinstance(n, int) for n in sizes):
        return None
    (b, hq, one, d), (bk, hkv, s, dk) = qv.shape, kv.shape
    if one != 1 or (b, hkv, s) != (bk, vv.shape[1], vv.shape[2]) or (bk, dk, d) != (vv.shape[0], d, vv.shape[3]) \
            or (hq != hkv and not bound.get("enable_gqa")) or hq % hkv or {x.device for x in vals} != {qv.device}:
        return None
    if m is not None and (m.dim() > 4 or m.dtype not in (torch.bool, qv.dtype) or m.device != qv.device
                          or list(torch.broadcast_shapes(m.shape, (b, hq, 1, s))) != [b, hq, 1, s]):
        return None
    if not choices.current().use_decode_attention(qv.device, qv.dtype, b, hq, hkv, s, d):
        return None
    scale = bound.get("scale")
    return q, k, v, mask, float(scale) if scale is not None else d ** -0.5


def use_decode_attention(gm: torch.fx.GraphModule) -> int:
    """Give the decode SDPA calls our kernel (`commfuse::decode_attention`); returns how many."""
    changed, old = 0, set(gm.graph.nodes)
    for node, bound in _sdpa_calls(gm):
        call = _decode_call(bound)
        if call is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.commfuse.decode_attention.default, call)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        give_example_values(gm, old)
    return finish(gm, changed)
