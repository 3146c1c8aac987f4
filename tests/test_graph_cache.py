"""The on-disk graph cache: a graph compiled again in a fresh Dynamo state is loaded from disk
(lowering does not run) and computes what eager does; whatever the generated code depends on
(config, input dtypes / shapes / strides, a replaced lowering) makes a new entry; a constant's
value always comes from the live graph; a corrupt entry is a miss; the cache can be turned off."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from commfuse import backend, config, graph
from commfuse.choices import Choices
from tests.common import DEVICE
from tests.dist_utils import WORLD, device, run_ranks


@pytest.fixture
def lowerings(monkeypatch):
    """Counts GraphLowering.run calls (the patch is part of the key, the same for every compile
    of a test)."""
    calls = []
    run = graph.GraphLowering.run

    def counted(self):
        calls.append(self.graph_id)
        return run(self)
    monkeypatch.setattr(graph.GraphLowering, "run", counted)
    return calls


@pytest.fixture(autouse=True)
def _without_aot_cache():
    """Our cache alone: AOTAutograd's would hold the graphs too (tests/test_aot_cache.py)."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _compile(fn, *args, cache_dir, **options):
    """fn compiled in a fresh Dynamo state; (its output, the summaries of the graphs it compiled)."""
    torch._dynamo.reset()
    before = len(backend.summaries)
    with config.patch(cache_dir=str(cache_dir), **options):
        out = torch.compile(fn, backend="commfuse")(*args)
    return out, backend.summaries[before:]


def _hits(summaries) -> list[bool]:
    return [s["cache_hit"] for s in summaries]


def _entries(cache_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cache_dir), "graphs", "*.pkl")))


def fn(x, y):
    return torch.softmax(x * 2 + y, -1).sum(0), (x - y).relu()


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(8, 16, device=DEVICE, dtype=dtype), torch.randn(16, device=DEVICE, dtype=dtype)


def test_second_compile_hits_and_matches_eager(tmp_path, lowerings):
    x, y = _inputs()
    out1, s1 = _compile(fn, x, y, cache_dir=tmp_path)
    assert _hits(s1) == [False] and len(lowerings) == 1 and len(_entries(tmp_path)) == 1
    out2, s2 = _compile(fn, x, y, cache_dir=tmp_path)
    assert _hits(s2) == [True] and len(lowerings) == 1, "a hit must not lower again"
    assert s2[0]["cache_key"] == s1[0]["cache_key"]
    assert s2[0]["kernels"] == s1[0]["kernels"]
    for a, b, want in zip(out1, out2, fn(x, y)):
        torch.testing.assert_close(a, want)
        torch.testing.assert_close(b, want)


def test_training_graphs_hit(tmp_path, lowerings):
    """Forward and backward (with its donated saved activations) both come from the cache."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to(DEVICE)
    x = torch.randn(8, 16, device=DEVICE)

    def step(m):
        m.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    want = step(model)
    for hit in (False, True):
        torch._dynamo.reset()
        before = len(backend.summaries)
        with config.patch(cache_dir=str(tmp_path)):
            got = step(torch.compile(model, backend="commfuse"))
        summaries = backend.summaries[before:]
        assert [s["graph_id"].split("_")[1] for s in summaries] == ["forward", "backward"]
        assert _hits(summaries) == [hit, hit]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(lowerings) == 2


@pytest.mark.parametrize("change", ["config", "dtype", "shape", "stride"])
def test_what_the_code_depends_on_is_a_new_entry(tmp_path, change):
    x, y = _inputs()
    _, first = _compile(fn, x, y, cache_dir=tmp_path)
    options = {}
    if change == "config":
        options = {"max_fusion_size": 1}
    elif change == "dtype":
        x, y = _inputs(torch.float64)
    elif change == "shape":
        x = x[:4].clone()
    else:
        x = x.t().contiguous().t()  # same shape and values, column-major
        assert x.stride() != (16, 1)
    out, summaries = _compile(fn, x, y, cache_dir=tmp_path, **options)
    assert _hits(summaries) == [False] and summaries[0]["cache_key"] != first[0]["cache_key"]
    assert len(_entries(tmp_path)) == 2
    for a, want in zip(out, fn(x, y)):
        torch.testing.assert_close(a, want)
    if change == "config":
        assert len(summaries[0]["kernels"]) > len(first[0]["kernels"])


def test_symbolic_sizes(tmp_path, lowerings):
    """A graph with symbolic sizes hits for the same first sizes; other first sizes (the hints
    that shaped its kernels) make another entry. Either way, any size runs right."""
    f = lambda x: (x * 2).softmax(-1) + x.sum()  # noqa: E731
    for n, hit in ((5, False), (5, True), (9, False)):
        torch._dynamo.reset()
        before = len(backend.summaries)
        with config.patch(cache_dir=str(tmp_path)):
            compiled = torch.compile(f, backend="commfuse", dynamic=True)
            for m in (n, n + 3):
                x = torch.randn(m, 6, device=DEVICE)
                torch.testing.assert_close(compiled(x), f(x))
        (summary,) = backend.summaries[before:]
        assert summary["cache_hit"] is hit
    assert len(lowerings) == 2 and len(_entries(tmp_path)) == 2


def test_a_constant_value_comes_from_the_live_graph(tmp_path):
    """Two functions that differ only in a tensor constant's value trace to the same aten graph
    (the constant is a graph attribute): the entry is shared, the value is the live graph's."""
    x = torch.randn(4, 3, device=DEVICE)
    for value, hit in ((1.0, False), (5.0, True)):
        namespace = {"torch": torch}
        exec(f"def f(x):\n    return x * torch.tensor([{value}, 2.0, 3.0], device=x.device) + 1\n", namespace)
        f = namespace["f"]
        out, summaries = _compile(f, x, cache_dir=tmp_path)
        assert _hits(summaries) == [hit]
        torch.testing.assert_close(out, f(x))


