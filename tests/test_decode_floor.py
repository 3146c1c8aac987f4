"""bench/decode_floor.py: the decode floor's bytes and all-reduce count read from a TP model's
shapes (2 gloo ranks, no compile) equal the counts written out by hand."""
from bench.llama import Config
from tests.dist_utils import device, run_ranks

CFG = Config(dim=32, n_heads=4, n_kv_heads=2, ffn=64, n_layers=2, max_batch=3, max_seq=16)


def _floors(rank, world):
    from bench import decode_floor
    from bench.llama import tp_llama
    model = tp_llama(CFG, world, device())
    return decode_floor.floors(model, CFG.max_batch, CFG.dim, pos=11, dtype=next(model.parameters()).dtype, dev=device())


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
