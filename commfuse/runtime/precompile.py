"""Compile a generated module's Triton kernels ahead of its first call, in parallel.

Triton compiles a kernel at its first launch, so a graph's first call compiles its kernels one
after the other. The wrapper lists every launch in the module's `_launches`; here each launch is
bound by its kernel's own JIT (`warmup`: the binder, specialization and option parsing a real
launch runs), with `_do_compile` stood in for to capture what it would pass to `triton.compile`.
Worker processes compile those into Triton's on-disk cache, where the first real launch, computing
the same key, finds them. The workers are plain subprocesses (runtime/compile_worker.py) with CUDA
hidden (the target comes from the parent): no CUDA context and no torch each, and the user's
`__main__` is not re-run as it would be by multiprocessing's spawn. Any failure is logged once at
debug level; its kernels then compile at their launch, as without this.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import inspect
import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading

from .. import config
from . import compile_worker
from .loader import interpreting

log = logging.getLogger(__name__)
TIMEOUT_S = 300  # most seconds for one kernel's compile, and for a first call to wait for its graph's
_pool = None
_logged: set = set()


def workers() -> int:
    """`config.compile_workers`; None: this host's CPUs shared among its ranks (LOCAL_WORLD_SIZE)."""
    if config.compile_workers is not None:
        return config.compile_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))


def warm() -> None:
    """Start the workers now, where CUDA is: the backend calls it at its entry, so that their
    interpreters start, and import torch and triton, while Dynamo's graph is traced and lowered,
    not when the first graph's kernels are ready."""
    import torch
    if torch.cuda.is_available():
        _current_pool()


def _current_pool() -> Pool | None:
    """The workers' pool, one for every graph; None on CPU or with compile_workers=0."""
    global _pool
    n = workers()
    if n <= 0 or interpreting():
        return None
    if _pool is None or _pool.n != n or _pool.pid != os.getpid():
        if _pool is not None:
            _pool.close()
        _pool = Pool(n)
    return _pool


def start(module) -> Pending | None:
    """Submit every kernel `module` launches; None where none is (CPU, compile_workers=0, failure)."""
    if not getattr(module, "_launches", None) or (pool := _current_pool()) is None:
        return None
    try:
        from triton.runtime import driver
        target = driver.active.get_current_target()  # as the JIT's binder gets it
        jobs = [job for launch in module._launches if (job := capture(*launch))]
        settings = triton_settings(target)
        return Pending([pool.submit((module.__file__, module.__name__, target, settings, job)) for job in jobs],
                       module._launches)
    except Exception as e:
        _failed(f"{type(e).__name__}: {e}")


def triton_settings(target) -> dict:
    """What a worker's Triton must see to compute this process's cache keys: the TRITON_* variables
    now, and the ptxas version this process's Triton read once and keeps (it hashes that one,
    even after a library sets TRITON_PTXAS_PATH to another ptxas, as Inductor does)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_") and k != "TRITON_INTERPRET"}
    version = None
    if target.backend == "cuda":
        try:
            from triton.backends.nvidia.compiler import get_ptxas_version
            version = get_ptxas_version(target.arch)
        except Exception:  # another Triton: the worker reads its own
            pass
    return {"env": env, "ptxas_version": version}


def capture(kernel, args, kwargs) -> tuple | None:
    """What `kernel[grid](*args, **kwargs)` would compile with: (kernel name, signature, constexprs,
    attrs, options), named by `_do_compile`'s own parameters; None if this process has it compiled."""
    seen = {}
    params = inspect.signature(type(kernel)._do_compile)

    def stand_in(*a, **kw):
        seen.update(params.bind(kernel, *a, **kw).arguments)  # returning None: nothing compiled, nothing cached

    kernel._do_compile = stand_in
    try:
        kernel.warmup(*args, grid=(1,), **kwargs)
    finally:
        del kernel._do_compile
    if not seen:
        return None
    return (kernel.__name__, seen["signature"], seen["constexprs"], seen["attrs"], dict(seen["options"].__dict__))


class Pending:
    """A graph's submitted kernels; its first call waits for them, then loads them."""

    def __init__(self, futures: list, launches: list = ()):
        self.futures, self.launches = futures, launches

    def wait(self) -> None:
        done, late = concurrent.futures.wait(self.futures, timeout=TIMEOUT_S)
        for why in {f.result() for f in done} - {None}:
            _failed(why)
        if late:
            _failed(f"{len(late)} kernel(s) not compiled after {TIMEOUT_S} s")
        load(self.launches)


def load(launches) -> None:
    """Load every kernel of `launches` onto the current device now, before the first is launched.
    Loaded at its first launch instead, each kernel took 160 ms on 2x H100 (the decode and
    training graphs of bench/model_tp.py), launches of a first call interleaved with loads."""
    for kernel, args, kwargs in launches:
        try:
            kernel.warmup(*args, grid=(1,), **kwargs)._init_handles()  # the JIT keeps it for the launch
        except Exception as e:  # it loads (or fails) at its launch instead
            _failed(f"loading {kernel.__name__}: {type(e).__name__}: {e}")


class Pool:
    """`n` compile workers, each fed by a daemon thread, so that interpreter exit never waits for a
    compile; the workers are killed at exit. Each starts at once (its imports take seconds), and
    one that crashes or times out is replaced."""

    def __init__(self, n: int):
        self.n, self.pid, self.closed = n, os.getpid(), False
        self.jobs, self.procs, self.lock = queue.SimpleQueue(), set(), threading.Lock()
        for _ in range(n):
            threading.Thread(target=self._feed, daemon=True, name="commfuse-compile").start()
        atexit.register(self.close)

    def submit(self, payload) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.jobs.put((payload, future))
        return future

    def _feed(self) -> None:
        try:
            proc = self._spawn()
        except Exception:
            proc = None  # tried again at its first job
        while (job := self.jobs.get()) is not None:
            payload, future = job
            try:
                if self.closed:
                    raise RuntimeError("closed")
                proc = proc if proc is not None and proc.poll() is None else self._spawn()
                pickle.dump(payload, proc.stdin)
                proc.stdin.flush()
                if not select.select([proc.stdout], [], [], TIMEOUT_S)[0]:
                    raise TimeoutError(f"no reply in {TIMEOUT_S} s")
                future.set_result(pickle.load(proc.stdout))  # None, or why it failed
            except Exception as e:
                self._end(proc)
                proc = None
                future.set_result(f"compile worker: {type(e).__name__}: {e}")
        self._end(proc)

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # this process's triton
        proc = subprocess.Popen([sys.executable, compile_worker.__file__],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        with self.lock:
            if not self.closed:
                self.procs.add(proc)
                return proc
        self._end(proc)  # closed while it started
        raise RuntimeError("closed")

    def _end(self, proc) -> None:
        if proc is not None:
            with self.lock:
                self.procs.discard(proc)
            proc.kill()
            proc.wait()

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child: the workers are its parent's
            return
        with self.lock:
            self.closed = True
        for _ in range(self.n):
            self.jobs.put(None)
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            self._end(proc)


def _failed(why: str) -> None:
    if why not in _logged:
        _logged.add(why)
        log.debug("commfuse: compiling kernels ahead of time failed (%s); they compile at their launch", why)
