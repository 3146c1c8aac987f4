"""bench/trace_summary.py: exposed communication from a synthetic Chrome trace (no GPU), and
bench/plot.py's timeline of it."""
import json

import pytest

from bench import trace_summary as ts


def _kernel(name, ts_us, dur, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur, "pid": 0, "tid": stream,
            "args": {"device": 0, "stream": stream}}


TRACE = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},           # host: ignored
    _kernel("sm90_xmma_gemm_bf16", 100, 50),                                         # compute 100-150
    _kernel("ncclDevKernel_AllGather_RING_LL", 120, 60, stream=20),                  # comm 120-180: 30 exposed
    _kernel("cf_one_shot_all_reduce_sum_3", 200, 10),                                # comm 200-210: exposed
    _kernel("cf_allreduce_add_mean_mul_4", 210, 20),                                 # fused: compute 210-230
    _kernel("void c10d::symmetric_memory::two_shot_all_reduce_kernel<>", 225, 10, stream=21),  # comm 225-235: 230-235 exposed
    _kernel("Memcpy PtoP (Device -> Device)", 240, 5, stream=22, cat="gpu_memcpy"),  # comm, exposed 5
    _kernel("Memcpy DtoD (Device -> Device)", 250, 10, cat="gpu_memcpy"),            # counts as compute
    _kernel("triton_poi_fused_mul_0", 260, 40),                                      # compute 260-300
    _kernel("cf_ring_reduce_scatter_sum_5", 270, 20, stream=23),                     # comm hidden under it
]}


def test_exposed_comm_of_a_synthetic_trace():
    assert [ts.is_comm(n) for n in ("ncclKernel_AllReduce", "cf_mm_3", "cf_allreduce_x_1", "cf_two_shot_all_reduce_sum_0",
                                    "triton_red_fused_0", "multimem_all_reduce_kernel")] == [True, False, False, True, False, True]
    s = ts.summarize(TRACE)
    assert s["step µs"] == 200.0  # 100 to 300
    assert s["exposed comm µs"] == 30 + 10 + 5 + 5
    assert s["comm µs"] == 60 + 10 + 10 + 5 + 20
    assert s["compute µs"] == 50 + 20 + 10 + 40
    assert s["exposed share"] == pytest.approx(0.25)
    assert "exposed comm 50.0 µs = 25.0%" in ts.line("x", s)
    assert ts.minus([(0, 10), (20, 30)], [(2, 3), (5, 25)]) == [(0, 2), (3, 5), (25, 30)]


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot
    path = tmp_path / "step_rank0.json"
    path.write_text(json.dumps(TRACE))
    plot.main([str(path), "--out", str(tmp_path)])
    with open(tmp_path / "step_rank0_timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
