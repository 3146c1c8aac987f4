"""Few-row matmuls that load the same `a` run as one launch (commfuse/mm_group.py), and a pointwise
consumer of two of them (SiLU(gate) * up) is their epilogue: values against eager, and the
generated code (one launch per group, no separate SiLU * mul kernel, intermediates not stored)."""
import re

import pytest
import torch
import torch.nn.functional as F

from commfuse import config
from tests.common import DEVICE, Dumps


def _weights(k, ns, dtype):
    torch.manual_seed(0)
    return [torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5 for n in ns]


def _norm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def _check(fn, args, tmp_path, **patch):
    want = fn(*args)
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path), **patch):
        compiled = torch.compile(fn, backend="commfuse", dynamic=False)
        compiled(*args)  # a split-K workspace left dirty would show in the second call
        got = compiled(*args)
    for g, w in zip(got, want):
        # 16-bit: eager rounds after each op, the kernels once; a residual stream of magnitude ~4
        atol, rtol = (1e-4, 1e-4) if w.dtype == torch.float32 else (6e-2, 2e-2)
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)
    summary, code = Dumps(tmp_path).only()
    host = code.split("def call(", 1)[1]
    launches = re.findall(r"\b(cf_\w+?)_launch\d+\(", host)
    return summary, code, launches


def _mms(summary):
    return [(k["members"], len(k["epilogues"])) for k in summary["kernels"] if k.get("template") == "mm"]


@pytest.mark.parametrize("dtype,k,rows", [(torch.bfloat16, 64, 3), (torch.bfloat16, 512, 3), (torch.float16, 96, 3),
                                          (torch.float32, 64, 3), (torch.bfloat16, 64, 1)])
def test_decode_block(tmp_path, dtype, k, rows):
    """q, k, v of one normed x (odd N) in one launch; gate and up of another in one launch whose
    epilogue is SiLU(gate) * up; the down projection reads it, the residual add its epilogue. K=512
    splits K (atomics). One row (batch 1) takes the same epilogues."""
    wq, wk, wv, wg, wu = _weights(k, (97, 33, 33, 45, 45), dtype)
    (wd,) = _weights(45, (k,), dtype)

    def block(x):
        h = _norm(x)
        q, kk, v = F.linear(h, wq), F.linear(h, wk), F.linear(h, wv)
        o = x + (q.sum(-1, keepdim=True) + kk[..., :1] * v[..., 1:2]) / 8
        h = _norm(o)
        return (o + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd),)

    x = torch.randn(rows, 1, k, dtype=dtype, device=DEVICE)
    summary, code, launches = _check(block, (x,), tmp_path)
    if dtype == torch.float32:  # no template (fp32 is aten's): nothing to group
        assert not _mms(summary) and summary["extern_calls"].count("aten.mm.out") == 6, summary
        return
    assert _mms(summary) == [(3, 0), (2, 1), (1, 1)], summary  # q/k/v; gate/up + SiLU*mul; down + residual
    assert not summary["extern_calls"], summary
    gate_up = next(k for k in summary["kernels"] if k.get("members") == 2)
    assert len(gate_up["writes"]) == 1, gate_up  # only the epilogue's value: gate and up never stored
    # 2 norms, the sum of q, 3 matmuls (ungrouped: q, k, v, gate, up, silu * mul and the residual add apart)
    assert len(launches) == len(summary["kernels"]) == 6, launches
    (sigmoid_kernel,) = {name for name in re.findall(r"def (cf_\w+)\(", code)
                         if "tl.sigmoid(" in code.split(f"def {name}(", 1)[1].split("\n@triton.jit", 1)[0]}
    assert sigmoid_kernel == gate_up["name"], (sigmoid_kernel, gate_up)
    if k == 512:
        assert all(k["config"]["SPLIT_K"] > 1 for k in summary["kernels"] if k.get("members", 0) > 1), summary


def test_intermediate_with_another_user_is_stored(tmp_path):
    """Gate is returned too: stored beside the epilogue's value. A row scale read by the prologue
    and by the epilogue (loads of one value per row)."""
    wg, wu = _weights(64, (40, 40), torch.bfloat16)

    def mlp(x, s):
        g, u = F.linear(x * s, wg), F.linear(x * s, wu)
        return F.silu(g) * u * s, g

    x, s = torch.randn(5, 64, dtype=torch.bfloat16, device=DEVICE), torch.rand(5, 1, dtype=torch.bfloat16, device=DEVICE)
    summary, _, launches = _check(mlp, (x, s), tmp_path)
    (kernel,) = summary["kernels"]
    assert (kernel["members"], len(kernel["epilogues"]), len(kernel["writes"])) == (2, 1, 2), kernel
    assert kernel["prologue"] and len(launches) == 1, (kernel, launches)


def test_different_k_does_not_group(tmp_path):
    """The same stored x, loaded as [M, 48] and as [M, 64]: two left operands, two matmul launches."""
    w1, w2 = _weights(48, (40,), torch.bfloat16) + _weights(64, (40,), torch.bfloat16)

    def two(x):
        return (F.linear(x[:, :48], w1) * F.linear(x, w2),)

    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE)
    summary, _, launches = _check(two, (x,), tmp_path)  # (the product: one of them's epilogue)
    assert sorted(_mms(summary)) == [(1, 0), (1, 1)] and len(launches) == 2, (summary, launches)


