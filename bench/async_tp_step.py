"""Async-TP in a sequence-parallel training step: commfuse with `comm.async_tp` off and on, on one
model (bench/llama.py's Llama-3-8B-shaped layers under torchtitan's sequence-parallel plan, B=2).

Per variant, the worst rank's:
- error: max abs difference of the loss and every parameter's gradient (the full tensors) from an
  fp32 run of the same weights and input; bf16 eager's own error is the yardstick, so a variant is
  judged against the exact values rather than against eager's rounding;
- ms per step (CUDA events, a loop of 10 steps, median of 3) and host ms per step (one step from an
  idle GPU: near the step time, the step is host-bound);
- from torch.profiler over 3 steps: the GPU busy time per step, and the time in the ops' barriers
  (`cf_barrier`: a rank waiting there waits for a late peer) and peer copies.

    torchrun --standalone --nproc-per-node 2 bench/async_tp_step.py [--seq 1024] [--out bench/results/x.md] [--host-profile]
    torchrun --standalone --nproc-per-node 2 bench/async_tp_step.py --cpu   # smoke check (gloo, tiny)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
import commfuse  # noqa: E402,F401  (before triton: Triton's interpreter on CPU)
from commfuse import config  # noqa: E402
from commfuse.runtime import async_tp  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import timing  # noqa: E402
from bench.common import run_meta, write_results  # noqa: E402
from bench.llama import Config, tp_llama  # noqa: E402
from bench.model_tp import SequenceParallelLayers  # noqa: E402

FULL = dict(dim=4096, n_heads=32, n_kv_heads=8, ffn=14336, n_layers=4, seq=1024)
TINY = dict(dim=64, n_heads=4, n_kv_heads=2, ffn=128, n_layers=2, seq=8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, tiny layers, fp32 (a smoke check)")
    ap.add_argument("--out", help="write the table here (and its .json beside)")
    ap.add_argument("--seq", type=int, help="sequence length (default 1024; 8 with --cpu)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also print rank 0's torch.profiler rows of most self CPU time per step, for each variant")
    a = ap.parse_args()
    cuda = not a.cpu
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = dict(TINY if a.cpu else FULL)
    seq = a.seq or shape["seq"]
    del shape["seq"]
    cfg = Config(**shape, max_batch=1, max_seq=seq)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = tp_llama(cfg, world, dev, dtype, sequence_parallel=True)
    exact = tp_llama(cfg, world, dev, dtype, sequence_parallel=True).to(torch.float32)  # the same weights
    torch.manual_seed(4 + rank)  # each rank its own positions of the sequence
    x = torch.randn(2, seq // world, cfg.dim, device=dev, dtype=dtype)

    def step(fn, module, inp, check=True):  # (checked: the gradients gathered whole, not timed)
        loss = fn(inp).float().pow(2).mean()
        loss.backward()
        grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in module.parameters()] if check else []
        module.zero_grad(set_to_none=True)
        return [loss.detach()] + grads

    want = step(SequenceParallelLayers(exact, world), exact, x.float())
    del exact

    def error(got) -> float:
        return max((g.float() - w).abs().max().item() for g, w in zip(got, want))

    layers = SequenceParallelLayers(model, world)
    res = {"eager": {"error vs fp32": error(step(layers, model, x))}}
    # async-TP's ops launched from Python each call, then replaying their CUDA graphs (comm.async_tp_graphs)
    for name, mode, graphs in (("off", "off", True), ("on, launched", "on", False), ("on", "on", True)):
        torch._dynamo.reset()
        with config.patch({"comm.async_tp_graphs": graphs}):
            fn = torch.compile(layers, backend="commfuse", dynamic=False, options={"comm.async_tp": mode})
            step(fn, model, x)  # compiles
            r = res[f"commfuse, async-TP {name}"] = {"error vs fp32": error(step(fn, model, x))}
            if cuda:
                r["ms/step"] = timing.loop_time_us(lambda: step(fn, model, x, False), iters=10, reps=3) / 1e3
            r["host ms/step"] = timing.host_time_us(lambda: step(fn, model, x, False), dev, iters=1, reps=5) / 1e3
            r.update(_profiled(lambda: step(fn, model, x, False), dev))
            calls = async_tp._replays.replayed + async_tp._replays.launched
            r["async-TP ops replayed, % of calls"] = 100 * async_tp._replays.replayed / calls if calls else -1
            if rank == 0:
                print(f"{name}: {async_tp._replays.replayed} replays, {async_tp._replays.launched} launched, "
                      f"{len(async_tp._replays.graphs)} graphs, {len(async_tp._replays.seen)} keys seen once or twice", flush=True)
            async_tp._replays.replayed = async_tp._replays.launched = 0
            if a.host_profile:
                _host_profile(f"async-TP {name}", lambda: step(fn, model, x, False), dev, rank)
    rows = sorted({k for r in res.values() for k in r}, key=lambda k: (k != "error vs fp32", k))  # (one order on every rank)
    worst = torch.tensor([[r.get(k, float("nan")) for k in rows] for r in res.values()], dtype=torch.float64, device=dev)
    dist.all_reduce(worst.nan_to_num_(-1.0), dist.ReduceOp.MAX)  # (every figure: larger is worse)
    names = list(res)
    table = "\n".join([f"Sequence-parallel step, {cfg.n_layers} layers of H {cfg.dim}, F {cfg.ffn}, B=2, S={seq}, {dtype}, "
                       f"world {world}, {torch.cuda.get_device_name(dev) if cuda else 'CPU (gloo)'}; the worst rank's figures", "",
                       "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"] +
                      [f"| {k} | " + " | ".join("—" if v < 0 else (f"{v:.2e}" if k.startswith("error") else f"{v:.2f}")
                                               for v in worst[:, i].tolist()) + " |" for i, k in enumerate(rows)]) + "\n"
    if rank == 0:
        write_results(a.out, table, {"meta": run_meta(torch.cuda.get_device_name(dev) if cuda else "CPU", None),
                                     "world": world, "results": dict(zip(names, [dict(zip(rows, w)) for w in worst.tolist()]))})
    dist.destroy_process_group()
    return 0


STEPS = 3  # profiled steps


def _events(step, dev, activities: list):
    """torch.profiler's averages over STEPS steps, started with the ranks together."""
    from torch.profiler import profile
    timing.sync(dev)
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        timing.sync(dev)
    return prof.key_averages()


