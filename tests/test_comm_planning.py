"""Comm-buffer planning: one pool per group shared by callsites and graphs, offsets by live range,
identical on every rank, and a cross-rank check that turns divergent programs into clear errors."""
import glob
import json

import pytest
import torch

from tests.dist_utils import WORLD, device, run_ranks
from tests.test_comm import _assert_disjoint_when_live_together

pytestmark = pytest.mark.xdist_group("comm_planning")  # one worker: its checks share spawns


def _comm_fallbacks(since: int = 0) -> list:
    """This process's collectives lowered to c10d (in the graphs from the `since`-th on), each with why."""
    from commfuse.compiled import summaries
    return [p["reason"] for s in summaries[since:] for p in s.get("comm_fallbacks", [])]


def _summaries(dump_dir, rank):
    return [json.load(open(p)) for p in sorted(glob.glob(f"{dump_dir}/rank{rank}/*/summary.json"))]


def _tp_stack(rank, world, dump_dir, layers=8):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import commfuse

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.ModuleList(torch.nn.Linear(16, 32) for _ in range(layers))
            self.down = torch.nn.ModuleList(torch.nn.Linear(32, 16) for _ in range(layers))

        def forward(self, x):
            for up, down in zip(self.up, self.down):
                x = x + down(torch.relu(up(x)))
            return x

    mesh = init_device_mesh(device().type, (world,))
    torch.manual_seed(0)
    ref, tp = Stack().to(device()), Stack().to(device())
    tp.load_state_dict(ref.state_dict())
    plan = {f"up.{i}": ColwiseParallel() for i in range(layers)}
    plan.update({f"down.{i}": RowwiseParallel() for i in range(layers)})
    parallelize_module(tp, mesh, plan)
    compiled = torch.compile(tp, backend="commfuse", options={"dump_dir": dump_dir})
    x = torch.randn(4, 16, device=device())
    for _ in range(2):  # a second step reuses the same pool slices
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, want = compiled(xt), ref(xr)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        g = torch.randn_like(want)
        out.backward(g)
        want.backward(g)
        torch.testing.assert_close(xt.grad, xr.grad, atol=1e-4, rtol=1e-4)
    return commfuse.comm_report()


def test_tp_stack_plans_one_small_pool(tmp_path):
    reports = run_ranks(_tp_stack, WORLD, args=(str(tmp_path),))
    s0 = _summaries(tmp_path, 0)
    assert len(s0) == 2  # forward and backward
    callsite = 4 * 16 * 4  # one all-reduce: 4 x 16 fp32
    for rank in range(1, WORLD):  # the same plan on every rank
        for a, b in zip(s0, _summaries(tmp_path, rank), strict=True):
            assert [(x["name"], x["offset"]) for x in a["comm_buffers"]] == \
                [(x["name"], x["offset"]) for x in b["comm_buffers"]], rank
    for a in s0:
        assert len(a["comm_buffers"]) >= 8, a["comm_buffers"]  # every layer's all-reduce
        (pool,) = a["comm_pools"]
        assert pool["sum_of_buffers"] >= 8 * callsite
        assert pool["planned_bytes"] <= 2 * callsite, pool  # not L x
        _assert_disjoint_when_live_together(a["comm_buffers"])
        _assert_exit_barriers_covered(a, glob.glob(f"{tmp_path}/rank0/{a['graph_id']}/output_code.py")[0])
    # forward and backward share the process-wide pool of the group (same size on every rank)
    sizes = [[list(per_device.values()) for per_device in r.values()] for r in reports]
    assert sizes == [[[max(s["comm_pools"][0]["planned_bytes"] for s in s0)]]] * WORLD


def _assert_exit_barriers_covered(summary, code_path):
    """Each comm buffer but the last stays live until the next comm kernel of its pool (two slices
    taking turns), and only the last kernel closes with a barrier of its own: the next kernel's
    opening barrier is passed only once every peer has ended the one before, so no rank rewrites
    a slice a peer still reads."""
    from commfuse.runtime.barrier import BARRIER_STEP
    bufs = summary["comm_buffers"]
    assert [b["exit_covered"] for b in bufs] == [True] * (len(bufs) - 1) + [False], bufs
    for a, b in zip(bufs, bufs[1:]):
        assert a["live"][1] >= b["live"][0] and a["offset"] != b["offset"], (a, b)
    code = open(code_path).read()
    barriers = [code.split(f"def {k}(", 1)[1].split("\n@triton.jit", 1)[0].count(BARRIER_STEP)
                for k in summary["collective_order"]]
    assert barriers[-1] == barriers[0] + 1 and len(set(barriers[:-1])) == 1, barriers


