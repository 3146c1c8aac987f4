"""PNG plots from the JSON the benchmarks write, drawn on the development machine (the GPU
machines have no matplotlib: `pip install -e ".[bench]"`).

    python bench/plot.py bench/results/comm_2xh200_full.json bench/results/model_tp_2xh100_04bba60.json --out docs/img

bench/comm.py's JSON gives the all-reduce latency against message size (ours one-shot / two-shot /
the pick, NCCL, torch symm_mem's one-shot / two-shot); bench/model_tp.py's gives the decode step of
each variant, with its floors where the bench measured them (whole cache, and prefix). A Chrome
trace (bench/model_tp.py --trace) gives the timeline of its step: each stream's compute and comm
intervals, and the exposed comm beneath them (bench/trace_summary.py).

    python bench/plot.py traces/sp_commfuse_rank0.json.gz --out docs/img
"""
from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def all_reduce(data: dict, title: str, path: str) -> None:
    rows = data["all_reduce"]
    series = [k for k in rows[0] if k not in ("bytes", "auto pick")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in series:  # the pick drawn wide beneath: it lies on the algorithm it picked
        wide = dict(lw=6, alpha=0.3, zorder=0) if name == "ours auto" else dict(marker="o", ms=3)
        ax.plot([r["bytes"] for r in rows], [r[name] for r in rows], "-" if name.startswith("ours") else "--",
                label=name, **wide)
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="message size", ylabel="µs (CUDA graphs, median)", title=title)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_bytes))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode(data: dict, title: str, path: str) -> None:
    results = {v: r for v, r in data["results"].items() if "decode µs/call" in r}
    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.4
    for i, (key, label) in enumerate((("decode µs/call", "per call (host + GPU)"), ("decode GPU µs/step", "GPU time per step"))):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ax.bar(xs, [results[n].get(key, float("nan")) for n in names], width, label=label)
    floors = {k: v for r in results.values() for k, v in r.items() if k in ("decode floor µs", "decode prefix floor µs")}
    for (k, v), ls in zip(sorted(floors.items()), (":", "-.")):
        ax.axhline(v, color="k", ls=ls, label=k)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="µs (log)", yscale="log", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline(trace: str, title: str, path: str) -> None:
    """One step's GPU events, a row per stream (compute blue, comm red), and a row of the exposed comm."""
    from bench import trace_summary as ts
    events = ts.gpu_events(trace)
    t0 = events[0]["start"] if events else 0.0
    streams = sorted({e["stream"] for e in events}, key=str)
    comm = ts.union((e["start"], e["end"]) for e in events if e["comm"])
    exposed = ts.minus(comm, ts.union((e["start"], e["end"]) for e in events if not e["comm"]))
    rows = [(f"stream {s}", [e for e in events if e["stream"] == s]) for s in streams]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * (len(rows) + 1)))
    for i, (_, evs) in enumerate(rows):
        for is_comm, color in ((False, "tab:blue"), (True, "tab:red")):
            spans = [((e["start"] - t0) / 1e3, (e["end"] - e["start"]) / 1e3) for e in evs if e["comm"] == is_comm]
            ax.broken_barh(spans, (i - 0.4, 0.8), color=color, lw=0)
    ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e in exposed], (len(rows) - 0.4, 0.8), color="black", lw=0)
    s = ts.summarize(trace)
    ax.set_yticks(range(len(rows) + 1), [r for r, _ in rows] + ["exposed comm"], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the step's first kernel",
           title=f"{title}: exposed comm {100 * s['exposed share']:.1f}% of {s['step µs'] / 1e3:.2f} ms "
                 "(blue compute, red comm)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bytes(n, _pos=None) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="JSON written by bench/comm.py or bench/model_tp.py, or a trace")
    ap.add_argument("--out", default="docs/img", help="folder for the PNGs")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for path in args.json:
        from bench.trace_summary import load
        data, stem = load(path), os.path.basename(path).removesuffix(".gz").removesuffix(".json")
        if "traceEvents" in data:
            timeline(path, stem, os.path.join(args.out, f"{stem}_timeline.png"))
            print(f"{path} -> {args.out}/{stem}_timeline.png")
            continue
        where = f"{data.get('world', '?')}x {data.get('device', '?')}"
        if "all_reduce" in data:
            all_reduce(data, f"all-reduce latency, {where}", os.path.join(args.out, f"{stem}_all_reduce.png"))
        if "results" in data:
            decode(data, f"TP decode step, {where}", os.path.join(args.out, f"{stem}_decode.png"))
        print(f"{path} -> {args.out}/{stem}_*.png")


if __name__ == "__main__":
    main()
