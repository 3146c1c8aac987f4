"""AOTAutograd's cache holds commfuse's compiled graphs: a graph compiled again in a fresh Dynamo
state skips AOTAutograd's trace and our lowering alike, and computes what eager does, forward and
backward; whatever our key covers (config, our cache folder) makes a new entry; a graph run
through aten, or compiled with dumps on, is never taken from it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from commfuse import backend, config, graph
from tests.common import DEVICE


@pytest.fixture
def lowerings(monkeypatch):
    calls = []
    run = graph.GraphLowering.run
    monkeypatch.setattr(graph.GraphLowering, "run", lambda self: calls.append(self.graph_id) or run(self))
    return calls


def _compiled(fn, *args, cache_dir, **options):
    """fn run compiled in a fresh Dynamo state: (its output, the summaries of its graphs)."""
    torch._dynamo.reset()
    before = len(backend.summaries)
    with config.patch(cache_dir=str(cache_dir), **options):
        out = fn(*args)
    return out, backend.summaries[before:]


def _sources(summaries) -> list:
    return [s["cache"] for s in summaries]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).to(DEVICE)


def _step(model, x):
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_training_graphs_come_from_aot_autograds_cache(tmp_path, lowerings):
    model, x = _model(), torch.randn(8, 16, device=DEVICE)
    want = _step(model, x)
    for source in (None, "AOTAutograd", "AOTAutograd"):
        got, summaries = _compiled(lambda: _step(torch.compile(model, backend="commfuse"), x), cache_dir=tmp_path)
        assert [s["graph_id"].split("_")[1] for s in summaries] == ["forward", "backward"]
        assert _sources(summaries) == [source, source]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(lowerings) == 2, "a hit lowers nothing"
    assert torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] >= 2


def test_a_constant_is_stored_with_the_graph(tmp_path):
    def fn(x):
        return x * torch.tensor([1.0, -2.0, 3.0, 0.5], device=x.device) + x.sum()
    x = torch.randn(5, 4, device=DEVICE)
    for source in (None, "AOTAutograd"):
        out, summaries = _compiled(torch.compile(fn, backend="commfuse"), x, cache_dir=tmp_path)
        assert _sources(summaries) == [source]
        torch.testing.assert_close(out, fn(x))


@pytest.mark.parametrize("boolean", [True, False])
def test_a_graph_commfuse_rewrote_before_aot_autograd_is_stored(tmp_path, boolean):
    """An SDPA mask strided in its last dimension (here a padding mask stored key-major) is made
    contiguous in Dynamo's graph; the nodes added must leave the graph cacheable, with a method
    called on the output they now give (AOTAutograd's cache takes a method call only on a node
    with an example value)."""
    def fn(q, k, v, keep):
        mask = keep[:, None, None, :].expand(-1, 2, 5, -1)
        mask = mask if boolean else torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 8, device=DEVICE) for _ in range(3))
    keep = (torch.rand(5, 3, device=DEVICE) > 0.3).t()
    keep[:, 0] = True
    assert keep.stride(-1) != 1
    for source in (None, "AOTAutograd"):
        out, summaries = _compiled(torch.compile(fn, backend="commfuse"), q, k, v, keep, cache_dir=tmp_path)
        assert _sources(summaries) == [source]
        torch.testing.assert_close(out, fn(q, k, v, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change", ["config", "cache folder"])
def test_what_our_key_covers_is_a_new_entry(tmp_path, change):
    model, x = _model(), torch.randn(8, 16, device=DEVICE)
    _compiled(lambda: torch.compile(model, backend="commfuse")(x), cache_dir=tmp_path)
    options = {"max_fusion_size": 1} if change == "config" else {}
    folder = tmp_path / "other" if change == "cache folder" else tmp_path
    out, summaries = _compiled(lambda: torch.compile(model, backend="commfuse")(x), cache_dir=folder, **options)
    assert _sources(summaries) == [None, None]
    torch.testing.assert_close(out, model(x))


def test_a_graph_ending_at_a_graph_break_is_another_entry(tmp_path):
    """The plan check reads a graph that ends where Dynamo broke the frame as a cut, one that ends
    where the frame returns as the whole program; the compiled code carries which. The same graph
    (same code, same lines) found in the cache from the other end was read the other way."""
    def fn(x, cut):
        y = x * 2 + 1
        if cut:
            torch._dynamo.graph_break()
        return y
    x = torch.randn(8, device=DEVICE)
    for cut, source in ((True, None), (False, None), (False, "AOTAutograd"), (True, "AOTAutograd")):
        out, summaries = _compiled(torch.compile(fn, backend="commfuse"), x, cut, cache_dir=tmp_path)
        assert _sources(summaries) == [source], cut
        torch.testing.assert_close(out, fn(x, cut))


def test_inputs_viewing_one_storage_otherwise_are_a_new_entry(tmp_path):
    """AOTAutograd compiles inputs that view one storage (both written) over a base of that
    storage's size, which its key leaves out: the entry of `b, b[:, :]` found for `b[:4], b[2:6]`
    read a base of 32 elements where there were 64 (Inductor fails there too)."""
    def f(x, y):
        x.mul_(2)
        y.add_(1)
        return x + y

    def views(kind):
        if kind == "whole":
            b = torch.arange(32.0, device=DEVICE).view(4, 8)
            return b, (b, b[:, :])
        b = torch.arange(64.0, device=DEVICE).view(8, 8)
        return b, (b[:4], b[2:6])
    for kind, source in (("whole", None), ("overlapping", None), ("overlapping", "AOTAutograd")):
        (base, args), (want_base, want_args) = views(kind), views(kind)
        out, summaries = _compiled(torch.compile(f, backend="commfuse"), *args, cache_dir=tmp_path)
        assert _sources(summaries) == [source], kind
        torch.testing.assert_close(out, f(*want_args))
        torch.testing.assert_close(base, want_base)


def test_a_graph_run_through_aten_is_compiled_again(tmp_path, monkeypatch, lowerings):
    def fails(self):
        raise RuntimeError("a lowering bug")
    monkeypatch.setattr(graph.GraphLowering, "run", fails)
    fn, x = (lambda x: (x * 2).relu()), torch.randn(6, device=DEVICE)
    for _ in range(2):
        out, summaries = _compiled(torch.compile(fn, backend="commfuse"), x, cache_dir=tmp_path,
                                   fallback_on_error=True)
        assert [s["compiled"] for s in summaries] == [False]
        torch.testing.assert_close(out, fn(x))


_FAILS_AT_FIRST_RUN = """
import torch, commfuse
from commfuse import backend
from commfuse.runtime import launch
launch.Site.__call__ = lambda self, *args: (_ for _ in ()).throw(RuntimeError("injected"))  # after AOTAutograd stored it
x = torch.arange(6.0, device="{device}")
torch.testing.assert_close(torch.compile(lambda x: (x * 2).relu(), backend="commfuse")(x), x * 2)
print([(s["compiled"], s["cache"]) for s in backend.summaries])
"""


def test_a_graph_whose_first_run_failed_is_compiled_again(tmp_path):
    """A graph whose first run raised reruns through aten, which AOTAutograd's copy cannot (it has
    no aten graph): the next process compiles it again (or takes our cache's copy, which has one),
    and it reruns through aten again, rather than raise from AOTAutograd's copy. Two processes:
    AOTAutograd's cache is found in the next."""
    env = dict(os.environ, COMMFUSE_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               COMMFUSE_FALLBACK_ON_ERROR="1")
    for source in ("None", "'graph'"):
        run = subprocess.run([sys.executable, "-c", _FAILS_AT_FIRST_RUN.format(device=DEVICE)], env=env, capture_output=True, text=True)
        assert run.returncode == 0 and run.stdout.split("\n")[-2] == f"[(False, {source})]", run.stderr[-2000:]


def test_with_dumps_graphs_are_compiled_and_not_stored_there(tmp_path):
    """Dumps need the aten graph, which AOTAutograd's entries do not keep: with dumps on, graphs
    come from our cache at most, and AOTAutograd's stores none."""
    fn, x = (lambda x: x.softmax(-1) * 3), torch.randn(4, 8, device=DEVICE)
    dumps = tmp_path / "dumps"
    for source, dump_dir in ((None, dumps), ("graph", dumps), ("graph", None)):
        out, summaries = _compiled(torch.compile(fn, backend="commfuse"), x, cache_dir=tmp_path, dump_dir=dump_dir)
        assert _sources(summaries) == [source]
        torch.testing.assert_close(out, fn(x))
    assert len(list(dumps.rglob("fx_graph.txt"))) == 2


def test_a_lowering_moved_to_another_op_is_a_new_entry(tmp_path, monkeypatch):
    """sin's lowering set to cos's (commfuse's own code both, the file digest unchanged): the pair
    AOTAutograd stored with it is not found once sin's own is back."""
    from commfuse import lowering
    lowering.load_all()
    f, x = (lambda x: x.sin() * 4), torch.randn(8, device=DEVICE)
    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.sin.default, lowering.lowerings[torch.ops.aten.cos.default])
    out, _ = _compiled(torch.compile(f, backend="commfuse"), x, cache_dir=tmp_path)
    torch.testing.assert_close(out, x.cos() * 4)
    monkeypatch.undo()
    out, summaries = _compiled(torch.compile(f, backend="commfuse"), x, cache_dir=tmp_path)
    assert _sources(summaries) == [None]
    torch.testing.assert_close(out, f(x))


