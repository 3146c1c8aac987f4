"""bench/model_tp.py, the distributed benchmark, runs end to end on CPU (2 gloo ranks, tiny sizes):
the sequence-parallel TP training and FSDP2 workloads compile, match eager, and their figures reach
the table and the JSON, warm compile from commfuse's graph cache included; --trace writes a trace
per rank and variant and its exposed-comm figure."""
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --cpu smoke run; on GPUs the benchmark runs for real")
def test_model_tp_cpu_smoke(tmp_path):
    out = tmp_path / "model_tp.md"
    env = {**os.environ, "COMMFUSE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "bench", "model_tp.py"), "--cpu", "--tiny", "--variants", "eager,commfuse",
           "--workloads", "sp,fsdp", "--trace", "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["complete"] and not result["failed"], result
    commfuse = result["results"]["commfuse"]
    for key in ("sp", "fsdp"):
        assert commfuse[f"err {key}"] < 1e-4, commfuse
        assert commfuse[f"{key} ms/step"] > 0 and commfuse[f"compile {key} s"] > 0
        loaded = sum(commfuse[f"warm compile {key} from the {c} cache"] for c in ("graph", "AOTAutograd"))
        assert loaded == 1.0, commfuse  # every graph loaded, from one cache or the other
        assert f"{key} exposed comm %" in commfuse  # no GPU kernels on CPU: the figure, not its value
        for rank in (0, 1):
            with gzip.open(tmp_path / f"model_tp_traces/{key}_commfuse_rank{rank}.json.gz", "rt") as f:
                assert json.load(f)["traceEvents"]
    assert "FSDP2 training fw+bw" in out.read_text() and "sequence-parallel TP training fw+bw" in out.read_text()
