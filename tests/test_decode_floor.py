"""bench/decode_floor.py: the decode floor's bytes and all-reduce count read from a TP model's
shapes (2 gloo ranks, no compile) equal the counts written out by hand; the per-kernel table (on
CPU, plain calls, aten's ops standing in for kernels) gives each matmul its inputs' bytes."""
import torch

from bench.llama import Config
from tests.common import DEVICE
from tests.dist_utils import device, run_ranks, use_cuda

CFG = Config(dim=32, n_heads=4, n_kv_heads=2, ffn=64, n_layers=2, max_batch=3, max_seq=16)


def _floors(rank, world):
    from bench import decode_floor
    from bench.llama import llama, tp_llama
    model = tp_llama(CFG, world, device())
    f = decode_floor.floors(model, CFG.max_batch, CFG.dim, pos=11, dtype=next(model.parameters()).dtype, dev=device())
    plain = llama(CFG, 1, device())  # (DTensor's ops would show twice: its own and the local one)
    x, pos = torch.randn(CFG.max_batch, 1, CFG.dim, device=device()), torch.tensor([11], device=device())
    with torch.no_grad():
        f["table"] = decode_floor.kernel_table(lambda: plain(x, pos), 2, device(), bandwidth_gbs=1.0, elem=4)
    return f


def test_floor_terms_from_the_model_shapes():
    hd = CFG.dim // CFG.n_heads
    for f in run_ranks(_floors, 2):
        # per layer, fp32: q, k, v, o, gate, up, down shards over 2 ranks, and 2 replicated norm weights
        weights = CFG.n_layers * 4 * ((CFG.dim * CFG.dim * 2 + 2 * CFG.dim * CFG.n_kv_heads * hd + 3 * CFG.dim * CFG.ffn) / 2
                                      + 2 * CFG.dim)
        cache = CFG.n_layers * 4 * 2 * CFG.max_batch * (CFG.n_kv_heads // 2) * CFG.max_seq * hd  # K and V, this rank's heads
        assert f["floor weight MB"] * 1e6 == weights and f["floor cache MB"] * 1e6 == cache, f
        assert f["floor prefix cache MB"] * 1e6 == cache * 12 / 16  # positions 0..11
        assert f["floor all-reduces"] == 2 * CFG.n_layers  # o and down, row-parallel
        assert f["floor read GB/s"] > 0 and f["floor all-reduce µs"] > 0
        bw = f["floor read GB/s"] * 1e3  # bytes per µs
        assert abs(f["floor µs"] - ((weights + cache) / bw + 4 * f["floor all-reduce µs"])) < 1e-6 * f["floor µs"]
        assert f["prefix floor µs"] < f["floor µs"]
        table = f.pop("table")
        if use_cuda(2):  # replays of a CUDA graph (or plain calls, the heading says why)
            assert "CUDA graph" in table.splitlines()[0] and "| total |" in table, table
            continue
        assert table.startswith("Profiled: 2 steps called one by one") and "| total |" in table, table
        # per layer 7 matmuls (q, k, v, o, gate, up, down), each step; fp32 inputs: rows x K + K x N
        header = next(line for line in table.splitlines() if line.startswith("| kernel |")).split(" | ")
        mm = dict(zip(header, next(line for line in table.splitlines() if line.startswith("| `aten::mm` |")).split(" | ")))
        assert float(mm["launches per step"]) == 7 * CFG.n_layers, mm
        assert float(mm["other ranks' µs"]) > 0, mm  # rank 1's time for the same kernel, beside rank 0's
        k_n = [(CFG.dim, CFG.dim), (CFG.dim, CFG.n_kv_heads * hd), (CFG.dim, CFG.n_kv_heads * hd),
               (CFG.dim, CFG.dim), (CFG.dim, CFG.ffn), (CFG.dim, CFG.ffn), (CFG.ffn, CFG.dim)]
        assert mm["MB per step"] == f"{CFG.n_layers * sum(4 * (CFG.max_batch * k + k * n) for k, n in k_n) / 1e6:.2f}", mm


def test_kernel_bytes_counts_a_tensor_passed_twice_once():
    """The few-row matmul group passes a weight again in place of the workspace it does not need:
    the grouped gate / up launch moves both weights, a and its output once, not the weight twice."""
    from bench import decode_floor
    torch._dynamo.reset()
    w1, w3 = (torch.randn(64, 32, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    x = torch.randn(4, 32, dtype=torch.bfloat16, device=DEVICE)
    f = torch.compile(lambda x: torch.nn.functional.silu(x @ w1.t()) * (x @ w3.t()), backend="commfuse")
    f(x)
    seen = decode_floor.kernel_bytes(lambda: f(x))
    (name,) = [k for k in seen if k.startswith("cf_mm")]
    assert seen[name] == (2 * 64 * 32 + 4 * 32 + 4 * 64) * 2, seen


def test_skew_rows_name_the_kernel_where_ranks_part():
    """The launch-order view averages each position over the steps and keeps only the kernels
    where the ranks differ: here rank 1 idles 4 µs more before its all-reduce on every other step
    (a fill that runs once is left out)."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from bench import decode_floor

    def events(extra_idle):
        out, t = [], 0.0
        for step in range(4):
            for name, us, idle in (("mm", 10.0, 1.0), ("ar", 5.0, 1.0 + extra_idle * (step % 2)), ("attn", 7.0, 1.0)):
                t += idle
                out.append(NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=t, end=t + us, elapsed_us=lambda us=us: us)))
                t += us
        return out + [NS(name="fill", device_type=DeviceType.CUDA, time_range=NS(start=t, end=t + 1, elapsed_us=lambda: 1.0))]
    orders = [decode_floor.in_order(events(x), 4) for x in (0.0, 4.0)]
    assert orders[1] == [["mm", 10.0, 0.0], ["ar", 5.0, 3.0], ["attn", 7.0, 1.0]]
    rows = [r for r in decode_floor._skew_lines(orders) if r.startswith("| 1 ")]
    assert rows == ["| 1 | `ar` | 5.0 / 1.0 | 5.0 / 3.0 |"]
    swapped = events(0.0)
    swapped[-2].name, swapped[-3].name = "ar", "attn"  # the last step runs them in another order
    assert decode_floor.in_order(swapped, 4) is None