@torch._dynamo.allow_in_graph
def _opaque_to_the_key(x):  # a call AOTAutograd's key cannot see into
    return x * 2


@pytest.mark.parametrize("cacheable", [True, False])
def test_the_backward_compiles_with_its_forward_only_where_the_pair_is_stored(tmp_path, cacheable):
    """AOTAutograd stores a forward and backward together when the backward compiles, so with the
    cache the backward compiles at once; a graph its key refuses keeps the backward lazy."""
    fn = (lambda x: x.sin() * 2) if cacheable else (lambda x: _opaque_to_the_key(x).sin())
    x = torch.randn(6, device=DEVICE, requires_grad=True)
    out, summaries = _compiled(torch.compile(fn, backend="commfuse"), x, cache_dir=tmp_path)
    kinds = [s["graph_id"].split("_")[1] for s in summaries]
    assert kinds == (["forward", "backward"] if cacheable else ["forward"])
    out.sum().backward()
    eager = x.detach().requires_grad_()
    fn(eager).sum().backward()
    torch.testing.assert_close(x.grad, eager.grad)


def test_functions_the_user_marked_cacheable_stay_marked(tmp_path):
    """A call the user marked cacheable (`unsafe_marked_cacheable_functions`) keeps the graph in
    AOTAutograd's cache beside the marks commfuse adds for DTensor's closures: the pair is stored."""
    name = f"{_opaque_to_the_key.__module__}.{_opaque_to_the_key.__name__}"
    x = torch.randn(6, device=DEVICE, requires_grad=True)
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions={name: "1"}):
        _, summaries = _compiled(torch.compile(lambda x: _opaque_to_the_key(x).sin(), backend="commfuse"), x,
                                 cache_dir=tmp_path)
    assert [s["graph_id"].split("_")[1] for s in summaries] == ["forward", "backward"]


