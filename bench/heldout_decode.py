"""Decode as users of other model families run it: transformers' `generate()` with a static KV cache,
its decode step compiled by commfuse through `CompileConfig` (commfuse's decode attention forced
on, `decode_attention=True`, so that its kernel meets each family's masks and head layouts),
against eager, teacher-forced: both pick the same fixed tokens, and every step's logits are
compared. Tiny random configs, fp32, on CPU (Triton's interpreter) or a GPU.

    python bench/heldout_decode.py                    # every family
    python bench/heldout_decode.py --only mistral_window,gemma_hd32

Families: GQA groups of 4 and 3 (Llama, Qwen2), a sliding window (Mistral: keys before the window
masked too), fused qkv (Phi-3), one K/V head of width 32 (Gemma), partial rotary (GPT-NeoX), QK
norms (OLMo-2). Exit status 1 when one fails or its logits differ by more than 1e-3.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402

from bench.hf_generate import Forced  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64,
              bos_token_id=0, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
FAMILIES = {  # name: (config class, model class, config fields)
    "llama_gqa4": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2_gqa3": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "gemma_hd32": ("GemmaConfig", "GemmaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_attention_heads=4, rotary_pct=0.25)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
}


def check(name: str, dev, new_tokens: int) -> float:
    """Max abs difference of the teacher-forced logits of every step, commfuse against eager."""
    import transformers
    cfg_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(0)
    with torch.device(dev):
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**COMMON, **fields})).eval()
    gc = model.generation_config
    gc.cache_implementation, gc.eos_token_id, gc.pad_token_id = "static", None, 0
    prompt = torch.randint(3, VOCAB, (2, 5), device=dev)
    forced = torch.randint(3, VOCAB, (2, new_tokens), device=dev)

    def logits(**kw):
        record = Forced(forced, prompt.shape[1])
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           logits_processor=[record], **kw)
        return torch.stack(record.logits)
    torch._dynamo.reset()
    want = logits(disable_compile=True)
    cc = transformers.CompileConfig(fullgraph=False, dynamic=False, backend="commfuse", mode=None,
                                    options={"decode_attention": True})
    cc._compile_all_devices = True  # (else generate() compiles on GPUs only)
    return (logits(disable_compile=False, compile_config=cc) - want).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--new-tokens", type=int, default=4)
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(FAMILIES)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = 0
    for name in names:
        try:
            err = check(name, dev, a.new_tokens)
            ok = err <= 1e-3
            print(f"{name}: max abs logit difference {err:.2e}{'' if ok else '  ! above 1e-3'}", flush=True)
        except Exception as e:  # report, go on with the others
            ok = False
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            traceback.print_exc(limit=4)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
