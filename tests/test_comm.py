"""Collectives on WORLD ranks (2 gloo processes on CPU; COMMFUSE_TEST_WORLD sets it): comm buffers chosen at lowering time, the one-shot kernel over
(emulated) symmetric memory, persistent pool slices, and the c10d path for what is ineligible."""
import glob
import json
import re

import pytest
import torch
from torch.testing import FileCheck

from tests.common import check_peer_sum, check_reduced_in_place, count
from tests.dist_utils import WORLD, SharedRanks, device, run_ranks

pytestmark = pytest.mark.xdist_group("comm")  # one worker: its checks share spawns


def _summaries(dump_dir, rank):
    return [json.load(open(p)) for p in sorted(glob.glob(f"{dump_dir}/rank{rank}/*/summary.json"))]


def _code(dump_dir, rank):
    return [open(p).read() for p in sorted(glob.glob(f"{dump_dir}/rank{rank}/*/output_code.py"))]


# ---------------------------------------------------------------------------------------- bodies
def _reduce_ops_and_dtypes(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in ("sum", "avg", "max", "min"):
            torch._dynamo.reset()
            fn = lambda x: funcol.all_reduce(x * 2 + 1, op, dist.group.WORLD).relu()  # noqa: E731
            torch.manual_seed(rank)
            x = torch.randn(33, 7, dtype=dtype, device=device())
            out = torch.compile(fn, backend="commfuse")(x)
            out2 = torch.compile(fn, backend="commfuse")(x)  # a second call reuses the pool
            ref = fn(x.float()).to(dtype)  # reduced in fp32 like our kernels (gloo rounds each partial sum)
            torch.testing.assert_close(out, ref, atol=tol[dtype], rtol=tol[dtype], msg=f"{op} {dtype}")
            torch.testing.assert_close(out2, ref, atol=tol[dtype], rtol=tol[dtype])
    return True


def _producer_writes_pool(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config

    def fn(x, w, b):
        y = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)      # mm writes into the pool
        z = funcol.all_reduce((y + b).relu(), "sum", dist.group.WORLD)  # a fused kernel does
        return z, funcol.all_reduce(x, "sum", dist.group.WORLD)  # a graph input: one copy in
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 16, device=device()), torch.randn(16, 32, device=device()), torch.randn(32, device=device())
    x = x + rank
    with config.patch(dump_dir=dump_dir):
        compiled = torch.compile(fn, backend="commfuse")
        for _ in range(3):  # persistent pool: same slices every call
            outs = compiled(x, w, b)
    for o, r in zip(outs, fn(x, w, b)):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-5)
    return True


def _ineligible(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    fn = lambda x: funcol.all_reduce(x + 1, "sum", dist.group.WORLD) * 2  # noqa: E731
    thresholds = {"comm.one_shot_max_bytes": {world: 64}, "comm.two_shot_max_bytes": {world: 0}}
    with config.patch(dump_dir=dump_dir, **thresholds):
        x = torch.randn(64, device=device())  # 256 bytes: over both thresholds
        torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x))
    torch._dynamo.reset()
    import logging
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("commfuse").addHandler(handler)
    with config.patch(dump_dir=dump_dir):
        for n in (5, 9):  # symbolic sizes
            x = torch.randn(n, device=device())
            torch.testing.assert_close(torch.compile(fn, backend="commfuse", dynamic=True)(x), fn(x))
    # losing the fast path to a dynamic shape is said out loud, with what to do about it
    assert any("dynamic=False" in m for m in warned), warned
    return True