@pytest.mark.gpu
def test_cuda_graph_mode_from_the_cache_updates_buffers_in_place(tmp_path):
    """A graph loaded from AOTAutograd's cache in CUDA-graph mode keeps its input roles: the
    buffers its replays update (a cache written by index_copy_, a counter) are the module's."""
    from tests.test_cudagraphs import Counter
    torch.manual_seed(0)
    y, pos = torch.randn(2, 4, device="cuda"), torch.tensor([1, 5], device="cuda")
    for source in (None, "AOTAutograd"):
        model, ref = Counter().cuda(), Counter().cuda()
        ref.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend="commfuse", options={"cuda_graphs": True})
        with torch.no_grad():
            outs, summaries = _compiled(lambda: [compiled(y, pos) for _ in range(4)], cache_dir=tmp_path)
            want = [ref(y, pos) for _ in range(4)]
        assert _sources(summaries) == [source]
        torch.testing.assert_close(outs, want)
        torch.testing.assert_close((model.cache, model.count), (ref.cache, ref.count))


def _tp_sources(rank, world, cache_dir, training):
    """Tensor-parallel training (or inference) compiled three times; before the third the mesh's
    cached hash() is what another process's PYTHONHASHSEED makes it. Which cache each graph came
    from, and whether the gradients (or outputs) matched eager's."""
    from torch.distributed.tensor import DTensor
    from bench.llama import Config, tp_llama
    from tests.dist_utils import device
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    model = tp_llama(Config(dim=32, n_heads=4, n_kv_heads=2, ffn=64, n_layers=1, max_batch=2, max_seq=8),
                     world, device())
    x = torch.randn(2, 8, 32, device=device())

    def run(fn):
        if not training:
            with torch.no_grad():
                return [fn(x)]
        model.zero_grad(set_to_none=True)
        fn(x).square().mean().backward()
        return [local(p.grad).clone() for p in model.parameters()]
    want = run(model)
    out = []
    for attempt in range(3):
        if attempt == 2:
            mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
            mesh._hash = hash(mesh) + 1
        got, summaries = _compiled(lambda: run(torch.compile(model, backend="commfuse")), cache_dir=cache_dir)
        out.append((_sources(summaries), all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got, want))))
    return out


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_tensor_parallel_graphs_come_from_aot_autograds_cache_in_any_process(tmp_path, training):
    """DTensor graphs: since torch 2.13 they take the DeviceMesh as an input, which pickled its
    cached hash() into AOTAutograd's key, so a new process (another PYTHONHASHSEED) missed every
    entry; before, Dynamo's closures for from_local, redistribute and to_local were refused.
    Inference graphs rebuild their DTensor weights from shards, by closures keyed the same way."""
    from tests.dist_utils import run_ranks
    graphs = 2 if training else 1
    for runs in run_ranks(_tp_sources, 2, args=(str(tmp_path), training)):
        assert runs == [([None] * graphs, True)] + [(["AOTAutograd"] * graphs, True)] * 2, runs


