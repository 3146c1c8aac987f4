"""The decode step of bench/llama.py (static KV cache as module buffers written by index_copy_,
rotary tables gathered at `pos`, the mask positions <= pos, HF repeat_kv, SDPA), compiled on a
world-1 gloo group as bench/model_tp.py compiles it: the cache is written in place by the kernel
that computes K (rotary) and V, and no copy or aten index op is left in the step. With
`decode_attention`, attention is our split-KV kernel too, reading the cache in place."""
import re

import pytest
import torch

from bench.llama import Config, tp_llama
from tests.common import DEVICE
from tests.dist_utils import device, run_ranks

CFG = Config(dim=32, n_heads=4, n_kv_heads=2, ffn=32, n_layers=2, max_batch=2, max_seq=12)


def _steps(dump_dir, generated, positions=(5, 6)):
    from commfuse import config
    from tests.common import Dumps
    torch._dynamo.reset()  # Dynamo's guards do not see config: the other variant's graph would run
    dtype = torch.bfloat16 if device().type == "cuda" else torch.float32  # as the bench runs it
    models = [tp_llama(CFG, 1, device(), dtype) for _ in range(2)]
    torch.manual_seed(1)
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    start = [torch.randn_like(b) for n, b in models[0].named_buffers() if "cache" in n]
    for m in models:
        for b, s in zip((b for n, b in m.named_buffers() if "cache" in n), start):
            b.copy_(s)
    compiled, eager = models
    ptrs = [b.data_ptr() for n, b in compiled.named_buffers() if "cache" in n]
    fn = torch.compile(compiled, backend="commfuse", dynamic=False)
    bad = {}
    with torch.no_grad(), config.patch(dump_dir=dump_dir, decode_attention=generated):
        for p in positions:
            x, pos = torch.randn(CFG.max_batch, 1, CFG.dim, device=device(), dtype=dtype), torch.tensor([p], device=device())
            got, want = fn(x, pos), eager(x, pos)
            bad[f"out {p}"] = (got - want).abs().max().item()
    for (n, a), b in zip(((n, b) for n, b in compiled.named_buffers() if "cache" in n),
                         (b for n, b in eager.named_buffers() if "cache" in n)):
        bad[n] = (a - b).abs().max().item()
    same = ptrs == [b.data_ptr() for n, b in compiled.named_buffers() if "cache" in n]
    return bad, same, [Dumps(dump_dir).code(g) for g in Dumps(dump_dir).graphs()]


def _both(rank, world, dump_dir):
    return [_steps(f"{dump_dir}/{name}", name == "generated") for name in ("aten", "generated")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_both, 1, args=(str(tmp_path_factory.mktemp("decode_step")),))[0]


@pytest.mark.parametrize("variant", [0, 1], ids=["aten_attention", "generated_attention"])
def test_decode_step_matches_eager(runs, variant):
    bad, same, _ = runs[variant]
    # fp32 on CPU (aten's and our attention sum in other orders); bf16 on CUDA
    tol = 1e-4 if DEVICE == "cpu" else 1e-1  # bf16: eager rounds after each op, kernels once
    assert all(v < tol for v in bad.values()), bad
    assert same  # the module's cache tensors themselves hold the steps


def test_decode_step_with_generated_attention_runs_no_aten_attention(runs):
    (code,) = runs[1][2]
    host = code.split("def call(", 1)[1]
    assert "scaled_dot_product" not in host and "decode_attention" not in host, host
    assert len(re.findall(r"cf_attn_buf\d+_launch", host)) == CFG.n_layers, host


@pytest.mark.parametrize("variant", [0, 1], ids=["aten_attention", "generated_attention"])
def test_decode_step_has_no_copy_and_no_aten_index(runs, variant):
    _, _, codes = runs[variant]
    (code,) = codes  # one graph: the second step reuses the first's
    host = code.split("def call(", 1)[1]
    for bad in (".copy_(", "clone", "contiguous", "aten.index", "aten.copy", "aten.gather", "index_copy"):
        assert bad not in host, (bad, host)
    # the only aten ops left: fp32 matmuls and (unless generated) the attention itself
    calls = set(re.findall(r"\b(aten\.[\w.]+)\(", host))
    assert all(c == "aten.mm.out" or (variant == 0 and "scaled_dot_product" in c) for c in calls), calls
    # each layer's K and V cache (graph inputs) stored into by a generated kernel, at the position
    caches = re.findall(r"# effect: stores into input (arg\d+_1)", host)
    assert len(set(caches)) == 2 * CFG.n_layers, host
    for arg in caches:
        buf = re.search(rf"(buf\d+) = {arg}  # stored into in place", host).group(1)
        launch = next(line for line in host.splitlines() if "_launch" in line and f" {buf}," in line)
        kernel = launch.split("_launch")[0].strip()
        params = code.split(f"def {kernel}(", 1)[1].split(")", 1)[0].split(", ")
        args = re.search(r"\(_stream, \((?:[^()]|\([^()]*\))*\), (.*)\)$", launch).group(1).split(", ")
        param = params[args.index(buf)]
        assert re.search(rf"tl\.store\({param} \+ \(.*tmp\d+", code.split(f"def {kernel}(", 1)[1]), kernel
