"""Per-rank dumps: COMMFUSE_DUMP_DIR/rank<R>/<graph-id>/ with the FX graph, the IR before
and after fusion, the generated module and a JSON summary, all byte-identical from run to run of
the same program (the rank diff, `commfuse.diff`, compares them); what belongs to one run (compile
time, cache) goes to timing.json beside them."""
from __future__ import annotations

import json
import os

from . import config

RUN_KEYS = ("compile_seconds", "cache_hit", "cache", "cache_key", "cache_skipped")  # timing.json's


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dump_dir(graph_id: str) -> str | None:
    if not config.dump_dir:
        return None
    path = os.path.join(config.dump_dir, f"rank{rank()}", graph_id)
    os.makedirs(path, exist_ok=True)
    return path


def write(graph_id: str, files: dict[str, str], summary: dict) -> str | None:
    path = dump_dir(graph_id)
    if path is None:
        return None
    for name, text in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    run = {k: summary[k] for k in RUN_KEYS if k in summary}
    for name, value in (("summary.json", {k: v for k, v in summary.items() if k not in run}), ("timing.json", run)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(value, f, indent=1, default=str)
    return path
