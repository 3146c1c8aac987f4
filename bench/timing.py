"""The benchmarks' timers: the all-reduce tuner's (commfuse.runtime.timing) and two of their own."""
from __future__ import annotations

import time

from commfuse.runtime.timing import (RENDEZVOUS_KERNELS, barrier, capture, cuda_graph_time_us, interleaved_times_us,  # noqa: F401
                                      median_us, start_together, sync)


def wall_time_s(fn, device) -> float:
    """Seconds of one call of `fn`, its device work included (a first call: compile time)."""
    sync(device)
    barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def loop_time_us(fn, iters=200, reps=5, warmup=5) -> float:
    """Median µs per call of `fn` called in a loop of `iters`, as a user's loop calls it."""
    for _ in range(warmup):
        fn()

    def run():
        for _ in range(iters):
            fn()
    return median_us(run, iters, reps)


def host_time_us(fn, device, iters=200, reps=3) -> float:
    """Median µs of host time per call of `fn` in a loop, not waiting for the device: above the
    per-call time's share of device work, the loop is host-bound."""
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    sync(device)
    return sorted(times)[len(times) // 2]