def _skewed_tp_stack(rank, world, dump_dir):
    """_tp_stack with rank 1 falling behind before half its kernel launches (sleeps of up to 50 ms):
    a rank that ran ahead and rewrote a pool slice its peer still reads would corrupt the sums."""
    import random
    import time
    from commfuse.runtime import launch
    launch_now, rng = launch.Site.__call__, random.Random(3)

    def late(self, stream, grid, *args):
        if rank == 1 and rng.random() < 0.5:
            time.sleep(rng.random() * 0.05)
        return launch_now(self, stream, grid, *args)
    launch.Site.__call__ = late
    try:
        return _tp_stack(rank, world, dump_dir)
    finally:
        launch.Site.__call__ = launch_now


def test_skewed_ranks_match_eager(tmp_path):
    """The comm kernels that skip their closing barrier (each buffer double-buffered until the next
    comm kernel of its pool) give eager's values, forward and backward, with one rank behind.
    Without the double buffering (slices reused by the next buffer) this fails."""
    run_ranks(_skewed_tp_stack, 2, args=(str(tmp_path),))
    for s in _summaries(tmp_path, 0):
        assert any(b["exit_covered"] for b in s["comm_buffers"]), s["comm_buffers"]


def _live_together(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    g = dist.group.WORLD

    def fn(x):
        a, b = x * 2, x * 3  # both produced before either is reduced
        ra = funcol.all_reduce(a, "sum", g)
        rb = funcol.all_reduce(b, "sum", g)
        return ra * rb
    x = torch.randn(32, device=device()) + rank
    with config.patch(dump_dir=dump_dir):
        torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x))
    return True


def test_buffers_live_together_get_disjoint_slices(tmp_path):
    run_ranks(_live_together, WORLD, args=(str(tmp_path),))
    (s0,) = _summaries(tmp_path, 0)
    a, b = s0["comm_buffers"]
    assert a["live"][0] <= b["live"][1] and b["live"][0] <= a["live"][1]
    assert a["offset"] + a["bytes"] <= b["offset"] or b["offset"] + b["bytes"] <= a["offset"]
    assert s0["comm_pools"][0]["planned_bytes"] >= a["bytes"] + b["bytes"]


