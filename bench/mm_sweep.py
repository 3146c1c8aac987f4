"""The few-row matmul template's configurations against cuBLAS, per decode shape (one GPU).

For M rows times each per-rank weight of Llama-3-8B's (`--model 1b`: Llama-3.2-1B's)
tensor-parallel decode at world 2 and 4 (`--worlds`; 1: one GPU) (q, k and v, o, gate and up,
down as bench/llama.py's Linears run them; `--fused`: qkv and gate+up concatenated), `a @ w.t()` (w stored [N, K], as nn.Linear's: what the model's matmuls
read) is compiled through commfuse once per candidate configuration (a `Choices` whose
`mm_template_config` returns it) and timed under CUDA graphs, beside torch.mm (cuBLAS) and the
configuration today's policy picks. Every call reads its weight from HBM, as the decode step does:
the timing cycles through copies of the weight that together take at least twice the GPU's L2 (its
size from torch, else 50 MB), one call on each, the template and cuBLAS alike, and reports µs per
call. Candidates are pruned to those that split K evenly, fill the SMs (1-8 programs per SM) and
fit shared memory, tiles first (4 warps), then warps and stages varied on the best two; a time
budget shared among the shapes (three shares for each shape at the first M, one at the others,
which try the first M's best three first) bounds the run. Runs of disjoint shapes (`--worlds 2`,
`--worlds 4`, `--fused`) each get the whole budget; `--write-table` merges them.

    python bench/mm_sweep.py --out bench/results/mm_sweep_h100.md   # GPU: table + .json
    python bench/mm_sweep.py --write-table bench/results/mm_sweep_h100.json  # into commfuse/tables/mm/
    python bench/mm_sweep.py --cpu                                  # interpreter smoke run
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402

from bench.common import REPO_ROOT, run_meta, write_results  # noqa: E402
from commfuse import config, tuned_tables  # noqa: E402
from commfuse.choices import Choices, sm_count  # noqa: E402
from commfuse.runtime.timing import cuda_graph_time_us  # noqa: E402
from commfuse.sizevars import next_pow2  # noqa: E402

MODELS = {"8b": (4096, 1024, 14336), "1b": (2048, 512, 8192)}  # Llama-3-8B, Llama-3.2-1B: H, KV width, F
SMEM = 200 * 1024                    # bytes of shared memory a candidate's stages may take


def shapes(world: int, fused: bool = False, model: str = "8b") -> dict:
    """Per rank's (K, N) of each decode matmul of `model` at `world`: the projections as
    bench/llama.py's Linears run them (q, k and v apart, gate and up apart), or concatenated (`fused`)."""
    DIM, KV, HIDDEN = MODELS[model]
    if fused:
        return {"qkv": (DIM, (DIM + 2 * KV) // world), "gate+up": (DIM, 2 * HIDDEN // world)}
    return {"q": (DIM, DIM // world), "k,v": (DIM, KV // world), "o": (DIM // world, DIM),
            "gate,up": (DIM, HIDDEN // world), "down": (HIDDEN // world, DIM)}


class Forced(Choices):
    """The default policy, but the matmul template always, with one configuration."""

    def __init__(self, cfg: dict):
        self.cfg, self.used = cfg, 0

    def use_mm_template(self, a, b, siblings=0) -> bool:
        return True

    def mm_template_config(self, m, n, k, device=None, dots=1, width=16) -> dict:  # (one plain weight)
        self.used += 1
        return {"BLOCK_M": max(16, next_pow2(m)), **self.cfg}


def tiles(m: int, k: int, n: int, sms: int) -> list[dict]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) that split K evenly in at least two steps each, fit shared
    memory at 3 stages and give every SM 1 to 8 programs (where none can: those of the most
    programs, within 2x); nearest to 2 programs per SM first, deeper steps first among equals."""
    fit = [(-(-n // bn) * sk, bn, bk, sk) for bn, bk, sk in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8))
           if k % (bk * sk) == 0 and k // (bk * sk) >= 2 and stage_bytes(m, bn, bk) * 3 <= SMEM]
    most = max((p for p, *_ in fit), default=0)
    keep = [t for t in fit if sms <= t[0] <= 8 * sms] or [t for t in fit if 2 * t[0] >= most]
    keep.sort(key=lambda t: (abs(math.log2(t[0] / (2 * sms))), -t[2]))
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk} for _, bn, bk, sk in keep]


def stage_bytes(m: int, bn: int, bk: int) -> int:
    return (bn + max(16, next_pow2(m))) * bk * 2


def variants(tile: dict, m: int) -> list[dict]:
    """Warps and stages for one tile: 4 warps and 4 stages first, then the others that fit."""
    out = [dict(tile, num_warps=w, num_stages=s) for w, s in ((4, 4), (8, 4), (4, 3), (4, 5), (8, 3), (8, 5))]
    return [c for c in out if stage_bytes(m, c["BLOCK_N"], c["BLOCK_K"]) * c["num_stages"] <= SMEM]


def cold_bytes(dev) -> int:
    """Bytes of weight copies the timing cycles through: twice the GPU's L2 (100 MB where torch does
    not say), so that every call reads its weight from HBM as the decode step does."""
    if dev.type != "cuda":
        return 0  # (the CPU check: two copies)
    return 2 * (getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 50_000_000)


def timer(dev):
    """time_us(fn, ws): µs per call of fn(w), each call on the next of the weight copies `ws` (a
    CUDA graph of passes over all of them on a GPU; the best of 3 passes on CPU)."""
    def cold_us(fn, ws):
        def one_pass():
            for w in ws:
                fn(w)
        if dev.type == "cuda":
            return cuda_graph_time_us(one_pass, iters=max(2, -(-100 // len(ws)))) / len(ws)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            one_pass()
            best = min(best, (time.perf_counter() - t) * 1e6 / len(ws))
        return best
    return cold_us


def run_template(cfg: dict, a, ws, time_us) -> float:
    """µs of `a @ w.t()` compiled with the template at `cfg` (each call on the next weight of `ws`),
    its values checked against eager."""
    torch._dynamo.reset()
    forced = Forced(cfg)
    with config.patch(choices=forced, graph_cache=False):
        compiled = torch.compile(lambda a, w: a @ w.t(), backend="commfuse", dynamic=False)
        compiled(a, ws[0])
    if not forced.used:
        raise RuntimeError("the template did not run")
    us = time_us(lambda w: compiled(a, w), ws)
    torch.testing.assert_close(compiled(a, ws[-1]).float(), (a @ ws[-1].t()).float(), atol=3e-2, rtol=3e-2)
    return us


def sweep_shape(name, m, k, n, dev, seeds, share_s, time_us) -> dict:
    """The heuristic's configuration, then seeds (the best at another M), then tiles, then warps
    and stages of the best two, until `share_s` seconds are spent (the heuristic and one more always)."""
    start = time.perf_counter()
    torch.manual_seed(0)
    a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5
    ws = [w] + [w.clone() for _ in range(max(1, -(-cold_bytes(dev) // (n * k * 2)) - 1))]  # >= 2 copies
    nbytes = (k * n + m * k + m * n) * 2
    cublas = time_us(lambda w: torch.mm(a, w.t()), ws)
    heur = {key: v for key, v in Choices().mm_template_config(m, n, k).items() if key != "BLOCK_M"}
    tried, failed = {}, {}

    def attempt(cfg):
        key = json.dumps(cfg, sort_keys=True)
        if key in tried or key in failed or (len(tried) >= 2 and time.perf_counter() - start > share_s):
            return
        try:
            tried[key] = run_template(cfg, a, ws, time_us)
        except Exception as e:  # out of resources, a wrong value: reported, never chosen
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    first = [dict(t, num_warps=4, num_stages=4 if stage_bytes(m, t["BLOCK_N"], t["BLOCK_K"]) * 4 <= SMEM else 3)
             for t in tiles(m, k, n, sm_count(dev))]
    for cfg in [heur] + seeds + first:
        attempt(cfg)
    by_tile = {}
    for key, us in sorted(tried.items(), key=lambda kv: kv[1]):
        cfg = json.loads(key)
        by_tile.setdefault((cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]), cfg)
    for cfg in list(by_tile.values())[:2]:
        for v in variants({t: cfg[t] for t in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}, m):
            attempt(v)
    if not tried:
        raise RuntimeError(f"{name} M={m}: every configuration failed: {failed}")
    best_key = min(tried, key=tried.get)
    heur_key = json.dumps(heur, sort_keys=True)

    def entry(us, cfg=None):
        return {"us": us, "gbs": nbytes / us / 1e3 if us else None, **({"config": cfg} if cfg else {})}
    return {"shape": name, "m": m, "k": k, "n": n, "bytes": nbytes, "best": entry(tried[best_key], json.loads(best_key)),
            "cublas": entry(cublas), "heuristic": entry(tried.get(heur_key), heur),
            "heuristic_error": failed.get(heur_key), "tried": len(tried), "failed": failed, "copies": len(ws),
            "ranking": sorted(([us, json.loads(key)] for key, us in tried.items()), key=lambda r: r[0])[:5]}


def short(cfg: dict) -> str:
    return f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} sk{cfg['SPLIT_K']} w{cfg['num_warps']} s{cfg['num_stages']}"


def table(results: list, read_gbs: float | None) -> str:
    pct = (lambda gbs: f" {100 * gbs / read_gbs:3.0f}%") if read_gbs else (lambda gbs: "")
    lines = [f"read bandwidth (torch.sum over 1 GiB): {read_gbs:.0f} GB/s\n" if read_gbs else ""]
    lines += ["µs per call with the weight cold, as in a decode step: each timed pass cycles through copies of "
              "the weight (together at least twice the L2) and calls once on each; the template and cuBLAS alike.\n"]
    lines += ["| shape | M | K | N | best config | best µs | GB/s | cuBLAS µs | GB/s | heuristic config | µs | GB/s "
             "| cuBLAS / best | tried |", "|" + "---|" * 14]
    for r in results:
        b, c, h = r["best"], r["cublas"], r["heuristic"]
        hus = f"{h['us']:.1f} | {h['gbs']:.0f}{pct(h['gbs'])}" if h["us"] else f"failed | {r['heuristic_error']}"
        hus += " (policy: cuBLAS)" if r["m"] > config.mm_template_max_rows else ""
        lines.append(f"| {r['shape']} | {r['m']} | {r['k']} | {r['n']} | {short(b['config'])} | {b['us']:.1f} | "
                     f"{b['gbs']:.0f}{pct(b['gbs'])} | {c['us']:.1f} | {c['gbs']:.0f}{pct(c['gbs'])} | "
                     f"{short(h['config'])} | {hus} | {c['us'] / b['us']:.2f} | {r['tried']} |")
    return "\n".join(lines) + "\n"


def write_table(path: str) -> str:
    """Merges a sweep's JSON into its GPU's table in commfuse/tables/mm/ (rows of the same M, K, N replaced)."""
    with open(path) as f:
        data = json.load(f)
    gpu = data["meta"]["device_name"]
    if gpu == "cpu":
        raise SystemExit("a --cpu run measured nothing worth a table")
    out = tuned_tables.mm_table_path(gpu)
    rows = {}
    if os.path.exists(out):
        with open(out) as f:
            rows = {(r["m"], r["k"], r["n"]): r for r in json.load(f)["rows"]}
    for r in data["results"]:
        rows[(r["m"], r["k"], r["n"])] = {"m": r["m"], "k": r["k"], "n": r["n"], "config": r["best"]["config"],
                                          "us": round(r["best"]["us"], 2), "cublas_us": round(r["cublas"]["us"], 2)}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"gpu": gpu, "source": f"bench/mm_sweep.py at {data['meta']['commit']} ({data['meta']['date']})",
                   "rows": sorted(rows.values(), key=lambda r: (r["k"], r["n"], r["m"]))}, f, indent=1)
        f.write("\n")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table to OUT and the data to OUT with .json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse)")
    ap.add_argument("--cpu", action="store_true", help="smoke run: Triton's interpreter, one tiny shape, two configurations")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b", help="whose layer shapes (default %(default)s)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 1, 32], help="M values; the first is swept widest")
    ap.add_argument("--fused", action="store_true", help="the concatenated qkv and gate+up weights instead")
    ap.add_argument("--budget-s", type=float, default=120, help="seconds for all shapes' candidates together")
    ap.add_argument("--write-table", metavar="JSON", help="merge a sweep's JSON into commfuse/tables/mm/ and exit")
    args = ap.parse_args()
    if args.write_table:
        print(f"wrote {os.path.relpath(write_table(args.write_table), REPO_ROOT)}")
        return
    dev = torch.device("cpu" if args.cpu else "cuda")
    time_us = timer(dev)
    if args.cpu:
        jobs = [("tiny", 2, 256, 128, [{"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}])]
        args.budget_s, read_gbs = 0.0, None  # the heuristic and the one seed
    else:
        named = {(k, n): f"{name} w{world}" for world in args.worlds
                 for name, (k, n) in shapes(world, args.fused, args.model).items()}
        jobs = [(name, m, k, n, None) for m in args.rows for (k, n), name in named.items()]
        x = torch.ones(1 << 29, dtype=torch.bfloat16, device=dev)
        read_gbs = (1 << 30) / cuda_graph_time_us(lambda: torch.sum(x), iters=10) / 1e3
        del x
    deadline, results, best_at = time.perf_counter() + args.budget_s, [], {}
    weights = [3 if m == jobs[0][1] else 1 for _, m, *_ in jobs]  # the first M swept widest
    for i, (name, m, k, n, seeds) in enumerate(jobs):
        share = max(0.0, deadline - time.perf_counter()) * weights[i] / sum(weights[i:])
        if seeds is None:  # the best configurations at the first M, tried first at the others
            seeds = [cfg for _, cfg in best_at.get((k, n), [])[:3]]
        r = sweep_shape(name, m, k, n, dev, seeds, share, time_us)
        best_at.setdefault((k, n), r["ranking"])
        results.append(r)
        print(f"{name} M={m}: best {short(r['best']['config'])} {r['best']['us']:.1f} µs, cuBLAS "
              f"{r['cublas']['us']:.1f}, heuristic {r['heuristic']['us'] or float('nan'):.1f} ({r['tried']} tried)",
              flush=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    data = {"meta": run_meta(name, args.commit), "read_gbs": read_gbs, "results": results}
    write_results(args.out, table(results, read_gbs), data)


if __name__ == "__main__":
    main()
