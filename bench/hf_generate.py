"""A user's decode path: Hugging Face transformers `generate()` with a static KV cache, on one device
or tensor-parallel over the ranks, `model.forward` compiled by each variant side by side.

    torchrun --standalone --nproc-per-node 1 bench/hf_generate.py [--out bench/results/hf_generate_h100.md]
    torchrun --standalone --nproc-per-node 2 bench/hf_generate.py --out bench/results/hf_generate_2xh100.md
    torchrun --standalone --nproc-per-node 2 bench/hf_generate.py --cpu --tiny     # checks the script on CPU (fp32)

The model: transformers' `LlamaForCausalLM` (or with `--arch qwen2`, `Qwen2ForCausalLM`: the same
shapes, q/k/v with biases) built from a config with random weights (nothing downloaded), Llama-3-8B-shaped decoder layers (H 4096, 32 query / 8 KV heads of 128, F 14336), 4 of
them, a vocabulary of 32000 (the head's share of the step's bytes about that of the whole 8B
model), bf16, SDPA attention. At world > 1 it is tensor-parallel with torch's `parallelize_module`,
as torch's TP tutorial does for Llama: column-parallel q/k/v and gate/up, row-parallel o and down,
the embedding row-parallel over the vocabulary and the head column-parallel with its logits
replicated; the heads must divide among the ranks. At world 1 it is the plain model.

Variants: eager, Inductor mode="reduce-overhead", Inductor, commfuse, commfuse options
{"cuda_graphs": True}, all on the one model. Two ways to compile, as users do (--compile):
- forward (default): `model.forward = torch.compile(<the original forward>, ...)`, prefill and decode
  steps compiled, with `disable_compile=True` so that generate() compiles nothing itself (on a GPU
  it would otherwise compile its decode steps with Inductor reduce-overhead over ours);
- generate: `generate(..., compile_config=CompileConfig(backend=..., mode=..., options=...))`:
  generate() runs the prefill eagerly and compiles the decode steps (also on CPU here). The static
  cache is then allocated eagerly, its tensors marked static (torch._dynamo.mark_static_address).

Each variant in turn, all its figures before the next (eager first: its logits are the reference):
a progress line when it finishes, and the table so far written to --out (with its JSON), so that a
run cut by a time limit keeps the variants done. The default run's time is mostly the variants' cold
compiles (a prefill and a decode graph each); N=64 new tokens and 3 timed calls keep the rest small.
Figures, the worst rank's:
- generate: `model.generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)` with
  `cache_implementation="static"` (B prompts of P tokens): ms per call (CUDA events; the median of
  --rounds calls, after the first call and the teacher-forced one), new tokens per second (B x N
  over it) and ms per new token; on CPU one timed call, a smoke figure;
- first generate: the first call's seconds (the compiles of the prefill and the decode step);
- teacher forcing: generate() again, a logits processor recording each step's logits (the prefill's
  last position, then each decode step's) and making greedy search pick fixed random tokens, so that
  every variant decodes the same sequence through the graphs that are timed; max abs error of the
  logits of every step against eager's (flagged `!`, exit status 1, above max(5 x Inductor's, 1e-2, 4 ulps at the largest logit):
  bench/model_tp.py's rule);
- generated tokens equal to eager's (greedy on random weights: near-ties may flip; information only);
- for reduce-overhead and cuda_graphs, the graphs run without a CUDA graph over all those calls
  (Inductor's cudagraph skips: a graph writing an input that is not static, as the decode step
  writes a cache that a compiled prefill allocated; commfuse's warnings);
- graphs: how many Dynamo compiled for the variant over all its calls (a prefill and a decode step:
  2; more, a recompile).

Ratios are speed-ups, other's time / this one's (above 1: the commfuse variant is faster).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from bench.model_tp import _why, add_size_args, fill_sizes  # noqa: E402  (model_tp sets NCCL's environment first)
from bench.model_tp_report import error_limit, ratio, worst_over_ranks  # noqa: E402
from bench.tp_variants import SELF_GRAPHED, compile_options  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import timing  # noqa: E402
from bench.common import add_run_args, commfuse_options, run_meta, write_results  # noqa: E402

VARIANTS = ("eager", "inductor reduce-overhead", "inductor", "commfuse", "commfuse cuda_graphs")
RATIOS = (("eager", "commfuse"), ("eager", "commfuse cuda_graphs"), ("inductor reduce-overhead", "commfuse"),
          ("inductor reduce-overhead", "commfuse cuda_graphs"), ("inductor", "commfuse"))
FULL = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=4, vocab=32000, batch=8, prompt=32, new_tokens=64)
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=128, batch=2, prompt=5, new_tokens=4)


# ------------------------------------------------------------------------------------------ model
def build(a, world, dev):
    """LlamaForCausalLM (Qwen2ForCausalLM with --arch qwen2) with random weights (the same on every
    rank), in a.dtype on `dev`; at world > 1 tensor-parallel as torch's TP tutorial does for Llama."""
    import transformers
    if not hasattr(transformers, "StaticCache"):
        sys.exit(f"transformers {transformers.__version__} has no StaticCache: generate() with "
                 "cache_implementation='static' needs transformers >= 4.38")
    config_cls, model_cls = ARCHS[a.arch]
    cfg = getattr(transformers, config_cls)(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
        max_position_embeddings=max(2048, a.prompt + a.new_tokens), attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(a.dtype)
    try:
        with torch.device(dev):
            model = getattr(transformers, model_cls)(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    gc = model.generation_config
    gc.cache_implementation, gc.eos_token_id, gc.pad_token_id = "static", None, 0
    gc.disable_compile = True  # (transformers without the flag ignores it and compiles nothing on its own)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(dev.type, (world,))
        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {"self_attn.o_proj": RowwiseParallel()}
        plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                         "lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def variant_calls(model, variants, options, how, dev) -> dict:
    """{variant: (forward, generate()'s extra arguments)}. --compile forward: torch.compile of the
    model's forward; generate: the forward as it is, and a CompileConfig by which generate() compiles
    its decode steps itself. --set options go to the commfuse variants."""
    from transformers import CompileConfig
    forward, out = model.forward, {}
    for name in variants:
        kw = compile_options(name)
        if kw is not None and name.startswith("commfuse") and options:
            kw = {**kw, "options": {**kw.get("options", {}), **options}}
        if kw is None or how == "forward":
            out[name] = (forward if kw is None else torch.compile(forward, **kw)), {"disable_compile": True}
            continue
        cc = CompileConfig(fullgraph=False, dynamic=False, backend=kw.get("backend", "inductor"), mode=kw.get("mode"),
                           options=kw.get("options"))
        cc._compile_all_devices = dev.type != "cuda"  # (else generate() compiles on GPUs only)
        out[name] = forward, {"disable_compile": False, "compile_config": cc}
    return out


class Forced:
    """A logits processor that records each step's logits and makes greedy search pick the given
    token: teacher forcing through generate() itself, so that the step's graphs are the ones timed."""
    def __init__(self, forced, prompt_len):
        self.forced, self.prompt_len, self.logits = forced, prompt_len, []

    def __call__(self, input_ids, scores):
        self.logits.append(scores.detach().float().clone())
        token = self.forced[:, input_ids.shape[1] - self.prompt_len]
        return torch.full_like(scores, -math.inf).scatter_(1, token[:, None], 0.0)


class Ungraphed(logging.Handler):
    """Counts graphs that a self-graphing variant runs without a CUDA graph: Inductor's cudagraph
    skips (a graph writing an input that is not static, a CPU one) and commfuse's warnings."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.warnings = 0
        logging.getLogger("commfuse").addHandler(self)

    def emit(self, record):
        self.warnings += "runs without a CUDA graph" in record.getMessage()

    def __call__(self) -> int:
        return self.warnings + torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def max_error(got, want) -> float:
    if len(got) != len(want):
        raise RuntimeError(f"{len(got)} steps' logits, eager had {len(want)}")
    return max((g - w).abs().max().item() for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------- main
def run(a, dev, variants, options, report) -> None:
    """Each variant in turn, all its figures before the next (its compiles, the teacher-forced check,
    --rounds timed calls); report(res, failed, scale, name, seconds) after each, on every rank."""
    from transformers import LogitsProcessorList
    world = dist.get_world_size()
    model = build(a, world, dev)
    calls = variant_calls(model, variants, options, a.compile, dev)
    torch.manual_seed(1)  # the same prompt and forced tokens on every rank
    prompt = torch.randint(1, a.vocab, (a.batch, a.prompt), device=dev)
    forced = torch.randint(1, a.vocab, (a.batch, a.new_tokens), device=dev)

    def generate(**kw):
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=a.new_tokens,
                                  min_new_tokens=a.new_tokens, do_sample=False, **kw)
    res, failed, tokens, ref, ungraphed, scale = {v: {} for v in variants}, {}, {}, None, Ungraphed(), 0.0
    for name in variants:
        start, r = time.perf_counter(), res[name]
        try:
            model.forward, kw = calls[name]
            before, graphs = ungraphed(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
            first = []
            r["first generate s"] = timing.wall_time_s(lambda: first.append(generate(**kw)), dev)
            tokens[name] = first[0][:, a.prompt:]
            forcing = Forced(forced, a.prompt)  # (also the warm-up call of the timed ones)
            if not torch.equal(generate(logits_processor=LogitsProcessorList([forcing]), **kw)[:, a.prompt:], forced):
                raise RuntimeError("teacher forcing: generate() did not emit the forced tokens")
            if name == "eager":
                ref = forcing.logits
                scale = max(t.abs().max().item() for t in ref)
            if ref is None:
                raise RuntimeError("eager's logits are the reference: add eager to --variants")
            r["err logits"] = max_error(forcing.logits, ref)
            if "eager" in tokens:
                r["tokens equal %"] = 100 * (tokens[name] == tokens["eager"]).float().mean().item()
            times = []
            for _ in range(a.rounds):
                if dev.type == "cuda":
                    times.append(timing.median_us(lambda: generate(**kw), 1, 1) / 1e3)
                else:
                    times.append(timing.wall_time_s(lambda: generate(**kw), dev) * 1e3)
            ms = sorted(times)[len(times) // 2]
            r.update({"ms/generate": ms, "tokens/s": a.batch * a.new_tokens / ms * 1e3, "ms/token": ms / a.new_tokens})
            r["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            if name in SELF_GRAPHED:
                r["ungraphed"] = ungraphed() - before
        except Exception as e:  # report, go on with the others
            failed[name] = _why(e)
        report(res, failed, scale, name, time.perf_counter() - start)


ROWS = (  # (key, label, fmt, higher is better)
    ("tokens/s", "generate: new tokens per second (B x N / time)", "{:.0f}", True),
    ("ms/generate", "generate: ms per call", "{:.1f}", False),
    ("ms/token", "generate: ms per new token (the call / N)", "{:.2f}", False),
    ("first generate s", "first generate: s (compiles)", "{:.1f}", False),
    ("graphs", "graphs Dynamo compiled (over all its calls: above 2, a recompile)", "{:.0f}", None),
    ("err logits", "teacher forcing: max abs logit error vs eager", "{:.2e}", None),
    ("tokens equal %", "generated tokens equal to eager's, % (information)", "{:.0f}", None),
    ("ungraphed", "graphs run without a CUDA graph (Inductor's cudagraph skips, commfuse's warnings)", "{:.0f}", None),
)


def table(a, res, failed, variants, world, device_name, scale) -> tuple[str, bool]:
    flagged = False
    ratios = [(o, c) for o, c in RATIOS if o in variants and c in variants]
    head = ["", *variants, *(f"{c} vs {o}" for o, c in ratios)]
    lines = [f"HF {ARCHS[a.arch][1]} generate(), static cache: {a.layers} layers, H {a.hidden}, {a.heads} query / "
             f"{a.kv_heads} KV heads, F {a.ffn}, vocab {a.vocab}, {a.dtype_name}, "
             f"{'tensor-parallel over ' + str(world) if world > 1 else 'one'} x {device_name}; B={a.batch}, prompt "
             f"{a.prompt}, {a.new_tokens} new tokens (greedy, and teacher-forced); "
             f"compiled: {'model.forward' if a.compile == 'forward' else 'by generate(compile_config=...)'}", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for key, label, fmt, higher in ROWS:
        cells = []
        for v in variants:
            val = res[v].get(key)
            text = "—" if val is None else fmt.format(val)
            if key == "err logits" and v.startswith("commfuse") and val is not None \
                    and val > error_limit(res, key, a.dtype, scale):
                text, flagged = text + " !", True
            cells.append(text)
        if all(c == "—" for c in cells):
            continue
        if higher is None:
            cols = [""] * len(ratios)
        else:
            cols = [ratio(*((res[c].get(key), res[o].get(key)) if higher else (res[o].get(key), res[c].get(key))))
                    for o, c in ratios]
        lines.append("| " + " | ".join([label, *cells, *cols]) + " |")
    lines += ["", "Ratios are speed-ups of the commfuse variant: the other's time / its own (above 1: commfuse is faster)."]
    if flagged:
        lines.append("`!`: a logit error above max(5 × Inductor's, 1e-2, 4 ulps at the largest eager logit).")
    if failed:
        lines += ["", "Failed:", *(f"- {k}: {v}" for k, v in failed.items())]
    return "\n".join(lines) + "\n", flagged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap, FULL, TINY)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default bfloat16; float32 with --cpu")
    ap.add_argument("--rounds", type=int, default=None, help="timed generate calls per variant (default 3; 1 with --tiny)")
    ap.add_argument("--compile", choices=("forward", "generate"), default="forward",
                    help="forward: model.forward = torch.compile(model.forward, ...) (default); generate: "
                         "generate(compile_config=CompileConfig(...)), transformers compiling its decode steps")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="the decoder's transformers class (default %(default)s)")
    add_run_args(ap, "decode_attention=True")
    a = ap.parse_args(argv)
    fill_sizes(a, FULL, TINY)
    a.rounds = a.rounds or (1 if a.tiny else 3)
    a.dtype_name = a.dtype or ("float32" if a.cpu else "bfloat16")
    a.dtype = getattr(torch, a.dtype_name)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    variants.sort(key=lambda v: v != "eager")  # eager first: its logits are the reference
    options = commfuse_options(ap, a.set)
    if "WORLD_SIZE" not in os.environ:
        ap.error("run it under torchrun: torchrun --standalone --nproc-per-node 1 bench/hf_generate.py")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "COMMFUSE_CACHE_DIR"):  # cold compiles
        if var not in os.environ:
            os.environ[var] = tempfile.mkdtemp(prefix=f"hf_generate_{var.split('_')[0].lower()}_r{os.environ.get('LOCAL_RANK', '0')}_")
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no GPU here: use --cpu --tiny to check the script on CPU")
    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    if a.heads % world or a.kv_heads % world or a.ffn % world or a.vocab % world:
        ap.error(f"heads, KV heads, F and the vocabulary must divide among {world} ranks")
    # one code object (the forward) holds every variant's graphs: a prefill and a decode step each
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(VARIANTS))
    dev_name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (gloo, Triton interpreter)"
    status = 0

    def report(res, failed, scale, variant, seconds):
        """After each variant: the worst rank's figures, a progress line and the table so far
        (written to --out each time: a run cut by a time limit keeps the variants done)."""
        nonlocal status
        res = worst_over_ranks(res, variants, dev)
        failures = [None] * world
        dist.all_gather_object(failures, failed)
        if dist.get_rank() != 0:
            return
        failed = {f"rank {r}: {k}": v for r, f in enumerate(failures) for k, v in f.items()}
        done = variants[: variants.index(variant) + 1]
        r, final = res[variant], done == variants
        why = next((v for k, v in failed.items() if k.endswith(f": {variant}")), None)
        print(f"[{len(done)}/{len(variants)}] {variant}: " + (f"failed ({why})" if why else
              f"first generate {r.get('first generate s', 0):.1f} s, {r.get('graphs', 0):.0f} graphs, {r.get('ms/generate', 0):.1f} ms per call, "
              f"logit error {r.get('err logits', 0):.2e}") + f"; {seconds:.1f} s in all", flush=True)
        text, flagged = table(a, res, failed, done, world, dev_name, scale)
        text += "" if final else f"\n(so far: {len(done)} of the {len(variants)} variants)\n"
        config = {k: v for k, v in vars(a).items() if k != "dtype"}
        write_results(a.out, text, {"meta": run_meta(dev_name, a.commit), "config": config, "world": world, "results": res,
                                    "failed": failed, "logit scale": scale, "complete": final}, partial=not final)
        status = 1 if failed or flagged else 0
    run(a, dev, variants, options, report)
    status_t = torch.tensor([status], device=dev)
    dist.broadcast(status_t, 0)
    dist.destroy_process_group()
    return int(status_t.item())


if __name__ == "__main__":
    sys.exit(main())