def _sums_of_all_reduces(rank, world, dump_dir):
    """all_reduce(a) + all_reduce(b) + all_reduce(c) all-reduces once (a sum, a mean); an
    all-reduced value read elsewhere too, or added with broadcasting, keeps its own."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config

    def fn(x, y, row):
        g = dist.group.WORLD
        s = funcol.all_reduce(x * 2, "sum", g) + funcol.all_reduce(y + 1, "sum", g) + funcol.all_reduce(x * y, "sum", g)
        m = funcol.all_reduce(x, "avg", g) + funcol.all_reduce(y, "avg", g)
        r = funcol.all_reduce(x - y, "sum", g)
        t = r + funcol.all_reduce(x * 3, "sum", g)  # r is read again below
        u = funcol.all_reduce(row, "sum", g) + funcol.all_reduce(y, "sum", g)  # row broadcasts
        return s, m, t * r, u
    torch.manual_seed(rank)
    args = torch.randn(8, 16, device=device()), torch.randn(8, 16, device=device()), torch.randn(16, device=device())
    with config.patch(dump_dir=dump_dir):
        outs = torch.compile(fn, backend="commfuse")(*args)
    for o, r in zip(outs, fn(*args)):
        torch.testing.assert_close(o, r)
    torch._dynamo.reset()
    for n in (5, 9):  # symbolic sizes (through c10d)
        args = torch.randn(n, 16, device=device()), torch.randn(n, 16, device=device()), torch.randn(16, device=device())
        for o, r in zip(torch.compile(fn, backend="commfuse", dynamic=True)(*args), fn(*args)):
            torch.testing.assert_close(o, r)
    return True


def _c10d_in_place(rank, world, dump_dir):
    """A c10d all-reduce of memory only it reads (an mm's output, through a view) reduces it in
    place; one whose input is read again, or is the graph's input, reduces a copy."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config

    def fn(x, w):
        y = funcol.all_reduce((x @ w).view(4, 2, 16), "sum", dist.group.WORLD)  # y's input: ours alone
        h = x * 3
        z = funcol.all_reduce(h, "sum", dist.group.WORLD) + h                    # h read again
        return y, z, funcol.all_reduce(x, "sum", dist.group.WORLD)             # the caller's x
    torch.manual_seed(0)
    x, w = torch.randn(8, 8, device=device()) + rank, torch.randn(8, 16, device=device())
    x0 = x.clone()
    thresholds = {"comm.one_shot_max_bytes": {world: 0}, "comm.two_shot_max_bytes": {world: 0},
                  "comm.bucketing": False}  # each all-reduce on its own buffer
    with config.patch(dump_dir=dump_dir, **thresholds):  # every all-reduce through c10d
        outs = torch.compile(fn, backend="commfuse")(x, w)
    for o, r in zip(outs, fn(x0, w)):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(x, x0)
    return True


def _inplace(rank, world, dump_dir):
    """all_reduce_ on a buffer we produce: the kernel overwrites it in place, no copy."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx
    from commfuse import config
    from commfuse.backend import compile_graph
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional

    def fn(x):
        y = x * 3
        c10d.all_reduce_(y, "sum", group)
        return (c10d.wait_tensor(y) + 1,)
    x = torch.randn(10, 12, device=device()) + rank
    gm = make_fx(fn)(x)
    with config.patch(dump_dir=dump_dir):
        compiled = compile_graph(gm, [x])
        (out,) = compiled([x])
    torch.testing.assert_close(out, fn(x)[0])
    return True


def _tp_mlp(rank, world, dump_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x))) + x

    mesh = init_device_mesh(device().type, (world,))
    torch.manual_seed(0)
    ref, tp = MLP().to(device()), MLP().to(device())
    tp.load_state_dict(ref.state_dict())
    parallelize_module(tp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(tp, backend="commfuse", options={"dump_dir": dump_dir})
    x = torch.randn(4, 16, device=device())
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = compiled(xt), ref(xr)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(xt.grad, xr.grad, atol=1e-5, rtol=1e-5)
    local = tp.up.weight.grad.to_local()
    full = ref.up.weight.grad.chunk(world, 0)[rank]
    torch.testing.assert_close(local, full, atol=1e-5, rtol=1e-5)
    return True


def _assert_disjoint_when_live_together(buffers):
    for a in buffers:
        for b in buffers:
            if a is b or a["pool"] != b["pool"]:
                continue
            live = a["live"][0] <= b["live"][1] and b["live"][0] <= a["live"][1]
            overlap = a["offset"] < b["offset"] + b["bytes"] and b["offset"] < a["offset"] + a["bytes"]
            assert not (live and overlap), (a, b)


# ---------------------------------------------------------------------------------------- tests
def test_all_reduce_ops_and_dtypes():
    assert SHARED.result(_reduce_ops_and_dtypes) == [True] * WORLD


def test_producers_write_into_the_pool(tmp_path):
    run_ranks(_producer_writes_pool, WORLD, args=(str(tmp_path),))
    (s0,) = _summaries(tmp_path, 0)
    (code0,) = _code(tmp_path, 0)
    assert len(s0["comm_buffers"]) == 3
    # (a) buffers we produce are written by their producers: mm through out=, a fused kernel
    mm_buf = re.search(r"aten\.mm\.out\(arg0_1, arg1_1, out=(buf\d+)\)", code0).group(1)
    assert mm_buf in [b["name"] for b in s0["comm_buffers"]]
    FileCheck().check(f"{mm_buf} = comm['{mm_buf}']").check_next(f"aten.mm.out(arg0_1, arg1_1, out={mm_buf})").run(code0)
    written = {w for k in s0["kernels"] for w in k["writes"]}
    # the first all-reduce's kernel computes relu(y + b) as its epilogue, straight into the second
    # all-reduce's buffer; a copy kernel fills the third from the graph input
    assert sum(b["name"] in written for b in s0["comm_buffers"]) == 2
    # (b) one-shot all-reduces read the peers' buffers, in two kernels: the second all-reduce reads
    # what the first one's epilogue wrote in the same kernel (a barrier in between), and the copy of
    # the graph input is the prologue of the third's kernel
    count(code0, "def cf_allreduce_", 2)
    assert len([k for k in s0["kernels"] if k.get("collective") == "all_reduce"]) == 2
    for b in s0["comm_buffers"]:  # a kernel sums every peer's copy, which the wrapper passes it
        check_peer_sum(code0, b["name"], WORLD)
        check = FileCheck().check("def call(").check(f"comm['peers_{b['name']}'][0]")
        for peer in range(1, WORLD):
            check = check.check_same(f"comm['peers_{b['name']}'][{peer}]")
        check.run(code0)
    # the two barriers that publish in-kernel writes (atomics in the interpreter, PTX on the GPU),
    # each between the store into a comm buffer and the loads of its peers' copies
    release = re.findall(r'sem="release"|st\.release\.sys', code0)
    assert len(release) == 2, release
    for b in s0["comm_buffers"]:
        if b["name"] in written:
            FileCheck().check(f"tl.store(ptr_{b['name']} + (").check(release[0]).check(
                f"tl.load({b['name']}_peer0 + (").run(code0)
    # (c) the same pool slices on every rank
    for rank in range(1, WORLD):
        (s,) = _summaries(tmp_path, rank)
        assert [(b["name"], b["offset"], b["bytes"]) for b in s0["comm_buffers"]] == \
            [(b["name"], b["offset"], b["bytes"]) for b in s["comm_buffers"]], rank
    _assert_disjoint_when_live_together(s0["comm_buffers"])
    # (d) only the graph input needed a copy in
    assert [b["copy_in"] for b in s0["comm_buffers"]].count(True) == 1
    assert all(b["feeds"] for b in s0["comm_buffers"])


def test_ineligible_all_reduce_takes_c10d_and_says_why(tmp_path):
    run_ranks(_ineligible, WORLD, args=(str(tmp_path),))
    reasons = [f["reason"] for s in _summaries(tmp_path, 0) for f in s["comm_fallbacks"]]
    assert any("over the one-shot threshold" in r for r in reasons), reasons
    assert any("symbolic size" in r for r in reasons), reasons
    for s in _summaries(tmp_path, 0):
        assert s["comm_buffers"] == []
        assert any("all_reduce" in c for c in s["extern_calls"])


def test_a_sum_of_all_reduces_all_reduces_once(tmp_path):
    run_ranks(_sums_of_all_reduces, WORLD, args=(str(tmp_path),))
    (s0,) = _summaries(tmp_path, 0)
    assert len(s0["comm_plans"]) == 1 + 1 + 2 + 2, s0["comm_plans"]


def test_c10d_all_reduce_in_place_where_nothing_else_reads_its_input(tmp_path):
    run_ranks(_c10d_in_place, WORLD, args=(str(tmp_path),))
    (code,) = _code(tmp_path, 0)
    calls = re.findall(r"_c10d_functional\.(all_reduce_?)\b", code)
    assert sorted(calls) == ["all_reduce", "all_reduce", "all_reduce_"], calls


def test_inplace_all_reduce_has_no_copy(tmp_path):
    run_ranks(_inplace, WORLD, args=(str(tmp_path),))
    (s0,) = _summaries(tmp_path, 0)
    (code0,) = _code(tmp_path, 0)
    (buf,) = s0["comm_buffers"]
    assert not buf["copy_in"]
    (kernel,) = [k for k in s0["kernels"] if k.get("collective")]
    check_reduced_in_place(code0, buf["name"], kernel["name"])


def _all_reduce_into_the_input(rank, world):
    """dist.all_reduce(x) on the compiled function's own input: the graph copies the input into a
    comm buffer, reduces it, and writes the result back into the input. The write-back went to the
    copy, so the caller's tensor stayed unreduced (the output was right)."""
    import torch.distributed as dist

    def fn(x):
        dist.all_reduce(x)
        return x * 2
    torch._dynamo.reset()
    x = torch.arange(8.0, device=device()) + 10 * rank
    want_x = x.clone()
    want_out = fn(want_x)
    out = torch.compile(fn, backend="commfuse")(x)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(x, want_x)
    return True


def _two_groups_chained(rank, world):
    """An all-reduce over one group feeding one over another (two dims of a mesh): the scheduler
    fused both peer reads into one kernel, which meets the ranks of one group only; the compile
    failed and the whole graph ran through aten."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import backend
    other = dist.new_group(list(range(world)))  # the same ranks, another group

    def fn(x):
        return funcol.all_reduce(funcol.all_reduce(x * 2, "sum", other) + 1, "sum", dist.group.WORLD)
    torch._dynamo.reset()
    before = len(backend.summaries)
    x = torch.randn(4, 8, device=device()) + rank
    torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x))
    return [s["compiled"] for s in backend.summaries[before:]]


def test_all_reduces_over_two_groups_compile():
    assert SHARED.result(_two_groups_chained) == [[True]] * WORLD


def test_all_reduce_into_the_input_updates_it():
    assert SHARED.result(_all_reduce_into_the_input) == [True] * WORLD


def test_dtensor_tp_mlp_forward_backward(tmp_path):
    assert run_ranks(_tp_mlp, WORLD, args=(str(tmp_path),)) == [True] * WORLD
    summaries = {s["graph_id"].split("_")[1]: s for s in _summaries(tmp_path, 0)}
    assert set(summaries) == {"forward", "backward"}
    for kind, s in summaries.items():  # the row-parallel output and the input-grad all-reduces
        assert len(s["comm_buffers"]) == 1, (kind, s["comm_buffers"], s["comm_fallbacks"])
        assert not s["comm_buffers"][0]["copy_in"], kind
        assert any(k.get("collective") == "all_reduce" for k in s["kernels"])


def _nan_max_min(rank, world):
    """A NaN held by one rank survives max / min across ranks, as in torch.maximum (tl.maximum
    dropped it): in the one-shot and two-shot kernels, a row max fused after them, and the
    standalone in-place kernel. gloo's own answer depends on its combining order, so the reference
    reduces every rank's input with torch.amax / amin."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx
    from commfuse import config
    from commfuse.backend import compile_graph
    g, c10d = dist.group.WORLD, torch.ops._c10d_functional

    def value(r):  # rank r holds the largest (and smallest) finite values where another holds NaN
        x = torch.arange(8.0, device=device()).view(2, 4) * (10 * r + 1) - 20 * r
        x[r % 2, r % 4] = float("nan")
        return x
    inputs = torch.stack([value(r) for r in range(world)])
    for algorithm in ("one_shot", "two_shot"):
        for op in ("max", "min"):
            want = 2 * (inputs.amax(0) if op == "max" else inputs.amin(0))
            red = torch.amax if op == "max" else torch.amin

            def fused(x):
                y = funcol.all_reduce(x * 2, op, g)
                return y, red(y, -1)

            def inplace(x):
                y = x * 2
                c10d.all_reduce_(y, op, g.group_name)
                return (c10d.wait_tensor(y),)
            torch._dynamo.reset()
            with config.patch({"comm.algorithm": algorithm}):
                y, m = torch.compile(fused, backend="commfuse")(value(rank))
                (z,) = compile_graph(make_fx(inplace)(value(rank)), [value(rank)])([value(rank)])
            msg = f"{algorithm} {op}"
            torch.testing.assert_close(y, want, equal_nan=True, msg=msg)
            torch.testing.assert_close(m, red(want, -1), equal_nan=True, msg=msg)
            torch.testing.assert_close(z, want, equal_nan=True, msg=msg)
    return True


def test_max_min_across_ranks_propagate_nan():
    assert SHARED.result(_nan_max_min) == [True] * WORLD


def _signed_zeros(rank, world):
    """-0.0 on every rank sums to -0.0 (eager: -0.0 + -0.0), in both algorithms: two-shot's gather
    took the owner's share by adding the peers' masked loads, and -0.0 + 0.0 is +0.0."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    x = -torch.zeros(4, 64, device=device())
    for algorithm in ("one_shot", "two_shot"):
        torch._dynamo.reset()
        with config.patch({"comm.algorithm": algorithm}):
            y = torch.compile(lambda x: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) * 3, backend="commfuse")(x)
        assert torch.equal(y, x) and bool(torch.signbit(y).all()), (algorithm, y)
    return True


def test_signed_zeros_survive_both_algorithms():
    assert SHARED.result(_signed_zeros) == [True] * WORLD


def _one_rank_groups(rank, world):
    """An all-reduce over a group of one rank (WORLD under --nproc-per-node 1, or a singleton
    subgroup) is a copy: it runs through c10d, which says why; the barriers of the symmetric-memory
    kernels crashed with no peer to signal."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import backend
    groups = [dist.new_group([r]) for r in range(world)] if world > 1 else [dist.group.WORLD]
    mine = groups[rank]
    torch._dynamo.reset()
    before = len(backend.summaries)
    for op in ("sum", "avg", "max"):
        fn = lambda x: funcol.all_reduce(x * 2, op, mine) + 1  # noqa: E731
        x = torch.randn(4, 8, device=device()) + rank
        torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x), msg=op)
    summaries = backend.summaries[before:]
    assert all(s["compiled"] and not s["comm_buffers"] for s in summaries), summaries
    return [f["reason"] for s in summaries for f in s["comm_fallbacks"]]