def _divergent(rank, world, mode, g):
    import time
    import torch.distributed._functional_collectives as funcol
    from commfuse.compiled import summaries
    x = torch.randn(64, device=device())
    later = []  # late_cut: rank 0 breaks its graph from the second call on
    if mode == "branch":  # the other ranks reduce a slice: different comm buffers
        fn = (lambda x: funcol.all_reduce(x * 2, "sum", g)) if rank == 0 else \
            (lambda x: funcol.all_reduce(x[:16] * 2, "sum", g))
    elif mode == "algorithm":  # same graph and buffers; the ranks' configs pick different kernels
        fn = lambda x: funcol.all_reduce(x * 2, "sum", g)  # noqa: E731
    elif mode == "producer":  # one more op before the collective on rank 0: its buffer names shift
        w = torch.ones(8, 8, device=device())
        fn = lambda x: funcol.all_reduce((torch.relu(x) if rank == 0 else x).view(8, 8) @ w, "sum", g) + 1  # noqa: E731
    elif mode == "reduce_op":  # the same all-reduce, another reduce op on rank 0
        fn = lambda x: funcol.all_reduce(x * 2, "max" if rank == 0 else "sum", g)  # noqa: E731
    elif mode in ("fusion", "apart"):  # a fusion or algorithm option set on rank 0 only
        fn = lambda x: torch.nn.functional.layer_norm(funcol.all_reduce(x * 2, "sum", g).view(4, 16), (16,))  # noqa: E731
    elif mode == "graph_break":  # a graph break on rank 0 only (a log under `if rank == 0`): same collectives
        def fn(x):
            y = funcol.all_reduce(x * 2, "sum", g)
            if rank == 0:
                torch._dynamo.graph_break()
            return funcol.all_reduce(y + 1, "sum", g) * 3
    elif mode == "extra":  # one more all-reduce on rank 0, no graph break: its collectives begin with the others'
        def fn(x):
            y = funcol.all_reduce(x * 2, "sum", g)
            return funcol.all_reduce(y + 1, "sum", g) * 3 if rank == 0 else y * 3
    elif mode == "late_cut":  # the same, from the second call on (a log every N steps): peers run the agreed graph
        def fn(x):
            y = funcol.all_reduce(x * 2, "sum", g)
            if rank == 0 and later:
                torch._dynamo.graph_break()
            return funcol.all_reduce(y + 1, "sum", g) * 3
    elif mode.startswith("sum_logged"):  # rank 0 also returns a term (a log): a + b is all-reduced once on the others only
        def fn(x):
            a, b = funcol.all_reduce(x * 2, "sum", g), funcol.all_reduce(x + 1, "sum", g)
            return torch.cat([a + b, a if rank == 0 else a + b])
    elif mode == "consumer":  # a residual norm after the all-reduce on rank 1 only: fused into its comm kernel
        def fn(x):
            x = x.view(4, 16)
            y = funcol.all_reduce(x * 2, "sum", g)
            return (torch.nn.functional.layer_norm(y + x, (16,)) if rank == 1 else y.relu()).reshape(-1)
    elif mode.startswith("bucketed"):  # two all-gathers, the second reading the first on rank 1 only: one bucket on rank 0
        def fn(x):
            ra = funcol.all_gather_tensor(x[:16] * 2, 0, g)
            return torch.cat([ra, funcol.all_gather_tensor(x[16:32] * 3 if rank == 0 else x[16:32] + ra[:16], 0, g)])
    elif mode == "constant":  # a rank-dependent constant (a vocabulary shard's offset): same collectives
        fn = lambda x: funcol.all_reduce(x * 2 - 12 * rank, "sum", g) + 1  # noqa: E731
    else:  # the other ranks take a branch with no collective at all
        fn = (lambda x: funcol.all_reduce(x * 2, "sum", g)) if rank == 0 else (lambda x: x * 2)
    algorithm = ("one_shot", "two_shot")[rank % 2] if mode == "algorithm" else "auto"
    options = {"comm.plan_check_timeout_s": 3, "comm.barrier_timeout_s": 3, "comm.algorithm": algorithm}
    if mode.endswith("_c10d"):  # every collective through c10d: no comm buffer, yet checked
        options["comm.enabled"] = False
    if rank == 0:
        options.update({"fusion": {"max_fusion_size": 1}, "apart": {"comm.algorithm": "one_shot_apart"}}.get(mode, {}))
    start, graphs = time.time(), len(summaries)
    try:
        # options=, not config.patch: the check runs at the first call, after the compile's options
        compiled = torch.compile(fn, backend="commfuse", options=options)
        if mode == "late_cut":
            compiled(x)
            later.append(True)
        got = compiled(x)
    except Exception as e:
        return ("error", str(e), time.time() - start)
    err = (got - fn(x)).abs().max().item()
    return ("ok", {"err": err, "c10d": _comm_fallbacks(graphs)} if mode in SPLIT_OR_FUSED else "", time.time() - start)


SPLIT_OR_FUSED = ("fusion", "graph_break", "algorithm", "apart", "sum_logged", "consumer", "bucketed", "sum_logged_c10d",
                  "bucketed_c10d")  # the ranks' kernels or c10d collectives differ


# "late_cut" and "missing" last: their ranks leave at different times
MODES = ("branch", "constant", "producer", "algorithm", "reduce_op", "fusion", "apart", "graph_break", "extra", "sum_logged",
         "consumer", "bucketed", "sum_logged_c10d", "bucketed_c10d", "late_cut", "missing")


