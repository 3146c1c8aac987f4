"""A Llama-shaped decoder, tensor-parallel over the ranks: bench/model_tp.py times it and
tests/test_tp_llama.py checks it against eager, so both run the same model.

RMSNorm, rotary embedding, grouped-query attention through SDPA with HF's repeat_kv (what a model
written for eager does; commfuse passes K/V unrepeated), SwiGLU. With `vocab`, token embeddings
and an output head around the layers; without, the layers run on hidden states. Decode writes
each step's K/V into a static cache (module buffers, index_copy_ in place) and attends to the
positions <= pos. `tp_llama` parallelizes it the torchtitan way: column-parallel q/k/v and
gate/up, row-parallel o and down, whose outputs are all-reduced. `fsdp_llama` shards it with FSDP2
instead (fully_shard per layer and at the root), each layer compiled on its own."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    n_layers: int
    max_batch: int          # sequences the KV cache holds
    max_seq: int            # positions: the KV cache's and the rotary table's
    vocab: int | None = None  # None: no embedding or head, the layers on hidden states
    eps: float = 1e-5
    rope_theta: float = 500000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def repeat_kv(x, n):
    """HF transformers' repeat_kv: (b, kv_heads, s, d) -> (b, kv_heads * n, s, d)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class Attention(nn.Module):
    """After parallelize_module the projections hold this rank's heads (n_heads / world query
    heads, n_kv_heads / world K/V heads), and so does the KV cache. `attend` is SDPA, or what
    a parallelization wraps it in (titan_llama: local_map over DTensor heads)."""
    attend = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, cfg: Config, world: int):
        super().__init__()
        self.hd, self.group = cfg.dim // cfg.n_heads, cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)
        cache = (cfg.max_batch, cfg.n_kv_heads // world, cfg.max_seq, self.hd)
        self.register_buffer("cache_k", torch.zeros(cache), persistent=False)
        self.register_buffer("cache_v", torch.zeros(cache), persistent=False)

    def forward(self, x, cos, sin, pos=None):
        b, s, _ = x.shape
        # -1: the local head count (each rank holds a column slice of wq/wk/wv)
        q, k, v = (w(x).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if pos is None:  # training: causal attention over the sequence
            mask, causal = None, True
        else:  # decode: this step's K/V into the static cache in place, attend to positions <= pos
            self.cache_k.index_copy_(2, pos, k)
            self.cache_v.index_copy_(2, pos, v)
            k, v = self.cache_k, self.cache_v
            mask, causal = torch.arange(k.shape[2], device=x.device)[None, :] <= pos[:, None], False
        y = self.attend(q, repeat_kv(k, self.group), repeat_kv(v, self.group),
                                           attn_mask=mask, is_causal=causal)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: Config, world: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg, world)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn)

    def forward(self, x, cos, sin, pos=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: Config, world: int):
        super().__init__()
        if cfg.vocab:
            self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
            self.norm = RMSNorm(cfg.dim, cfg.eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.layers = nn.ModuleList(Layer(cfg, world) for _ in range(cfg.n_layers))
        hd = cfg.dim // cfg.n_heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(cfg.max_seq).float(), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, pos=None):
        """Training (pos None): x from position 0. Decode: x at positions `pos` (s,). x holds
        tokens (b, s) with a vocabulary, else hidden states (b, s, dim)."""
        at = pos if pos is not None else torch.arange(x.shape[1], device=x.device)
        cos, sin = self.cos[at], self.sin[at]  # (s, hd): broadcast over batch and heads
        if hasattr(self, "tok_embeddings"):
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x, cos, sin, pos)
        return self.output(self.norm(x)) if hasattr(self, "output") else x


def llama(cfg: Config, world: int, device, dtype=torch.float32, seed=0) -> Llama:
    """The model with random weights from `seed` (the same on every rank), std 1/sqrt(fan-in) so
    that activations stay O(1); its KV cache sized for `world` tensor-parallel ranks."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg, world)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=p.shape[1] ** -0.5)
    return model.to(dtype)


def tp_llama(cfg: Config, world: int, device, dtype=torch.float32, seed=0, sequence_parallel=False) -> Llama:
    """`llama`, parallelized over `world` ranks (each keeps its shard of the same weights). With
    `sequence_parallel`, torchtitan's plan: the residual stream and the norms sharded along the
    sequence (all-gathered before each block's projections, reduce-scattered after), the embedding
    and the head too (training only: a decode step has one position)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    device = torch.device(device)
    model = llama(cfg, world, device, dtype, seed)
    mesh = init_device_mesh(device.type, (world,))
    rows = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": rows,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": rows}
    if sequence_parallel:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                     desired_input_layouts=(Replicate(), None, None, None)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        if cfg.vocab:  # (without: the layers on hidden states, each rank's shard of the sequence)
            parallelize_module(model, mesh, {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def titan_llama(cfg: Config, device, tp, dp=None, dtype=torch.float32, seed=0) -> Llama:
    """`llama` parallelized as torchtitan's Llama 3 (its DTensor plan): sequence-parallel norms,
    PrepareModuleInput around attention and feed-forward, q/k/v column-parallel with DTensor
    outputs (use_local_output=False: RoPE on DTensors, the rotary tables made Replicate) and SDPA
    on each rank's heads through local_map, row-parallel o/down reduce-scattered to the sequence
    shards, the head's logits left vocabulary-sharded for loss_parallel(). The residual stream
    stays a sequence-sharded DTensor between the layers. `tp` is the TP mesh;
    with `dp` (a data-parallel mesh), FSDP2 on each layer and then the root. Compile per block."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import local_map
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    model = llama(cfg, 1, device, dtype, seed)
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    heads = local_map(F.scaled_dot_product_attention, out_placements=[Shard(1)], in_placements=([Shard(1)],) * 3,
                      device_mesh=tp)
    cols, rows = ColwiseParallel(use_local_output=False), RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate(), Replicate(), None),
                                            desired_input_layouts=(Replicate(), Replicate(), Replicate(), None)),
            "attention.wq": cols, "attention.wk": cols, "attention.wv": cols, "attention.wo": rows,
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": rows}
    for layer in model.layers:
        parallelize_module(layer, tp, plan)
        layer.attention.attend = heads
        if dp is not None:
            fully_shard(layer, mesh=dp)
    return model if dp is None else fully_shard(model, mesh=dp)


def fsdp_llama(cfg: Config, device, dtype=torch.float32, seed=0) -> Llama:
    """`llama` sharded over every rank by FSDP2: fully_shard on each layer, then on the root (its
    rotary tables and any embedding or head). Compile per block as torchtitan does,
    `layer.compile(...)` on each of `model.layers`: FSDP2's all-gathers and reduce-scatters then
    run in its hooks, around the compiled layers."""
    from torch.distributed.fsdp import fully_shard
    model = llama(cfg, 1, device, dtype, seed)
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)
