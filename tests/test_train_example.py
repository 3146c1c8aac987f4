"""The README's first command: launch/train_example.py under torchrun on 2 ranks (gloo on CPU),
tensor-parallel training checked against eager on every step (the script stops on a mismatch),
and its closing report naming commfuse's comm kernels and what they fused."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run needs 2 GPUs and NCCL: run the README command")
def test_torchrun_tensor_parallel_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "COMMFUSE_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "launch/train_example.py", "--steps", "2"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"summary: 2 steps on 2 rank\(s\), backend=commfuse: .* loss \S+, grad \S+, params \S+\. OK", out), out[-4000:]
    for rank in (0, 1):
        steps = re.findall(rf"\[rank{rank}\] step \d: loss (\S+) \(eager (\S+)\)", out)
        assert len(steps) == 2 and all(abs(float(a) - float(b)) < 1e-4 for a, b in steps), out[-4000:]
        report = [line for line in out.splitlines() if line.startswith(f"[rank{rank}]   ")]
        # the forward and backward graphs each all-reduce twice, as commfuse comm kernels with a fused neighbour
        graphs = [line for line in report if re.search(r"g00\d_(forward|backward)_\w+: \d+ kernels \(2 comm\)", line)]
        assert len(graphs) == 2, report
        fused = [line for line in report if "all_reduce sum" in line and "comm kernel cf_allreduce" in line
                 and re.search(r"fused with [1-9]\d* epilogue node", line)]
        assert len(fused) == 4, report
