"""torchtitan as a client: its Llama 3 debug model, built and parallelized by torchtitan's own code
(model_registry, update_from_config, ParallelDims, parallelize_llama: Module.parallelize for
TP + sequence parallel, apply_compile per TransformerBlock with compile_config.backend,
apply_fsdp_to_decoder; pipeline_llm's stages and schedule under PP; apply_cp_to_forward under CP;
its ChunkedLossWrapper loss, vocab-parallel under TP; its AdamW container),
trained for a few steps next to an eager copy (same seed, same init, same data). Prints each
step's losses, their largest difference, and the compile time (the first step minus an eager one).

Install (torchtitan pins torch nightlies and needs Python >= 3.11; its import deps, without theirs):
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro einops torchdata safetensors \
        tokenizers torch_checkpointing docstring_parser typeguard rich shtab typing_extensions
Run (2 ranks: tp, fsdp, ddp (dp_replicate 2), pp or cp; 4 ranks: 2d (dp_shard 2 x tp 2), hsdp
(dp_replicate 2 x dp_shard 2), pp_tp, pp_fsdp):
    torchrun --standalone --nproc-per-node 2 bench/torchtitan_llama.py --parallel tp --backend commfuse --steps 3

Activation checkpointing is the Trainer's default, per-op SAC (--ac selective; full or none). With
torch 2.13, TP with it fails under Inductor and aot_eager in AOTAutograd's runtime ("expected all
tensors_saved_with_vc_check to be Tensors"); commfuse puts the saved values back in the order the
runtime reads them (commfuse/passes/saved_order.py) and trains.

Pipeline schedules that split the backward (ZBVZeroBubble, DualPipeV) keep the autograd graph
between its halves, which AOTAutograd refuses for any backend while its buffers are donated: set
torch._functorch.config.donated_buffer = False for them (and --ac none: per-op SAC refuses a
second backward in eager too). CP runs on GPUs only: CPU SDPA has no DTensor sharding rule.

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


# each --parallel: its ranks, and the degrees it sets (the other ranks shard data, FSDP2)
MESHES = {"tp": (2, {"tp": 2}), "fsdp": (2, {}), "cp": (2, {"cp": 2}), "pp": (2, {"pp": 2}), "ddp": (2, {"dp": 2}),
          "2d": (4, {"tp": 2}), "pp_tp": (4, {"pp": 2, "tp": 2}), "pp_fsdp": (4, {"pp": 2}), "hsdp": (4, {"dp": 2})}


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
    tp, cp, pp, dp = (MESHES[args.parallel][1].get(dim, 1) for dim in ("tp", "cp", "pp", "dp"))
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, context_parallel_degree=cp, pipeline_parallel_degree=pp,
                                    pipeline_parallel_schedule=args.pp_schedule, data_parallel_replicate_degree=dp,
                                    data_parallel_shard_degree=world // tp // cp // pp // dp, spmd_backend=args.spmd_backend)
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
    # llama3_debugmodel()'s loss and optimizer
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)).build(
        compile_config=compile_config)
    parallelize = dict(training=training, parallelism=parallelism, compile_config=compile_config,
                       ac_config=ac_config(args.ac))
    parts, schedule = model_parts(spec, dims, device, loss_fn, **parallelize)
    optim = default_adamw(lr=8e-4).build(model_parts=parts)
    ctx = dist_utils.get_spmd_context(parallel_dims=dims)
    return parts[0], loss_fn, optim, ctx, dims, schedule


def model_parts(spec, dims, device, loss_fn, **parallelize):
    """This rank's model parts (under PP its stages, by the Trainer's pipelining_fn) and the PP
    schedule (None without PP); the last part's lm_head handed to a chunked loss, as the Trainer does."""
    if dims.pp_enabled:
        parts, schedule, last = pipelined(spec, dims, device, loss_fn, **parallelize)
    else:
        parts, schedule, last = [parallelized(spec, dims, device, **parallelize)], None, True
    if hasattr(loss_fn, "set_lm_head") and last:
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    return parts, schedule


