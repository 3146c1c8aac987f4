"""The split-KV decode attention kernel (codegen/decode_attention.py) against eager SDPA: one query
token per sequence over a cache, at odd cache lengths, GQA ratios 1 and 4, per-sequence positions
(bool masks), a bool mask per head with holes, a float mask, no mask, one split and several (the combine kernel), fp32 and bf16.
Compiled with `decode_attention=True`, so on CPU it runs in Triton's interpreter."""
import pytest
import torch
import torch.nn.functional as F

from commfuse import choices as cf_choices
from tests.common import DEVICE, compile_and_run, count


class FewKeysPerSplit(cf_choices.Choices):
    """Splits of 16 keys: several splits (and the combine) at test sizes."""

    def decode_attention_config(self, device, b, hkv, group, s, d):
        return {**super().decode_attention_config(device, b, hkv, group, s, d), "BLOCK_N": 16,
                "SPLITS": -(-s // 16)}


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


CASES = [  # B, query heads, K/V heads, cache length, head dim, dtype, mask, splits
    (2, 4, 1, 37, 16, torch.float32, "positions", True),
    (3, 2, 2, 21, 8, torch.float32, "positions", False),
    (1, 8, 2, 50, 16, torch.bfloat16, "float", True),
    (2, 4, 4, 19, 32, torch.float32, None, True),
    (2, 4, 2, 45, 16, torch.float32, "heads", True),
    (3, 4, 2, 33, 16, torch.float32, "lowest", True),
    (2, 2, 1, 21, 16, torch.bfloat16, "lowest", False),
]


@pytest.mark.parametrize("b,hq,hkv,s,d,dtype,mask,split", CASES)
def test_decode_attention_matches_sdpa(tmp_path, b, hq, hkv, s, d, dtype, mask, split):
    torch.manual_seed(s)
    q = torch.randn(b, hq, 1, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(b, hkv, s, d, dtype=dtype, device=DEVICE) for _ in range(2))
    keys = torch.arange(s, device=DEVICE)
    if mask == "positions":  # each sequence at its own position; keys after it are not read
        pos = torch.arange(b, device=DEVICE) * 7 % s
        m = (keys[None, :] <= pos[:, None])[:, None, None, :]
        m[-1] = False  # the last sequence keeps no key: zeros, as SDPA gives, not 0/0
    elif mask == "heads":  # a mask per head, with holes: each head's own last key bounds the range read
        m = torch.rand(b, hq, 1, s, device=DEVICE) < 0.5
        m[..., 0] = True
        m[:, 1::2, :, s // 3:] = False
    elif mask == "lowest":  # Hugging Face's: the dtype's lowest value, not -inf; a row keeping no key (a padding
        # slot) is a softmax of equal scores there, the mean of V (the kernel scaled it to -inf: zeros)
        m = torch.zeros(b, 1, 1, s, dtype=dtype, device=DEVICE).masked_fill(keys > 11, torch.finfo(dtype).min)
        m[-1] = torch.finfo(dtype).min
    elif mask == "float":
        m = torch.randn(1, s, dtype=dtype, device=DEVICE).masked_fill(keys > s - 9, float("-inf"))
    else:
        m = None
    options = {"decode_attention": True} | ({"choices": FewKeysPerSplit()} if split else {})
    with torch.no_grad():
        got, dumps = compile_and_run(attend, q, k, v, m, tmp_path=tmp_path, **options)
        want = attend(*(x.float() if x is not None and x.is_floating_point() else x for x in (q, k, v, m)))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want, **tol)
    summary, code = dumps.only()
    assert "scaled_dot_product" not in code and not summary["extern_calls"], summary["extern_calls"]
    count(code, "def cf_attn_buf", 1)
    count(code, "def cf_attn_combine_buf", 1 if split else 0)


def test_decode_attention_only_where_measured(monkeypatch):
    """Without `config.decode_attention`, the kernel runs only on a GPU and shape that choices'
    measured table covers: its GPU, dtype, head dim and group, within its batches and cache lengths."""
    c = cf_choices.Choices()
    win = cf_choices.DECODE_ATTENTION_WINS[0]
    b, keys, group, d = win["batch"][1], win["keys"][1], win["group"], win["head_dim"]
    dtype, gpu = getattr(torch, win["dtype"].split(".")[1]), torch.device("cuda")
    assert not c.use_decode_attention(torch.device("cpu"), dtype, b, 8 * group, 8, keys, d)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: win["gpu"])
    assert c.use_decode_attention(gpu, dtype, b, 8 * group, 8, keys, d)
    for other in [(b + 1, 8 * group, 8, keys, d), (b, 8 * group, 8, keys + 1, d), (b, 8 * group, 8, keys, d // 2),
                  (b, 16 * group, 8, keys, d)]:
        assert not c.use_decode_attention(gpu, dtype, *other), other
    assert not c.use_decode_attention(gpu, torch.float32, b, 8 * group, 8, keys, d)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "another GPU")
    assert not c.use_decode_attention(gpu, dtype, b, 8 * group, 8, keys, d)


def test_decode_attention_leaves_training_to_aten(tmp_path):
    """Inputs that need gradients keep aten's SDPA (it has a backward), even with the option on."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(2))
    got, dumps = compile_and_run(attend, q, k, v, None, tmp_path=tmp_path, decode_attention=True)
    torch.testing.assert_close(got, attend(q, k, v, None))
    assert "cf_attn" not in dumps.code(dumps.graphs()[0])


def test_values_of_another_head_dim_keep_aten(tmp_path):
    """V heads narrower than Q and K's (SDPA allows it; MLA's are): the kernel assumes one head
    dim, and wrote past its output with V's, so aten's SDPA runs, even with the option on."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16, device=DEVICE), torch.randn(2, 2, 37, 16, device=DEVICE), \
        torch.randn(2, 2, 37, 8, device=DEVICE)
    with torch.no_grad():
        got, dumps = compile_and_run(attend, q, k, v, None, tmp_path=tmp_path, decode_attention=True)
    torch.testing.assert_close(got, attend(q, k, v, None))
    assert "cf_attn" not in dumps.code(dumps.graphs()[0])


def test_a_sliding_window_model_decodes_as_eager(tmp_path):
    """Mistral's generate() with a static cache and a sliding window (keys before the window masked
    as well as those after the position), its decode step through our kernel: teacher-forced
    logits as eager's (bench/heldout_decode.py runs the other families)."""
    pytest.importorskip("transformers")
    from bench.heldout_decode import check
    from commfuse import config
    with config.patch(dump_dir=str(tmp_path)):
        assert check("mistral_window", torch.device(DEVICE), new_tokens=3) < 1e-3
    assert any("def cf_attn_buf" in p.read_text() for p in tmp_path.rglob("output_code.py"))
