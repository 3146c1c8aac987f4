"""Split-KV decode attention (`ir.DecodeAttention`): one query token per sequence over a cache.

Decode attention reads the whole K/V cache for a few FLOPs per byte, so it runs at the speed K/V
stream from memory. Program (b, kv head, split) owns one K/V head and one contiguous chunk of the
keys: it loads each [BLOCK_N, D] block of K and V once and applies it to all G query heads of the
group at once (a [G, D] x [D, BLOCK_N] dot), keeping a running max, sum of exponentials and
weighted sum of V per query head (online softmax). With a mask, each program first finds the
last key that any head of its group keeps (a scan of the mask row, a few KB) and the splits
divide the keys up to there: a static cache masked beyond the current position is read up to it
only, spread over all the programs (not idle programs beyond it and busy ones before). Inside that
range the mask still drops keys from the scores. With one split the program divides and stores
the output; with several each stores its unnormalized partial sums and (max, sum), and a second
kernel combines the splits: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.

A query whose keys are all masked gets zeros, as SDPA gives, not 0/0; a row of a float mask's
lowest finite value (Hugging Face's) is a softmax of equal scores, the mean of V, as in eager.
"""
from __future__ import annotations

import torch

from commfuse import sizevars
from commfuse.virtualized import V

from .common import AFTER_PREDECESSOR

SPLIT = '''
@triton.jit
def {name}(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_acc, part_ml, S, scale,
        sqb, sqh, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smh, sms, sob, soh, sod,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GBLOCK: tl.constexpr, DBLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, MASK: tl.constexpr, MASK_HEADS: tl.constexpr,
        SCAN: tl.constexpr, F32: tl.constexpr):
    {after}bh = tl.program_id(0).to(tl.int64)
    b, kvh = bh // HKV, bh % HKV
    split = tl.program_id(1)
    g = tl.arange(0, GBLOCK)[:, None]          # query heads of the group, rows
    d = tl.arange(0, DBLOCK)[None, :]
    gmask, dmask = g < G, d < D
    h = kvh * G + g
    valid = S
    if MASK != 0:  # the keys up to the last one kept (one mask row where it is the same for all heads)
        last = tl.zeros([], tl.int32) - 1
        for start in range(0, S, SCAN):
            if MASK_HEADS:
                n = start + tl.arange(0, SCAN)[None, :]
                at, inside = mask_ptr + b * smb + h * smh + n * sms, (n < S) & gmask
            else:
                n = start + tl.arange(0, SCAN)
                at, inside = mask_ptr + b * smb + n * sms, n < S
            if MASK == 1:
                kept = tl.load(at, inside, other=0) != 0
            else:
                kept = tl.load(at, inside, other=float("-inf")).to(tl.float32) > float("-inf")
            if MASK_HEADS:
                last = tl.maximum(last, tl.max(tl.max(tl.where(kept, n, -1), 1), 0))
            else:
                last = tl.maximum(last, tl.max(tl.where(kept, n, -1), 0))
        valid = last + 1
    chunk = tl.cdiv(tl.cdiv(valid, SPLITS), BLOCK_N) * BLOCK_N
    n0 = split * chunk
    end = tl.minimum(n0 + chunk, valid)
    q = tl.load(q_ptr + b * sqb + h * sqh + d * sqd, gmask & dmask, other=0)
    if F32:
        q = q.to(tl.float32)
    m_i = tl.full([GBLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([GBLOCK], tl.float32)
    acc = tl.zeros([GBLOCK, DBLOCK], tl.float32)
    for start in range(n0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        live = inside[None, :] & gmask
        if MASK == 1:    # bool: keys kept
            keep = tl.load(mask_ptr + b * smb + h * smh + n[None, :] * sms, live, other=0) != 0
            bias = tl.zeros([GBLOCK, BLOCK_N], tl.float32)
        elif MASK == 2:  # float: added to the scores; -inf drops the key
            bias = tl.load(mask_ptr + b * smb + h * smh + n[None, :] * sms, live, other=float("-inf")).to(tl.float32)
            keep = bias > float("-inf")  # (a dtype's lowest value, a mask's "never", times log2(e) stays finite)
            bias = tl.maximum(bias, -2.35e38) * 1.4426950408889634
        else:
            keep = live
            bias = tl.zeros([GBLOCK, BLOCK_N], tl.float32)
        keep = keep & live
        kv = inside[:, None] & dmask
        k = tl.load(k_ptr + b * skb + kvh * skh + n[:, None] * sks + d * skd, kv, other=0)
        v = tl.load(v_ptr + b * svb + kvh * svh + n[:, None] * svs + d * svd, kv, other=0)
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(keep, s * (scale * 1.4426950408889634) + bias, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
        tl.store(out_ptr + b * sob + h * soh + d * sod, o.to(out_ptr.dtype.element_ty), gmask & dmask)
    else:
        row = (bh * SPLITS + split) * G + g       # partials [B * HKV, SPLITS, G, D] and [.., G, 2]
        tl.store(part_acc + row * D + d, acc, gmask & dmask)
        tl.store(part_ml + row * 2, m_i[:, None], gmask)
        tl.store(part_ml + row * 2 + 1, l_i[:, None], gmask)
'''