def _profiled(step, dev) -> dict:
    """GPU busy, barrier and peer-copy ms per step."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity
    events = _events(step, dev, [ProfilerActivity.CUDA])

    def ms(pick) -> float:
        return sum(e.device_time_total for e in events if pick(e.key)) / (STEPS * 1e3)
    return {"GPU busy ms/step": ms(lambda k: True), "barrier ms/step": ms(lambda k: "cf_barrier" in k),
            "peer copies ms/step": ms(lambda k: "Memcpy PtoP" in k)}


def _host_profile(title: str, step, dev, rank: int, rows: int = 16) -> None:
    """Where the host's time goes: per step, the self CPU time of each op (an op's own Python
    between its aten calls counts as its self time)."""
    from torch.profiler import ProfilerActivity
    events = _events(step, dev, [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (dev.type == "cuda"))
    if rank == 0:
        events = sorted(events, key=lambda e: -e.self_cpu_time_total)
        print(f"== {title}: self CPU ms per step {sum(e.self_cpu_time_total for e in events) / (STEPS * 1e3):.2f}")
        for e in events[:rows]:
            print(f"  {e.self_cpu_time_total / (STEPS * 1e3):7.3f} ms  x{e.count / STEPS:6.1f}  "
                  f"{e.self_cpu_time_total / max(e.count, 1):8.1f} µs/call  {e.key[:90]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
