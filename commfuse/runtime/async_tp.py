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

import collections
import warnings

import torch

from .. import config
from .barrier import barrier_kernel
from .launch import Site
from .loader import interpreting, load_module
from .symm import shared_pools

TAG = "async_tp"
# Host time matters: an op's GPU work is about 100 µs at a Llama-8B layer's sequence-parallel sizes,
# so what can be made once is (the barrier's bound launcher, events, the pool's views per shape).
_barriers: dict = {}
_side_streams: dict = {}
_events: dict = {}
_views: dict = {}


def _workspace(group_name: str, device, nbytes: int, timeout_s: float | None):  # (the compile's barrier_timeout_s)
    pool = shared_pools.get(group_name, device, nbytes, TAG)
    if timeout_s is not None and pool.timeout_s != timeout_s:  # as a graph's pools (symm.CommState)
        pool.set_barrier_timeout(timeout_s)
    _check(pool, group_name, start=True)
    return pool


def _check(pool, group_name: str, start: bool) -> None:
    """Raise the error of a barrier that gave up (on a GPU, learnt a call or two late)."""
    what = lambda: (f"an async-TP op (all-gather + matmul, or matmul + reduce-scatter) of group {group_name}",) * 2  # noqa: E731
    err = pool.failure(what, start)
    if err is not None:
        raise err


def _barrier(pool, group_name: str) -> None:
    key = (pool.world_size, pool.device)
    if key not in _barriers:
        source = barrier_kernel(pool.world_size, inline_ptx=not interpreting())
        _barriers[key] = Site(load_module(source, {})[0].cf_barrier, {"num_warps": 1})
    cuda = pool.device.type == "cuda"
    stream = torch._C._cuda_getCurrentRawStream(pool.device.index) if cuda else None
    _barriers[key](stream, (1, 1, 1), *pool.signals, pool.signals[pool.rank], pool.rank)
    if not cuda:  # the interpreter knows at once
        _check(pool, group_name, start=False)


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _event(device: torch.device, peer: int):  # one per peer, reused: an issued wait keeps its record
    if (device, peer) not in _events:
        _events[device, peer] = torch.cuda.Event()
    return _events[device, peer]


class _Replays:
    """An op's launches recorded once as a CUDA graph and replayed, keyed by every address and
    layout they touch: the op's tensors (inputs, outputs, scratch, all allocated before) and its
    pool. Launched from Python, one op costs 200-400 µs of host time against about 80 µs on the
    GPU (2x H200, bench/results/atp_host_2xh200_67a6bf8.txt), so a training step of them is
    host-bound; a training loop's allocator hands a call the same addresses step after step, and
    one replay costs about 10. The second call with a key runs on the capture stream (its cuBLAS
    workspace then exists before any capture), the third is captured. Not inside another capture
    (a `cuda_graphs` graph records the launches itself), nor off CUDA."""
    LIMIT = 256  # graphs kept (least recently replayed dropped): they hold no memory of their own

    def __init__(self):
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: dict = {}
        self.streams: dict = {}
        self.broken = False  # a capture failed: plain launches from then on
        self.replayed = self.launched = 0  # calls so far (bench/async_tp_step.py reports the share)

    def run(self, pool, tensors: tuple, launches, *what) -> None:
        """`launches()`, or its graph's replay; `what`: the other values the launches depend on."""
        device = pool.device
        if (device.type != "cuda" or self.broken or not config.comm.async_tp_graphs
                or torch.cuda.is_current_stream_capturing()):
            self.launched += 1
            return launches()
        key = (id(pool), pool.local.data_ptr(), pool.nbytes, launches.__code__, *what) + tuple(
            (t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors)
        graph = self.graphs.get(key)
        if graph is None:
            calls = self.seen[key] = self.seen.get(key, 0) + 1
            self.launched += 1
            if calls == 1:
                return launches()
            if len(self.seen) > 4 * self.LIMIT:  # addresses that never repeat
                self.seen.clear()
            graph = self._record(device, launches, capture=calls > 2)
            if graph is None:
                return None
            self.seen.pop(key, None)
            self.graphs[key] = graph
            if len(self.graphs) > self.LIMIT:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        self.replayed += 1
        graph.replay()
        return None

    def _record(self, device, launches, capture: bool):
        """On this device's capture stream: the launches run (capture False: None), or recorded
        (the graph; None after a failed capture, which turns replays off)."""
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.graph_pool_handle())
        stream, mempool = self.streams[device]
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph() if capture else None
        try:
            with torch.cuda.stream(stream):
                if graph is None:
                    launches()
                else:
                    graph.capture_begin(pool=mempool, capture_error_mode="thread_local")
                    try:
                        launches()
                    finally:
                        graph.capture_end()
        except Exception as e:  # noqa: BLE001 - a capture the driver refused: launch as before
            if graph is None:
                raise
            self.broken, graph = True, None
            warnings.warn(f"commfuse: async-TP ops run without CUDA graphs: capturing one failed ({e})")
            with torch.cuda.stream(stream):
                launches()
        current.wait_stream(stream)
        return graph