COMBINE = '''
@triton.jit
def {name}(part_acc, part_ml, out_ptr, sob, soh, sod, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
        D: tl.constexpr, DBLOCK: tl.constexpr, SPLITS: tl.constexpr, SBLOCK: tl.constexpr):
    {after}bq = tl.program_id(0).to(tl.int64)        # (b, query head)
    b, h = bq // HQ, bq % HQ
    s = tl.arange(0, SBLOCK)[:, None]
    d = tl.arange(0, DBLOCK)[None, :]
    row = ((b * HKV + h // G) * SPLITS + s) * G + h % G
    m = tl.load(part_ml + row * 2, s < SPLITS, other=float("-inf"))
    l = tl.load(part_ml + row * 2 + 1, s < SPLITS, other=0)
    top = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(top == float("-inf"), 0.0, top)[None, :])
    acc = tl.load(part_acc + row * D + d, (s < SPLITS) & (d < D), other=0)
    total = tl.sum(l * w, 0)
    o = tl.where(total > 0, tl.sum(acc * w, 0) / total, 0.0)
    tl.store(out_ptr + b * sob + h * soh + tl.arange(0, DBLOCK) * sod, o.to(out_ptr.dtype.element_ty),
             tl.arange(0, DBLOCK) < D)
'''


_MASKS = {None: 0, "bool": 1, "float": 2}  # the kernel's MASK for `buf.mask`


def launches(buf, value) -> tuple[dict, list[tuple]]:
    """What the wrapper launches for `buf` (`ir.DecodeAttention`): (its config, [(kernel, source, grid,
    args, specs, constexprs)]): the split kernel, then the combine where there are several splits.
    `value(x)`: the Python source of argument `x`."""
    q, k, v, *mask = buf.args
    (b, hq, _, d), (_, hkv, s, _) = (map(int, x.layout.size) for x in (q, k))
    g, dtype = hq // hkv, buf.get_dtype()
    cfg = V.choices.decode_attention_config(q.get_device(), b, hkv, g, s, d)
    splits = cfg["SPLITS"]
    heads = bool(buf.mask_strides) and int(buf.mask_strides[1]) != 0  # a mask row per head: scanned per row
    scan = max(16, cfg["SCAN"] // cfg["GBLOCK"]) if heads else cfg["SCAN"]
    rows = b * hkv * splits * g  # partial sums and (max, sum) per split: overwritten by every call
    scratch = [f"workspace(_workspaces, 'attn_{what}_{n}', {n}, torch.float32, {buf.name}.device)"
               for what, n in (("acc", rows * d), ("ml", rows * 2))] if splits > 1 else [buf.name] * 2
    scratch_dtypes = [torch.float32 if splits > 1 else dtype] * 2
    strides = [int(x) for t in (q, k, v) for x in _bhsd(t.layout.stride, t is q)]
    strides += [int(x) for x in buf.mask_strides or (0, 0, 0)] + [int(x) for x in _bhsd(buf.layout.stride, True)]
    ins = (q, k, v, mask[0] if mask else q)
    args = [value(x) for x in ins] + [buf.name, *scratch, str(s), repr(buf.scale)] + list(map(str, strides))
    specs = [x.get_dtype() for x in ins] + [dtype, *scratch_dtypes, s, buf.scale] + strides
    consts = (f"HKV={hkv}, G={g}, D={d}, GBLOCK={cfg['GBLOCK']}, DBLOCK={cfg['DBLOCK']}, BLOCK_N={cfg['BLOCK_N']}, "
              f"SPLITS={splits}, MASK={_MASKS[buf.mask]}, MASK_HEADS={heads}, SCAN={scan}, F32={cfg['F32'] or dtype == torch.float32}, "
              f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']}")
    name = f"cf_attn_{buf.name}"
    after = AFTER_PREDECESSOR + "\n    " if V.choices.dependent_launch(q.get_device()) else ""
    out = [(name, SPLIT.format(name=name, after=after).lstrip("\n"), f"({b * hkv}, {splits})", args, specs, consts)]
    if splits > 1:
        name = f"cf_attn_combine_{buf.name}"
        consts = (f"HQ={hq}, HKV={hkv}, G={g}, D={d}, DBLOCK={cfg['DBLOCK']}, SPLITS={splits}, "
                  f"SBLOCK={sizevars.next_pow2(splits)}, num_warps=4")
        out.append((name, COMBINE.format(name=name, after=after).lstrip("\n"), f"({b * hq},)",
                    [*scratch, buf.name, *map(str, strides[-3:])], [*scratch_dtypes, dtype, *strides[-3:]], consts))
    return cfg, out


def _bhsd(stride, query: bool) -> list:
    """A [B, H, S, D] tensor's strides that the kernels take: (b, h, s, d), or for the one-token
    query and output (b, h, d)."""
    return [stride[0], stride[1], stride[3]] if query else list(stride)
