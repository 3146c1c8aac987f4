"""Whole models, side by side in one run: eager vs Inductor vs commfuse, inference and training (1 GPU).

    python bench/models.py                                    # every model, both modes, bf16
    python bench/models.py --models gpt2,llama --modes training
    python bench/models.py --out bench/results/models_h100.md --commit abc1234   # + models_h100.json
    python bench/models.py --cpu --tiny                       # checks the script on CPU: measures nothing

Models are built from configs with random weights, nothing downloaded: HF transformers GPT-2 (12
layers, 768 wide), Llama and Qwen2 (8 layers each, grouped-query attention), BERT-base, T5-small,
ViT-base (SDPA attention), Segformer (MiT-b0, 512 x 512); torchvision resnet18 and mobilenet_v3_small; a 6-layer
nn.TransformerEncoder; and Llama decode, one token over a static KV cache filled by a 512-token
prompt (inference only). All in eval mode (dropout off), so that every backend computes the same
function. A training step is forward + loss + backward, no optimizer.

Per model and mode, for Inductor and commfuse:
  err       max |x - eager| / max |eager| over the outputs (inference), or the loss and every
            parameter's gradient (training), the largest over those tensors; a gradient is scaled
            by at least 1e-3 of the model's largest (one that is zero in exact arithmetic is noise).
            Eager runs in the same dtype: Inductor's err is the size of that noise. `!` marks a
            commfuse err above max(5 x Inductor's, 1e-2); the script then exits with status 1.
  compile   seconds of the first step: cold (this model's first compile in the process; the
            script points Inductor's, Triton's and commfuse's caches at a new folder unless
            TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / COMMFUSE_CACHE_DIR are set), warm
            (compiled again after torch._dynamo.reset(), caches filled).
  breaks    Dynamo graph breaks (torch._dynamo.utils.counters), and Dynamo graphs
  kernels   generated kernels: Inductor's metrics.generated_kernel_count, commfuse's distinct kernels
            per graph (each graph's summary); externs: commfuse's extern calls (aten ops run as
            they are); fallbacks: commfuse graphs that failed to compile and ran op by op through
            aten (fallback_on_error)
  step      ms per step under CUDA graphs: bench/timing.py: interleaved_times_us captures each
            backend's step after warm-up and replays them in interleaved rounds, best median of
            each: GPU time, without host overhead. Ratios t_other / t_commfuse: above 1, faster.
  peak      MiB, torch.cuda.max_memory_allocated over one step less what was allocated before it
            (parameters, inputs; gradients are set to None first, so they count).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Callable, NamedTuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
# Cold compiles start from empty caches (read when used, so set before anything compiles).
_CACHES = tempfile.mkdtemp(prefix="bench_models_")
for _var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "COMMFUSE_CACHE_DIR"):
    os.environ.setdefault(_var, os.path.join(_CACHES, _var.split("_")[0].lower()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import commfuse  # noqa: E402,F401  (before torch._dynamo imports triton: picks the interpreter on CPU)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._inductor import metrics as inductor_metrics  # noqa: E402

from bench.common import add_run_args, commfuse_options, run_meta, write_results  # noqa: E402
from commfuse import backend as commfuse_backend  # noqa: E402
from bench import timing  # noqa: E402

COMPILED = ("inductor", "commfuse")
MODES = ("inference", "training")


class Spec(NamedTuple):
    model: nn.Module
    inputs: Callable       # model -> keyword inputs of one step (its own state, e.g. a KV cache)
    outputs: Callable      # model output -> tensors compared in inference
    loss: Callable         # model output -> the scalar trained on


# --------------------------------------------------------------------------------------------- models
def _hf(model_cls, config_cls, loss_type=None, **config):
    import transformers
    cfg = getattr(transformers, config_cls)(attn_implementation="sdpa", **config)
    model = getattr(transformers, model_cls)(cfg)
    if loss_type:  # GPT2LMHeadModel's name names no loss: transformers would warn in forward (a graph break)
        model.loss_type = loss_type
    return model


def _lm_spec(model, batch, seq, vocab, dev):
    ids = torch.randint(0, vocab, (batch, seq), device=dev)
    return Spec(model, lambda m: {"input_ids": ids, "labels": ids}, lambda o: (o.logits,), lambda o: o.loss)


def gpt2(tiny, dev):
    L, C, H, V, B, T = (2, 32, 2, 100, 2, 8) if tiny else (12, 768, 12, 50257, 8, 512)
    model = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=V, n_positions=max(T, 16), n_embd=C, n_layer=L,
                n_head=H, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return _lm_spec(model, B, T, V, dev)


def _llama_config(tiny):
    if tiny:
        return dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)


def llama(tiny, dev):  # grouped-query attention, head dim 128
    cfg = _llama_config(tiny)
    model = _hf("LlamaForCausalLM", "LlamaConfig", bos_token_id=0, eos_token_id=0, pad_token_id=0, **cfg)
    return _lm_spec(model, *((2, 8) if tiny else (4, 1024)), cfg["vocab_size"], dev)


def qwen2(tiny, dev):  # GQA with 6 query heads per K/V head, biases on q/k/v (Qwen2-1.5B's widths)
    cfg = (dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2) if tiny else
           dict(vocab_size=32000, hidden_size=1536, intermediate_size=8960, num_hidden_layers=8,
                num_attention_heads=12, num_key_value_heads=2))
    model = _hf("Qwen2ForCausalLM", "Qwen2Config", max_position_embeddings=2048, bos_token_id=0,
                eos_token_id=0, pad_token_id=0, **cfg)
    return _lm_spec(model, *((2, 8) if tiny else (4, 1024)), cfg["vocab_size"], dev)


def bert(tiny, dev):  # masked LM, 15% of the tokens predicted; no padding mask (HF checks one on the host)
    L, C, H, F_, V, B, T = (2, 32, 2, 64, 100, 2, 8) if tiny else (12, 768, 12, 3072, 30522, 16, 512)
    model = _hf("BertForMaskedLM", "BertConfig", vocab_size=V, hidden_size=C, num_hidden_layers=L,
                num_attention_heads=H, intermediate_size=F_, max_position_embeddings=max(T, 16), pad_token_id=0)
    ids = torch.randint(1, V, (B, T), device=dev)
    labels = torch.where(torch.rand(B, T, device=dev) < 0.15, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one predicted token per row, whatever the draw
    return Spec(model, lambda m: {"input_ids": ids, "labels": labels}, lambda o: (o.logits,), lambda o: o.loss)


def t5(tiny, dev):  # encoder-decoder; decoder inputs are the labels shifted right
    L, C, KV, F_, H, V, B, S, T = ((2, 32, 16, 64, 2, 100, 2, 8, 6) if tiny
                                   else (6, 512, 64, 2048, 8, 32128, 16, 512, 128))
    model = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=V, d_model=C, d_kv=KV, d_ff=F_,
                num_layers=L, num_heads=H, decoder_start_token_id=0, pad_token_id=0)
    src = torch.randint(1, V, (B, S), device=dev)
    tgt = torch.randint(1, V, (B, T), device=dev)
    return Spec(model, lambda m: {"input_ids": src, "labels": tgt}, lambda o: (o.logits,), lambda o: o.loss)


def vit(tiny, dev):
    I, P, L, C, H, F_, K, B = (16, 8, 2, 32, 2, 64, 10, 2) if tiny else (224, 16, 12, 768, 12, 3072, 1000, 32)
    model = _hf("ViTForImageClassification", "ViTConfig", image_size=I, patch_size=P, hidden_size=C,
                num_hidden_layers=L, num_attention_heads=H, intermediate_size=F_, num_labels=K)
    x = torch.randn(B, 3, I, I, device=dev)
    labels = torch.randint(0, K, (B,), device=dev)
    return Spec(model, lambda m: {"pixel_values": x.to(m.dtype), "labels": labels},
                lambda o: (o.logits,), lambda o: o.loss)


def segformer(tiny, dev):  # MiT-b0 at 512 x 512: strided-conv patch embeddings, each LayerNorm'd through a transpose
    cfg = (dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                num_attention_heads=[1, 2], decoder_hidden_size=32, patch_sizes=[7, 3], strides=[4, 2],
                mlp_ratios=[2, 2]) if tiny else {})
    I, B, K = (32, 2, 10) if tiny else (512, 8, 150)
    model = _hf("SegformerForSemanticSegmentation", "SegformerConfig", num_labels=K, **cfg)
    x = torch.randn(B, 3, I, I, device=dev)
    labels = torch.randint(0, K, (B, I, I), device=dev)
    return Spec(model, lambda m: {"pixel_values": x.to(m.dtype), "labels": labels},
                lambda o: (o.logits,), lambda o: o.loss)


def _torchvision(name, tiny, dev):
    import torchvision
    B, I = (4, 32) if tiny else (64, 224)
    model = getattr(torchvision.models, name)(num_classes=1000).to(dev)
    x = torch.randn(B, 3, I, I, device=dev)
    with torch.no_grad():  # running statistics of real activations, so that eval-mode BN keeps them O(1)
        model.train()(x)
    labels = torch.randint(0, 1000, (B,), device=dev)
    return Spec(model, lambda m: {"x": x.to(next(m.parameters()).dtype)}, lambda o: (o,),
                lambda o: F.cross_entropy(o.float(), labels))


def resnet18(tiny, dev):
    return _torchvision("resnet18", tiny, dev)


def mobilenet_v3_small(tiny, dev):
    return _torchvision("mobilenet_v3_small", tiny, dev)


def transformer_encoder(tiny, dev):  # (seq, batch, dim): batch_first=True takes the fused fast path in inference
    D, H, F_, L, B, T = (32, 2, 64, 2, 2, 8) if tiny else (1024, 16, 4096, 6, 8, 512)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, H, F_), L, enable_nested_tensor=False)
    x = torch.randn(T, B, D, device=dev)
    mask = nn.Transformer.generate_square_subsequent_mask(T, device=dev)
    probe = torch.randn(T, B, D, device=dev)  # not mean(o²): after the final LayerNorm it is ~1 whatever the weights

    def inputs(m):
        dt = next(m.parameters()).dtype
        return {"src": x.to(dt), "mask": mask.to(dt), "is_causal": True}
    return Spec(model, inputs, lambda o: (o,), lambda o: (o.float() * probe).sum())


def llama_decode(tiny, dev):
    """One greedy decode step (B tokens) over a StaticCache filled by a prompt in eager; each
    backend's model gets its own cache. The step writes the same cache slot every time."""
    from transformers import StaticCache
    cfg = _llama_config(tiny)
    model = _hf("LlamaForCausalLM", "LlamaConfig", bos_token_id=0, eos_token_id=0, pad_token_id=0, **cfg)
    B, P, N = (2, 8, 16) if tiny else (8, 512, 1024)
    prompt = torch.randint(1, cfg["vocab_size"], (B, P), device=dev)
    token = torch.randint(1, cfg["vocab_size"], (B, 1), device=dev)

    def inputs(m):
        cache = StaticCache(config=m.config, max_cache_len=N)
        with torch.no_grad():
            m(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(P, device=dev),
              use_cache=True)
        return {"input_ids": token, "past_key_values": cache, "cache_position": torch.tensor([P], device=dev),
                "use_cache": True}
    return Spec(model, inputs, lambda o: (o.logits,), None)


