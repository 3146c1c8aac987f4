"""Small collectives of one group and dtype merge into one (commfuse/passes/bucketing.py).

The rules (what merges, what never does) are checked on aten graphs traced in-process over a
one-rank gloo group; one 2-rank spawn compiles forward and backward and checks the values."""
import collections
import glob
import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse import config
from commfuse.passes.bucketing import bucket_collectives
from tests.dist_utils import device, run_ranks

c10d = torch.ops._c10d_functional


@torch.library.custom_op("cftest::side_effect", mutates_args=())
def side_effect(x: torch.Tensor) -> torch.Tensor:  # an op the compiler cannot see into
    return x + 1


@side_effect.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _collectives(gm):
    return collections.Counter(n.target.__name__.split(".")[0] for n in gm.graph.nodes
                               if n.op == "call_function" and n.target in (
                                   c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                                   c10d.all_reduce.default))


def _bucketed(fn, *args, **patch):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = _collectives(gm)
    with config.patch(**patch):
        bucket_collectives(gm)
    gm.graph.lint()
    return before, _collectives(gm), gm


def test_small_collectives_merge_per_kind_group_and_op(group):
    def f(a, b, c, h):
        gathered = [funcol.all_gather_tensor(x * 2, 0, group) for x in (a, b)]
        scattered = [funcol.reduce_scatter_tensor(x, "sum", 0, group) for x in (c, c * 3)]
        summed = [funcol.all_reduce(x, "sum", group) for x in (a, b, c)]
        other = [funcol.all_reduce(a, "max", group), funcol.all_reduce(h, "sum", group)]  # another op, dtype
        return gathered, scattered, summed, other
    args = torch.randn(4, 3), torch.randn(2, 5), torch.randn(6, 2), torch.randn(3, dtype=torch.float64)
    before, after, gm = _bucketed(f, *args)
    assert before == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 5}, before
    assert after == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 3}, after
    assert sum(n.target is c10d.wait_tensor.default for n in gm.graph.nodes) == 5
    nodes = list(gm.graph.nodes)
    for n in nodes:  # a bucket starts right after its packed input, which its last member's input made
        if n.meta.get("bucket"):
            assert n.prev is n.args[0] and nodes.index(n.args[0]) < nodes.index(next(iter(n.users))), gm.code
    for got, want in zip(torch.utils._pytree.tree_leaves(gm(*args)), torch.utils._pytree.tree_leaves(f(*args))):
        torch.testing.assert_close(got, want)
    with config.patch({"comm.bucketing": False}):
        assert bucket_collectives(gm := make_fx(f, tracing_mode="fake")(*args)) == 0


def test_layout_ops_of_an_input_move_up_with_its_bucket(group):
    """A member's input made by layout ops after another member's result is used (DTensor's padding
    of a short shard, on some ranks only) still merges: the ops move up, so every rank buckets as
    the rank whose inputs need no padding does. An op that computes values stays where the program
    put it (a producer the collective's kernel may fuse), and so does its collective."""
    def padded(a, b):
        x = funcol.all_gather_tensor(torch.nn.functional.pad(a, (0, 0, 0, 1)), 0, group)
        y = x.sum() * b  # uses the first result before the second input is made
        return x, funcol.all_gather_tensor(torch.cat([b[:3], torch.nn.functional.pad(b[3:], (0, 1))]), 0, group), y

    def computed(a, b):
        x = funcol.all_gather_tensor(a, 0, group)
        y = x.sum() * b
        return x, funcol.all_gather_tensor(b * 2, 0, group), y
    a, b = torch.randn(3, 4), torch.randn(5)
    before, after, gm = _bucketed(padded, a, b)
    assert before == {"all_gather_into_tensor": 2} and after == {"all_gather_into_tensor": 1}, gm.code
    for got, want in zip(gm(a, b), padded(a, b)):
        torch.testing.assert_close(got, want)
    assert _bucketed(computed, a, b)[1] == {"all_gather_into_tensor": 2}


def test_what_never_merges(group):
    def chain(a, b):  # the second all-reduce's input is the first one's result
        x = funcol.all_reduce(a, "sum", group)
        return funcol.all_reduce(x * b, "sum", group)

    def chain_view(a, b):  # the second all-gather's input is a view of the first one's result
        x = funcol.all_gather_tensor(a, 0, group)
        return funcol.all_gather_tensor(x.view(-1)[:6], 0, group), b

    def across(a, b):  # a side-effecting op between the two
        x = funcol.all_reduce(a, "sum", group)
        s = side_effect(b)
        return x, s, funcol.all_reduce(b * 2, "sum", group)

    def p2p(a, b):  # a send between the two (traced, not run: it would wait for a peer)
        x = funcol.all_reduce(a, "sum", group)
        s = torch.ops._c10d_functional.isend(b, 0, 0, group.group_name)
        return x, s, funcol.all_reduce(b * 2, "sum", group)

    def capped(a, b, c):  # 48 bytes each, a cap of 100 bytes: two fit
        return [funcol.all_gather_tensor(x, 0, group) for x in (a, b, c)]
    a, b, c = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    # functional send/recv exist from torch 2.12 (not in 2.11)
    p2p_case = ((p2p, (a, b), {}, 2),) if hasattr(torch.ops._c10d_functional, "isend") else ()
    for fn, args, patch, want in ((chain, (a, b), {}, 2), (chain_view, (a, b), {}, 2), (across, (a, b), {}, 2), *p2p_case,
                                  (capped, (a, b, c), {"comm.bucket_cap_bytes": 100}, 2),
                                  (capped, (a, b, c), {"comm.bucket_member_max_bytes": 40}, 3),
                                  (capped, (a, b, c), {}, 1)):
        before, after, gm = _bucketed(fn, *args, **patch)
        assert sum(after.values()) == want, (fn.__name__, patch, after, gm.code)
        if fn is p2p:
            continue
        for got, ref in zip(torch.utils._pytree.tree_leaves(gm(*args)), torch.utils._pytree.tree_leaves(fn(*args))):
            torch.testing.assert_close(got, ref)


