"""Small helpers shared by the launch/ examples: process group set-up, backend lookup, timing.

Every example runs both under `torchrun --nproc-per-node N` and as a plain `python` script (one rank,
a gloo group over a FileStore, so that collectives behave the same either way).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Import commfuse before anything imports triton (torch._dynamo does): on a machine without CUDA it
# selects Triton's interpreter, and triton reads that choice only once, when it is first imported.
try:
    import commfuse  # noqa: F401
except ImportError:  # not pip-installed: use the checkout this script is in
    sys.path.append(REPO_ROOT)
    try:
        import commfuse  # noqa: F401
    except ImportError:
        pass  # only an error if the commfuse backend is asked for (resolve_backend)


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    def print(self, *args) -> None:
        sys.stdout.write(" ".join([f"[rank{self.rank}]", *map(str, args)]) + "\n")  # one write per line
        sys.stdout.flush()

    def print0(self, *args) -> None:
        if self.rank == 0:
            print(*args, flush=True)


def init_distributed() -> Dist:
    """nccl on CUDA (device from LOCAL_RANK), gloo otherwise; a 1-rank FileStore group without torchrun."""
    use_cuda = torch.cuda.is_available() and os.environ.get("COMMFUSE_EXAMPLE_DEVICE", "") != "cpu"
    pg_backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(pg_backend, **kwargs)
    else:  # plain `python launch/...py`: one rank
        store = dist.FileStore(tempfile.mktemp(prefix="commfuse_store_"), 1)
        dist.init_process_group(pg_backend, store=store, rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def resolve_backend(name: str) -> str:
    """Return a torch.compile backend name, registering commfuse by hand if it is not pip-installed."""
    if name != "commfuse":
        return name
    from torch._dynamo.backends.registry import lookup_backend, register_backend

    try:
        lookup_backend(name)  # installed: found through the torch_dynamo_backends entry point
    except Exception:
        from commfuse.backend import commfuse_backend

        register_backend(compiler_fn=commfuse_backend, name=name)
    return name


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0