def test_a_corrupt_or_foreign_entry_is_a_miss(tmp_path):
    x, y = _inputs()
    _, first = _compile(fn, x, y, cache_dir=tmp_path)
    (entry,) = _entries(tmp_path)
    with open(entry, "wb") as f:
        f.write(b"\x80\x04not a pickle")
    out, summaries = _compile(fn, x, y, cache_dir=tmp_path)
    assert _hits(summaries) == [False]
    for a, want in zip(out, fn(x, y)):
        torch.testing.assert_close(a, want)
    _, summaries = _compile(fn, x, y, cache_dir=tmp_path)
    assert _hits(summaries) == [True], "the miss wrote a good entry again"
    # an entry under another graph's key (a renamed file) is not taken for it
    x2 = x[:4].clone()
    _, other = _compile(fn, x2, y, cache_dir=tmp_path)
    with open(entry, "rb") as f:
        data = f.read()
    with open(os.path.join(str(tmp_path), "graphs", f"{other[0]['cache_key']}.pkl"), "wb") as f:
        f.write(data)
    out, summaries = _compile(fn, x2, y, cache_dir=tmp_path)
    assert _hits(summaries) == [False]
    for a, want in zip(out, fn(x2, y)):
        torch.testing.assert_close(a, want)


def test_the_cache_can_be_turned_off(tmp_path, lowerings):
    x, y = _inputs()
    for _ in range(2):
        out, summaries = _compile(fn, x, y, cache_dir=tmp_path, graph_cache=False)
        assert _hits(summaries) == [False] and summaries[0]["cache_key"] is None
    assert len(lowerings) == 2 and not _entries(tmp_path)


def test_a_replaced_lowering_is_a_new_entry(tmp_path, monkeypatch):
    """A lowering replaced at run time (no file changed) changes the key: the cached code of the
    original lowering is not used for it."""
    from commfuse import lowering
    f = lambda x: torch.tanh(x) + 1  # noqa: E731
    x = torch.randn(32, device=DEVICE)
    _, first = _compile(f, x, cache_dir=tmp_path)
    assert "aten.tanh.default" not in first[0]["fallback_ops"]
    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.tanh.default, lambda *a, **k: None)  # declines
    out, summaries = _compile(f, x, cache_dir=tmp_path)
    assert _hits(summaries) == [False] and "aten.tanh.default" in summaries[0]["fallback_ops"]
    torch.testing.assert_close(out, f(x))


def test_a_lowering_moved_to_another_op_is_a_new_entry(tmp_path, monkeypatch):
    """sin's lowering set to cos's: both are commfuse's own code, which the file digest sees
    unchanged. The entry compiled with it is not used once sin's own is back, nor the reverse."""
    from commfuse import lowering
    lowering.load_all()
    f, x = (lambda x: x.sin() * 4), torch.randn(8, device=DEVICE)
    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.sin.default, lowering.lowerings[torch.ops.aten.cos.default])
    out, _ = _compile(f, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, x.cos() * 4)
    monkeypatch.undo()
    out, summaries = _compile(f, x, cache_dir=tmp_path)
    assert _hits(summaries) == [False]
    torch.testing.assert_close(out, f(x))


def test_a_registered_comm_algorithm_is_in_the_key(monkeypatch):
    """An all-reduce algorithm registered by the user's own file holds code the file digest cannot
    see: its functions are keyed by the file they were written in."""
    from commfuse import collectives, graph_cache
    before = graph_cache.replaced_functions()
    mine = collectives.CommAlgorithm("mine", symmetric=False, call=lambda plan, src, out: f"{out}.copy_({src})")
    monkeypatch.setitem(collectives.ALGORITHMS, "mine", mine)
    added = sorted(set(graph_cache.replaced_functions()) - set(before))
    added = [a for a in added if not a.startswith("commfuse functions: ")]  # the digest of commfuse's own
    assert added and all("ALGORITHMS[mine].call: " + __file__ in a for a in added), added


def test_a_policy_object_is_not_cached(tmp_path):
    """A Choices instance in the config is code the key cannot see: compiled every time."""
    class Mine(Choices):
        pass
    x, y = _inputs()
    for _ in range(2):
        out, summaries = _compile(fn, x, y, cache_dir=tmp_path, choices=Mine())
        assert _hits(summaries) == [False] and "choices" in summaries[0]["cache_skipped"]
    assert not _entries(tmp_path)


