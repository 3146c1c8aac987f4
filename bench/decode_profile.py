"""Where a tensor-parallel decode step (bench/llama.py's layers, as bench/model_tp.py times them)
spends its GPU time, kernel by kernel, under torch.profiler: every copy (DtoD memcpy, copy kernel)
and aten index kernel stands out, with the generated code beside it (COMMFUSE_DUMP_DIR).

    torchrun --standalone --nproc-per-node 2 bench/decode_profile.py --dump /tmp/decode_dump
    torchrun --standalone --nproc-per-node 2 bench/decode_profile.py --set decode_attention=True
    torchrun --standalone --nproc-per-node 1 bench/decode_profile.py --cpu   # checks the script

Rank 0 prints µs and launches per step of each kernel, largest first, the kind of each (copy,
aten index, generated, gemm, attention, other), and the step's total per kind.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import commfuse_options  # noqa: E402
from bench.llama import Config, tp_llama  # noqa: E402
from bench.profile_model import kind_of, profile_step  # noqa: E402


def kind(name: str) -> str:
    low = name.lower()
    return "aten index" if "index" in low and not low.startswith("cf_") else kind_of(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dump", help="write the generated code here (commfuse's dump_dir)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a commfuse option")
    a = ap.parse_args()
    options = commfuse_options(ap, a.set) | ({"dump_dir": a.dump} if a.dump else {})
    dist.init_process_group("gloo" if a.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.cpu:
        dev, dtype = torch.device("cpu"), torch.float32
        a.hidden, a.heads, a.kv_heads, a.ffn, a.cache, a.layers, a.batch = 64, 8, 4, 64, 32, 2, 2
    else:
        dev, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(dev)
    cfg = Config(dim=a.hidden, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn=a.ffn, n_layers=a.layers,
                 max_batch=a.batch, max_seq=a.cache)
    model = tp_llama(cfg, world, dev, dtype)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if "cache" in n:
                b.copy_(torch.randn_like(b))
    fn = torch.compile(model, backend="commfuse", dynamic=False, options=options)
    x, pos = torch.randn(a.batch, 1, a.hidden, device=dev, dtype=dtype), torch.tensor([a.cache - 1], device=dev)

    def step():
        with torch.no_grad():
            fn(x, pos)
    for _ in range(3):
        step()

    def synced():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        step()
    table = profile_step(synced, a.steps, dev.type)
    if rank == 0:
        totals = {}
        print(f"decode step, world {world}, B={a.batch}, cache {a.cache}, {a.layers} layers, options {options}")
        print(f"{'µs/step':>9} {'launches':>8}  {'kind':10s} kernel")
        for name, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            totals[kind(name)] = totals.get(kind(name), 0.0) + us
            print(f"{us:9.1f} {n:8.1f}  {kind(name):10s} {name[:110]}")
        print("per kind: " + ", ".join(f"{k} {v:.1f} µs" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
