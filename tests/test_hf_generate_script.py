"""bench/hf_generate.py, a user's decode path (HF generate() with a static cache, model.forward
compiled, tensor-parallel with parallelize_module), runs end to end on CPU at 2 gloo ranks: the
teacher-forced logits match eager's, the figures reach the table and the JSON; and its table flags
a commfuse error above the bench's rule."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --cpu smoke run; on GPUs the benchmark runs for real")
def test_hf_generate_tp_cpu_smoke(tmp_path):
    out = tmp_path / "hf_generate.md"
    env = {**os.environ, "COMMFUSE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "bench", "hf_generate.py"), "--cpu", "--tiny", "--layers", "1", "--new-tokens", "3",
           "--variants", "eager,commfuse", "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert not result["failed"] and result["world"] == 2, result
    assert result["logit scale"] > 0  # the reference logits are not all zero
    commfuse = result["results"]["commfuse"]
    assert commfuse["err logits"] < 1e-4, commfuse  # fp32: every step's logits as eager's
    assert commfuse["tokens/s"] > 0 and commfuse["first generate s"] > 0 and commfuse["tokens equal %"] >= 0
    assert "tensor-parallel over 2" in out.read_text() and "| commfuse vs eager |" in out.read_text()


def test_table_flags_a_logit_error_above_the_rule():
    from bench import hf_generate
    a = SimpleNamespace(arch="llama", layers=1, hidden=8, heads=2, kv_heads=2, ffn=8, vocab=8, dtype_name="float32", compile="forward",
                        dtype=torch.float32, batch=1, prompt=2, new_tokens=2)
    variants = ["eager", "inductor", "commfuse"]
    res = {"eager": {"err logits": 0.0, "ms/generate": 4.0}, "inductor": {"err logits": 1e-3, "ms/generate": 2.0},
           "commfuse": {"err logits": 1e-3, "ms/generate": 1.0}}
    text, flagged = hf_generate.table(a, res, {}, variants, 1, "CPU", scale=1.0)
    assert not flagged and "!" not in text
    assert "| generate: ms per call | 4.0 | 2.0 | 1.0 | 4.00× | 2.00× |" in text  # speed-ups: other / commfuse
    res["commfuse"]["err logits"] = 0.2  # above 5 x Inductor's and 1e-2
    text, flagged = hf_generate.table(a, res, {}, variants, 1, "CPU", scale=1.0)
    assert flagged and "2.00e-01 !" in text
