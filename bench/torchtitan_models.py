"""torchtitan's other models as clients, the way bench/torchtitan_llama.py runs its Llama 3: each
model's own debug Trainer.Config (its config_registry function: model flavor, loss, optimizer,
LR schedule, activation checkpointing, grad clipping), its own update_from_config (sharding specs,
RoPE length, EP dispatcher), its own parallelize_fn (TP + SP, EP, AC, apply_compile with
compile_config.backend, FSDP2) and its MoE load-balancing hook, trained a few steps next to an
eager copy (same seed, same init, same data). Prints each step's loss and grad norm, their largest
difference from eager, and the compile time (first step minus eager's).

    torchrun --standalone --nproc-per-node 2 bench/torchtitan_models.py --model qwen3 --parallel tp
    torchrun --standalone --nproc-per-node 2 bench/torchtitan_models.py --model deepseek_v3 --parallel ep

On 2 CPU cores, Triton's interpreter (torch 2.13, gloo): qwen3, qwen3_moe and deepseek_v3 at the
defaults (seq 64, batch 2) take 3-5 min a run; gpt_oss (expert hidden size 2880) needs --seq 16
--batch 1 (about 2-5 min; at seq 64 over 13 min), and --balanced-routing in bf16: a top-k flip on
near-tied scores moves eager's own loss by about 1e-2. gpt_oss under TP differs from eager under
aot_eager too (6% in step 0's grad norm): compare it with --backend aot_eager, not eager.
qwen3_5 needs fla (flash-linear-attention), not installed here.

Models: see MODELS. --parallel: tp (TP 2, sequence parallel), fsdp (FSDP 2), ep (expert parallel 2
over FSDP 2; MoE models), tp_ep (TP 2 with EP 2 borrowing the TP ranks; MoE models), pp (PP 2,
torchtitan's pipeline_llm and its default schedule, 1F1B), pp_ep (PP 2 x EP 2, 4 ranks; MoE models).

Only what CPU/gloo/torch 2.13 cannot do is overridden, as in torchtitan_llama.py:
- device type "cpu" (torchtitan picks "cuda" without an accelerator), FSDP's sum reduction (gloo
  has no PREMUL_SUM), spmd_backend partial_dtensor (torch 2.13's FSDP2 wants DTensors);
- attention: torchtitan 0.3.0 builds its language models with flex or varlen attention. Flex has
  no backward on CPU ("FlexAttention does not support backward on CPU") and varlen is CUDA's.
  --attn sdpa (where the model passes no out_transform) swaps in torchtitan's own SDPA inner
  attention (causal; one document per row, so the same mask); --attn math (the default where a
  model needs the softmax's log-sum-exp, gpt-oss's sinks, or a sliding window) swaps in
  MathAttention below: torchtitan's own flex BlockMasks, made dense outside the compiled region,
  and attention written in plain torch ops, returning the LSE for out_transform.
- torchtitan.trainer imports tensorboard and datasets; where those are absent they are stubbed
  (only their names: nothing here logs or loads a dataset).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_llama import ac_config, cpu_torchtitan, forward_backward, model_parts  # noqa: E402

# name: (package under torchtitan.models, its config_registry function)
MODELS = {
    "llama3": ("llama3", "llama3_debugmodel"),
    "qwen3": ("qwen3", "qwen3_debugmodel"),
    "qwen3_moe": ("qwen3", "qwen3_moe_debug"),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3_debugmodel"),
    "gpt_oss": ("gpt_oss", "gpt_oss_debugmodel"),
    "qwen3_5": ("qwen3_5", "qwen35_debugmodel"),            # needs fla (flash-linear-attention)
    "qwen3_5_moe": ("qwen3_5", "qwen35_debugmodel_moe"),    # needs fla
}


def stub_trainer_imports():
    """torchtitan.trainer (and so every config_registry) imports tensorboard and datasets."""
    class _Absent:
        def __init__(self, *a, **k):
            raise RuntimeError("stubbed by bench/torchtitan_models.py")

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []
        sys.modules[name] = m
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        stub("torch.utils.tensorboard", SummaryWriter=_Absent)
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub("datasets", Dataset=_Absent, IterableDataset=_Absent, load_dataset=_Absent,
             interleave_datasets=_Absent)
        stub("datasets.distributed", split_dataset_by_node=_Absent)


def balanced_routing():
    """Every MoE router built from now on assigns tokens to experts evenly, whatever its scores."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    init = TokenChoiceTopKRouter.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._debug_force_load_balance = True
    TokenChoiceTopKRouter.__init__ = __init__


