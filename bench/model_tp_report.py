"""bench/model_tp.py's table: the rows, the ratios between variants, the floors, the worst rank's
figures and the error limits; written to --out with its JSON."""
from __future__ import annotations

import itertools
import json
import math
import os

import torch
import torch.distributed as dist

from bench import decode_floor
from bench.tp_variants import (ASYNC_TP, CHUNKED_GRAPHED, SELF_GRAPHED, SINGLE_BUFFERED, UNCHUNKED, UNCHUNKED_GRAPHED,
                               UNHIDDEN, WORKLOADS)


ROWS = (  # (key, label, fmt)
    ("decode GPU µs/step", "decode: GPU µs per step (CUDA graph of {graph_steps} steps)", "{:.1f}"),
    ("decode µs/call", "decode: µs per call, as a user loops it", "{:.1f}"),
    ("decode host µs/call", "decode: host µs per call (not waiting for the GPU)", "{:.1f}"),
    ("decode / floor", "decode: GPU time / floor (whole cache)", "{:.2f}×"),
    ("decode / prefix floor", "decode: GPU time / prefix floor (cache up to the position)", "{:.2f}×"),
    ("train ms/step", "TP training fw+bw: ms per step", "{:.2f}"),
    ("train host ms/step", "TP training: host ms per step (from an idle GPU)", "{:.2f}"),
    ("train peak MiB above weights", "TP training: peak MiB above weights", "{:.0f}"),
    ("sp ms/step", "sequence-parallel TP training fw+bw: ms per step", "{:.2f}"),
    ("sp host ms/step", "sequence-parallel TP training: host ms per step (from an idle GPU)", "{:.2f}"),
    ("sp peak MiB above weights", "sequence-parallel TP training: peak MiB above weights", "{:.0f}"),
    ("fsdp ms/step", "FSDP2 training fw+bw: ms per step", "{:.2f}"),
    ("fsdp host ms/step", "FSDP2 training: host ms per step (from an idle GPU)", "{:.2f}"),
    ("fsdp peak MiB above weights", "FSDP2 training: peak MiB above weights", "{:.0f}"),
    ("compile decode s", "cold compile, decode (s)", "{:.1f}"),
    ("compile train s", "cold compile, TP training (s)", "{:.1f}"),
    ("compile sp s", "cold compile, sequence-parallel TP training (s)", "{:.1f}"),
    ("compile fsdp s", "cold compile, FSDP2 training (s)", "{:.1f}"),
    ("warm compile decode s", "warm compile, decode (s)", "{:.1f}"),
    ("warm compile train s", "warm compile, TP training (s)", "{:.1f}"),
    ("warm compile sp s", "warm compile, sequence-parallel TP training (s)", "{:.1f}"),
    ("warm compile fsdp s", "warm compile, FSDP2 training (s)", "{:.1f}"),
    *((f"{w} exposed comm %", f"{w}: exposed comm, % of the traced step (--trace)", "{:.1f}") for w in WORKLOADS),
    ("err decode", "max abs error vs eager, decode", "{:.2e}"),
    ("err train", "max abs error vs eager, TP training", "{:.2e}"),
    ("err sp", "max abs error vs eager, sequence-parallel TP training", "{:.2e}"),
    ("err fsdp", "max abs error vs eager, FSDP2 training", "{:.2e}"),
)


def ratio(other, ours) -> str:
    return f"{other / ours:.2f}×" if other and ours else "—"


RATIOS = (("inductor", "commfuse"), ("inductor reduce-overhead", "commfuse cuda_graphs"), (ASYNC_TP, "commfuse"),
          (UNHIDDEN, "commfuse"), (UNCHUNKED, "commfuse"), (UNCHUNKED_GRAPHED, "commfuse cuda_graphs"),
          ("inductor reduce-overhead", CHUNKED_GRAPHED), (SINGLE_BUFFERED, "commfuse"))


SWEEP_ROWS = (  # per --sweep configuration
    ("{key} GPU µs/step", "{key}: GPU µs per step", "{:.1f}"),
    ("{key} µs/call", "{key}: µs per call", "{:.1f}"),
    ("{key} / floor", "{key}: GPU time / floor (whole cache)", "{:.2f}×"),
    ("{key} / prefix floor", "{key}: GPU time / prefix floor", "{:.2f}×"),
    ("err {key}", "{key}: max abs error vs eager", "{:.2e}"),
)


def floor_ratios(res, variants, keys) -> None:
    """Each variant's decode time over the floors: its GPU time per step, else (self-graphing) per call."""
    for v, key in itertools.product(variants, keys):
        r = res[v]
        t = r.get(f"{key} GPU µs/step") or (r.get(f"{key} µs/call") if v in SELF_GRAPHED else None)
        for floor in ("floor", "prefix floor"):
            if t and r.get(f"{key} {floor} µs"):
                r[f"{key} / {floor}"] = t / r[f"{key} {floor} µs"]


def error_limit(res, key, dtype, scale) -> float:
    """The most a commfuse variant's error `key` may be: 5 x Inductor's (else eager's own
    run-to-run difference), 1e-2, and 4 ulps of the dtype at the largest reference value `scale`."""
    base = res.get("inductor", {}).get(key) or res.get("eager", {}).get(key) or 0
    return max(5 * base, 1e-2, 4 * torch.finfo(dtype).eps * scale)


