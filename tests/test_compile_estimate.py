"""bench/compile_estimate.py: a model compiled with no kernel run reports each graph's kernels and
peak estimate. Run in a subprocess: the script stubs launches for its whole process."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = """
import json, torch
from bench import compile_estimate as ce
ce.stub_launches()
print(json.dumps(ce.estimate("gpt2", "training", torch.float32, tiny=True)))
"""


def test_tiny_gpt2_training_graphs_are_estimated(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMMFUSE_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["graph"].split("_")[1] for r in rows] == ["forward", "backward"], rows
    assert all(r["kernels"] > 0 and r["peak_mib"] > 0 for r in rows), rows