MODELS = {f.__name__: f for f in (gpt2, llama, qwen2, bert, t5, vit, segformer, resnet18, mobilenet_v3_small,
                                  transformer_encoder, llama_decode)}
INFERENCE_ONLY = {"llama_decode"}


# --------------------------------------------------------------------------------------------- one step
def make_step(fn, spec, inputs, mode):
    if mode == "inference":
        def step():
            with torch.no_grad():
                return spec.outputs(fn(**inputs))
    else:
        def step():
            loss = spec.loss(fn(**inputs))
            loss.backward()
            return (loss,)
    return step


def zero_grads(model):
    for p in model.parameters():
        p.grad = None


def results(model, step, mode) -> list:
    """One step from zero gradients: the outputs, or the loss and every gradient (None where none)."""
    zero_grads(model)
    out = [t.detach() for t in step()]
    return out + ([p.grad for p in model.parameters()] if mode == "training" else [])


def rel_err(got, want, mode) -> float:
    grads = [w for w in want[1:] if w is not None] if mode == "training" else []
    floor = 1e-3 * max((g.abs().max().item() for g in grads), default=0.0)
    err = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None or g is None:
            if (w is None) != (g is None):
                return float("inf")
            continue
        g, w = g.float(), w.float()
        scale = max(w.abs().max().item(), floor if mode == "training" and i else 0.0) or 1.0
        err = max(err, (g - w).abs().max().item() / scale)
    return err


