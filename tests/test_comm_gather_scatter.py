"""All-gather and reduce-scatter over symmetric memory: values against eager for every dtype, sum
and avg, odd sizes, forward and backward; the plan, a producer writing the comm buffer, consumers
fused into the comm kernel; the policy's c10d cases."""
import glob
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.testing import FileCheck

from commfuse import choices as choices_mod, config
from commfuse.collectives import CommRequest
from tests.common import check_peer_sum
from tests.dist_utils import device, run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _gathers_and_scatters(rank, world, dump_dir, small_blocks=False, dtypes=DTYPES):
    """One graph: per dtype, an all-gather between a pointwise producer and consumer, one feeding a
    row norm, and a sum and an avg reduce-scatter, at 7 x 5 (3 x 5) per rank; then an all-gather of
    8 x 4, whose every block lies in one rank's shard when blocks are 32 elements (`small_blocks`,
    also two programs striding over several blocks each)."""
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD

    def fn(*xs):
        out = [funcol.all_gather_tensor(xs[-1].abs(), 0, g) * 3]
        for x, y in zip(xs[::2], xs[1::2]):
            out.append(funcol.all_gather_tensor(x * 2, 0, g) + 1)
            gathered = funcol.all_gather_tensor(x - 1, 0, g).float()
            out.append(gathered * torch.rsqrt(gathered.pow(2).mean(-1, keepdim=True) + 1e-6))
            out.append(funcol.reduce_scatter_tensor(y * y - 1, "sum", 0, g).float() * 3)
            out.append(funcol.reduce_scatter_tensor(torch.sin(y), "avg", 0, g) - 0.5)
        return out

    def reference(*xs):  # eager, with avg as sum / world (gloo has no avg)
        out = [funcol.all_gather_tensor(xs[-1].abs(), 0, g) * 3]
        for x, y in zip(xs[::2], xs[1::2]):
            out.append(funcol.all_gather_tensor(x * 2, 0, g) + 1)
            gathered = funcol.all_gather_tensor(x - 1, 0, g).float()
            out.append(gathered * torch.rsqrt(gathered.pow(2).mean(-1, keepdim=True) + 1e-6))
            out.append(funcol.reduce_scatter_tensor((y * y - 1).float(), "sum", 0, g) * 3)
            out.append((funcol.reduce_scatter_tensor(torch.sin(y).float(), "sum", 0, g) / world).to(y.dtype) - 0.5)
        return out
    torch.manual_seed(rank)
    xs = [t for d in dtypes for t in (torch.randn(7, 5, device=device(), dtype=d),
                                       torch.randn(3 * world, 5, device=device(), dtype=d))]
    xs.append(torch.randn(8, 4, device=device()))
    torch._dynamo.reset()
    with config.patch({"dump_dir": dump_dir, **({"comm.block": 32, "comm.bulk_block": 32, "comm.max_programs": 2} if small_blocks else {})}):
        got = torch.compile(fn, backend="commfuse", dynamic=False)(*xs)
    want = reference(*xs)
    for i, (o, r) in enumerate(zip(got, want)):
        d = dtypes[(i - 1) // 4] if i else torch.float32
        assert o.dtype == r.dtype and o.shape == r.shape, (i, o.dtype, r.dtype, o.shape, r.shape)
        torch.testing.assert_close(o.float(), r.float(), atol=TOL[d], rtol=TOL[d], msg=f"output {i} ({d})")
    return True


def _check_code(dump_dir, world, small_blocks=False, dtypes=DTYPES):
    (path,) = glob.glob(f"{dump_dir}/rank0/*/summary.json")
    s = json.load(open(path))
    code = open(os.path.join(os.path.dirname(path), "output_code.py")).read()
    # no c10d extern: every collective is a plan of ours, which names its algorithm
    assert not [c for c in s["extern_calls"] if "c10d" in c] and not s["comm_fallbacks"], s["extern_calls"]
    plans = s["comm_plans"]
    assert [(p["collective"], p["reduce_op"], p["algorithm"]) for p in plans] == [
        ("all_gather_into_tensor", "", "symm_all_gather")] + len(dtypes) * (
        [("all_gather_into_tensor", "", "symm_all_gather")] * 2 +
        [("reduce_scatter_tensor", op, "symm_reduce_scatter") for op in ("sum", "avg")]), plans
    assert all(p["world"] == world and "gather_scatter_max_bytes" in p["reason"] for p in plans), plans
    comm_kernels = [k for k in s["kernels"] if k.get("collective")]  # (a repeated kernel: one name)
    for p in plans:
        # the producer's kernel stores into the comm buffer (no copy); the collective's value is
        # never stored: its consumers run in the comm kernel, which writes their outputs
        (producer,) = [k for k in s["kernels"] if p["buffer"] in k["writes"]]
        assert not producer.get("collective") and not p["copy_in"], (p, producer)
        FileCheck().check(f"{p['buffer']} = comm['{p['buffer']}']").check(f"{producer['name']}_launch").check_same(
            p["buffer"]).run(code)
        (kernel,) = [k for k in comm_kernels if p["result"] in k["nodes"]]
        assert kernel["collective"] == p["collective"] and kernel["algorithm"] == p["algorithm"], kernel
        assert kernel["fused_nodes"] >= 2 and p["result"] not in kernel["writes"], kernel
        defn = f"def {kernel['name']}("
        if p["collective"] == "reduce_scatter_tensor":  # every rank's element of this rank's shard
            check_peer_sum(code, p["buffer"], world, kernel=defn)
            assert "rank * 15 + (" in code.split(defn, 1)[1].split("\n@triton", 1)[0]
        else:  # each lane loads from the pointer of the rank that holds its row
            body = code.split(defn, 1)[1].split("\n@triton", 1)[0]
            # (one pointer per block where the block lies in one rank's shard)
            uniform = small_blocks and p is plans[0]
            who = r"\(xoffset // 32\)" if uniform else r"tmp\d+"
            select = "".join(rf"tl\.where\({who} == {r}, \w+_peer{r}, " for r in range(world - 1))
            assert re.search(rf"tl\.load\({select}\w+_peer{world - 1}\){{{world - 1}}} \+ ", body), body
    assert any(k["reduction"] for k in comm_kernels)  # the norm reduces the gathered rows in the comm kernel


def _backward(rank, world, dump_dir):
    """Forward all-gathers a sequence shard; its backward reduce-scatters the gradient."""
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    torch.manual_seed(0)
    w = torch.randn(5, 6, device=device())

    def step(x):
        full = funcol.all_gather_tensor_autograd(torch.tanh(x), 0, g)
        return ((full @ w).sin() * full.sum(-1, keepdim=True)).sum()
    torch.manual_seed(rank + 10)
    x = torch.randn(7, 5, device=device(), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    with config.patch(dump_dir=dump_dir):
        loss = torch.compile(step, backend="commfuse", dynamic=False)(x)
        loss.backward()
    ref = step(x_ref)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    return True


def _forward_and_backward(rank, world, dump_dir):  # one spawn for both
    return _gathers_and_scatters(rank, world, f"{dump_dir}/fw") and _backward(rank, world, f"{dump_dir}/bw")


def test_all_gather_and_reduce_scatter_two_ranks(tmp_path):
    run_ranks(_forward_and_backward, 2, args=(str(tmp_path),))
    _check_code(tmp_path / "fw", 2)
    plans = {}
    for path in glob.glob(f"{tmp_path}/bw/rank0/*/summary.json"):
        for p in json.load(open(path))["comm_plans"]:
            plans[p["collective"]] = p["algorithm"]
    assert plans == {"all_gather_into_tensor": "symm_all_gather", "reduce_scatter_tensor": "symm_reduce_scatter"}, plans


def test_all_gather_and_reduce_scatter_four_ranks(tmp_path):
    # the low-precision dtypes (fp32's path is theirs without the casts, run at 2 ranks): 4 ranks on a
    # CPU's cores are slow
    run_ranks(_gathers_and_scatters, 4, args=(str(tmp_path), True, DTYPES[1:]))
    _check_code(tmp_path, 4, small_blocks=True, dtypes=DTYPES[1:])


@pytest.mark.parametrize("collective", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_policy_says_why_c10d(collective, monkeypatch, tmp_path):
    """Symmetric up to the cap per rank, c10d over it, a table's choice where it measured the
    collective, c10d for what the kernel cannot run; each with its reason."""
    monkeypatch.setattr(choices_mod, "group_size", lambda group: 4)
    monkeypatch.setattr(choices_mod, "single_host", lambda group: True)
    gather = collective == "all_gather_into_tensor"
    symm = "symm_all_gather" if gather else "symm_reduce_scatter"

    def plan(rows, cols=256, dtype=torch.float32, op="sum", flops=0, **patch):  # a shard of rows x cols per rank
        size = (rows, cols) if gather else (rows * 4, cols)
        with config.patch(patch):
            return choices_mod.Choices().gather_scatter_plan(
                CommRequest(collective, "" if gather else op, "0", dtype, torch.device("cpu"), size, False, flops))
    cap = config.comm.gather_scatter_max_bytes // 1024  # rows of 1 KiB
    p = plan(cap)
    assert (p.algorithm.name, p.world) == (symm, 4) and "under comm.gather_scatter_max_bytes" in p.reason
    assert plan(cap + 1).algorithm.name == "c10d" and "over comm.gather_scatter_max_bytes" in plan(cap + 1).reason
    assert plan(cap + 1, **{"comm.gather_scatter": "symmetric"}).algorithm.name == symm
    assert "forced" in plan(1, **{"comm.gather_scatter": "c10d"}).reason
    assert "dtype" in plan(1, dtype=torch.int64).reason and "symbolic" in plan(__import__("sympy").Symbol("s0")).reason
    if not gather:
        assert "reduce op" in plan(1, op="premul_sum").reason
    # a table that measured the collective on this host: its fastest at the gathered tensor's bytes
    section = "all_gather" if gather else "reduce_scatter"
    table = {"host": {"gpu": "cpu", "world": 4}, "measurements": [],
             section: [{"bytes": 4 << 20, symm: 10.0, "c10d": 20.0}, {"bytes": 64 << 20, symm: 300.0, "c10d": 200.0}]}
    (tmp_path / "t.json").write_text(json.dumps(table))
    in_table = plan(1024, **{"comm.table": str(tmp_path / "t.json")})  # 1 MiB per rank: 4 MiB gathered
    assert in_table.algorithm.name == symm and "t.json" in in_table.reason, in_table.reason
    assert plan(16 << 10, **{"comm.table": str(tmp_path / "t.json")}).algorithm.name == "c10d"  # 64 MiB
    # c10d where independent matmuls (overlap.independent_flops) take longer than it: it runs under them
    per_us = choices_mod.Choices().matmul_us(10**9, torch.float32, torch.device("cpu")) / 1e9  # µs per flop
    hidden = plan(1024, flops=int(25 / per_us), **{"comm.table": str(tmp_path / "t.json")})
    assert hidden.algorithm.name == "c10d" and "hides behind about 25 µs" in hidden.reason, hidden.reason
    assert plan(1024, flops=int(15 / per_us), **{"comm.table": str(tmp_path / "t.json")}).algorithm.name == symm
    assert plan(1024, flops=int(25 / per_us), overlap_collectives=False,
                **{"comm.table": str(tmp_path / "t.json")}).algorithm.name == symm
