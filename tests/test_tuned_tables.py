"""Tuned all-reduce tables: nearest measured point, confidence range, fused measurements by producer."""
import glob
import json

from commfuse import tuned_tables

TABLE = {
    "host": {"gpu": "cpu", "world": 2},
    "measurements": [{"bytes": 4096, "one_shot": 4.0, "two_shot": 8.0, "c10d": 15.0},
                     {"bytes": 1 << 20, "one_shot": 20.0, "two_shot": 12.0, "c10d": 30.0},
                     {"bytes": 64 << 20, "one_shot": 600.0, "two_shot": 340.0, "c10d": 330.0}],
    "fused": [{"rows": 1, "row_bytes": 8192, "prologue": False, "one_shot": 10.0, "two_shot": 8.0},
              {"rows": 8, "row_bytes": 8192, "prologue": False, "one_shot": 8.0, "two_shot": 12.0},
              {"rows": 1, "row_bytes": 8192, "prologue": True, "one_shot": 7.0, "one_shot_apart": 6.0, "two_shot": 8.0},
              {"rows": 8, "row_bytes": 8192, "prologue": True, "one_shot": 5.0, "one_shot_apart": 6.0, "two_shot": 8.0}],
}


def test_all_reduce_alone_takes_the_nearest_size_within_range():
    assert tuned_tables.best_algorithm(TABLE, 4096) == "one_shot"
    assert tuned_tables.best_algorithm(TABLE, 3 << 19) == "two_shot"   # 1.5 MiB: nearest is 1 MiB
    assert tuned_tables.best_algorithm(TABLE, 48 << 20) == "c10d"
    assert tuned_tables.best_algorithm(TABLE, 1024) is None             # below half the smallest size
    assert tuned_tables.best_algorithm(TABLE, 256 << 20) is None        # above twice the largest


def test_fused_choice_by_rows_and_producer():
    assert tuned_tables.best_fused_algorithm(TABLE, 1, 8192, prologue=False) == "two_shot"
    assert tuned_tables.best_fused_algorithm(TABLE, 2, 8192, prologue=False) == "two_shot"
    assert tuned_tables.best_fused_algorithm(TABLE, 16, 8192, prologue=False) == "one_shot"
    assert tuned_tables.best_fused_algorithm(TABLE, 1, 8192, prologue=True) == "one_shot_apart"
    assert tuned_tables.best_fused_algorithm(TABLE, 8, 8192, prologue=True) == "one_shot"
    assert tuned_tables.best_fused_algorithm(TABLE, 64, 8192, prologue=False) is None  # 8x the most rows
    assert tuned_tables.best_fused_algorithm(TABLE, 1, 1024, prologue=False) is None
    # measured with one kind of producer only: those measurements stand for both
    only_mm = {**TABLE, "fused": TABLE["fused"][:2]}
    assert tuned_tables.best_fused_algorithm(only_mm, 1, 8192, prologue=True) == "two_shot"
    only_pointwise = {**TABLE, "fused": TABLE["fused"][2:]}  # apart means one-shot without a producer
    assert tuned_tables.best_fused_algorithm(only_pointwise, 1, 8192, prologue=False) == "one_shot"
    assert tuned_tables.best_fused_algorithm({"measurements": []}, 1, 8192, prologue=False) is None


def test_a_table_for_another_host_is_not_used_and_says_so(tmp_path, caplog):
    from commfuse import config
    path = tmp_path / "table.json"
    path.write_text(json.dumps({**TABLE, "host": {"gpu": "NVIDIA H200", "world": 2}}))
    with config.patch({"comm.table": str(path)}), caplog.at_level("WARNING", logger="commfuse"):
        assert tuned_tables.lookup(2, 4096, "cpu") is None
        assert tuned_tables.lookup(2, 4096, "cpu") is None
    (warning,) = [r.getMessage() for r in caplog.records]  # once
    assert "NVIDIA H200" in warning and "'gpu': 'cpu'" in warning and str(path) in warning
    path.write_text(json.dumps(TABLE))  # this host's: used
    tuned_tables._load.cache_clear()
    with config.patch({"comm.table": str(path)}):
        assert tuned_tables.lookup(2, 4096, "cpu") == ("one_shot", "table.json")


def test_shipped_tables_are_complete():
    paths = glob.glob(f"{tuned_tables.TABLE_DIR}/*.json")
    assert paths
    for path in paths:
        table = json.load(open(path))
        assert {"gpu", "world"} <= set(table["host"]), path
        for row in table["measurements"]:
            assert all(row[a] > 0 for a in tuned_tables.ALGORITHMS), (path, row)
        for row in table.get("fused", []):
            assert row["rows"] >= 1 and row["row_bytes"] > 0 and isinstance(row["prologue"], bool), (path, row)
            assert row["one_shot"] > 0 and row["two_shot"] > 0, (path, row)
            assert row["prologue"] == ("one_shot_apart" in row), (path, row)


def test_tuner_outside_torchrun_says_how_to_run_it(tmp_path, capsys, monkeypatch):
    """With GPUs: run it under torchrun. On a CPU, under torchrun or not: it needs CUDA GPUs."""
    import pytest
    import torch
    from commfuse import tune
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for world in (None, "2") if not torch.cuda.is_available() else (None,):
        if world:
            monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(SystemExit) as e:
            tune.main(["--out", str(tmp_path / "t.json")])
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        assert ("torchrun" in err) if torch.cuda.is_available() else ("needs CUDA GPUs" in err and "torchrun" not in err)
    assert not (tmp_path / "t.json").exists()
