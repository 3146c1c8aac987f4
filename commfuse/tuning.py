"""Tuned all-reduce tables: which algorithm is fastest at which size, measured on a host.

A table is the JSON that `python -m commfuse.tune` writes: the host it was measured on (GPU name,
world size, link) and, per size, the latency of each algorithm. The compiler uses a table only when
it matches this host and the size lies within the measured range; otherwise choices.py falls back
to its built-in thresholds. Tables for shipped hosts live in commfuse/tables/.
"""
from __future__ import annotations

import functools
import glob
import json
import math
import os

import torch

from . import config

ALGORITHMS = ("one_shot", "two_shot", "c10d")
TABLE_DIR = os.path.join(os.path.dirname(__file__), "tables")


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
    return None, None


def best_algorithm(table: dict, nbytes: int) -> str | None:
    """The fastest algorithm at the measured size nearest to `nbytes` (log scale), if in range."""
    rows = table["measurements"]
    sizes = [r["bytes"] for r in rows]
    if not sizes or nbytes < min(sizes) / 2 or nbytes > max(sizes) * 2:
        return None  # not enough confidence outside what was measured
    row = min(rows, key=lambda r: abs(math.log2(r["bytes"]) - math.log2(max(nbytes, 1))))
    timed = {a: row[a] for a in ALGORITHMS if row.get(a) is not None}
    return min(timed, key=timed.get) if timed else None


def lookup(world: int, nbytes: int, device):
    table, path = find_table(world, device)
    if table is None:
        return None
    algo = best_algorithm(table, nbytes)
    return (algo, os.path.basename(path)) if algo else None