def parallelized(spec, dims, device, **parallelize):
    """spec's model built on the meta device, parallelized by its own parallelize_fn, then
    materialized on `device` and initialized, as torchtitan's Trainer does."""
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    return materialized(spec.parallelize_fn(model, parallel_dims=dims, dump_folder="/tmp", **parallelize), device)


def materialized(model, device):
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule) and device.type == "cpu":  # gloo lacks PREMUL_SUM (FSDP's mean over ranks)
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def pipelined(spec, dims, device, loss_fn, **parallelize):
    """The Trainer's PP path: spec's pipelining_fn splits the meta model into this rank's stages
    (one under 1F1B, torchtitan's default schedule; two under the looped ones) and parallelizes them."""
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    schedule, parts, _, last = spec.pipelining_fn(
        model, parallel_dims=dims, dump_folder="/tmp", device=device, model_config=spec.model,
        parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn, **parallelize)
    return [materialized(part, device) for part in parts], schedule, last


def forward_backward(model, schedule, loss_fn, inputs, labels, n_tokens, extra, dims):
    """One step's forward and backward, as the Trainer runs it: through the model and the loss, or
    under PP through torch's schedule, which splits the batch into microbatches. Returns the loss
    (under PP the last stage's sum over microbatches, sent to every stage)."""
    if schedule is None:
        pred = model(inputs, **extra)
        loss, _ = loss_fn(pred, labels, n_tokens, positions=extra["positions"])
        del pred
        loss.backward()
        return loss
    mb_losses = []
    schedule.step(inputs, target=labels, losses=mb_losses, return_outputs=False,
                  loss_kwargs={"global_valid_tokens": n_tokens.to(inputs.device)}, **extra)
    local = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in mb_losses]
    loss = torch.stack(local).sum().detach() if local else torch.zeros((), device=inputs.device)
    dist.all_reduce(loss, group=dims.get_mesh("pp").get_group())
    return loss


def ac_config(name: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    return {"selective": SelectiveAC.Config, "full": FullAC.Config, "none": lambda: None}[name]()


def batches(args, dims, steps, vocab=2048):
    """Token batches: the same on the ranks of one TP group, distinct across data-parallel ranks."""
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    g = torch.Generator().manual_seed(1234 + dp_rank)
    return [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(steps)]


def train(args, backend, world, device):
    model, loss_fn, optim, ctx, dims, schedule = build(args, backend, world, device)
    losses, times = [], []
    for tokens in batches(args, dims, args.steps):
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        t0 = time.perf_counter()
        optim.zero_grad()
        # one document per row: positions for RoPE, and the block-causal mask flex needs (the Trainer's)
        extra = {"positions": torch.arange(args.seq, device=device).expand(args.batch, -1)}
        if args.attn == "flex":
            extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
        if dims.cp_enabled:  # each rank its share of the sequence, by torchtitan's load balancer
            from torchtitan.distributed.context_parallel import prepare_context_parallel_input
            inputs, labels, extra = prepare_context_parallel_input(inputs, labels, extra, dims.get_mesh("cp"), device)
        with ctx():
            loss = forward_backward(model, schedule, loss_fn, inputs, labels, torch.tensor(labels.numel(), device=device),
                                    extra, dims)
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
    p.add_argument("--parallel", choices=sorted(MESHES), default="tp",
                   help="2 ranks: tp, fsdp, ddp, cp (context parallel, GPU only: CPU SDPA has no DTensor "
                        "rule) or pp (pipeline); 4 ranks: 2d (FSDP 2 x TP 2), hsdp, pp_tp, pp_fsdp")
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
    p.add_argument("--pp-schedule", default="1F1B", help="torchtitan's pipeline_parallel_schedule (its default; "
                   "also GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
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
    assert world == MESHES[args.parallel][0], f"--parallel {args.parallel} runs on {MESHES[args.parallel][0]} ranks"
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
