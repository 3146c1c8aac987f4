"""Async tensor parallelism: an all-gather that feeds matmuls, and a matmul that feeds a
reduce-scatter, split into one chunk per rank so that each chunk's transfer overlaps a matmul.

`all_gather_mm`: each rank puts its shard in its workspace; after a barrier, a side stream copies
the peers' shards into the gathered tensor (the copy engine: no SMs taken from the matmuls), one
peer at a time, while the current stream multiplies the chunks that have arrived, its own first.
`mm_reduce_scatter`: the rows that peer j owns are multiplied first, and the side stream pushes
the partial product into peer j's workspace at this rank's slot while the next chunk multiplies;
the own chunk comes last, written in place; after a barrier each rank adds up its slots.
Each op opens with a barrier too: no rank writes a workspace that a peer may still read.

The workspace is a symmetric pool of its own per group (`shared_pools`, tag "async_tp"), as large
as the largest op so far; the barriers are the comm kernels' (runtime/barrier.py): bounded, and a
missing rank is named. On a CPU the same steps run in order over the shared-memory emulation.
The ops are in the `commfuse_comm` namespace: `ir.meets_ranks` holds them for ops that meet
other ranks, which no collective may cross.
"""
from __future__ import annotations

import torch

from .barrier import barrier_kernel
from .loader import interpreting, load_module
from .symm import shared_pools

TAG = "async_tp"
_barriers: dict = {}
_side_streams: dict = {}


def _workspace(group_name: str, device, nbytes: int):
    pool = shared_pools.get(group_name, device, nbytes, TAG)
    _check(pool, group_name, start=True)
    return pool


def _check(pool, group_name: str, start: bool) -> None:
    """Raise the error of a barrier that gave up (on a GPU, learnt a call or two late)."""
    what = f"an async-TP op (all-gather + matmul or matmul + reduce-scatter) of group {group_name}"
    err = pool.failure(lambda: (what, what), start)
    if err is not None:
        raise err


def _barrier(pool, group_name: str) -> None:
    world = pool.world_size
    if world not in _barriers:
        _barriers[world] = load_module(barrier_kernel(world, inline_ptx=not interpreting()), {})[0].cf_barrier
    _barriers[world][(1,)](*pool.signals, pool.signals[pool.rank], pool.rank, num_warps=1)
    if pool.device.type != "cuda":  # the interpreter knows at once
        _check(pool, group_name, start=False)


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _peer_rows(pool, peer: int, rows: int, k: int, dtype) -> torch.Tensor:
    return pool.peer_views(0, rows * k, dtype)[peer].view(rows, k)


@torch.library.custom_op("commfuse_comm::all_gather_mm", mutates_args=())
def all_gather_mm(shard: torch.Tensor, weights: list[torch.Tensor], group_name: str,
                  world: int) -> list[torch.Tensor]:
    """[gathered, gathered_2d @ w for w in weights]: `gathered` is all_gather_into_tensor(shard)
    (the ranks' shards along dim 0), gathered_2d its view as rows of its last dim."""
    k = shard.shape[-1]
    rows = shard.numel() // k
    gathered = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
    chunks = gathered.view(world, rows, k)
    outs = [shard.new_empty((world, rows, w.shape[1])) for w in weights]
    pool = _workspace(group_name, shard.device, shard.nbytes)
    rank = pool.rank
    _barrier(pool, group_name)  # no peer still copies our previous shard
    pool.view(0, (rows, k), (k, 1), shard.dtype).copy_(shard.reshape(rows, k))
    chunks[rank].copy_(shard.reshape(rows, k))
    _barrier(pool, group_name)  # every shard is in place
    order = [(rank + i) % world for i in range(world)]
    cuda = shard.device.type == "cuda"
    if cuda:
        current, side = torch.cuda.current_stream(shard.device), _side_stream(shard.device)
        side.wait_stream(current)
        arrived = {}
        with torch.cuda.stream(side):
            for j in order[1:]:
                chunks[j].copy_(_peer_rows(pool, j, rows, k, shard.dtype))
                arrived[j] = torch.cuda.Event()
                arrived[j].record(side)
    for j in order:
        if not cuda and j != rank:
            chunks[j].copy_(_peer_rows(pool, j, rows, k, shard.dtype))
        elif cuda and j != rank:
            current.wait_event(arrived[j])
        for w, out in zip(weights, outs):
            torch.mm(chunks[j], w, out=out[j])
    if cuda:
        current.wait_stream(side)
    return [gathered] + [o.view(world * rows, -1) for o in outs]


@all_gather_mm.register_fake
def _(shard, weights, group_name, world):
    rows = world * shard.numel() // shard.shape[-1]
    return [shard.new_empty((world * shard.shape[0], *shard.shape[1:]))] + \
        [shard.new_empty((rows, w.shape[1])) for w in weights]


def _products(chunks: list, weights: list, j: int, out: torch.Tensor) -> torch.Tensor:
    torch.mm(chunks[0][j], weights[0], out=out)
    for c, w in zip(chunks[1:], weights[1:]):
        out.addmm_(c[j], w)
    return out


@torch.library.custom_op("commfuse_comm::mm_reduce_scatter", mutates_args=())
def mm_reduce_scatter(a: list[torch.Tensor], weights: list[torch.Tensor], reduce_op: str, group_name: str,
                      world: int) -> torch.Tensor:
    """reduce_scatter_tensor(sum of a[i] @ weights[i]) along dim 0, "sum" or "avg": the rows of
    each a[i] in the order the scatter deals them, rank r's block r."""
    m, n, dtype = a[0].shape[0] // world, weights[0].shape[1], a[0].dtype
    pool = _workspace(group_name, a[0].device, world * m * n * dtype.itemsize)
    rank = pool.rank
    chunks = [x.view(world, m, x.shape[1]) for x in a]
    slots = pool.view(0, (world, m, n), (m * n, n, 1), dtype)  # slot p: peer p's partial of our rows
    peer_slot = lambda j: pool.peer_views(0, world * m * n, dtype)[j].view(world, m, n)[rank]  # noqa: E731
    order = [(rank + i) % world for i in range(1, world)]  # the peers' chunks, then the own
    _barrier(pool, group_name)  # every peer has added up its slots of the previous op
    partial = a[0].new_empty((world, m, n))
    if a[0].device.type == "cuda":
        current, side = torch.cuda.current_stream(a[0].device), _side_stream(a[0].device)
        for j in order:
            _products(chunks, weights, j, partial[j])
            side.wait_stream(current)
            with torch.cuda.stream(side):
                peer_slot(j).copy_(partial[j])
        _products(chunks, weights, rank, slots[rank])
        current.wait_stream(side)
    else:
        for j in order:
            peer_slot(j).copy_(_products(chunks, weights, j, partial[j]))
        _products(chunks, weights, rank, slots[rank])
    _barrier(pool, group_name)  # every partial has arrived
    out = slots.sum(0, dtype=torch.float32)
    return (out / world if reduce_op == "avg" else out).to(dtype)


@mm_reduce_scatter.register_fake
def _(a, weights, reduce_op, group_name, world):
    return a[0].new_empty((a[0].shape[0] // world, weights[0].shape[1]))