def test_off(tmp_path):
    wg, wu = _weights(64, (40, 40), torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=DEVICE)
    summary, _, launches = _check(lambda x: (F.silu(x @ wg.t()) * (x @ wu.t()),), (x,), tmp_path, mm_group=False)
    assert _mms(summary) == [(1, 0), (1, 0)] and len(launches) == 3, (summary, launches)


def test_members_write_a_cats_slices(tmp_path):
    """Grouped members whose outputs are slices of a cat (out views): each stores into its slice."""
    w1, w2 = _weights(64, (40, 24), torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE)
    summary, code, launches = _check(lambda x: (torch.cat([F.linear(x * 2, w1), F.linear(x * 2, w2)], 1) + 1,),
                                     (x,), tmp_path)
    assert _mms(summary) == [(2, 0)] and len(launches) == 2 and "cat written in place" in code, (summary, launches)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rotate_pairs(x):  # GPT-J's rotate_every_two: (-x1, x0) in each pair of columns
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_one(x):  # each column from its neighbour: crosses every pair of columns
    return torch.cat((x[..., 1:], x[..., :1]), dim=-1)


@pytest.mark.parametrize("dtype,hd,rotate,b", [(torch.bfloat16, 16, _rotate_half, 3), (torch.float16, 32, _rotate_half, 3),
                                               (torch.bfloat16, 16, _rotate_pairs, 3), (torch.bfloat16, 16, _rotate_one, 3),
                                               (torch.bfloat16, 16, _rotate_half, 1)])
def test_rotary_and_cache_store_are_the_qkv_epilogue(tmp_path, dtype, hd, rotate, b, bias=False):
    """A decode step's q, k and v in one launch whose epilogues apply the rotary embedding (each
    column and the other half of its head: the tile's halves swapped in registers) and store k and
    v into the static cache at a position read from the device: no other kernel, q/k/v never
    stored, at batch 1 too. A rotation by one column reads across the blocks, and GPT-J's within
    pairs of columns (blocks narrower than mm_group.MIN_HALF allows): both stay kernels apart."""
    wq, wk, wv = _weights(64, (4 * hd, 2 * hd, 2 * hd), dtype)
    biases = [torch.randn(w.shape[0], dtype=dtype, device=DEVICE) if bias else None for w in (wq, wk, wv)]
    cos, sin = (torch.randn(24, hd, dtype=dtype, device=DEVICE) for _ in range(2))

    def step(x, pos, cache_k, cache_v):
        q, k, v = (F.linear(x, w, bb).view(b, 1, -1, hd).transpose(1, 2) for w, bb in zip((wq, wk, wv), biases))
        c, s = cos[pos], sin[pos]
        q, k = q * c + rotate(q) * s, k * c + rotate(k) * s
        cache_k.index_copy_(2, pos, k)
        cache_v.index_copy_(2, pos, v)
        return (q,)

    x, pos = torch.randn(b, 1, 64, dtype=dtype, device=DEVICE), torch.tensor([13], device=DEVICE)
    caches = [torch.randn(b, 2, 24, hd, dtype=dtype, device=DEVICE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want = step(x, pos, *want_caches)
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        got = torch.compile(step, backend="commfuse", dynamic=False)(x, pos, *caches)
    for g, w in zip([*got, *caches], [*want, *want_caches]):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
    summary, code = Dumps(tmp_path).only()
    launches = re.findall(r"\b(cf_\w+?)_launch\d+\(", code.split("def call(", 1)[1])
    (mm,) = [k for k in summary["kernels"] if k.get("template") == "mm"]
    if rotate is _rotate_half:
        assert mm["members"] == 3 and len(mm["epilogues"]) == 3 and launches == [mm["name"]], (summary, launches)
        assert not summary["extern_calls"] and "tl.split(" in code, summary
    else:  # q's and k's rotations run apart (v's store still joins); pairs: blocks of 2 (MIN_HALF)
        assert len(launches) > 1 and "tl.split(" not in code, (summary, launches)


def test_biased_qkv_add_their_biases_in_the_epilogue(tmp_path):
    """Qwen2's q, k and v carry biases (aten.addmm): each bias is added by the launch's epilogue,
    before the rotary embedding and the cache store; no addmm runs apart."""
    test_rotary_and_cache_store_are_the_qkv_epilogue(tmp_path, torch.bfloat16, 16, _rotate_half, 3, bias=True)


def test_lone_biased_matmul_takes_its_consumer(tmp_path):
    """One biased Linear and its activation (GPT-2's MLP): the bias and the GELU are the matmul's
    epilogue, one launch, the product never stored."""
    (w,) = _weights(64, (72,), torch.bfloat16)
    bias = torch.randn(72, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE)
    summary, _, launches = _check(lambda x: (F.gelu(F.linear(x, w, bias), approximate="tanh"),), (x,), tmp_path)
    (kernel,) = summary["kernels"]
    assert _mms(summary) == [(1, 1)] and len(kernel["writes"]) == 1 and len(launches) == 1, (summary, launches)
    assert not summary["extern_calls"], summary