def _every_divergence(rank, world):
    """Each mode of _divergent in one spawn, over a group of its own (every rank): its own pool and
    plan-check sequence, as a fresh process group would have; Dynamo reset between modes."""
    import torch.distributed as dist
    out = {}
    for mode in MODES:
        torch._dynamo.reset()
        out[mode] = _divergent(rank, world, mode, dist.new_group(list(range(world))))
    dist.barrier()  # the ranks that skip "missing"'s collective stay alive: they never arrive, not exit
    return out


@pytest.fixture(scope="module")
def divergent():
    """mode -> every rank's (status, message, seconds)."""
    ranks = run_ranks(_every_divergence, WORLD)
    return {mode: [r[mode] for r in ranks] for mode in MODES}


def test_rank_divergent_branch_fails_on_every_rank(divergent):
    results = divergent["branch"]
    for status, message, seconds in results:
        assert status == "error"
        assert "ranks disagree on the comm-buffer plan" in message and "buf" in message, message
        assert seconds < 30


def test_a_rank_dependent_constant_is_no_disagreement(divergent):
    """The graphs differ in a constant, their collectives do not: the check compared the graphs'
    code and refused a correct SPMD program."""
    for status, message, _ in divergent["constant"]:
        assert status == "ok", message


def test_collectives_agreeing_under_other_buffer_names_are_no_disagreement(divergent):
    """The ranks' collectives agree, their buffer names do not (rank 0 stores one more value before
    the all-reduce; DTensor's uneven shards do the same): the check compared the names."""
    for status, message, _ in divergent["producer"]:
        assert status == "ok", message


def test_ranks_running_different_comm_kernels_run_through_c10d(divergent):
    """A config or tuned table that differs between ranks: the programs' collectives agree, the
    kernels do not. Refused before any barrier where Inductor runs; c10d's all-reduce now, named."""
    for status, message, seconds in divergent["algorithm"]:
        assert status == "ok" and message["err"] < 1e-5, message
        assert any("compiled different comm kernels" in r and "two_shot" in r for r in message["c10d"]), message
        assert seconds < 30


def test_ranks_reducing_with_different_ops_fail(divergent):
    """sum on some ranks, max on others: each rank combined the peers' values its own way and the
    ranks went on with different results, silently."""
    for status, message, seconds in divergent["reduce_op"]:
        assert status == "error", message
        assert "comm kernel #0" in message and "differs in reduce op: '" in message and "'max' on rank 0" in message, message
        assert seconds < 30


def test_option_set_on_one_rank_is_named(divergent):
    """comm.algorithm set on rank 0 only: what differs is named, and the option behind it."""
    for status, message, _ in divergent["apart"]:
        assert status == "ok" and message["err"] < 1e-5, message
        assert any("algorithm (comm.algorithm" in r and "'one_shot_apart' on rank" in r for r in message["c10d"]), message


def test_a_fusion_option_on_one_rank_changes_nothing_the_ranks_exchange(divergent):
    """max_fusion_size set on rank 0 only: its all-reduce's producer runs apart, the others' in
    their comm kernel, reading and writing the same slices in the same programs: it runs as eager."""
    for status, message, _ in divergent["fusion"]:
        assert status == "ok" and message["err"] < 1e-5 and not message["c10d"], (status, message)


def test_a_graph_break_on_one_rank_runs_through_c10d(divergent):
    """Rank 0 breaks its graph between two all-reduces, the others do not: the same collectives in
    the same order, cut apart. Each graph planned its comm buffers alone, and the check refused the
    program where Inductor ran it; the collectives of that group now run through c10d."""
    for status, message, _ in divergent["graph_break"]:
        assert status == "ok" and message["err"] < 1e-5, (status, message)


def test_extra_collectives_on_one_rank_are_no_graph_break(divergent):
    """Rank 0 all-reduces once more in the same graph, with no graph break: its collectives begin
    with the others', as a cut's would. Taken for a cut, the group ran through c10d and rank 0
    waited in its second all-reduce until the group's timeout (as under Inductor). Dynamo says
    where a graph ended: every rank now fails at the plan check."""
    for status, message, seconds in divergent["extra"]:
        assert status == "error" and "ranks disagree on the comm-buffer plan" in message and seconds < 30, message