def worst_over_ranks(res, variants, dev) -> dict:
    """{variant: {key: figure}}, each figure the largest over the ranks (times, errors): every
    rank measured its own."""
    keys = sorted({k for r in res.values() for k in r})
    vals = torch.tensor([[res[v].get(k, math.nan) for k in keys] for v in variants], dtype=torch.float64, device=dev)
    gathered = [torch.empty_like(vals) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, vals)
    worst = torch.stack(gathered).nan_to_num(-1.0).amax(0)
    return {v: {k: worst[i, j].item() for j, k in enumerate(keys) if worst[i, j] >= 0} for i, v in enumerate(variants)}


def table(a, res, world, device_name, variants) -> tuple[str, bool]:
    flagged = False
    variants = [v for v in variants if res.get(v)]  # (async-TP runs in sequence-parallel training only)
    keys = ["decode"] + a.sweep_keys
    floor_ratios(res, variants, keys)
    rows = list(ROWS) + [tuple(t.replace("{key}", k) for t in row) for k in a.sweep_keys for row in SWEEP_ROWS]
    ratios = [(o, c) for o, c in RATIOS if o in variants and c in variants]
    head = ["workload", *variants, *(f"{o} / {c}" for o, c in ratios)]
    lines = [f"TP Llama decoder layers: {a.layers} layers, H {a.hidden}, {a.heads} query / {a.kv_heads} KV heads, "
             f"F {a.ffn}, {a.dtype_name}, {world}x {device_name}; decode B={a.batch}, KV cache {a.cache}, "
             f"position {a.pos}; TP training (also sequence-parallel) B={a.train_batch} S={a.seq}; FSDP2 training (data parallel, each layer compiled): "
             f"{a.fsdp['layers']} layers, H {a.fsdp['hidden']}, {a.fsdp['heads']} / {a.fsdp['kv_heads']} heads, "
             f"F {a.fsdp['ffn']}, B={a.fsdp['batch']} S={a.fsdp['seq']} per rank", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for key, label, fmt in rows:
        cells = []
        for v in variants:
            val = res[v].get(key)
            text = "—" if val is None else fmt.format(val)
            if key.startswith("err") and v.startswith("commfuse") and val is not None:
                if val > error_limit(res, key, a.dtype, a.scales.get(key, 0)):
                    text, flagged = text + " !", True
            cells.append(text)
        if all(c == "—" for c in cells):
            continue  # a workload not run
        if key.startswith("err") or " / " in key or "exposed" in key:  # (" / ": a ratio to the floor)
            cols = [""] * len(ratios)
        else:
            cols = [ratio(res.get(o, {}).get(key), res.get(c, {}).get(key)) for o, c in ratios]
        lines.append("| " + " | ".join([label.format(graph_steps=a.graph_steps), *cells, *cols]) + " |")
    lines += ["", "Ratios are other / commfuse: above 1, commfuse is faster, smaller or compiles sooner. "
              "Self-graphing variants (reduce-overhead, cuda_graphs) cannot be captured in another CUDA graph: "
              "their per-call time is their graph time."]
    for key in keys:
        floor = next((res[v] for v in variants if f"{key} floor µs" in res[v]), None)
        if floor:
            lines += ["", decode_floor.describe(floor, key)]
    if flagged:
        lines.append("`!`: a commfuse error above max(5 × Inductor's (else eager's), 1e-2, 4 ulps at the largest "
                     "reference value).")
    return "\n".join(lines), flagged


def report(a, res, failed, variants, dev, final) -> int:
    """The table over every rank (each measured its own: the worst rank's figure), printed when
    final and written to --out every time; rank 0's exit status."""
    world = dist.get_world_size()
    res = worst_over_ranks(res, variants, dev)
    failures = [None] * world
    dist.all_gather_object(failures, failed)
    if dist.get_rank() != 0:
        return 0
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (gloo, Triton interpreter)"
    text, flagged = table(a, res, world, name, variants)
    merged = {f"rank {r}: {k}": v for r, f in enumerate(failures) for k, v in f.items()}
    if merged:
        text += "\n\nFailed:\n" + "\n".join(f"- {k}: {v}" for k, v in merged.items())
    for what, t in a.kernel_tables.items():
        text += f"\n\nPer kernel, {what} (rank 0; bytes: a generated kernel's tensor arguments, a KV " \
                f"cache up to the position, a matmul's or attention's aten inputs, each once; other aten " \
                f"kernels without):\n\n" + t
    if final:
        print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        if a.profiles:
            from bench.profile_model import host_markdown, markdown
            with open(os.path.splitext(a.out)[0] + "_profile.md", "w") as f:
                f.write("\n".join(markdown(k, "training", t, 25) for k, t in a.profiles.items()))
                f.write("".join(host_markdown(k, t, 30) for k, t in a.host_profiles.items()))
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"config": {k: v for k, v in vars(a).items() if k not in ("dtype", "profiles", "host_profiles", "kernel_tables")},
                       "kernels": a.kernel_tables, "device": name,
                       "world": world, "torch": torch.__version__, "results": res, "failed": merged,
                       "complete": final}, f, indent=1)
    return 1 if merged or flagged else 0
