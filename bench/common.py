"""What the single-GPU benchmark scripts share: their --out / --commit / --set options, the run's
metadata (versions, commit, date) and the results written as a markdown table plus its JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_run_args(ap, example: str) -> None:
    ap.add_argument("--out", help="also write the markdown table to OUT and the data to OUT with .json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse, where .git exists)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help=f"a commfuse option for this run, e.g. --set {example} (repeatable)")


def commfuse_options(ap, items: list[str]) -> dict:
    """--set NAME=VALUE items as commfuse options, each value coerced to the option's type."""
    options = {}
    for item in items:
        from commfuse import config
        name, _, value = item.partition("=")
        if name not in config.snapshot():
            ap.error(f"unknown commfuse option {name!r}")
        options[name] = config.parse(name, value, f"--set {name}")
    return options


def run_meta(device_name: str, commit: str | None) -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                          capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        commit = commit or "unknown"
    return {"device_name": device_name, "torch": torch.__version__, "triton": triton_version,
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_results(out: str | None, table: str, data: dict, partial: bool = False) -> None:
    """Print the table; with `out`, write it there and `data` beside it as .json. `partial`: the
    rows so far, written quietly after each one, so that a run cut by a time limit keeps them."""
    if not partial:
        print(table)
    if not out:
        return
    with open(out, "w") as f:
        f.write(table)
    base = out[: -len(".md")] if out.endswith(".md") else out
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    if not partial:
        print(f"wrote {out} and {base}.json", file=sys.stderr)
