"""Tuned all-reduce tables: which algorithm is fastest at which size, measured on a host.

A table is the JSON that `python -m commfuse.tune` writes: the host it was measured on (GPU name,
world size, link); per size, the latency of each algorithm alone; and per (rows, row bytes), its
latency with a residual add and RMSNorm fused, whose ranking differs (two-shot wins at fewer
bytes with a norm in its kernel; a one-row one-shot runs faster with its producer apart); and,
where measured, per size the all-gather's and the reduce-scatter's (`all_gather`, `reduce_scatter`:
rows like `measurements`, keyed by the gathered tensor's bytes: the all-gather's output, the
reduce-scatter's input). The
compiler uses a table only when it matches this host and the size lies within the measured range;
otherwise choices.py falls back to its built-in thresholds. Tables for shipped hosts live in commfuse/tables/.

commfuse/tables/mm/ holds one few-row matmul table per GPU model (`bench/mm_sweep.py --write-table`):
per (rows, K, N), the fastest template configuration measured, its µs and cuBLAS's.
"""
from __future__ import annotations

import functools
import glob
import json
import logging
import math
import os
import re

import torch

from . import config

ALGORITHMS = ("one_shot", "two_shot", "c10d")       # measured for the all-reduce alone
FUSED_ALGORITHMS = ("one_shot", "one_shot_apart", "two_shot")  # and with a norm fused (fused algorithms of commfuse/collectives.py)
# the other collectives: (the table's section, the algorithms measured), by `_c10d_functional` op
SECTIONS = {"all_reduce": ("measurements", ALGORITHMS),
            "all_gather_into_tensor": ("all_gather", ("symm_all_gather", "c10d")),
            "reduce_scatter_tensor": ("reduce_scatter", ("symm_reduce_scatter", "c10d"))}
log = logging.getLogger("commfuse")
TABLE_DIR = os.path.join(os.path.dirname(__file__), "tables")
MM_TABLE_DIR = os.path.join(TABLE_DIR, "mm")


def host_key(world: int, device) -> dict:
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"gpu": name, "world": world}


@functools.lru_cache(None)
def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def find_table(world: int, device):
    """(table, path) for this host: `config.comm.table` if set, else a shipped one that matches."""
    paths = [config.comm.table] if config.comm.table else sorted(glob.glob(os.path.join(TABLE_DIR, "*.json")))
    want = host_key(world, device)
    for path in paths:
        table = _load(path)
        if all(table["host"].get(k) == v for k, v in want.items()):
            return table, path
    if config.comm.table:
        _say_unused(config.comm.table, str(want))
    return None, None


@functools.lru_cache(None)
def _say_unused(path: str, want: str):  # once per table and host
    log.warning("commfuse: comm.table %s was measured on %s, this is %s: it is not used (python -m "
                "commfuse.tune measures this host)", path, _load(path)["host"], want)


def _fastest(row: dict, algorithms=ALGORITHMS) -> str | None:
    timed = {a: row[a] for a in algorithms if row.get(a) is not None}
    return min(timed, key=timed.get) if timed else None


def _nearest(rows: list[dict], point: dict) -> dict | None:
    """The measured row nearest to `point` (log scale in each key), or None when some key lies
    outside the measured range by more than a factor of 2: no confidence there."""
    if not rows:
        return None
    for key, value in point.items():
        seen = [r[key] for r in rows]
        if value < min(seen) / 2 or value > max(seen) * 2:
            return None

    def distance(r):
        return sum(abs(math.log2(r[k]) - math.log2(max(v, 1))) for k, v in point.items())
    return min(rows, key=distance)


def best_algorithm(table: dict, nbytes: int, collective: str = "all_reduce") -> str | None:
    """The fastest algorithm of the collective alone at the measured size nearest to `nbytes`, if
    the table measured it and the size is in range."""
    section, algorithms = SECTIONS[collective]
    row = _nearest(table.get(section, []), {"bytes": nbytes})
    return _fastest(row, algorithms) if row else None


def best_fused_algorithm(table: dict, rows: int, row_bytes: int, prologue: bool) -> str | None:
    """The fastest all-reduce with a row epilogue fused (residual add + RMSNorm, as `commfuse.tune`
    times it) at the measured shape nearest to rows x row_bytes, measured with the input's producer
    fusable as one-shot's prologue or not, if the table has such measurements."""
    fused = table.get("fused", [])
    row = _nearest([r for r in fused if r.get("prologue", False) == prologue] or fused,
                   {"rows": rows, "row_bytes": row_bytes})
    algo = _fastest(row, FUSED_ALGORITHMS) if row else None
    return "one_shot" if algo == "one_shot_apart" and not prologue else algo  # nothing to keep apart


def measured_us(world: int, nbytes: int, device, collective: str = "all_reduce") -> dict:
    """{algorithm: µs alone} at the measured size nearest to `nbytes` in this host's table ({}
    without a table, or out of its range)."""
    table, _ = find_table(world, device)
    section, algorithms = SECTIONS[collective]
    row = _nearest(table.get(section, []), {"bytes": nbytes}) if table else None
    return {a: row[a] for a in algorithms if row and row.get(a) is not None}


def lookup(world: int, nbytes: int, device, rows: int | None = None, prologue: bool = False,
           collective: str = "all_reduce"):
    """(algorithm, table file) from this host's table: for a collective alone, or an all-reduce
    with a row epilogue fused when `rows` is given (nbytes is then the whole tensor's); None
    without one."""
    table, path = find_table(world, device)
    if table is None:
        return None
    algo = best_algorithm(table, nbytes, collective) if rows is None else \
        best_fused_algorithm(table, rows, nbytes // rows, prologue)
    return (algo, os.path.basename(path)) if algo else None


def mm_table_path(gpu: str) -> str:
    """The few-row matmul table of a GPU model, by its name ("NVIDIA H100 80GB HBM3")."""
    return os.path.join(MM_TABLE_DIR, re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") + ".json")


def mm_row(device, m: int, k: int, n: int) -> dict | None:
    """This GPU's measured row for `m` rows times a [k, n] weight: of the same K and N, the one of
    the fewest rows at or above m (its blocks fit fewer rows as well); None where none is."""
    path = device is not None and torch.device(device).type == "cuda" and mm_table_path(torch.cuda.get_device_name(device))
    rows = _load(path)["rows"] if path and os.path.exists(path) else []
    return min((r for r in rows if (r["k"], r["n"]) == (k, n) and r["m"] >= m), key=lambda r: r["m"], default=None)