def test_all_reduce_over_one_rank_is_a_copy():
    for world in (1, WORLD):
        for reasons in run_ranks(_one_rank_groups, world):
            assert reasons and all("a group of one rank" in r for r in reasons), reasons


def _uneven_column_shard_norm(rank, world):
    """A DTensor row norm of a column-sharded matrix whose columns do not split evenly: each rank
    sums the squares of its own columns, over rows of its own length. Fused into the all-reduce's
    kernel, that sum made the ranks disagree on the plan ("row length: 2 on rank 1, 3 on rank 0";
    at 2049 columns, on its blocks and grid too): it stays out of the comm kernel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(device().type, (world,))
    for rows, cols in ((7, 2 * world + 1), (300, 1024 * world + 1)):
        torch._dynamo.reset()
        a = torch.randn(rows, cols, device=device(), generator=torch.Generator(device()).manual_seed(0))
        fn = torch.compile(lambda x: torch.linalg.vector_norm(x, dim=-1).full_tensor(), backend="commfuse")
        torch.testing.assert_close(fn(distribute_tensor(a, mesh, [Shard(1)])), a.norm(dim=-1))


def test_uneven_column_shard_norm_in_the_prologue():
    run_ranks(_uneven_column_shard_norm, 2)


def _assert_step_matches(fn, x, w):
    """A training step compiled, forward and backward, against eager: its loss and w's gradient."""
    loss = torch.compile(fn, backend="commfuse")(x)
    loss.backward()
    grad, w.grad = w.grad, None
    want = fn(x)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, w.grad)