def math_attention_class():
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.protocols.module import Module

    class MathAttention(Module):
        """FlexAttention's config (so the model builds its BlockMasks), plain torch ops inside.
        attention_masks is a dense bool (B, 1, L, L) tensor, from dense_masks(). Not a
        FlexAttention module: torchtitan's apply_compile refuses any backend but inductor and
        aot_eager for a model holding one."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            pass

        def __init__(self, config: Config):
            super().__init__()

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False,
                    out_transform=None, **kwargs):
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
            if q.shape[1] != k.shape[1]:  # grouped-query: repeat K/V heads
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            s = (q.float() @ k.float().transpose(-2, -1)) * scale
            s = s.masked_fill(~attention_masks, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # (B, N, L)
            out = (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype).transpose(1, 2)
            if out_transform is None:
                return out
            return out_transform(out, lse.transpose(1, 2))

    return MathAttention


def dense_masks(masks):
    """torchtitan's flex BlockMask(s) as dense (B, 1, L, L) bool tensors, built eagerly."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask
    if isinstance(masks, dict):
        return {k: dense_masks(v) for k, v in masks.items()}
    assert isinstance(masks, BlockMask), type(masks)
    B, _, L, S = masks.shape[0], None, masks.seq_lengths[0], masks.seq_lengths[1]
    return create_mask(masks.mask_mod, B, 1, L, S, device=masks.kv_num_blocks.device)


def swap_attention(model_cfg, attn: str) -> str:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    if attn == "auto":  # SDPA where the model passes no out_transform and no window, else math
        import inspect
        first = next(layer.attention for layer in model_cfg.layers if getattr(layer, "attention", None) is not None)
        src = inspect.getsource(type(first)._owner)  # (qwen3_5's first layers are linear attention: None)
        windowed = any(getattr(layer.attention, "sliding_window_size", None) for layer in model_cfg.layers
                       if getattr(layer, "attention", None) is not None)
        attn = "math" if "out_transform" in src or windowed else "sdpa"
    if attn == "flex":
        return attn
    new = {"sdpa": ScaledDotProductAttention.Config, "math": math_attention_class().Config}[attn]
    for layer in model_cfg.layers:
        a = getattr(layer, "attention", None)
        if a is not None and hasattr(a, "inner_attention"):
            a.inner_attention = new()
    return attn


def build(args, backend, world, device):
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    pkg, fn = MODELS[args.model]
    cfg = getattr(importlib.import_module(f"torchtitan.models.{pkg}.config_registry"), fn)()
    spec = cfg.model_spec
    if args.flavor:  # another flavor of the same package
        spec = importlib.import_module(f"torchtitan.models.{pkg}").model_registry(args.flavor)
        cfg.model_spec = spec
    args.attn_used = swap_attention(spec.model, args.attn)
    tp, ep, pp = {"tp": (world, 1, 1), "fsdp": (1, 1, 1), "ep": (1, world, 1), "tp_ep": (world, world, 1),
                  "2d": (2, 1, 1), "pp": (1, 1, 2), "pp_ep": (1, 2, 2)}[args.parallel]
    cfg.parallelism = dataclasses.replace(
        cfg.parallelism, tensor_parallel_degree=tp, data_parallel_shard_degree=world // tp // pp,
        expert_parallel_degree=ep, pipeline_parallel_degree=pp, spmd_backend=args.spmd_backend)
    cfg.training = dataclasses.replace(cfg.training, local_batch_size=args.batch, seq_len=args.seq,
                                       mixed_precision_param=args.param_dtype, steps=args.steps)
    cfg.compile = dataclasses.replace(cfg.compile, enable=backend != "eager", backend=backend,
                                      components=args.compile.split(","),
                                      enable_async_tensor_parallel=args.async_tp and backend != "eager")
    ac = cfg.activation_checkpoint if args.ac == "default" else ac_config(args.ac)
    spec.model.update_from_config(config=cfg)  # as the Trainer does: sharding, RoPE length, EP
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    parallelize = dict(training=cfg.training, parallelism=cfg.parallelism, compile_config=cfg.compile, ac_config=ac)
    parts, schedule = model_parts(spec, dims, device, loss_fn, **parallelize)
    optim = cfg.optimizer.build(model_parts=parts)
    if spec.post_optimizer_build_fn is not None:  # MoE load balancing: expert bias update
        spec.post_optimizer_build_fn(optim, parts, dims)
    sched = cfg.lr_scheduler.build(optimizers=optim, training_steps=cfg.training.steps)
    ctx = dist_utils.get_spmd_context(parallel_dims=dims)
    return parts, schedule, loss_fn, optim, sched, ctx, dims, cfg