def _check_grads(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _per_parameter(rank, world, dump_dir):
    from commfuse import config
    g = dist.group.WORLD
    torch.manual_seed(0)
    ws = [torch.randn(s, device=device(), requires_grad=True) for s in ((3, 4), (5,), (2, 3, 2))]

    def step(x):  # per-parameter all-gathers; their backward: per-gradient reduce-scatters
        full = [funcol.all_gather_tensor_autograd(w, 0, g) for w in ws]
        h = (x @ full[0].view(-1, 4)[:4].t()).sum(-1) * full[1][:x.shape[0]] + full[2].pow(2).sum()
        # fp64: c10d's (our kernels' fp32 all-reduces fuse with their neighbours and stay apart)
        parts = [funcol.all_reduce(t.double(), "sum", g) for t in (x.sum(0), x.amax(0))]
        return h.pow(2).sum() + (parts[0] * parts[1]).sum()
    x = torch.randn(5, 4, device=device()) + rank
    with config.patch(dump_dir=dump_dir):
        loss = torch.compile(step, backend="commfuse", dynamic=False)(x)
        loss.backward()
    grads = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    ref = step(x)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    _check_grads(grads, [w.grad for w in ws])


def _simple_fsdp(rank, world, dump_dir, dims=(8, 16, 8), dtype=torch.float32):
    """SimpleFSDP-style: parameters are DTensors sharded on dim 0, gathered inside the forward.
    Dims that do not divide among the ranks: DTensor pads the short shards, and unpads what the
    collectives return, on some ranks only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from commfuse import config
    mesh = init_device_mesh(device().type, (world,))

    class Linear(torch.nn.Module):
        def __init__(self, i, o):
            super().__init__()
            torch.manual_seed(i * 100 + o)
            w, b = torch.randn(o, i, device=device()) / i ** 0.5, torch.randn(o, device=device()) / 10
            w, b = w.to(dtype), b.to(dtype)
            self.w, self.b = (torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in (w, b))

        def forward(self, x):  # the gradients' reduce-scatters come from the Partial placement
            w, b = (p.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) for p in (self.w, self.b))
            return torch.nn.functional.linear(x, w, b)
    eager, model = (torch.nn.Sequential(*[m for i, o in zip(dims, dims[1:]) for m in (Linear(i, o), torch.nn.ReLU())])
                    for _ in range(2))
    compiled = torch.compile(model, backend="commfuse")
    torch.manual_seed(1 + rank)
    x = torch.randn(4, dims[0], device=device(), dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with config.patch(dump_dir=dump_dir):
        for _ in range(2):
            losses = [m(x).float().square().mean() for m in (compiled, eager)]
            for loss in losses:
                loss.backward()
            torch.testing.assert_close(*losses, rtol=tol, atol=tol)
            for a, b in zip(*([p.grad.to_local() for p in m.parameters()] for m in (model, eager)), strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            model.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)


def _ranks(rank, world, dump_dir):
    from commfuse import choices
    from commfuse.collectives import CommRequest
    _per_parameter(rank, world, f"{dump_dir}/per_parameter")
    torch._dynamo.reset()
    _simple_fsdp(rank, world, f"{dump_dir}/simple_fsdp")
    torch._dynamo.reset()
    _simple_fsdp(rank, world, f"{dump_dir}/uneven", dims=(8, 15, 7, 5))
    torch._dynamo.reset()
    _simple_fsdp(rank, world, f"{dump_dir}/uneven_bf16", dims=(8, 15, 7, 5), dtype=torch.bfloat16)
    group = dist.group.WORLD.group_name  # an all-reduce our kernels run stays apart; c10d's may join
    return [choices.current().bucket_member(CommRequest(kind, "sum", group, dtype, device(), (16,)))
            for kind, dtype in (("all_reduce", torch.float32), ("all_reduce", torch.float64),
                                ("reduce_scatter", torch.float32))]


def _plans(root):
    out = {}
    for path in glob.glob(f"{root}/rank0/*/summary.json"):
        kind = "forward" if "_forward_" in os.path.basename(os.path.dirname(path)) else "backward"
        out[kind] = collections.Counter(p["collective"] for p in json.load(open(path))["comm_plans"])
    return out


def test_bucketed_forward_and_backward_match_eager(tmp_path):
    """Three per-parameter all-gathers and two all-reduces in the forward, three reduce-scatters in
    the backward; a SimpleFSDP-style model's four parameters, gathered and their gradients
    reduce-scattered, and one of six parameters that do not divide among the ranks: one collective
    of each kind per graph."""
    assert run_ranks(_ranks, 2, args=(str(tmp_path),)) == [[False, True, True]] * 2
    plans = _plans(f"{tmp_path}/per_parameter")
    assert plans == {"forward": {"all_gather_into_tensor": 1, "all_reduce": 1},
                     "backward": {"reduce_scatter_tensor": 1}}, plans
    for model in ("simple_fsdp", "uneven", "uneven_bf16"):
        plans = _plans(f"{tmp_path}/{model}")
        assert plans == {"forward": {"all_gather_into_tensor": 1}, "backward": {"reduce_scatter_tensor": 1}}, plans