def _degenerate_shapes(rank, world):
    """All-reduces of a 0-d value (a TP step's loss, forward and backward), of no elements and of
    size-1 dims take the symmetric-memory path like any other; the 0-d one made the whole graph
    fall back to aten (the scheduler looked for its rows). No elements under a symbolic size is a
    dynamic shape (c10d): the pool's slices are static."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import backend
    g = dist.group.WORLD

    def fn(x):  # (the sum alone of no elements would be the constant 0, and the all-reduce dead)
        y = funcol.all_reduce(x * 2, "sum", g)
        return y + 1, y.sum() + 1
    w = torch.randn(8, 4, device=device(), requires_grad=True)

    def step(x):
        return funcol.all_reduce(((x @ w).relu() ** 2).mean(), "sum", g) / world
    torch._dynamo.reset()
    before = len(backend.summaries)
    for shape, dynamic in (((), False), ((0, 4), False), ((1, 1), False), ((0, 4), True)):
        x = torch.randn(shape, device=device()) + rank  # (0, s0): no elements, yet a symbolic size
        torch.testing.assert_close(torch.compile(fn, backend="commfuse", dynamic=dynamic)(x), fn(x), msg=str(shape))
    _assert_step_matches(step, torch.randn(3, 8, device=device()) + rank, w)
    return [(s["compiled"], len(s["comm_buffers"])) for s in backend.summaries[before:]]


def test_all_reduce_of_degenerate_shapes():
    # static shapes, (0, s0), then the step's forward and backward (its grad all-reduced too)
    assert SHARED.result(_degenerate_shapes) == [[(True, 1)] * 3 + [(True, 0)] + [(True, 1)] * 2] * WORLD


def _inference_mode_then_training(rank, world):
    """Evaluate under torch.inference_mode, then train: the symmetric pool (shared by every graph)
    and its views were made at the first call, as inference tensors, and the mm writing into the
    pool through out= outside inference mode raised."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    torch._dynamo.reset()
    x, w = torch.randn(4, 8, device=device()) + rank, torch.randn(8, 8, device=device(), requires_grad=True)
    evaluate = lambda x: funcol.all_reduce(x @ w, "sum", g) + 1  # noqa: E731
    train = lambda x: (funcol.all_reduce(x @ w, "sum", g) - 1).square().sum()  # noqa: E731
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(evaluate, backend="commfuse")(x), evaluate(x))
    _assert_step_matches(train, x, w)
    return True


