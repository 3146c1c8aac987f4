"""torchtitan as a client: its Llama 3 debug model, built and parallelized by torchtitan's own code
(model_registry, update_from_config, ParallelDims, parallelize_llama: Module.parallelize for
TP + sequence parallel, apply_compile per TransformerBlock with compile_config.backend,
apply_fsdp_to_decoder; its ChunkedLossWrapper loss, vocab-parallel under TP; its AdamW container),
trained for a few steps next to an eager copy (same seed, same init, same data). Prints each
step's losses, their largest difference, and the compile time (the first step minus an eager one).

Install (torchtitan pins torch nightlies and needs Python >= 3.11; its import deps, without theirs):
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro einops torchdata safetensors \
        tokenizers torch_checkpointing docstring_parser typeguard rich shtab typing_extensions
Run (2 ranks: tp or fsdp; 4 ranks: 2d, dp_shard 2 x tp 2):
    torchrun --standalone --nproc-per-node 2 bench/torchtitan_llama.py --parallel tp --backend commfuse --steps 3

Activation checkpointing is the Trainer's default, per-op SAC (--ac selective; full or none). With
torch 2.13, TP with it fails under Inductor and aot_eager in AOTAutograd's runtime ("expected all
tensors_saved_with_vc_check to be Tensors"); commfuse puts the saved values back in the order the
runtime reads them (commfuse/passes/saved_order.py) and trains.

On CPU (the default) only torchtitan's CPU limits are set here: its device type (it picks "cuda"
with no accelerator) and FSDP's sum reduction (gloo has no PREMUL_SUM). With --gpu each rank runs
on its GPU under NCCL, torchtitan's own settings untouched. Attention is SDPA unless --attn flex."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def cpu_torchtitan():
    """torchtitan's modules read a device type chosen at import ("cuda" without an accelerator)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools
    for mod in (tools, parallel_dims, dist_utils):
        mod.device_type = "cpu"
    tools.device_module = dist_utils.device_module = torch.cpu


def build(args, backend, world, device):
    """The debug model, parallelized and initialized as torchtitan's Trainer does (no PP)."""
    import dataclasses
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.common.attention import ScaledDotProductAttention
    spec = model_registry("debugmodel", attn_backend="flex")
    if args.attn == "sdpa":  # 0.3.0 builds language models with flex or varlen only; SDPA is causal
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    tp = {"tp": world, "fsdp": 1, "2d": 2}[args.parallel]
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, data_parallel_shard_degree=world // tp,
                                    spmd_backend=args.spmd_backend)
    training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, mixed_precision_param=args.param_dtype)
    compile_config = CompileConfig(enable=backend != "eager", backend=backend, components=args.compile.split(","),
                                   enable_async_tensor_parallel=args.async_tp and backend != "eager")
    # Decoder.Config.update_from_config for a Trainer.Config (importing the Trainer pulls in
    # datasets and tensorboard): RoPE tables of seq_len positions, then the sharding specs
    for layer in spec.model.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=args.seq)
    set_llama3_sharding_config(spec.model, enable_sp=parallelism.enable_sequence_parallel)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    model = parallelized(spec, dims, device, training=training, parallelism=parallelism,
                         compile_config=compile_config, ac_config=ac_config(args.ac))
    # llama3_debugmodel()'s loss and optimizer
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)).build(
        compile_config=compile_config)
    if hasattr(loss_fn, "set_lm_head"):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optim = default_adamw(lr=8e-4).build(model_parts=[model])
    ctx = dist_utils.get_spmd_context(parallel_dims=dims)
    return model, loss_fn, optim, ctx, dims