@pytest.mark.parametrize("mode", ["sum_logged", "consumer", "bucketed", "sum_logged_c10d", "bucketed_c10d"])
def test_code_around_collectives_on_one_rank_runs_through_c10d(divergent, mode):
    """The same collectives, and code around them on one rank only that changed what it compiled:
    an all-reduced term it also returns (the others summed the terms first and all-reduced once:
    wrong values on every call), a norm fused into its comm kernel, all-gathers merged into one
    bucket (gloo aborted); also where every collective runs through c10d (no comm buffer to check
    before). Refused, or worse, where Inductor runs; c10d's collectives now, as the program issues
    them."""
    for status, message, _ in divergent[mode]:
        assert status == "ok" and message["err"] < 1e-5, (status, message)
        assert any("compiled different comm kernels" in r for r in message["c10d"]) or mode.endswith("_c10d"), message


def test_a_graph_break_on_one_rank_after_the_first_calls_is_named(divergent):
    """Rank 0 cuts a graph the ranks agreed on, from its second call on; the peers run it whole and
    wait in its comm kernels. Not mendable there (the peers are mid-graph): the error says why,
    on rank 0, and every rank's wait is bounded."""
    (s0, m0, t0), *others = divergent["late_cut"]
    assert s0 == "error" and "cut apart on this rank after the first calls" in m0, m0
    for status, message, seconds in [(s0, m0, t0), *others]:
        assert status == "error" and seconds < 30, (status, message, seconds)


def _breaks_on_rank_0(rank, world, breaks=True):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def fn(x):
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        if rank == 0 and breaks:
            torch._dynamo.graph_break()
        return funcol.all_reduce(y + 1, "sum", dist.group.WORLD) * 3
    x = torch.arange(8.0, device=device()) + rank
    got = torch.compile(fn, backend="commfuse")(x)
    return (got - fn(x)).abs().max().item(), _comm_fallbacks()


@pytest.mark.parametrize("starts", [(True, True, False), (False, True, True)],
                         ids=["break_then_none", "none_then_break"])
def test_a_graph_break_on_one_rank_at_a_warm_start(tmp_path, monkeypatch, starts):
    """Three starts over one cache folder, each with or without a graph break on rank 0.
    break_then_none: the second start finds the first's graphs in AOTAutograd's cache, which
    cannot lower them again: the first start marked the graphs that found the cut, and the second
    compiles them afresh. A third start without the break runs commfuse's kernels again: the mark
    carries over no cut (it did, on the one rank whose graph had it, which alone sent the group to
    c10d, and the peer waited at the plan check).
    none_then_break: the second start finds rank 1's whole graph in AOTAutograd's cache, which
    cannot be lowered again: it raised. It now runs through aten, its c10d collectives meeting
    rank 0's in order, and the next start compiles it afresh."""
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for start, breaks in enumerate(starts):
        for err, reasons in run_ranks(_breaks_on_rank_0, 2, args=(breaks,)):
            assert err < 1e-5, (start, err)
            assert any("cut their graphs" in r for r in reasons) == breaks, (start, reasons)


def _c10d_on_rank_1(rank, world):
    import time
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    if rank == 1:  # an environment variable exported on one node only: its all-reduce goes to c10d
        config.comm.algorithm = "c10d"
    start = time.time()
    try:
        torch.compile(lambda x: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1, backend="commfuse",
                      options={"comm.plan_check_timeout_s": 3})(torch.ones(16, device=device()))
    except Exception as e:
        return str(e), time.time() - start
    return "", time.time() - start


def test_an_option_set_on_one_rank_only_is_named_at_the_timeout():
    """A rank whose config sends its all-reduce to c10d has no plan to check, so its peer waits at
    the check for it: the timeout names the options that differ, as each process announced them."""
    (message, seconds), _ = run_ranks(_c10d_on_rank_1, 2)
    assert "rank 1's commfuse options differ from this rank's: comm.algorithm = 'c10d' there, 'auto' here" in message, message
    assert seconds < 30


def test_missing_rank_is_reported_not_hung(divergent):
    (s0, m0, t0), *others = divergent["missing"]
    missing = str(list(range(1, WORLD)))  # every other rank, by number
    assert s0 == "error" and "did not reach the comm-buffer plan check" in m0 and missing in m0, m0
    assert t0 < 30
    assert [s for s, _, _ in others] == ["ok"] * (WORLD - 1)


