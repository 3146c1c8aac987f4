"""Exposed communication in a Chrome / Perfetto trace of one step (torch.profiler's
export_chrome_trace), from the GPU's kernel intervals.

A GPU event (a kernel, a memcpy, a memset) is communication when its name says so: NCCL's kernels,
torch symm_mem's (one-shot / two-shot / multimem / barrier), peer-to-peer copies, and commfuse's
own comm kernels (`cf_<algorithm>_all_reduce_...`, and any `cf_..._all_gather / reduce_scatter /
all_to_all`). Everything else is compute, a fused comm + compute kernel (commfuse's
`cf_allreduce_<ops>`, whose all-reduce is fused with its neighbours) included. A device-to-device
copy counts as compute: its name does not say whether it reads a peer.

    exposed = time during which some comm event runs and no compute event does
    step    = first GPU event's start to the last one's end

    python bench/trace_summary.py TRACE.json.gz [...]      # one line per trace
"""
from __future__ import annotations

import gzip
import json
import re
import sys

COMM = re.compile(r"nccl|symm_?mem|symmetric_memory|one_shot|two_shot|multimem|barrier_kernel|PtoP"
                  r"|^cf_\w*?(all_reduce|all_gather|reduce_scatter|all_to_all)", re.I)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def is_comm(name: str) -> bool:
    return bool(COMM.search(name))


def load(path: str) -> dict:
    """A trace's JSON, gzipped (.gz, as bench/model_tp.py writes them) or not."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def gpu_events(trace: dict | str) -> list[dict]:
    """The GPU events of a trace (a dict, or a path to its JSON): {name, start, end (µs), stream,
    device, comm}, by start."""
    if isinstance(trace, str):
        trace = load(trace)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS or not e.get("dur"):
            continue
        args = e.get("args", {})
        out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                    "stream": args.get("stream", e.get("tid")), "device": args.get("device", e.get("pid")),
                    "comm": is_comm(e["name"])})
    return sorted(out, key=lambda e: e["start"])


def union(intervals) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the given ones."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def minus(a, b) -> list[tuple[float, float]]:
    """The parts of disjoint sorted intervals `a` outside disjoint sorted intervals `b`."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def summarize(trace, device=None) -> dict:
    """Step, compute, comm and exposed comm µs of one trace (of one device: `device`, else all its
    events), and the exposed share of the step."""
    events = [e for e in gpu_events(trace) if device is None or e["device"] == device]
    if not events:
        return {"step µs": 0.0, "compute µs": 0.0, "comm µs": 0.0, "exposed comm µs": 0.0, "exposed share": 0.0,
                "comm kernels": []}
    comm = union((e["start"], e["end"]) for e in events if e["comm"])
    compute = union((e["start"], e["end"]) for e in events if not e["comm"])
    step = max(e["end"] for e in events) - events[0]["start"]
    exposed = length(minus(comm, compute))
    return {"step µs": step, "compute µs": length(compute), "comm µs": length(comm), "exposed comm µs": exposed,
            "exposed share": exposed / step if step else 0.0,
            "comm kernels": sorted({e["name"][:60] for e in events if e["comm"]})}


def line(what: str, s: dict) -> str:
    return (f"{what}: exposed comm {s['exposed comm µs']:.1f} µs = {100 * s['exposed share']:.1f}% of the "
            f"{s['step µs']:.1f} µs step (comm busy {s['comm µs']:.1f} µs, compute busy {s['compute µs']:.1f} µs)")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(line(path, summarize(path)))
