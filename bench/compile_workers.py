"""Cold compile time with and without compiling the kernels ahead of time (`compile_workers`).

    python bench/compile_workers.py                                  # gpt2 inference and training, 0 vs auto
    python bench/compile_workers.py --models gpt2,llama --modes training --workers 0,4,auto

Each setting runs bench/models.py (commfuse only, one timing round) in a fresh process with empty
Inductor / Triton / commfuse caches, and the table shows its `compile cold`: the seconds of the
first step, compile and first call (which waits for the pool) together. "auto" leaves the option
unset (the host's CPUs over LOCAL_WORLD_SIZE). Needs a GPU: on CPU (--cpu) nothing is compiled ahead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2")
    ap.add_argument("--modes", default="inference,training")
    ap.add_argument("--workers", default="0,auto", help="comma-separated compile_workers values; auto: unset")
    ap.add_argument("--backends", default="commfuse", help="add inductor for its cold compile beside")
    ap.add_argument("--cpu", action="store_true", help="checks the script on CPU (--cpu --tiny): measures nothing")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items()  # bench/models.py then makes new, empty caches
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "COMMFUSE_CACHE_DIR", "COMMFUSE_COMPILE_WORKERS")}
    out_dir = tempfile.mkdtemp(prefix="compile_workers_")
    cold, kernels, inductor = {}, {}, {}
    for w in args.workers.split(","):
        out = os.path.join(out_dir, f"w{w}.md")
        cmd = [sys.executable, os.path.join(ROOT, "bench", "models.py"), "--models", args.models, "--modes",
               args.modes, "--backends", args.backends, "--rounds", "1", "--out", out]
        cmd += ([] if w == "auto" else ["--set", f"compile_workers={w}"]) + (["--cpu", "--tiny"] if args.cpu else [])
        print(f"compile_workers={w}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            rows = json.load(open(out[:-3] + ".json"))["rows"]
        except OSError:
            print(f"compile_workers={w}: bench/models.py wrote no results", file=sys.stderr)
            continue
        for r in rows:
            key = (r["model"], r["mode"])
            cold.setdefault(key, {})[w] = r.get("commfuse", {}).get("cold_s")
            kernels[key] = r.get("commfuse", {}).get("kernels")
            inductor.setdefault(key, r.get("inductor", {}).get("cold_s"))
    ws = args.workers.split(",")
    print("| model | mode | kernels | " + " | ".join(f"cold s, workers={w}" for w in ws) + " | inductor cold s |")
    print("|" + "---|" * (4 + len(ws)))
    for (model, mode), by_w in cold.items():
        cells = " | ".join("—" if by_w.get(w) is None else f"{by_w[w]:.1f}" for w in ws)
        ind = inductor.get((model, mode))
        print(f"| {model} | {mode} | {kernels[(model, mode)]} | {cells} | {'—' if ind is None else f'{ind:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