def _peer_stops(rank, world):
    import time
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    fn = torch.compile(lambda x: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1, backend="commfuse",
                       options={"comm.barrier_timeout_s": 2})
    x = torch.randn(32, device=device())
    fn(x)  # every rank: pools made, plans checked
    if rank != 0:
        time.sleep(8)  # alive, but never calls again
        return ("ok", "", 0.0)
    start = time.time()
    try:
        for _ in range(4):  # on a GPU the host learns of the give-up a call or two later
            fn(x).sum().item()
    except Exception as e:
        return ("error", str(e), time.time() - start, device().type)
    return ("ok", "", time.time() - start, device().type)


def test_peer_that_stops_calling_is_reported_not_hung():
    """Rank 0 calls the graph once more than the others: its comm kernel waited at the barrier
    forever, past the process group's timeout. The error names the ranks, on a GPU too (the kernel
    gives up without a trap; its host reads why)."""
    (status, message, seconds, where), *_ = run_ranks(_peer_stops, WORLD, timeout=60)
    assert status == "error" and seconds < 8, (status, message, seconds)
    assert "gave up waiting for rank(s) " in message and "(timed out)" in message, message
    assert str(list(range(1, WORLD))) in message and "comm.barrier_timeout_s=2 s" in message, message


def _eager_after_the_recompile_limit(rank, world):
    """Rank 1 alone sees a new size each call (an MoE's rank-local token count), recompiles until
    Dynamo's recompile limit, and then runs the frame eagerly: its c10d all-reduce cannot meet rank
    0's comm kernel. Rank 0's wait gives up after its timeout, and says why."""
    import time
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    fn = torch.compile(lambda x, z: funcol.all_reduce(x + z.sum(), "sum", dist.group.WORLD) * 2, backend="commfuse",
                       dynamic=False, options={"comm.barrier_timeout_s": 3})
    x, start = torch.ones(64, device=device()), time.time()
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            for i in range(4):
                fn(x, torch.ones(4 + (i if rank == 1 else 0), device=device())).sum().item()
    except Exception as e:
        return str(e), time.time() - start
    return "", time.time() - start


def test_a_peer_that_runs_a_frame_eagerly_after_dynamos_recompile_limit_is_named():
    (message, seconds), _ = run_ranks(_eager_after_the_recompile_limit, 2, timeout=120)
    assert "gave up waiting for rank(s) [1]" in message and seconds < 60, (message, seconds)
    assert "rank 1 runs '<lambda>'" in message and "torch._dynamo.config.recompile_limit (2)" in message, message


def _two_levels(rank, world):
    """All-reduces over a sub-group ({0, 1} / {2, 3}, a 2-D mesh's inner dim) and over WORLD in one
    graph. The WORLD check compared every rank's pools, sub-group names included, which differ
    between {0, 1} and {2, 3}: 'ranks disagree ... pools differ'. The pairs reduce different sizes
    (each its own sequence length): the WORLD check compared the pairs' kernels, 'differs in elements'."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    pair, _ = dist.new_subgroups(2)
    torch.manual_seed(0)
    w = torch.randn(8, 8, device=device())

    def fn(x):
        a = funcol.all_reduce(x @ w, "sum", pair)
        return funcol.all_reduce(a.sum(0) @ w, "sum", dist.group.WORLD)
    x = torch.randn(4 + 2 * (rank // 2), 8, device=device()) + rank
    torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x), rtol=1e-4, atol=1e-4)
    return True


def test_sub_group_and_world_in_one_graph():
    assert run_ranks(_two_levels, world=4) == [True] * 4


def _initialized_again(rank, world, init_dir, second):
    """The same all-reduce compiled and checked by every rank, then the process group destroyed and
    initialized anew, and the all-reduce compiled again with algorithm `second[rank % 2]`: its
    largest error against eager, or its error message."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from tests.dist_utils import use_cuda
    x = torch.randn(64, device=device()) + rank
    fn = lambda t: funcol.all_reduce(t * 2, "sum", dist.group.WORLD) + 1  # noqa: E731

    def run(algorithm):
        torch._dynamo.reset()
        options = {"comm.plan_check_timeout_s": 3, "comm.barrier_timeout_s": 3, "comm.algorithm": algorithm}
        return (torch.compile(fn, backend="commfuse", options=options)(x) - fn(x)).abs().max().item()
    first = run("one_shot")
    dist.destroy_process_group()
    dist.init_process_group("nccl" if use_cuda(world) else "gloo", init_method=f"file://{init_dir}/again",
                            rank=rank, world_size=world)
    try:
        return max(first, run(second[rank % 2])), _comm_fallbacks()
    except Exception as e:
        return str(e), []



