"""Decode attention (one query token per sequence over a static bf16 KV cache, GQA) on one GPU:
commfuse's split-KV kernel against aten's SDPA backends, GPU time per call under CUDA graphs,
variants interleaved, with each one's ratio to commfuse's time and its read bandwidth (the K/V
bytes SDPA over the whole cache reads, over the time).

    python bench/decode_attention.py [--out bench/results/decode_attention.md]
    python bench/decode_attention.py --cpu      # a smoke run (Triton's interpreter, tiny sizes)
    python bench/decode_attention.py --blocks --batches 8 --lengths 8192 --head-dims 64   # tune its blocks

Rows: B in {1, 8}, cache lengths 512 to 32k, head dims 128 (Llama-3-8B) and 64 (Llama-3.2-1B),
Llama-3-8B's heads (32 query / 8 KV) and one tensor-parallel rank's share at world 2 (16 / 4); the
position is the cache's last (`full`) or its middle (`half`: keys after it masked; our kernel reads
up to it, aten's read the whole cache). Under the table: per (head dim, GQA group), the batches and
cache lengths at which commfuse beat aten's own choice at both positions, as entries for
`commfuse.choices.DECODE_ATTENTION_WINS` (the policy's measured table). `--blocks`: instead, per
row, commfuse's kernel under each of a grid of blocks (keys per step, programs per SM, pipeline
stages) against the policy's own (`Choices.decode_attention_config`), the best three printed.
Variants: `aten` (SDPA's own choice, bool mask), `cudnn` / `efficient` (forced, with the mask),
`flash` (no mask: over the cache's valid prefix as a slice, what an engine that knows the length
runs), `commfuse` (torch.compile with decode_attention=True). Errors vs fp32 math print beside.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.common import add_run_args, commfuse_options, run_meta, write_results  # noqa: E402
from commfuse import choices as cf_choices  # noqa: E402

VARIANTS = ("aten", "cudnn", "efficient", "flash", "commfuse")


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def variants(q, k, v, mask, pos, options):
    """name -> a call computing the step's attention (each over the same tensors)."""
    def forced(backend):
        def run():
            with sdpa_kernel([backend]):
                return attend(q, k, v, mask)
        return run
    prefix_k, prefix_v = k[:, :, :pos + 1], v[:, :, :pos + 1]
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="commfuse", dynamic=False, options={**options, "decode_attention": True})
    return {"aten": lambda: attend(q, k, v, mask), "cudnn": forced(SDPBackend.CUDNN_ATTENTION),
            "efficient": forced(SDPBackend.EFFICIENT_ATTENTION),
            "flash": lambda: F.scaled_dot_product_attention(q, prefix_k, prefix_v, enable_gqa=True),
            "commfuse": lambda: compiled(q, k, v, mask)}


def row(b, hq, hkv, s, d, where, dev, dtype, options, timed):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=dev, dtype=dtype) for _ in range(2))
    pos = s - 1 if where == "full" else s // 2
    mask = (torch.arange(s, device=dev) <= pos)[None, None, None, :]
    want = attend(*(x.float() for x in (q, k, v)), mask)
    fns, res, failed = variants(q, k, v, mask, pos, options), {}, {}
    with torch.no_grad():
        for name, fn in list(fns.items()):
            try:
                res[f"err {name}"] = (fn().float() - want).abs().max().item()
            except Exception as e:  # a backend with no kernel for these inputs
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                del fns[name]
        times = timed(fns, failed)
    nbytes = 2 * k.numel() * k.element_size()  # the whole cache, as SDPA with a mask reads it
    for name, us in times.items():
        res[f"{name} µs"] = us
        res[f"{name} GB/s"] = nbytes / us / 1e3
    return res, failed


class Blocks(cf_choices.Choices):
    """The policy with the decode kernel's blocks forced: keys per step, programs per SM, stages."""

    def __init__(self, block_n, per_sm, stages):
        self.blocks = block_n, per_sm, stages

    def decode_attention_config(self, device, b, hkv, group, s, d):
        block_n, per_sm, stages = self.blocks
        return {**super().decode_attention_config(device, b, hkv, group, s, d), "BLOCK_N": block_n,
                "SPLITS": cf_choices.key_splits(device, b * hkv, s, block_n, per_sm), "num_stages": stages}


