"""Memory-aware fusion and scheduling: read-accumulation limits."""
import re

import pytest
import torch

from tests.common import DEVICE, compile_and_run

N = 16
F32 = torch.float32.itemsize


def _mm_outputs(code: str) -> set:
    return set(re.findall(r"aten\.mm\.out\(.*out=(buf\d+)\)", code))


# ----------------------------------------------------------------------------- read accumulation
def accumulate(x, ws):
    total = x
    for w in ws:
        total = total + x @ w
    return total


def _accumulation(tmp_path, **options):
    torch.manual_seed(0)
    x, ws = torch.randn(N, N, device=DEVICE), [torch.randn(N, N, device=DEVICE) for _ in range(10)]
    out, dumps = compile_and_run(accumulate, x, ws, tmp_path=tmp_path, **options)
    torch.testing.assert_close(out, accumulate(x, ws), atol=1e-4, rtol=1e-4)
    summary, code = dumps.only()
    mms = _mm_outputs(code)
    assert len(mms) == 10
    return [set(k["reads"]) & mms for k in summary["kernels"]]


def test_accumulation_without_thresholds_is_one_kernel(tmp_path):
    reads = _accumulation(tmp_path, realize_acc_reads_threshold=1000, realize_acc_reads_size_threshold=None)
    assert [len(r) for r in reads] == [10]  # one kernel keeps all ten matmul outputs alive


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_size_threshold_bounds_reads_per_kernel(tmp_path, k):
    reads = _accumulation(tmp_path, realize_acc_reads_size_threshold=k * N * N * F32)
    assert max(len(r) for r in reads) <= k, reads
    assert len(set().union(*reads)) == 10


def test_accumulation_count_threshold_alone_still_fuses(tmp_path):
    # realizing by count bounds inlined bodies; the scheduler fuses the pieces back (no memory cost)
    reads = _accumulation(tmp_path, realize_acc_reads_threshold=3)
    assert [len(r) for r in reads] == [10]