def test_a_group_initialized_again_runs_and_checks_its_plans_anew(tmp_path):
    """What the ranks agreed on lives with the store of one init_process_group. After a new one,
    the all-reduce runs as before; and where an odd rank picks another algorithm, every rank sees
    it, and runs the all-reduce through c10d (rank 0, whose plan was agreed before, skipped the
    check its peer waited in)."""
    (tmp_path / "same").mkdir(), (tmp_path / "other").mkdir()
    for err, reasons in run_ranks(_initialized_again, WORLD, args=(str(tmp_path / "same"), ("one_shot",) * 2)):
        assert err < 1e-5 and not reasons, (err, reasons)
    for err, reasons in run_ranks(_initialized_again, WORLD, args=(str(tmp_path / "other"), ("one_shot", "two_shot"))):
        assert err < 1e-5 and any("compiled different comm kernels" in r and "two_shot" in r for r in reasons), (err, reasons)


def _uneven_all_to_all(rank, world, bucketing):
    """A mixture of experts' dispatch: each rank sends and receives its own numbers of rows
    (all_to_all_single with splits) beside an all-reduce of ours, or beside all-gathers that
    bucketing merges. The plan check compared the all-to-all's elements across ranks: 'ranks
    disagree' where Inductor ran."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    sends, receives = [r + 1 + rank for r in range(world)], [rank + 1 + r for r in range(world)]

    def fn(x, y, w1, w2):
        h = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        if bucketing:
            h = h + sum(funcol.all_gather_tensor(w, 0, dist.group.WORLD).sum() for w in (w1, w2))
        return h + 1, funcol.all_to_all_single(y * 3, receives, sends, dist.group.WORLD) + 1
    x, w1, w2 = (torch.randn(*s, device=device()) for s in ((4, 5), (3, 5), (2, 5)))
    y = torch.arange(sum(sends) * 5, dtype=torch.float32, device=device()).reshape(-1, 5) + 100 * rank
    options = {"comm.enabled": not bucketing}  # (then the group is checked for the bucket alone)
    for got, want in zip(torch.compile(fn, backend="commfuse", options=options)(x, y, w1, w2), fn(x, y, w1, w2)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return True


@pytest.mark.parametrize("bucketing", [False, True], ids=["beside_a_comm_kernel", "beside_a_bucket"])
def test_uneven_all_to_all_is_no_disagreement(bucketing):
    assert run_ranks(_uneven_all_to_all, 2, args=(bucketing,)) == [True] * 2


def _p2p_beside_a_comm_kernel(rank, world):
    """A send from rank 0 to rank 1 traced into the graph (torch's opt-in) beside an all-reduce of
    ours: the plan check took the sender's and the receiver's programs for different ones; with
    them out of the plan, the receive (its schema says no write) was dead code, its buffer read
    unreceived. The ops write their tensors, their waits too."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def fn(x):
        a = funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
        buf = torch.empty_like(a)
        (dist.isend(a * 3, 1) if rank == 0 else dist.irecv(buf, 0)).wait()
        return a, (buf if rank == 1 else a)  # (rank 0's buffer is never written: not compared)
    with torch._dynamo.config.patch(enable_p2p_compilation=True):
        got = torch.compile(fn, backend="commfuse")(torch.ones(4, device=device()))
    for g, w in zip(got, fn(torch.ones(4, device=device()))):
        torch.testing.assert_close(g, w)
    return True


@pytest.mark.skipif(not hasattr(torch.ops._c10d_functional, "isend"), reason="functional send/recv: torch >= 2.12")
def test_send_and_receive_beside_a_comm_kernel():
    assert run_ranks(_p2p_beside_a_comm_kernel, 2) == [True] * 2
