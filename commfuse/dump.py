"""Per-rank dumps: COMMFUSE_DUMP_DIR/rank<R>/<graph-id>/ with the FX graph, the IR before
and after fusion, the generated module and a JSON summary."""
from __future__ import annotations

import json
import os

from . import config


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
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path
