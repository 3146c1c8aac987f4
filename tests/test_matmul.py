"""The few-row matmul template: values against eager, the prologue fused, split-K across calls."""
import glob
import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck

from commfuse import config
from tests.common import DEVICE


def _compile_and_check(fn, args, dump_dir, calls=3):
    torch._dynamo.reset()
    with config.patch(dump_dir=str(dump_dir)):
        compiled = torch.compile(fn, backend="commfuse", dynamic=False)
        want = fn(*args)
        for call in range(calls):  # a split-K workspace left dirty would show from the second call
            got = compiled(*args)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"call {call}")
    (path,) = glob.glob(f"{dump_dir}/rank0/*/summary.json")
    return json.load(open(path)), open(path.replace("summary.json", "output_code.py")).read()


@pytest.mark.parametrize("m,k,n", [(1, 256, 80), (8, 64, 96), (3, 512, 64), (16, 96, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_prologue_is_computed_in_the_matmul(tmp_path, m, k, n, dtype):
    torch.manual_seed(0)
    a, w = torch.randn(m, k, dtype=dtype, device=DEVICE), torch.randn(k, n, dtype=dtype, device=DEVICE) / k ** 0.5
    s, code = _compile_and_check(lambda a, w: F.silu(a * 2) @ w, (a, w), tmp_path)
    (kernel,) = s["kernels"]  # silu is never stored: one kernel, no aten mm
    assert kernel["template"] == "mm" and kernel["prologue"] and not s["extern_calls"], s
    # the prologue's load is issued a step ahead; silu is computed on it in the loop, before tl.dot
    FileCheck().check(f"def {kernel['name']}(").check("pf0 = tl.load(ptr_arg0_1 + ").check(
        "for roffset in range(").check_next("pf0_now = pf0").check("pf0 = tl.load(ptr_arg0_1 + ").check(
        "= pf0_now").check("tl.sigmoid(").check("acc0 = tl.dot(a, b, acc0)").run(code)
    if (m, k, n) == (3, 512, 64):  # one column block: K is split over four programs
        assert kernel["config"]["SPLIT_K"] == 4
        FileCheck().check(f"{kernel['name']}_launch0 = Site({kernel['name']}, dict(").check_same("SPLIT_K=4").check(
            f"{kernel['name']}_launch0(_stream, (").check_same(f"workspace(_workspaces, '{kernel['name']}_sums'").run(code)


def test_strided_operands(tmp_path):
    """a transposed (a view), b a Linear weight used through .t(): strides, not copies."""
    torch.manual_seed(0)
    x = torch.randn(64, 8, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(48, 64, dtype=torch.bfloat16, device=DEVICE) / 8
    s, _ = _compile_and_check(lambda x, weight: F.linear(x.t(), weight), (x, weight), tmp_path)
    assert [k.get("template") for k in s["kernels"]] == ["mm"] and not s["extern_calls"], s


@pytest.mark.parametrize("case", ["rows", "fp32", "off"])
def test_aten_mm_where_the_template_does_not_apply(tmp_path, case):
    m, dtype = (17, torch.bfloat16) if case == "rows" else (8, torch.float32 if case == "fp32" else torch.bfloat16)
    torch.manual_seed(0)
    a, w = torch.randn(m, 32, dtype=dtype, device=DEVICE), torch.randn(32, 48, dtype=dtype, device=DEVICE)
    with config.patch(mm_template=case != "off"):
        s, _ = _compile_and_check(lambda a, w: a @ w, (a, w), tmp_path, calls=1)
    assert s["extern_calls"] == ["aten.mm.out"] and not any(k.get("template") for k in s["kernels"]), s


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(8, 4096, 7168), (8, 7168, 4096)])
def test_decode_sizes_on_gpu(tmp_path, m, k, n):
    """The sizes the configs were measured on: unsplit, and split-K in 4 (the atomics path)."""
    torch.manual_seed(0)
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(k, n, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    s, _ = _compile_and_check(lambda a, w: F.silu(a) @ w, (a, w), tmp_path)
    assert s["kernels"][0]["template"] == "mm", s


def test_mm_template_config_follows_the_sweep():
    from commfuse.choices import Choices
    up, down = Choices().mm_template_config(8, 7168, 4096), Choices().mm_template_config(8, 4096, 7168)
    assert (up["SPLIT_K"], up["BLOCK_K"], down["SPLIT_K"], down["BLOCK_K"]) == (1, 256, 4, 128)
    # gate and up side by side in one program (3584 columns each): one 7168-column matmul's
    # program, each weight's tile half as wide
    assert Choices().mm_template_config(8, 7168, 4096, dots=2) == {**up, "BLOCK_N": up["BLOCK_N"] // 2}