def test_inference_mode_then_training():
    assert SHARED.result(_inference_mode_then_training) == [True] * WORLD


def _other_collectives(rank, world, dump_dir):
    """Collectives without a symmetric-memory lowering run c10d asynchronously; waits stay put.
    The dumps say so: each has a c10d plan, with why, and its fallback reason names it."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    g = dist.group.WORLD

    def fn(x, y):
        a = funcol.all_gather_tensor(x * 2, 0, g)
        b = funcol.all_to_all_single(y + 1, None, None, g)
        c = funcol.broadcast(x.sin(), 1, g)
        d, e = funcol.all_reduce_coalesced([x, y], "sum", g)
        f = funcol.reduce_scatter_tensor(y * y, "sum", 0, g)
        return a.sum(0), b * 3, c, d + e.sum(), f
    torch.manual_seed(rank)
    x, y = torch.randn(4, 3, device=device()), torch.randn(world * 2, 3, device=device())
    with config.patch({"dump_dir": dump_dir, "comm.gather_scatter": "c10d"}):  # (tests/test_comm_gather_scatter.py: ours)
        out = torch.compile(fn, backend="commfuse")(x, y)
    for o, r in zip(out, fn(x, y)):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    (summary,) = _summaries(dump_dir, rank)
    _inputs_kept_until_waited(*_code(dump_dir, rank))
    return sorted((p["collective"], p["world"], p["reduce_op"]) for p in summary["comm_fallbacks"]), \
        {op: why for op, why in summary["fallback_reasons"].items() if "c10d" in op}


def _inputs_kept_until_waited(code: str) -> None:
    """An async c10d collective may read its input until its wait: the wrapper neither frees nor
    reuses that buffer in between (it reused it for the next op's output, and gloo, reading later,
    sent that: a wrong answer under load)."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"(buf\d+) = .*_c10d_functional\.(?!wait_tensor)\w+\.default\((buf\d+)", line)
        if m:
            out, src = m.groups()
            j = next(k for k in range(i, len(lines)) if f"wait_tensor.default({out})" in lines[k])
            assert not any(re.search(rf"\bdel {src}\b", t) for t in lines[i:j]), "\n".join(lines[i:j + 1])


def test_other_collectives_run_through_c10d(tmp_path):
    for plans, reasons in run_ranks(_other_collectives, WORLD, args=(str(tmp_path),)):
        assert plans == [("all_gather_into_tensor", WORLD, ""), ("all_reduce_coalesced", WORLD, "sum"),
                         ("all_to_all_single", WORLD, ""), ("broadcast", WORLD, ""),
                         ("reduce_scatter_tensor", WORLD, "sum")], plans
        assert all("through c10d" in why for why in reasons.values()) and len(reasons) == 6, reasons


def _torch_algorithm(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    fn = lambda x: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1  # noqa: E731
    x = torch.randn(64, 32, device=device(), dtype=torch.bfloat16)
    with config.patch({"comm.algorithm": "torch"}):
        out = torch.compile(fn, backend="commfuse")(x)
    torch.testing.assert_close(out, fn(x), atol=2e-2, rtol=2e-2)
    return True


@pytest.mark.gpu
def test_torch_one_shot_selectable_on_gpu():
    assert run_ranks(_torch_algorithm, WORLD) == [True] * WORLD


def _three_ranks_repeated(rank, world):
    """Barrier epochs advance correctly across calls and across kernels with different grids:
    one-shot, two-shot and a fused row reduction, called back to back, several times."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    g = dist.group.WORLD

    def fn(x, y):
        a = funcol.all_reduce(x * 2, "sum", g)          # 4 programs (two-shot: 2 steps each)
        b = funcol.all_reduce(y + 1, "sum", g)          # fused with its consumer: one program per row
        return a + 1, b / b.abs().sum(-1, keepdim=True)
    for algorithm in ("one_shot", "two_shot"):
        torch._dynamo.reset()
        with config.patch({"comm.algorithm": algorithm, "comm.block": 64, "comm.bulk_block": 128,
                           "comm.max_programs": 4}):
            compiled = torch.compile(fn, backend="commfuse")
            for step in range(3):
                torch.manual_seed(10 * rank + step)
                x, y = torch.randn(1000, device=device()), torch.randn(6, 40, device=device())
                for got, want in zip(compiled(x, y), fn(x, y)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{algorithm} step {step}")
    return True


def test_three_ranks_repeated_calls():
    assert run_ranks(_three_ranks_repeated, world=3) == [True] * 3


def _eight_ranks(rank, world, dump_dir):
    """The tuner's standalone one-shot and two-shot kernels (`commfuse.tune` times them), then one
    graph of four all-reduces, the built-in thresholds lowered so that the small ones are one-shot
    and the larger two-shot: each alone, and each with residual add + RMSNorm fused."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    from commfuse.runtime.symm import SymmPool
    from commfuse.tune import kernels, launcher
    g = dist.group.WORLD
    pool = SymmPool(g.group_name, "cpu", 4096)
    for name, kernel in kernels(world, torch.float32).items():
        for numel in (1, 37, 1000):  # fewer elements than ranks, and not a multiple of them
            out = torch.empty(numel)
            run, peers = launcher(kernel, pool, numel, out, torch.float32)
            torch.manual_seed(rank)
            peers[rank].copy_(torch.randn(numel))
            want = peers[rank].clone()
            dist.all_reduce(want)  # also: every rank has written its input
            run()
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=f"{name} {numel}")
            dist.barrier()  # every rank has read the inputs before they are rewritten

    def add_rms_norm(y, res, w):
        h = y + res
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w, h

    def fn(x, big, a1, w1, res1, a2, w2, res2, norm_w):
        small = funcol.all_reduce(x * 2, "sum", g) + 1                      # 148 B: one-shot
        large = funcol.all_reduce(big * 3, "avg", g) - 1                    # 4004 B: two-shot
        n1, h1 = add_rms_norm(funcol.all_reduce(a1 @ w1, "sum", g), res1, norm_w[:64])   # 2 x 64
        n2, h2 = add_rms_norm(funcol.all_reduce(a2 @ w2, "sum", g), res2, norm_w)        # 8 x 128
        return small, large, n1, h1, n2, h2
    torch.manual_seed(0)
    w1, w2, norm_w = torch.randn(16, 64) / 4, torch.randn(16, 128) / 4, torch.rand(128) + 0.5
    res1, res2 = torch.randn(2, 64), torch.randn(8, 128)
    compiled = torch.compile(fn, backend="commfuse", dynamic=False)
    with config.patch({"dump_dir": dump_dir, "comm.one_shot_max_bytes": {world: 2048}}):
        for step in range(2):  # the second call reuses the pool slices and the barrier epochs
            torch.manual_seed(100 * step + rank)
            args = (torch.randn(37), torch.randn(1001), torch.randn(2, 16), w1, res1,
                    torch.randn(8, 16), w2, res2, norm_w)
            for i, (got, want) in enumerate(zip(compiled(*args), fn(*args), strict=True)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"output {i}, step {step}")
    return True


def test_eight_ranks_one_shot_two_shot_and_fused_norm(tmp_path):
    # 8 gloo processes on CPU (8 GPUs on a GPU host): the widest world of an NVLink host
    assert run_ranks(_eight_ranks, 8, args=(str(tmp_path),)) == [True] * 8
    (s0,), (code0,) = _summaries(tmp_path, 0), _code(tmp_path, 0)
    assert len(s0["comm_buffers"]) == 4 and not any(b["copy_in"] for b in s0["comm_buffers"])
    for rank in range(1, 8):  # one plan on every rank
        (s,) = _summaries(tmp_path, rank)
        assert [(b["name"], b["offset"], b["bytes"]) for b in s["comm_buffers"]] == \
            [(b["name"], b["offset"], b["bytes"]) for b in s0["comm_buffers"]], rank
    comm = sorted(((k["algorithm"], bool(k["reduction"])) for k in s0["kernels"] if k.get("collective")))
    assert comm == [("one_shot", False), ("one_shot", True), ("two_shot", False), ("two_shot", True)], comm
    for b in s0["comm_buffers"]:  # every kernel reads all 8 ranks' copies
        check_peer_sum(code0, b["name"], 8)


# the value checks above, in one spawn (they assert values and their own graphs' summaries only)
def _one_rank_recompiles(rank, world):
    """Rank 0's last batch is shorter (a loader without drop_last): it alone compiles the function
    again, for a batch size of its own. Its all-reduce is the one every rank agreed on at the first
    call, so it runs with the peers' graph, checked before and not again; and a training step whose
    all-reduce result meets a loss over the symbolic batch compiles (a comm kernel's grid is static)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD

    def stat(x):  # always 8 values all-reduced, whatever the batch
        return x - funcol.all_reduce(x.sum(0), "sum", g)

    def step(x, w):
        return (x @ w).square().sum() / funcol.all_reduce(x.new_tensor([x.shape[0]]), "sum", g)
    torch._dynamo.reset()
    fn = torch.compile(stat, backend="commfuse")
    worst = 0.0
    for b in ([4, 4, 3] if rank == 0 else [4, 4, 4]):
        x = torch.randn(b, 8, device=device())
        worst = max(worst, (fn(x) - stat(x)).abs().max().item())
    from commfuse import backend
    before = len(backend.summaries)
    w = torch.randn(8, 4, device=device(), requires_grad=True)
    x = torch.randn(3, 8, device=device())
    torch._dynamo.mark_dynamic(x, 0)
    got = torch.compile(step, backend="commfuse")(x, w)
    got.backward()
    grad, w.grad = w.grad, None
    want = step(x, w)
    want.backward()
    compiled = [s["compiled"] for s in backend.summaries[before:]]
    return max(worst, (got - want).abs().max().item(), (grad - w.grad).abs().max().item()), compiled


def test_a_rank_that_alone_compiles_again_runs_the_agreed_plan():
    for worst, compiled in SHARED.result(_one_rank_recompiles):
        assert worst < 1e-4 and compiled == [True, True], (worst, compiled)


def _rank_local_producer(rank, world):
    """A row-parallel linear written by hand, its bias added on rank 0 only before the all-reduce
    (Megatron's way): rank 0's comm kernel computes its input, the others' read theirs; the ranks
    exchange the same slices all the same, so their plans agree and the result is eager's."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    torch.manual_seed(rank)
    w, b, x = (torch.randn(*s, device=device()) for s in ((4, 8), (8,), (3, 4)))

    def row_parallel(x):
        y = x @ w
        if rank == 0:
            y = y + b
        return torch.nn.functional.rms_norm(funcol.all_reduce(y, "sum", dist.group.WORLD) + 1, (8,))
    torch._dynamo.reset()
    return (torch.compile(row_parallel, backend="commfuse")(x) - row_parallel(x)).abs().max().item()


def test_a_producer_on_one_rank_only_fuses_into_its_all_reduce():
    assert max(SHARED.result(_rank_local_producer)) < 1e-5


SHARED = SharedRanks([_reduce_ops_and_dtypes, _two_groups_chained, _all_reduce_into_the_input, _nan_max_min,
                      _signed_zeros, _degenerate_shapes, _inference_mode_then_training, _one_rank_recompiles,
                      _rank_local_producer], WORLD)


def _saved_unwaited(rank, world):
    """Selective checkpointing that saves collectives (torchtitan's SAC saves c10d ops) keeps the
    all-to-all's result un-waited for the backward, which waits on it again."""
    import functools

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        save = op.namespace == "_c10d_functional" and "wait" not in str(op)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, counts):
        c = torch.ops._c10d_functional.wait_tensor(funcol.all_to_all_single(counts, None, None, dist.group.WORLD))
        c = c.view(-1)
        return x * ((c.cumsum(0) - c) * 3 + c).float()  # c read again after the cumsum

    def f(x, counts):
        return checkpoint(block, x, counts, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    counts = torch.arange(2 * world, dtype=torch.int64, device=device()).view(world, 2) + 10 * rank + 1
    x = torch.randn(2 * world, device=device(), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    f(x, counts).sum().backward()
    torch.compile(f, backend="commfuse")(x2, counts).sum().backward()
    return (x2.grad - x.grad).abs().max().item()


def test_a_collective_saved_unwaited_keeps_its_memory_through_the_backwards_wait():
    """The backward's input (the saved result, donated) was handed to the cumsum's output at the
    wait, while the wait's result, the same tensor, was read after it: gradients silently wrong."""
    assert run_ranks(_saved_unwaited, WORLD) == [0.0] * WORLD
