"""Overlap scheduling (commfuse/overlap.py): a c10d collective is issued as early as its inputs
allow and waited at the first use of its result, never later than the program placed it, never
across an op we cannot see into or another collective; the ranks check the collectives' order.

One spawn of two ranks: rank 0 compiles the ordering programs over a group of its own (c10d, as
for any group of one rank); both ranks then compile an all-gather that goes to c10d because
independent matmuls hide it (Choices.hidden_behind_compute), and a program whose collectives they
order differently (the order is part of the plan they check where the graph has symmetric pools)."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.testing import FileCheck

from tests.common import compile_and_run
from tests.dist_utils import device, run_ranks

c10d = torch.ops._c10d_functional


@torch.library.custom_op("cftest::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An op commfuse cannot see into: for all it knows, it meets other ranks."""
    return x * 2


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


def _programs(g1: str, g2: str) -> dict:
    def early(x, a, b):  # the program issues its collective after a matmul it does not need
        h = a @ b
        y = c10d.all_reduce(x * 2, "sum", g1)
        h = torch.relu(h) @ b
        return c10d.wait_tensor(y) + 1, h

    def far_wait(x, a, b):  # issued first, waited after independent matmuls (issue 38)
        y = c10d.all_reduce(x * 2, "sum", g1)
        h = torch.relu(a @ b) @ b
        h = torch.relu(h @ b) @ b
        return c10d.wait_tensor(y).sum(0) + h.sum(), h

    def barrier(x, a, b):  # the custom op might communicate: the collective stays after it
        h = opaque(a @ b)
        y = c10d.all_reduce(x * 2, "sum", g1)
        h = h @ b
        return c10d.wait_tensor(y) + 1, h

    def two_groups(x, a, b):  # the second collective's input is ready first: it still goes second
        y1 = c10d.all_reduce(a @ b, "sum", g1)
        y2 = c10d.all_reduce(x * 3, "sum", g2)
        h = torch.relu(a) @ b
        return c10d.wait_tensor(y1) + h, c10d.wait_tensor(y2) + 1

    def late(x, a, b):  # issued last; issuing it early would hold its big input through the matmuls
        h = torch.relu(a @ b) @ b
        y = c10d.all_reduce(x * 2, "sum", g1)
        return c10d.wait_tensor(y).sum(0), h

    def blocks(x, *ws):  # FSDP: each block's weight gathered just before the block uses it
        h = x
        for w in ws:
            h = torch.relu(h @ c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, g1)))
        return h

    return dict(early=early, far_wait=far_wait, barrier=barrier, two_groups=two_groups, late=late, blocks=blocks)


def _swapped(rank: int, group: str):
    def f(x, y):  # a rank-dependent branch: the ranks issue the two all-reduces in opposite orders,
        if rank == 0:  # one over symmetric memory (fp32), one through c10d (fp64)
            a, b = c10d.all_reduce(x, "sum", group), c10d.all_reduce(y, "sum", group)
        else:
            b, a = c10d.all_reduce(y, "sum", group), c10d.all_reduce(x, "sum", group)
        return c10d.wait_tensor(a) * 2, c10d.wait_tensor(b)
    return f


