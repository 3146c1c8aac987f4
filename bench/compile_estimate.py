"""Compile bench/models.py's models at their real sizes on a CPU, running no generated kernel: the
kernels and the estimated peak memory of each graph, as commfuse plans them. Nothing is measured.

    python bench/compile_estimate.py --models segformer --modes training

Every generated kernel launch and commfuse's atomic scatter are no-ops (the values are garbage),
so a model whose step takes minutes in Triton's interpreter compiles in seconds; aten's ops (matmuls,
convolutions, attention) still run on the CPU. For a fusion or memory change, compare the table
before and after it; a GPU run of bench/models.py measures what the estimate predicts.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import models as zoo  # noqa: E402
from commfuse import config  # noqa: E402
from commfuse.runtime import launch, scatter  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches():
    """From now on in this process, generated kernels and commfuse's scatter launch nothing."""
    launch.Site.__call__ = lambda self, *a, **k: None
    scatter._add_at = _NoLaunch()


def estimate(name: str, mode: str, dtype: torch.dtype, tiny: bool = False) -> list[dict]:
    """Per compiled graph of one step: its id, kernels and estimated peak (MiB)."""
    torch._dynamo.reset()
    spec = zoo.MODELS[name](tiny, "cpu")
    model = spec.model.eval().to(dtype)
    dump = tempfile.mkdtemp(prefix="compile_estimate_")
    with config.patch(dump_dir=dump), torch.set_grad_enabled(mode == "training"):
        out = torch.compile(model, backend="commfuse")(**spec.inputs(model))
        if mode == "training":
            spec.loss(out).backward()
    rows = []
    for path in sorted(glob.glob(f"{dump}/rank0/*/summary.json")):
        s = json.load(open(path))
        rows.append({"graph": os.path.basename(os.path.dirname(path)), "kernels": len(s.get("kernels", [])),
                     "peak_mib": round(s.get("peak_memory_estimate", 0) / 2**20, 1)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="segformer", help="comma-separated, from " + ",".join(zoo.MODELS))
    ap.add_argument("--modes", default="inference,training")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny configs")
    args = ap.parse_args()
    stub_launches()
    print("| model | mode | graph | kernels | estimated peak MiB |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for r in estimate(name, mode, getattr(torch, args.dtype), args.tiny):
                print(f"| {name} | {mode} | {r['graph']} | {r['kernels']} | {r['peak_mib']} |", flush=True)


if __name__ == "__main__":
    main()