_replays = _Replays()


def _pool_views(pool, key: tuple, make):
    """The views `make(pool)` of this pool for `key`, made once (again after the pool grew)."""
    hit = _views.get(key)
    if hit is None or hit[0] is not pool:
        hit = _views[key] = (pool, make(pool))
    return hit[1]


@torch.library.custom_op("commfuse_comm::all_gather_mm", mutates_args=())
def all_gather_mm(shard: torch.Tensor, weights: list[torch.Tensor], group_name: str, world: int,
                  barrier_timeout_s: float | None) -> list[torch.Tensor]:
    """[gathered, gathered_2d @ w for w in weights]: `gathered` is all_gather_into_tensor(shard)
    (the ranks' shards along dim 0), gathered_2d its view as rows of its last dim."""
    k = shard.shape[-1]
    rows = shard.numel() // k
    gathered = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
    chunks = gathered.view(world, rows, k)
    outs = [shard.new_empty((world, rows, w.shape[1])) for w in weights]
    pool = _workspace(group_name, shard.device, shard.nbytes, barrier_timeout_s)
    rank, own = pool.rank, shard.reshape(rows, k)
    mine, theirs = _pool_views(pool, ("ag", rows, k, shard.dtype), lambda p: (
        p.view(0, (rows, k), (k, 1), shard.dtype), [v.view(rows, k) for v in p.peer_views(0, rows * k, shard.dtype)]))

    def launches():
        _barrier(pool, group_name)  # no peer still copies our previous shard
        mine.copy_(own)
        chunks[rank].copy_(mine)
        _barrier(pool, group_name)  # every shard is in place
        order = [(rank + i) % world for i in range(world)]
        cuda = shard.device.type == "cuda"
        if cuda:
            current, side = torch.cuda.current_stream(shard.device), _side_stream(shard.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for j in order[1:]:
                    chunks[j].copy_(theirs[j])
                    _event(shard.device, j).record(side)
        for j in order:
            if j != rank:
                current.wait_event(_event(shard.device, j)) if cuda else chunks[j].copy_(theirs[j])
            for w, out in zip(weights, outs):
                torch.mm(chunks[j], w, out=out[j])
        if cuda:
            current.wait_stream(side)
    _replays.run(pool, (own, *weights, gathered, *outs), launches)
    return [gathered] + [o.view(world * rows, -1) for o in outs]


@all_gather_mm.register_fake
def _(shard, weights, group_name, world, barrier_timeout_s):
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
                      world: int, barrier_timeout_s: float | None) -> torch.Tensor:
    """reduce_scatter_tensor(sum of a[i] @ weights[i]) along dim 0, "sum" or "avg": the rows of
    each a[i] in the order the scatter deals them, rank r's block r."""
    m, n, dtype = a[0].shape[0] // world, weights[0].shape[1], a[0].dtype
    pool = _workspace(group_name, a[0].device, world * m * n * dtype.itemsize, barrier_timeout_s)
    rank = pool.rank
    chunks = [x.reshape(world, m, x.shape[1]) for x in a]  # (a transposed operand: copied)
    # slots[p]: peer p's partial of our rows; theirs[j]: our slot in peer j's workspace
    slots, theirs = _pool_views(pool, ("rs", world, m, n, dtype), lambda p: (
        p.view(0, (world, m, n), (m * n, n, 1), dtype),
        [v.view(world, m, n)[rank] for v in p.peer_views(0, world * m * n, dtype)]))
    order = [(rank + i) % world for i in range(1, world)]  # the peers' chunks, then the own
    partial, total = a[0].new_empty((world, m, n)), a[0].new_empty((m, n), dtype=torch.float32)
    out = a[0].new_empty((m, n))

    def launches():
        _barrier(pool, group_name)  # every peer has added up its slots of the previous op
        if a[0].device.type == "cuda":
            current, side = torch.cuda.current_stream(a[0].device), _side_stream(a[0].device)
            for j in order:
                _products(chunks, weights, j, partial[j])
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    theirs[j].copy_(partial[j])
            _products(chunks, weights, rank, slots[rank])
            current.wait_stream(side)
        else:
            for j in order:
                theirs[j].copy_(_products(chunks, weights, j, partial[j]))
            _products(chunks, weights, rank, slots[rank])
        _barrier(pool, group_name)  # every partial has arrived
        torch.sum(slots, 0, dtype=torch.float32, out=total)
        out.copy_(total.div_(world) if reduce_op == "avg" else total)
    _replays.run(pool, (*chunks, *weights, partial, total, out), launches, reduce_op)
    return out


@mm_reduce_scatter.register_fake
def _(a, weights, reduce_op, group_name, world, barrier_timeout_s):
    return a[0].new_empty((a[0].shape[0] // world, weights[0].shape[1]))