def test_dumps_on_a_hit(tmp_path):
    x, y = _inputs()
    cache, dumps = tmp_path / "cache", tmp_path / "dumps"
    _compile(fn, x, y, cache_dir=cache)  # stored without the IR text of dumps
    for hit in (False, True):  # so the first compile with dumps compiles again, then it hits
        _, summaries = _compile(fn, x, y, cache_dir=cache, dump_dir=str(dumps))
        assert _hits(summaries) == [hit]
        folder = os.path.join(str(dumps), "rank0", summaries[0]["graph_id"])
        with open(os.path.join(folder, "timing.json")) as f:  # facts of this run, beside summary.json
            assert json.load(f)["cache_hit"] is hit
        for name in ("fx_graph.txt", "ir_pre_fusion.txt", "ir_post_fusion.txt", "output_code.py"):
            with open(os.path.join(folder, name)) as f:
                assert f.read().strip(), name
        with open(os.path.join(folder, "output_code.py")) as f:
            assert summaries[0]["graph_id"] in f.read()


def test_a_lowering_warning_is_logged_again_on_a_hit(tmp_path, monkeypatch, caplog):
    from commfuse import lowering

    def broken(*args, **kwargs):
        raise RuntimeError("simulated lowering bug")
    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.tanh.default, broken)
    f = lambda x: torch.tanh(x) * 2  # noqa: E731
    x = torch.randn(32, device=DEVICE)
    for hit in (False, True):
        caplog.clear()
        out, summaries = _compile(f, x, cache_dir=tmp_path, fallback_on_error=True)
        assert _hits(summaries) == [hit]
        assert "simulated lowering bug" in caplog.text
        torch.testing.assert_close(out, f(x))


# ------------------------------------------------------------------------------------ 2 ranks
def _ranks_hit_their_own_entries(rank, world, cache_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import backend, config
    fn = lambda x: funcol.all_reduce(x * 2 + 1, "sum", dist.group.WORLD).relu()  # noqa: E731
    x = torch.randn(33, 7, device=device()) + rank
    want = fn(x)
    hits = []
    torch._functorch.config.enable_autograd_cache = False  # our cache alone
    for _ in range(2):
        torch._dynamo.reset()
        before = len(backend.summaries)
        with config.patch(cache_dir=cache_dir):
            out = torch.compile(fn, backend="commfuse")(x)
        torch.testing.assert_close(out, want)
        (s,) = backend.summaries[before:]
        assert s["comm_buffers"], s  # the symmetric-memory path
        hits.append((s["cache_hit"], s["cache_key"]))
    return hits


def test_each_rank_hits_its_own_entry(tmp_path):
    results = run_ranks(_ranks_hit_their_own_entries, WORLD, args=(str(tmp_path),))
    assert [[hit for hit, _ in r] for r in results] == [[False, True]] * WORLD
    keys = {r[0][1] for r in results}
    assert len(keys) == WORLD, "the rank is part of the key"
    assert len(_entries(tmp_path)) == WORLD


def _tp_training_hits(rank, world, cache_dir):
    """A tensor-parallel model's training graphs, compiled three times. DTensor graphs take the
    DeviceMesh as an input (torch >= 2.13) and the backward hands it back: the key describes the
    mesh, and the code returns the mesh of the call, not the one seen while compiling."""
    from torch.distributed.tensor import DTensor
    from bench.llama import Config, tp_llama
    from commfuse import backend, config, graph_cache
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    cfg = Config(dim=32, n_heads=4, n_kv_heads=2, ffn=64, n_layers=1, max_batch=2, max_seq=8)
    model = tp_llama(cfg, world, device())
    x = torch.randn(2, 8, 32, device=device())
    model(x).square().mean().backward()
    want = [local(p.grad).clone() for p in model.parameters()]
    seen, out = [], []  # descriptions of the graphs compiled; (hit, seen before, why not stored)
    torch._functorch.config.enable_autograd_cache = False  # our cache alone
    describe = graph_cache.describe
    graph_cache.describe = lambda *a: seen.append(d := describe(*a)) or d
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        before, known = len(backend.summaries), list(seen)
        with config.patch(cache_dir=cache_dir):
            torch.compile(model, backend="commfuse")(x).square().mean().backward()
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(local(p.grad), g, atol=1e-5, rtol=1e-5)
        out.append([(s["cache_hit"], d in known, s.get("cache_skipped"))
                    for s, d in zip(backend.summaries[before:], seen[len(known):])])
    return out


def test_tensor_parallel_graphs_hit(tmp_path):
    """Every graph is stored, and one traced again as it was is loaded. (On torch 2.11 with CUDA,
    Dynamo's second trace of the model differs from its first: the third is the same.)"""
    for compiles in run_ranks(_tp_training_hits, 2, args=(str(tmp_path),)):
        assert [len(c) for c in compiles] == [2, 2, 2], compiles  # a forward and a backward each
        assert all(why is None and hit == again for c in compiles for hit, again, why in c), compiles
        assert all(hit for hit, _, _ in compiles[-1]), compiles