def block_sweep(b, hq, hkv, s, d, where, dev, options, rounds) -> str:
    """One row of --blocks: the policy's blocks against a grid of others, µs under CUDA graphs."""
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    mask = (torch.arange(s, device=dev) <= (s - 1 if where == "full" else s // 2))[None, None, None, :]
    want = attend(*(x.float() for x in (q, k, v)), mask)
    torch._dynamo.reset()
    fns = {}
    for blocks in [None, *itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 3, 4))]:
        extra = {} if blocks is None else {"choices": Blocks(*blocks)}
        fn = torch.compile(attend, backend="commfuse", dynamic=False, options={**options, "decode_attention": True, **extra})
        with torch.no_grad():
            assert (fn(q, k, v, mask).float() - want).abs().max().item() < 2e-2, blocks
        fns[blocks or "policy"] = lambda fn=fn: fn(q, k, v, mask)
    from commfuse.runtime.timing import interleaved_times_us
    with torch.no_grad():
        t = interleaved_times_us(fns, rounds=rounds, iters=50)
    best = sorted((us, name) for name, us in t.items() if name != "policy")[:3]
    return (f"B={b} heads {hq}/{hkv} d={d} keys {s} {where}: policy {t['policy']:.1f} µs; best (keys per step, "
            "programs per SM, stages): " + ", ".join(f"{n} {us:.1f}" for us, n in best))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="a smoke run on CPU (interpreter, tiny sizes)")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--heads", default="32/8,16/4", help="query/KV heads, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", action="store_true", help="tune the kernel's blocks per row instead (GPU)")
    add_run_args(ap, "decode_attention=True")
    a = ap.parse_args()
    options = commfuse_options(ap, a.set)
    dev = torch.device("cpu" if a.cpu else "cuda")
    heads = [tuple(map(int, h.split("/"))) for h in a.heads.split(",")] if not a.cpu else [(4, 2)]
    lengths = [int(x) for x in a.lengths.split(",")] if not a.cpu else [37]
    batches = [int(x) for x in a.batches.split(",")] if not a.cpu else [2]
    dims = [int(x) for x in a.head_dims.split(",")] if not a.cpu else [16]

    if a.blocks:
        if a.cpu:
            ap.error("--blocks times kernels: on a GPU")
        torch._dynamo.config.recompile_limit = 10 ** 4  # a compiled function per block configuration
        torch._dynamo.config.accumulated_recompile_limit = 10 ** 5
        for d, b, (hq, hkv), s, where in itertools.product(dims, batches, heads, lengths, ("full", "half")):
            print(block_sweep(b, hq, hkv, s, d, where, dev, options, a.rounds), flush=True)
        return

    def timed(fns, failed):
        if dev.type != "cuda":
            return {}
        from commfuse.runtime.timing import interleaved_times_us
        return interleaved_times_us(fns, rounds=a.rounds, failed=failed)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    lines = [f"decode attention, bf16, one query token; GPU µs per call (CUDA graph); "
             f"ratio = variant / commfuse; {name}", "",
             "| B | heads q/kv | head dim | cache | pos | " + " | ".join(f"{v} µs (×)" for v in VARIANTS) +
             " | commfuse GB/s | max err commfuse / aten |",
             "|" + "---|" * (len(VARIANTS) + 7)]
    data = {"meta": run_meta(name, a.commit), "rows": []}
    for d, b, (hq, hkv), s, where in itertools.product(dims, batches, heads, lengths, ("full", "half")):
        res, failed = row(b, hq, hkv, s, d, where, dev, torch.bfloat16, options, timed)
        ours = res.get("commfuse µs")
        cells = [f"{res[f'{v} µs']:.1f} ({res[f'{v} µs'] / ours:.2f})" if f"{v} µs" in res and ours
                 else ("n/a" if v in failed else "-") for v in VARIANTS]
        gbs = f"{res['commfuse GB/s']:.0f}" if "commfuse GB/s" in res else "-"
        errs = f"{res.get('err commfuse', float('nan')):.1e} / {res.get('err aten', float('nan')):.1e}"
        lines.append(f"| {b} | {hq}/{hkv} | {d} | {s} | {where} | " + " | ".join(cells) + f" | {gbs} | {errs} |")
        data["rows"].append({"b": b, "hq": hq, "hkv": hkv, "d": d, "s": s, "pos": where, **res, "failed": failed})
        print(lines[-1], flush=True)
        write_results(a.out, "\n".join(lines) + "\n", data, partial=True)
    data["wins"] = wins(data["rows"], name)
    lines += ["", "Entries for `commfuse.choices.DECODE_ATTENTION_WINS` (commfuse faster than aten at both positions):", ""]
    lines += [f"    {w}," for w in data["wins"]] or ["    (none)"]
    print("\n".join(lines[-len(data["wins"] or [0]) - 2:]), flush=True)
    write_results(a.out, "\n".join(lines) + "\n", data)


def wins(rows: list, gpu: str) -> list[dict]:
    """Per (head dim, GQA group): the batches and the longest run of consecutive cache lengths at
    which commfuse beat aten's own choice at both positions for every batch measured (the policy
    takes the whole rectangle between)."""
    out = []
    for d, group in sorted({(r["d"], r["hq"] // r["hkv"]) for r in rows}):
        mine = [r for r in rows if (r["d"], r["hq"] // r["hkv"]) == (d, group)]
        won = {s: all(r.get("commfuse µs", math.inf) <= r.get("aten µs", 0) for r in mine if r["s"] == s)
               for s in sorted({r["s"] for r in mine})}
        runs = [list(g) for w, g in itertools.groupby(won, key=won.get) if w]
        keys = max(runs, key=len, default=[])
        if keys:
            bs = [r["b"] for r in mine]
            out.append({"gpu": gpu, "dtype": "torch.bfloat16", "head_dim": d, "group": group,
                        "batch": (min(bs), max(bs)), "keys": (keys[0], keys[-1])})
    return out


if __name__ == "__main__":
    main()