def test_a_dtensor_closure_binding_what_no_key_describes_is_not_stored():
    """Dynamo's DTensor closures (before torch 2.13) are keyed by what they bind; an object known
    only by its address cannot be, and the graph stays out of AOTAutograd's cache."""
    from commfuse import compiled, graph_cache
    opaque = object()

    def prim_redistribute(x):
        return x if opaque else None
    prim_redistribute.__module__ = "torch._dynamo.variables.tensor"
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    (x,) = gm.graph.find_nodes(op="placeholder")
    with gm.graph.inserting_after(x):
        node = gm.graph.call_function(prim_redistribute, (x,))
    x.replace_all_uses_with(node, lambda user: user is not node)
    gm.recompile()
    with pytest.raises(graph_cache.Uncacheable, match="prim_redistribute binds"):
        compiled._dtensor_closures(gm)


def _groups_of_all_reduces(rank, world, cache_dir):
    """The same program on DTensors of two meshes over the same ranks, each with its own process
    group: where each graph came from, and the group its all-reduce ran on, against the mesh's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from tests.dist_utils import device
    meshes = [init_device_mesh(device().type, (world,)),
              DeviceMesh.from_group(dist.new_group(list(range(world))), device().type)]
    out = []
    for mesh in meshes:  # the graph's one input is the DTensor: its mesh known by the DTensor's spec
        w = DTensor.from_local(torch.randn(4, 4, device=device()), mesh, [Partial()])
        got, summaries = _compiled(torch.compile(lambda w: w.full_tensor() * 2, backend="commfuse"), w,
                                   cache_dir=cache_dir)
        torch.testing.assert_close(got, w.full_tensor() * 2)
        out.append((_sources(summaries), [p["group"] for s in summaries for p in s["comm_plans"]],
                    mesh.get_group().group_name))
    return out


def test_a_dtensor_on_another_process_group_is_a_new_entry(tmp_path):
    """AOTAutograd's key knows a DTensor input's mesh by its ranks and dimension names (torch
    2.13's stable hash): a mesh over the same ranks on another process group found the first
    one's entry, whose all-reduce ran on the first group. (Found by the distributed sweep.)"""
    from tests.dist_utils import run_ranks
    for (first, groups, group), (second, groups_b, group_b) in run_ranks(_groups_of_all_reduces, 2,
                                                                          args=(str(tmp_path),)):
        assert first == [None] and groups == [group], (first, groups, group)
        assert second == [None] and groups_b == [group_b] != groups, (second, groups_b, group_b)
