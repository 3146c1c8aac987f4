"""Host time per call of the tensor-parallel decode step (bench/model_tp.py's model) compiled by one
variant alone in its process, beside Dynamo alone: the same model compiled with a backend that
returns a cached output, so that its time is Dynamo's guards and frame handling only. What a
variant adds above that is its own (AOTAutograd's wrappers, the backend's call, a CUDA graph's
replay). On rank 0, each one's top functions by self time (cProfile) follow.

    torchrun --standalone --nproc-per-node 2 bench/decode_host.py [--variant "commfuse cuda_graphs"]
    torchrun --standalone --nproc-per-node 2 bench/decode_host.py --cpu --tiny   # checks the script

A user's loop compiles one model once; bench/model_tp.py compiles every variant on one model in one
process, their cache entries all on the model's forward. A loop of one variant's calls still runs
its own guards only (Dynamo moves the entry a call hits to the front, and passes over another
backend's entry before its guards): the same calls as here, their time up to host noise.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.model_tp import FULL, TINY, VARIANTS, build, compile_options  # noqa: E402
from bench.timing import host_time_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="commfuse cuda_graphs", choices=[v for v in VARIANTS if v != "eager"])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=20, help="functions listed per cProfile")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (checks the script)")
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions")
    ap.add_argument("--dtensor", action="store_true",
                    help="on one rank too, the TP model's DTensor parameters (their guards) over a mesh of 1")
    a = ap.parse_args()
    for k, v in (TINY if a.tiny else FULL).items():
        setattr(a, k, v)
    a.dtype = torch.float32 if a.cpu else torch.bfloat16
    calls = 3 if a.cpu else a.calls
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=dev)
    model = build(a, dist.get_world_size(), dev, dtensor=a.dtensor)
    x = torch.randn(a.batch, 1, a.hidden, device=dev, dtype=a.dtype)
    pos = torch.tensor([a.cache // 2], device=dev)  # the middle of the cache, as model_tp.py's
    with torch.no_grad():
        cached = model(x, pos)
    lines = []
    for name in (a.variant, "Dynamo alone"):
        torch._dynamo.reset()  # alone in the process: no other variant's cache entries
        fn = torch.compile(model, backend=lambda gm, example: (lambda *args: (cached,)), dynamic=False) \
            if name == "Dynamo alone" else torch.compile(model, **compile_options(name))
        with torch.no_grad():
            for _ in range(2 if a.cpu else 20):  # compile, record, replays
                fn(x, pos)
            dist.barrier()
            us = host_time_us(lambda: fn(x, pos), dev, iters=calls)
            prof = cProfile.Profile()
            prof.enable()
            host_time_us(lambda: fn(x, pos), dev, iters=calls, reps=1)
            prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
        body = [line[:160] for line in text.getvalue().splitlines() if line.strip()][3:]
        lines += [f"== {name}: host µs per call {us:.1f}", *body, ""]
        dist.barrier()
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
