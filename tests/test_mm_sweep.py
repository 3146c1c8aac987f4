"""bench/mm_sweep.py's pruning and its table: a sweep's JSON written into commfuse/tables/mm/ is
what the policy then picks (block sizes, or cuBLAS where it won), and other shapes keep the heuristic."""
import json

import torch

from bench import mm_sweep
from commfuse import tuned_tables
from commfuse.choices import Choices

GPU = "NVIDIA Test GPU 80GB"


def test_candidates_split_k_evenly_and_fill_the_sms():
    for world, fused in ((2, False), (4, False), (2, True)):
        for k, n in mm_sweep.shapes(world, fused).values():
            found = mm_sweep.tiles(8, k, n, sms=132)
            assert found, (k, n)
            programs = [-(-n // t["BLOCK_N"]) * t["SPLIT_K"] for t in found]
            assert all(k % (t["BLOCK_K"] * t["SPLIT_K"]) == 0 for t in found)
            assert all(132 <= p <= 8 * 132 for p in programs) or max(programs) < 132 and 2 * min(programs) >= max(programs), (k, n)
            for v in mm_sweep.variants(found[0], 32):
                assert mm_sweep.stage_bytes(32, v["BLOCK_N"], v["BLOCK_K"]) * v["num_stages"] <= mm_sweep.SMEM


def test_written_table_is_what_the_policy_picks(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned_tables, "MM_TABLE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8, "num_stages": 5}
    result = lambda m, us, cublas: {"m": m, "k": 4096, "n": 3072, "best": {"config": cfg, "us": us}, "cublas": {"us": cublas}}
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"meta": {"device_name": GPU, "commit": "abc", "date": "today"},
                                 "results": [result(8, 10.0, 12.0), result(32, 14.0, 11.0)]}))
    path = mm_sweep.write_table(str(sweep))
    assert path == str(tmp_path / "nvidia_test_gpu_80gb.json")
    cuda = torch.device("cuda", 0)
    assert Choices().mm_template_config(3, 3072, 4096, cuda) == {"BLOCK_M": 16, **cfg}  # the 8-row row
    assert tuned_tables.mm_row(cuda, 8, 4096, 3072)["us"] == 10.0
    assert tuned_tables.mm_row(cuda, 20, 4096, 3072)["cublas_us"] == 11.0  # cuBLAS won at 32 rows
    assert tuned_tables.mm_row(cuda, 33, 4096, 3072) is None
    heuristic = Choices().mm_template_config(8, 3072, 4096)  # no device, another shape: the heuristic
    assert Choices().mm_template_config(8, 3072, 4096, torch.device("cpu")) == heuristic
    assert Choices().mm_template_config(8, 4096, 4096, cuda)["BLOCK_N"] == 64


def _one_row_table(tmp_path, monkeypatch, mkn, block_n, us, cublas_us):
    """This test GPU's table: one measured shape, its tiles `block_n` wide."""
    monkeypatch.setattr(tuned_tables, "MM_TABLE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    cfg = {"BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 3}
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"meta": {"device_name": GPU, "commit": "abc", "date": "today"}, "results": [
        dict(zip("mkn", mkn), best={"config": cfg, "us": us}, cublas={"us": cublas_us})]}))
    mm_sweep.write_table(str(sweep))


def test_a_rotary_epilogue_joins_and_widens_a_measured_narrower_tile(tmp_path, monkeypatch):
    """A rotary embedding's epilogue needs tiles a head wide; where this GPU's table measured the
    group's matmul with narrower tiles, the epilogue still joins and the group takes the heuristic's
    blocks, widened to a head; where the row's tiles are wide enough, the row's."""
    _one_row_table(tmp_path, monkeypatch, (8, 4096, 1536), 32, 7.5, 8.4)
    cuda, policy = torch.device("cuda", 0), Choices()
    assert policy.mm_epilogue(2, (8, 1536, 4096, cuda), 128) and policy.mm_epilogue(2, (8, 1536, 4096, cuda), 16)
    assert policy.mm_template_config(8, 1536, 4096, cuda, dots=2, width=128)["BLOCK_N"] == 128
    assert policy.mm_template_config(8, 1536, 4096, cuda)["BLOCK_N"] == 32  # the measured row


class _Box:  # what use_mm_template asks of a lowered operand
    def __init__(self, size, device):
        self.size, self.device = size, device

    def get_size(self):
        return self.size

    def get_dtype(self):
        return torch.bfloat16

    def get_device(self):
        return self.device


def test_cublas_where_it_won_unless_other_matmuls_share_the_operand(tmp_path, monkeypatch):
    """Where the table has cuBLAS faster at a shape, a lone matmul runs cuBLAS, but one whose left
    operand other matmuls read (q beside k and v) stays in the template: one launch for the group."""
    _one_row_table(tmp_path, monkeypatch, (8, 2048, 2048), 64, 6.4, 6.2)
    cuda = torch.device("cuda", 0)
    a, b = _Box([8, 2048], cuda), _Box([2048, 2048], cuda)
    assert not Choices().use_mm_template(a, b)
    assert Choices().use_mm_template(a, b, siblings=2)
    assert Choices().use_mm_template(a, _Box([2048, 512], cuda))  # no row: the template


def test_sibling_matmuls_are_counted_through_views():
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowering.matmul import _sibling_mms

    def layer(x, wq, wk, wo):  # q and k each view x anew, as nn.Linear does; o reads another operand
        q = x.view(8, 64) @ wq
        k = x.reshape(8, 64) @ wk
        return q, k, q @ wo

    gm = make_fx(layer)(torch.randn(8, 1, 64), torch.randn(64, 64), torch.randn(64, 16), torch.randn(64, 64))
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [_sibling_mms(n) for n in mms] == [1, 1, 0]
