"""bench/plot.py draws a PNG from each benchmark JSON kept in bench/results (matplotlib: the bench extra)."""
import os

import pytest

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")


def test_plots_from_the_benchmarks_json(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot
    plot.main([os.path.join(RESULTS, "comm_2xh200_full.json"), os.path.join(RESULTS, "model_tp_2xh100_04bba60.json"),
               "--out", str(tmp_path)])
    for name in ("comm_2xh200_full_all_reduce.png", "model_tp_2xh100_04bba60_decode.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