def parallelized(spec, dims, device, **parallelize):
    """spec's model built on the meta device, parallelized by its own parallelize_fn, then
    materialized on `device` and initialized, as torchtitan's Trainer does."""
    from torch.distributed.fsdp import FSDPModule
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, dump_folder="/tmp", **parallelize)
    for m in model.modules():
        if isinstance(m, FSDPModule) and device.type == "cpu":  # gloo lacks PREMUL_SUM (FSDP's mean over ranks)
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def ac_config(name: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    return {"selective": SelectiveAC.Config, "full": FullAC.Config, "none": lambda: None}[name]()


def batches(args, dims, steps, vocab=2048):
    """Token batches: the same on the ranks of one TP group, distinct across data-parallel ranks."""
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    g = torch.Generator().manual_seed(1234 + dp_rank)
    return [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(steps)]


def train(args, backend, world, device):
    model, loss_fn, optim, ctx, dims = build(args, backend, world, device)
    losses, times = [], []
    for tokens in batches(args, dims, args.steps):
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        t0 = time.perf_counter()
        optim.zero_grad()
        # one document per row: positions for RoPE, and the block-causal mask flex needs (the Trainer's)
        extra = {"positions": torch.arange(args.seq, device=device).expand(args.batch, -1)}
        if args.attn == "flex":
            extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
        with ctx():
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, labels, torch.tensor(labels.numel()), positions=extra["positions"])
            loss.backward()
        optim.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    graphs = []
    if backend == "commfuse":  # with fallback_on_error (the default) a failed graph runs through aten
        from commfuse import backend as cf
        graphs = [(s["graph_id"], s["compiled"]) for s in cf.summaries]
    return losses, times, graphs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", choices=["tp", "fsdp", "2d"], default="tp")
    p.add_argument("--backend", default="commfuse", help="commfuse, inductor, aot_eager or eager")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--attn", default="sdpa", help="torchtitan's attn_backend: sdpa or flex (its default)")
    # torchtitan's default, spmd_types, hands fully_shard plain tensors with SPMD annotations, which
    # only torch nightlies' FSDP2 reads (torch 2.13: "all parameters must be DTensors")
    p.add_argument("--spmd-backend", default="partial_dtensor", help="torchtitan's parallelism.spmd_backend")
    p.add_argument("--compile", default="model,loss", help="torchtitan's compile.components (its default)")
    p.add_argument("--param-dtype", default="bfloat16", help="FSDP2's compute dtype, torchtitan's "
                   "mixed_precision_param: bfloat16 (its default, also under TP alone) or float32")
    p.add_argument("--async-tp", action="store_true", help="torchtitan's compile.enable_async_tensor_parallel "
                   "(it sets torch._inductor.config._micro_pipeline_tp, which commfuse follows)")
    p.add_argument("--ac", choices=["selective", "full", "none"], default="selective",
                   help="torchtitan's activation_checkpoint (its Trainer's default: selective, per-op SAC)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--gpu", action="store_true", help="each rank on its GPU, NCCL (default: CPU, gloo)")
    args = p.parse_args()
    if args.backend == "commfuse":
        import commfuse  # noqa: F401  (Triton's interpreter on CPU: before triton's first import)
    if args.gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        cpu_torchtitan()
    world, rank = dist.get_world_size(), dist.get_rank()
    assert (world == 4) == (args.parallel == "2d"), "tp and fsdp run on 2 ranks, 2d on 4"
    want, eager_s, _ = train(args, "eager", world, device)
    got, times, graphs = train(args, args.backend, world, device) if args.backend != "eager" else (want, eager_s, [])
    diff = max(abs(a - b) for a, b in zip(got, want))
    out = {**vars(args), "world": world,
           "eager_losses": want, "losses": got, "max_diff": diff,
           "compile_s": times[0] - eager_s[0], "step_s": times[1:], "eager_step_s": eager_s[1:],
           "graphs": graphs}
    if rank == 0:
        for i, (a, b) in enumerate(zip(got, want)):
            print(f"step {i}: {args.backend} {a:.6f} eager {b:.6f} diff {abs(a - b):.2e}")
        print(f"max diff {diff:.2e}; compile {out['compile_s']:.1f} s (first step minus eager's)")
        if graphs:
            print(f"commfuse graphs: {sum(ok for _, ok in graphs)} compiled of {len(graphs)}: {graphs}")
        if args.json:
            json.dump(out, open(args.json, "w"), indent=1)
    dist.destroy_process_group()
    tol = (1e-3 if args.param_dtype == "bfloat16" else 1e-5) * max(1.0, abs(want[0]))  # relative
    if diff > tol or not all(ok for _, ok in graphs):
        raise SystemExit(f"rank {rank}: losses differ from eager by {diff:.2e} (tolerance {tol:.0e})")


if __name__ == "__main__":
    main()
