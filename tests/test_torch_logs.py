"""commfuse through torch's logging: TORCH_LOGS=output_code prints our generated module,
TORCH_LOGS=commfuse one progress line per graph, TORCH_TRACE writes structured-trace artifacts
(what tlparse shows per rank and compile). Each in a fresh process: torch reads both at import."""
import glob
import json
import os
import subprocess
import sys

import torch

from commfuse import dump
from tests.common import DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = """
import torch, commfuse
def f(x, w):
    return torch.relu(x @ w).sum(-1) * 2
x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
torch.testing.assert_close(torch.compile(f, backend="commfuse")(x, w), f(x, w))
"""


def _run(tmp_path, **env):
    env = dict(os.environ, COMMFUSE_CACHE_DIR=str(tmp_path / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache" / "inductor"), **env)
    run = subprocess.run([sys.executable, "-c", f"DEVICE = {DEVICE!r}" + PROGRAM], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return run.stderr


def test_torch_logs_output_code_and_progress_and_trace(tmp_path):
    err = _run(tmp_path, TORCH_LOGS="output_code,commfuse", TORCH_TRACE=str(tmp_path / "trace"))
    assert "commfuse output_code of graph g000_inference_" in err, err
    assert "# commfuse generated code: graph g000_inference_" in err and "@triton.jit" in err, err
    progress = [line for line in err.splitlines() if "aten nodes ->" in line]
    assert len(progress) == 1 and "lowering" in progress[0] and "cache miss" in progress[0], err
    # the structured trace: our artifacts, under the compile that made them
    records = [json.loads(line.split("] ", 1)[1]) for path in glob.glob(str(tmp_path / "trace" / "*"))
               for line in open(path) if '"commfuse_g000_inference_' in line]
    assert sorted(r["artifact"]["name"].split("_", 4)[-1] for r in records) == \
        ["comm_plans", "ir_post_fusion", "ir_pre_fusion", "output_code"], records
    assert all(r.get("frame_id") == 0 for r in records), records


def test_a_long_compile_says_so_on_rank_0_by_default(capfd, monkeypatch):
    monkeypatch.setattr(dump, "SLOW_COMPILE_S", 0.0)  # every compile is long

    def f(x):
        return torch.sin(x) + 1
    x = torch.randn(8, device=DEVICE)
    torch.testing.assert_close(torch.compile(f, backend="commfuse")(x), f(x))
    err = capfd.readouterr().err
    assert "commfuse: graph g" in err and "aten nodes -> 1 kernels (0 comm)" in err, err
