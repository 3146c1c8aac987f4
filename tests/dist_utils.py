"""Run a test body on N ranks (one process each: NCCL on GPUs when there are enough, else gloo
on CPU) and collect each rank's result."""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What the forkserver of CPU ranks imports once, so that no rank imports it again: torch, and what
# a rank's first compile imports (AOTAutograd, Inductor's cache and codegen modules, Triton in the
# interpreter mode the parent chose, DTensor): seconds of CPU per rank per spawn otherwise. None of
# it reads the environment a rank is given; commfuse (its config does) is imported in the rank.
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
    "torch._inductor.codecache", "torch._inductor.select_algorithm", "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.async_compile", "torch.distributed._functional_collectives", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel", "triton", "triton.language", "networkx", "jinja2"]

# The world size of the multi-rank tests written for any number of ranks (they pass it to
# run_ranks): 2 by default, as on CPU and in CI; COMMFUSE_TEST_WORLD=8 on an 8-GPU host.
WORLD = int(os.environ.get("COMMFUSE_TEST_WORLD", "2"))


def use_cuda(world: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world


def device() -> torch.device:
    """The device of this rank: its own GPU under NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _worker(rank, world, init_file, fn, args, results, env):
    os.environ.clear()  # the caller's environment, as a spawned rank would have it
    os.environ.update(env)
    os.environ.setdefault("COMMFUSE_FALLBACK_ON_ERROR", "0")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import commfuse  # noqa: F401  (Triton's interpreter on CPU)
    backend = "nccl" if use_cuda(world) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def skip_unless_ranks(world: int) -> None:
    """Skip the test where `world` ranks cannot run: a GPU machine with fewer GPUs."""
    if torch.cuda.is_available() and not use_cuda(world):
        import pytest
        pytest.skip(f"needs {world} GPUs (CPU ranks need Triton's interpreter, off on a GPU machine)")


def run_ranks(fn, world: int = 2, args=(), timeout: float = 300) -> list:
    """fn(rank, world, *args) on `world` ranks; returns their results, raising the first failure."""
    skip_unless_ranks(world)
    if use_cuda(world):
        ctx = mp.get_context("spawn")  # fresh interpreters: CUDA does not survive a fork once initialized
    else:
        # CPU ranks are forks of a server that imported torch once: a fresh interpreter per rank
        # costs seconds of CPU each, most of an 8-rank test on a small machine. commfuse itself is
        # imported in the rank, after its environment is set.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as d, ctx.Manager() as manager:
        results = manager.dict()
        init, env = os.path.join(d, "init"), dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world, init, fn, args, results, env)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank did not finish in {timeout}s")
        out = [results.get(r, ("error", "no result (crashed)")) for r in range(world)]
    for r, (status, value) in enumerate(out):
        if status != "ok":
            raise AssertionError(f"rank {r} failed:\n{value}")
    return [v for _, v in out]


def _key(check) -> str:
    fn, args = check if isinstance(check, tuple) else (check, ())
    return f"{fn.__module__}.{fn.__name__}{tuple(args)!r}"


def _checks(rank, world, checks):
    out = {}
    for check in checks:
        fn, args = check if isinstance(check, tuple) else (check, ())
        torch._dynamo.reset()
        try:
            out[_key(check)] = ("ok", fn(rank, world, *args))
        except BaseException:
            out[_key(check)] = ("error", traceback.format_exc())
    return out


class SharedRanks:
    """Several checks, fn(rank, world, *args) each (given as fn or (fn, args)), run one after
    another in a single spawn of `world` ranks, Dynamo reset between them: a spawn costs seconds of
    process start and first-compile imports per rank. `result(fn, *args)` is that check's result
    on every rank, raising where it failed. The checks share the process group and its pool, as the
    graphs of one program do; a check that fails on some ranks only can fail the ones after it:
    read the first failure. The spawn runs at the first result(), in the environment of that time."""

    def __init__(self, checks, world: int = 2, timeout: float = 600):
        self.checks, self.world, self.timeout, self._results = list(checks), world, timeout, None

    def result(self, fn, *args) -> list:
        if self._results is None:
            self._results = run_ranks(_checks, self.world, args=(self.checks,), timeout=self.timeout)
        out = [r[_key((fn, args))] for r in self._results]
        for r, (status, value) in enumerate(out):
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
        return [v for _, v in out]