def train(args, backend, world, device):
    from torchtitan.distributed import utils as dist_utils
    parts, schedule, loss_fn, optim, sched, ctx, dims, cfg = build(args, backend, world, device)
    vocab = spec_vocab(cfg)
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    g = torch.Generator().manual_seed(1234 + dp_rank)
    losses, norms, times = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        t0 = time.perf_counter()
        optim.zero_grad()
        extra = {"positions": torch.arange(args.seq, device=device).expand(args.batch, -1)}
        if args.attn_used in ("flex", "math"):
            masks = parts[0].get_attention_masks(positions=extra["positions"])
            extra["attention_masks"] = dense_masks(masks) if args.attn_used == "math" else masks
        ntok = torch.tensor(labels.numel() * (dims.get_mesh("batch").size() if dims.dp_enabled else 1))
        with ctx():
            loss = forward_backward(parts[0], schedule, loss_fn, inputs, labels, ntok, extra, dims)
        norm = dist_utils.clip_grad_norm_([p for m in parts for p in m.parameters()], cfg.training.max_norm,
                                          foreach=True, pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None,
                                          ep_enabled=dims.ep_enabled)
        optim.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else float(norm))
    graphs = []
    if backend == "commfuse":
        from commfuse import backend as cf
        graphs = [(s["graph_id"], s["compiled"]) for s in cf.summaries]
    return losses, norms, times, graphs


def spec_vocab(cfg):
    return cfg.model_spec.model.vocab_size


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    p.add_argument("--flavor", help="another model_registry flavor of the same package")
    p.add_argument("--parallel", choices=["tp", "fsdp", "ep", "tp_ep", "2d", "pp", "pp_ep"], default="tp")
    p.add_argument("--backend", default="commfuse", help="commfuse, inductor, aot_eager or eager")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "math", "flex"])
    p.add_argument("--spmd-backend", default="partial_dtensor")
    p.add_argument("--compile", default="model,loss")
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--async-tp", action="store_true")
    p.add_argument("--ac", choices=["default", "selective", "full", "none"], default="default",
                   help="default: the model's Trainer.Config's")
    p.add_argument("--balanced-routing", action="store_true",
                   help="MoE routers send tokens to experts evenly (torchtitan's _debug_force_load_balance): in "
                        "bf16 a top-k flip on near-tied scores moves eager's own loss by ~1e-2 (gpt_oss)")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()
    if args.backend == "commfuse":
        import commfuse  # noqa: F401  (Triton's interpreter on CPU: before triton's first import)
    stub_trainer_imports()
    dist.init_process_group("gloo")
    cpu_torchtitan()
    if args.balanced_routing:
        balanced_routing()
    device = torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    want, want_n, eager_s, _ = train(args, "eager", world, device)
    if args.backend != "eager":
        got, got_n, times, graphs = train(args, args.backend, world, device)
    else:
        got, got_n, times, graphs = want, want_n, eager_s, []
    diff = max(abs(a - b) for a, b in zip(got, want))
    ndiff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got_n, want_n))
    both = torch.tensor([diff, ndiff], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    diff, ndiff = both.tolist()
    if rank == 0:
        for i in range(len(got)):
            print(f"step {i}: {args.backend} loss {got[i]:.6f} eager {want[i]:.6f} (diff {abs(got[i]-want[i]):.2e}); "
                  f"grad norm {got_n[i]:.6f} eager {want_n[i]:.6f}")
        print(f"{args.model} {args.parallel} attn={args.attn_used}: max loss diff {diff:.2e}, "
              f"max grad-norm rel diff {ndiff:.2e}; compile {times[0] - eager_s[0]:.1f} s")
        if graphs:
            print(f"commfuse graphs: {sum(ok for _, ok in graphs)} compiled of {len(graphs)}: {graphs}")
        if args.json:
            json.dump({**vars(args), "world": world, "eager_losses": want, "losses": got,
                       "eager_norms": want_n, "norms": got_n, "max_diff": diff, "norm_rel_diff": ndiff,
                       "graphs": graphs}, open(args.json, "w"), indent=1)
    dist.destroy_process_group()
    tol = (1e-3 if args.param_dtype == "bfloat16" else 1e-5) * max(1.0, abs(want[0]))
    if diff > tol or ndiff > 10 * tol / max(1.0, abs(want[0])) or not all(ok for _, ok in graphs):
        raise SystemExit(f"rank {rank}: differs from eager: loss {diff:.2e}, grad norm {ndiff:.2e} "
                         f"(tolerance {tol:.0e})")


if __name__ == "__main__":
    main()
