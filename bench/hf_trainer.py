"""The Hugging Face Trainer as a client: a tiny model of one architecture (random weights, dropout
off), trained for a few steps by `Trainer` eagerly and then compiled with a backend, same seed and
data; prints both loss curves and their largest difference. One process, or DDP under torchrun.

accelerate refuses backend names it does not list (`torch_compile_backend="commfuse"`: "not a valid
DynamoBackend"), so the model is compiled here and handed to the Trainer, with
remove_unused_columns=False (a compiled forward takes *args, **kwargs). Needs accelerate.

    python bench/hf_trainer.py --arch llama
    torchrun --standalone --nproc-per-node 2 bench/hf_trainer.py --arch gpt2 --args '{"bf16": true}'
"""
from __future__ import annotations

import argparse
import json
import os

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=128, max_position_embeddings=64)
ARCHS = {  # config class, its fields
    "llama": ("LlamaConfig", dict(SMALL, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(SMALL, num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": ("BertConfig", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}


class Tokens(torch.utils.data.Dataset):
    """Random token rows; labels are the tokens (causal LM) or a class (BERT's classifier)."""
    def __init__(self, classify: bool, n=16, seq=16, vocab=128):
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.classify = torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, 2, (n,), generator=g), classify

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]),
                "labels": self.y[i] if self.classify else self.x[i]}


def losses(arch: str, backend: str, extra: dict, steps: int) -> list[float]:
    import transformers
    transformers.set_seed(0)
    name, fields = ARCHS[arch]
    classify = arch == "bert"
    auto = transformers.AutoModelForSequenceClassification if classify else transformers.AutoModelForCausalLM
    model = auto.from_config(getattr(transformers, name)(**fields))
    if backend != "eager":
        model = torch.compile(model, backend=backend)
    args = transformers.TrainingArguments(
        output_dir=f"/tmp/hf_trainer_{arch}_{backend}", per_device_train_batch_size=4, max_steps=steps,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(classify))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    p.add_argument("--backend", default="commfuse")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--args", default="{}", type=json.loads,
                   help='more TrainingArguments as JSON, e.g. \'{"bf16": true, "gradient_checkpointing": true}\'')
    a = p.parse_args()
    if a.backend == "commfuse":
        import commfuse  # noqa: F401  (Triton's interpreter on CPU: before triton's first import)
    want, got = losses(a.arch, "eager", a.args, a.steps), losses(a.arch, a.backend, a.args, a.steps)
    diff = max(abs(x - y) for x, y in zip(got, want))
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"eager {want}\n{a.backend} {got}\n{a.arch} {a.args}: max diff {diff:.2e}")
    tol = (2e-2 if a.args.get("bf16") else 1e-4) * max(1.0, abs(want[0]))
    if diff > tol:
        raise SystemExit(f"losses differ from eager by {diff:.2e} (tolerance {tol:.0e})")


if __name__ == "__main__":
    main()
