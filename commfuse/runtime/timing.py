"""Timers of the all-reduce tuner (`commfuse.tune`), which the benchmarks share (bench/timing.py).

GPU times are medians of repetitions, taken between CUDA events (`median_us`): of a CUDA graph of
many calls replayed (GPU time, no host overhead); bench/timing.py adds loops of plain calls. When
a process group is up, the ranks start each repetition together (`start_together`), so that
collectives are timed together rather than waiting for a late rank."""
from __future__ import annotations

import torch
import torch.distributed as dist


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# GPU cycles (about 50 µs) that every rank idles after the device rendezvous while its host queues
# the timed work: all of it then starts when the sleep ends, at the same moment on every rank
RENDEZVOUS_SLEEP_CYCLES = 100_000
RENDEZVOUS_KERNELS = ("nccl", "spin_kernel")  # the names of its kernels, which profiles leave out


def start_together() -> None:
    """The ranks meet at a barrier and, under NCCL, on their GPUs too: a one-element all-reduce on
    the current stream, then a short sleep kernel. Work queued next starts at the same moment on
    every rank. After the host barrier alone the GPUs start as far apart as the hosts left it
    (up to hundreds of µs), and the first collective of the timed work waits out that skew."""
    barrier()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return
    dist.all_reduce(torch.zeros(1, device=torch.cuda.current_device()))
    torch.cuda._sleep(RENDEZVOUS_SLEEP_CYCLES)


def median_us(run, iters: int, reps: int) -> float:
    """Median over `reps` of the µs per call of `run()`, which makes `iters` calls, between events."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start_together()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def capture(fn, iters=100):
    """A CUDA graph of `iters` calls of `fn`, after warm-up calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph


def replay_time_us(graph, iters, reps=5) -> float:
    """Median µs per call of a graph of `iters` calls (`capture`), replayed `reps` times."""
    return median_us(graph.replay, iters, reps)


def cuda_graph_time_us(fn, iters=100, reps=5) -> float:
    """Median per-call µs of `fn` replayed from a CUDA graph of `iters` calls."""
    return replay_time_us(capture(fn, iters), iters, reps)


def interleaved_times_us(fns: dict, rounds=3, iters=100, failed=None) -> dict:
    """Per-call µs of each of `fns`, its best median over rounds that take them in turn: variants
    compared side by side see the same drift (clocks, the other ranks' skew). With a `failed`
    dict, one that cannot be captured is left out and its error put there instead of raised."""
    graphs, best = {}, {}
    for name, fn in fns.items():
        try:
            graphs[name] = capture(fn, iters)
        except Exception as e:
            if failed is None:
                raise
            failed[name] = e
    for _ in range(rounds):
        for name, graph in graphs.items():
            best[name] = min(best.get(name, float("inf")), replay_time_us(graph, iters))
    return best