def _hidden(rank, world, tmp):
    """An all-gather that the (made-up) table runs faster as our kernel, beside matmuls it does not
    feed or need that outlast c10d's time: it goes to c10d, issued before them and waited after."""
    group = dist.group.WORLD.group_name

    def fn(x, a, b):
        y = c10d.all_gather_into_tensor(x * 2, world, group)
        h = torch.relu(a @ b) @ b  # 2 x 2 x 256^3 flops: about 2 µs at the policy's fp32 rate
        return c10d.wait_tensor(y) + 1, h
    table = {"host": {"gpu": "cpu", "world": world}, "measurements": [],
             "all_gather": [{"bytes": 2048, "symm_all_gather": 1.0, "c10d": 1.5}]}
    path = f"{tmp}/table{rank}.json"
    with open(path, "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    args = [torch.randn(8, 32, device=device()), *(torch.randn(256, 256, device=device()) for _ in range(2))]
    got, dumps = compile_and_run(fn, *args, tmp_path=f"{tmp}/hidden{rank}", **{"comm.table": path})
    for w, v in zip(fn(*args), got):
        torch.testing.assert_close(v, w, rtol=1e-4, atol=1e-3)
    [graph] = dumps.graphs(rank)
    return dumps.summary(graph)["comm_plans"], _call(dumps.code(graph))


def _ranks(rank, world, tmp):
    own = [dist.new_group([r]) for r in range(world) for _ in range(2)]  # every rank creates every group
    out = {}
    if rank == 0:
        g1, g2 = own[0].group_name, own[1].group_name
        torch.manual_seed(0)
        small = [torch.randn(n, n, device=device()) for n in (64, 256, 256)]
        big = [torch.randn(n, n, device=device()) for n in (576, 512, 512)]  # a 1.3 MB all-reduce
        cases = {"early": (small, {}), "far_wait": (big, {}), "far_wait_off": (big, {"overlap_collectives": False}),
                 "barrier": (small, {}), "two_groups": (small, {}), "late": ([big[0], *small[1:]], {}),
                 "late_loose": ([big[0], *small[1:]], {"overlap_peak_share": 1.0}),
                 # a gathered weight is 64 KB against a peak of about 576 KB: one more held fits the bound
                 "blocks": ([torch.randn(512, 128, device=device()), *(torch.randn(128, 128, device=device()) / 8
                                                                        for _ in range(4))],
                            {"overlap_peak_share": 0.15, "comm.bucketing": False})}
        programs = _programs(g1, g2)
        for name, (args, patch) in cases.items():
            fn = programs[name.removesuffix("_off").removesuffix("_loose")]
            got, dumps = compile_and_run(fn, *args, tmp_path=f"{tmp}/{name}", **patch)
            want = fn(*args)
            for w, v in zip(want, got):
                torch.testing.assert_close(v, w, rtol=1e-4, atol=1e-3)
            summary, code = dumps.only()
            out[name] = (summary, code, g1, g2)
    dist.barrier()  # rank 1 waits here, not at the plan check (its timeout is shorter than rank 0's compiles)
    out["hidden"] = _hidden(rank, world, tmp)
    f = _swapped(rank, dist.group.WORLD.group_name)
    try:
        compile_and_run(f, torch.ones(8, device=device()), torch.ones(8, dtype=torch.float64, device=device()),
                        tmp_path=f"{tmp}/swapped{rank}")
        out["swapped"] = "ran"
    except RuntimeError as e:
        out["swapped"] = str(e)
    return out


def _call(code: str) -> str:
    return code[code.index("def call"):]


def test_overlap_orders(tmp_path):
    out = run_ranks(_ranks, 2, args=(str(tmp_path),))
    res = out[0]
    ar, mm, wait = "_c10d_functional.all_reduce", "aten.mm", "_c10d_functional.wait_tensor"

    # issued before the matmul the program put first, waited after the last one
    summary, code, *_ = res["early"]
    FileCheck().check(ar).check(mm).check(mm).check(wait).run(_call(code))
    [c] = summary["c10d_overlap"]
    assert c["placed"].startswith("issued early") and c["issued_at"] < c["waited_at"], c

    # far wait: the memory order alone moves the collective after the matmuls, waited at once...
    summary, code, *_ = res["far_wait_off"]
    assert summary["peak_memory_by_order"]["least_peak_first"] < summary["peak_memory_by_order"]["original"]
    FileCheck().check_count(mm, 4).check(ar).check(wait).run(_call(code))
    # ... the overlap the program asked for is kept: never later than the program placed it
    summary, code, *_ = res["far_wait"]
    FileCheck().check(ar).check_count(mm, 4).check(wait).run(_call(code))
    assert summary["collective_order"] == [f"c10d_all_reduce__{summary['c10d_overlap'][0]['issued_at']}"]

    # no collective crosses an op we cannot see into (the extern calls, in the wrapper's order)
    summary, code, *_ = res["barrier"]
    calls = summary["extern_calls"]
    opaque_at = calls.index("cftest.opaque.default")
    ar_at = next(i for i, c in enumerate(calls) if c.startswith(ar))
    assert opaque_at < ar_at < calls.index("aten.mm.out", opaque_at), calls

    # collectives on two groups keep the program's order, though the second could go first
    summary, code, g1, g2 = res["two_groups"]
    FileCheck().check(f"'sum', '{g1}')").check(f"'sum', '{g2}')").check(mm).check(wait).run(_call(code))
    assert [c["group"] for c in summary["c10d_overlap"]] == [g1, g2]

    # overlap bounded by the peak memory: the memory order runs the collective and its reduction of
    # the big result before the matmuls, and overlapping would hold that result across them...
    summary, code, *_ = res["late"]
    FileCheck().check(ar).check(wait).check_count(mm, 2).run(_call(code))
    assert summary["c10d_overlap"][0]["placed"].startswith("kept in the memory order"), summary["c10d_overlap"]
    summary, code, *_ = res["late_loose"]  # ... as it may, under a looser bound: waited after them
    FileCheck().check(ar).check_count(mm, 2).check(wait).run(_call(code))

    # every all-gather at the start would hold all gathered weights past the bound; the last is
    # issued as early as the bound allows, not left where its block needs it: each is issued at
    # least a block ahead
    summary, code, *_ = res["blocks"]
    lines = _call(code).splitlines()
    issued = [k for k, line in enumerate(lines) if "_c10d_functional.all_gather_into_tensor" in line]
    mms = [k for k, line in enumerate(lines) if mm in line]
    assert len(issued) == len(mms) == 4 and all(issued[i] < mms[i - 1] for i in (1, 2, 3)), (issued, mms)
    assert issued[3] > mms[0] and "groups early" in summary["c10d_overlap"][3]["placed"], summary["c10d_overlap"]

    # c10d where the independent matmuls outlast it, though the table has our kernel faster alone
    for plans, code in (o["hidden"] for o in out):
        [plan] = plans
        assert plan["algorithm"] == "c10d" and "hides behind about 2 µs" in plan["reason"], plan
        FileCheck().check("_c10d_functional.all_gather_into_tensor").check_count(mm, 2).check(wait).run(code)

    # the ranks ordered their collectives differently: both stop at the first call, naming them
    for r, o in enumerate(out):
        assert "ranks disagree" in o["swapped"] and "comm kernel #0" in o["swapped"] and "c10d" in o["swapped"], \
            (r, o["swapped"])


def test_independent_flops_counts_what_neither_feeds_nor_needs_the_collective():
    """The matmuls between the collectives before and after, that neither feed this one nor need
    its result (the work a c10d collective can run under)."""
    from commfuse.overlap import independent_flops
    g = torch.fx.Graph()

    def op(target, *args):
        n = g.call_function(target, args)
        n.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
        return n
    x, w, b = (g.placeholder(n) for n in "xwb")
    for n, shape in ((x, (8, 16)), (w, (16, 32)), (b, (16,))):
        n.meta["val"] = torch.empty(shape, device="meta")
    aten = torch.ops.aten
    before = op(aten.mm.default, x, w)                           # 8 x 16 x 32: before a barrier
    opaque_ = g.call_function(torch.ops.cftest.opaque.default, (x,))
    feeds = op(aten.relu.default, op(aten.mm.default, x, w))     # feeds the collective
    independent = op(aten.mm.default, x, w)                      # 8 x 16 x 32
    pair = g.call_function(aten.var_mean.correction, (x,))       # a tuple-valued node and its item
    pair.meta["val"] = aten.var_mean.correction(x.meta["val"])
    item = g.call_function(__import__("operator").getitem, (pair, 0))
    item.meta["val"] = pair.meta["val"][0]
    ag = g.call_function(c10d.all_gather_into_tensor.default, (feeds, 2, "0"))
    ag.meta["val"] = torch.empty(16, 32, device="meta")
    wait = g.call_function(c10d.wait_tensor.default, (ag,))
    wait.meta["val"] = ag.meta["val"]
    needs = op(aten.mm.default, wait, op(aten.t.default, op(aten.mm.default, x, w)))  # its user's input is independent
    later = op(aten.addmm.default, b, independent, op(aten.t.default, w))  # 8 x 32 x 16, after the wait
    other = g.call_function(c10d.all_reduce.default, (later, "sum", "0"))
    after = op(aten.mm.default, x, w)                            # past the next collective
    g.output((before, opaque_, needs, other, after, item))
    assert independent_flops(ag) == 2 * (8 * 16 * 32 + 8 * 16 * 32 + 8 * 32 * 16)