def compile_model(model, backend, options=None):
    return torch.compile(model, backend=backend, options=options)


def commfuse_counts(summaries: list) -> dict:
    """Counts over the summaries of the graphs commfuse compiled (commfuse.backend.summaries)."""
    return {"graphs": len(summaries),
            "kernels": sum(len({k["name"] for k in s.get("kernels", ())}) for s in summaries),
            "externs": sum(len(s.get("extern_calls", ())) for s in summaries),
            "fallbacks": sum(not s.get("compiled", True) for s in summaries),
            "fallback_reasons": [s["fallback_reason"] for s in summaries if "fallback_reason" in s]}


def peak_mib(model, step, dev):
    if dev != "cuda":
        return None
    zero_grads(model)
    timing.sync(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    timing.sync(dev)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def step_times_ms(steps: dict, dev, args, failed: dict) -> dict:
    if dev != "cuda":  # --cpu: one call each, to exercise the path, not to measure
        return {b: 1e3 * timing.wall_time_s(s, dev) for b, s in steps.items()}
    est_ms = 1e3 * min(timing.wall_time_s(steps["eager"], dev) for _ in range(3))
    iters = max(1, min(100, round(args.graph_ms / max(est_ms, 1e-3))))  # calls per CUDA graph
    us = timing.interleaved_times_us(steps, rounds=args.rounds, iters=iters, failed=failed)
    return {b: t / 1e3 for b, t in us.items()}


def run(name, mode, args, dev, dtype) -> dict:
    torch.manual_seed(0)
    with torch.device(dev):
        spec = MODELS[name](args.tiny, dev)
    base = spec.model.to(dev, dtype).eval()
    backends = ["eager"] + args.backends
    models = {b: base if b == "eager" else copy.deepcopy(base) for b in backends}
    inputs = {b: spec.inputs(models[b]) for b in backends}
    row = {"model": name, "mode": mode, "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
           "errors": {}}
    want = results(base, make_step(base, spec, inputs["eager"], mode), mode)
    # cold: each backend's first compile of this model
    for b in args.backends:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        inductor_metrics.reset()
        options = args.options if b == "commfuse" else None
        compiled_before = len(commfuse_backend.summaries)
        try:
            step = make_step(compile_model(models[b], b, options), spec, inputs[b], mode)
            t0 = time.perf_counter()
            got = results(models[b], step, mode)
            timing.sync(dev)
            r = {"cold_s": time.perf_counter() - t0, "err": rel_err(got, want, mode),
                 "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                 "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
            if b == "inductor":
                r["kernels"] = inductor_metrics.generated_kernel_count
            else:
                r.update(commfuse_counts(commfuse_backend.summaries[compiled_before:]))
            row[b] = r
        except Exception as e:  # report it, go on with the other backend and models
            row["errors"][b] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            print(f"[{name}/{mode}/{b}] {row['errors'][b]}", file=sys.stderr)
            if args.verbose:
                traceback.print_exc()
    # warm: compiled again with filled caches; these compiles are the ones timed (no reset between
    # the backends: Dynamo keeps one cache entry per backend)
    torch._dynamo.reset()
    steps = {"eager": make_step(base, spec, inputs["eager"], mode)}
    for b in args.backends:
        if b in row["errors"]:
            continue
        try:
            steps[b] = make_step(compile_model(models[b], b, args.options if b == "commfuse" else None),
                                 spec, inputs[b], mode)
            row[b]["warm_s"] = timing.wall_time_s(steps[b], dev)
        except Exception as e:
            steps.pop(b, None)
            row["errors"][b] = f"warm compile: {type(e).__name__}: {e}".splitlines()[0][:200]
            print(f"[{name}/{mode}/{b}] {row['errors'][b]}", file=sys.stderr)
    row["peak_mib"] = {b: peak_mib(models[b], s, dev) for b, s in steps.items()}
    failed = {}
    row["step_ms"] = step_times_ms(steps, dev, args, failed)
    for b, e in failed.items():
        row["errors"][b] = f"timing: {type(e).__name__}: {e}".splitlines()[0][:200]
    del models, steps, inputs
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------------- report
def fmt(x, spec=".3g"):
    return "—" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a and b else None


def suspect(row) -> bool:
    cf, ind = row.get("commfuse", {}).get("err"), row.get("inductor", {}).get("err")
    return cf is not None and cf > max(5 * (ind or 0.0), 1e-2)


def markdown(rows, args, meta) -> str:
    b = lambda r, k, backend: r.get(backend, {}).get(k)  # noqa: E731
    pair = lambda r, k, spec=".3g": " / ".join(fmt(b(r, k, x), spec) for x in COMPILED)  # noqa: E731
    out = ["Correctness and compilation (Inductor / commfuse):", "",
           "| model | mode | params (M) | err | compile cold (s) | compile warm (s) | graph breaks | "
           "Dynamo graphs | kernels | commfuse externs | commfuse fallbacks |", "|" + "---|" * 11]
    for r in rows:
        err = pair(r, "err", ".2g") + (" !" if suspect(r) else "")
        out.append(f"| {r['model']} | {r['mode']} | {r['params_m']:.3g} | {err} | {pair(r, 'cold_s', '.1f')} | "
                   f"{pair(r, 'warm_s', '.1f')} | {pair(r, 'breaks', 'd')} | {pair(r, 'dynamo_graphs', 'd')} | "
                   f"{pair(r, 'kernels', 'd')} | {fmt(b(r, 'externs', 'commfuse'), 'd')} | "
                   f"{fmt(b(r, 'fallbacks', 'commfuse'), 'd')} |")
    timer = "ms, CUDA graphs" if meta["device"] == "cuda" else "ms, one call: not a measurement"
    out += ["", f"Step time ({timer}) and peak memory (MiB):", "",
            "| model | mode | eager | inductor | commfuse | vs eager (×) | vs inductor (×) | "
            "peak eager | peak inductor | peak commfuse | commfuse / inductor mem |", "|" + "---|" * 11]
    for r in rows:
        t, m = r["step_ms"], r["peak_mib"]
        out.append(f"| {r['model']} | {r['mode']} | {fmt(t.get('eager'))} | {fmt(t.get('inductor'))} | "
                   f"{fmt(t.get('commfuse'))} | {fmt(ratio(t.get('eager'), t.get('commfuse')), '.2f')} | "
                   f"{fmt(ratio(t.get('inductor'), t.get('commfuse')), '.2f')} | {fmt(m.get('eager'), '.0f')} | "
                   f"{fmt(m.get('inductor'), '.0f')} | {fmt(m.get('commfuse'), '.0f')} | "
                   f"{fmt(ratio(m.get('commfuse'), m.get('inductor')), '.2f')} |")
    errors = [f"- {r['model']}/{r['mode']}/{b}: {e}" for r in rows for b, e in r["errors"].items()]
    reasons = [f"- {r['model']}/{r['mode']}: {why}" for r in rows
               for why in r.get("commfuse", {}).get("fallback_reasons", ())]
    out += ["", f"{meta['device_name']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, "
            f"commit {meta['commit']}, {meta['date']}."
            + (f" commfuse options {meta['commfuse_options']}." if meta["commfuse_options"] else ""),
            "err: max |x - eager| / max |eager| (`!`: commfuse above max(5 x Inductor's, 1e-2)). "
            "Time ratios: t_other / t_commfuse (above 1: commfuse faster)."]
    if meta["skipped"]:
        out += ["", "Skipped: " + "; ".join(f"{m} ({why})" for m, why in meta["skipped"].items())]
    if errors:
        out += ["", "Failed:", *errors]
    if reasons:
        out += ["", "commfuse graphs that fell back whole:", *reasons]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ",".join(MODELS))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from inference,training")
    ap.add_argument("--backends", default=",".join(COMPILED), help="compiled backends besides eager: "
                    "inductor,commfuse")
    ap.add_argument("--dtype", default="bfloat16", help="GPU dtype (--cpu runs float32)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--graph-ms", type=float, default=200,
                    help="about this many ms of steps in one CUDA graph replay")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny configs (2 layers, width 32)")
    ap.add_argument("--cpu", action="store_true", help="on CPU (commfuse in Triton's interpreter), with "
                    "--tiny: checks the script, measures nothing")
    add_run_args(ap, "max_fusion_size=32")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args()

    names = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b]
    if set(names) - set(MODELS) or set(args.modes) - set(MODES) or set(args.backends) - set(COMPILED):
        ap.error(f"models from {list(MODELS)}, modes from {list(MODES)}, backends from {list(COMPILED)}")
    args.options = commfuse_options(ap, args.set)
    if args.cpu:
        if not args.tiny:
            ap.error("--cpu runs commfuse's kernels in Triton's interpreter: only with --tiny")
        dev, dtype, args.rounds = "cpu", torch.float32, 1
    elif torch.cuda.is_available():
        dev, dtype = "cuda", getattr(torch, args.dtype)
    else:
        print("bench/models.py measures on a GPU and no CUDA device is visible; --cpu --tiny checks the "
              "script on CPU.", file=sys.stderr)
        return 2

    # the first compile of the process imports and initializes what every later one reuses
    for b in args.backends:
        torch.compile(lambda x: (x * 2).sum(), backend=b)(torch.ones(4, device=dev))
    meta = {"device": dev, **run_meta(torch.cuda.get_device_name() if dev == "cuda"
                                      else f"CPU ({platform.processor() or 'cpu'}, smoke run)", args.commit),
            "dtype": str(dtype).replace("torch.", ""), "commfuse_options": args.options}
    rows, skipped = [], {}
    for name in names:
        for mode in args.modes:
            if (mode == "training" and name in INFERENCE_ONLY) or name in skipped:
                continue
            print(f"running {name} / {mode} ...", file=sys.stderr, flush=True)
            try:
                rows.append(run(name, mode, args, dev, dtype))
            except ImportError as e:  # torchvision or transformers missing: the other models still run
                skipped[name] = str(e)
                print(f"[{name}] skipped: {e}", file=sys.stderr)
            meta["skipped"] = skipped
            write_results(args.out, markdown(rows, args, meta), {"meta": meta, "args": vars(args), "rows": rows},
                          partial=True)
    write_results(args.out, markdown(rows, args, meta), {"meta": meta, "args": vars(args), "rows": rows})
    bad = [(r["model"], r["mode"]) for r in rows if r["errors"] or suspect(r)]
    if bad:
        print(f"{len(bad)} model/mode pair(s) failed or have a suspect error: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
