"""The all-reduce absorbs its epilogue: residual add + RMSNorm in the one-shot and two-shot kernels."""
import glob
import json
import re

import pytest
import torch
from torch.testing import FileCheck

from commfuse.tuned_tables import host_key
from tests.common import check_peer_sum, check_reduced_in_place
from tests.dist_utils import WORLD, device, run_ranks, use_cuda


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _ar_add_rmsnorm(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("sum", "avg"):
            torch._dynamo.reset()

            def step(x, w_down, res, norm_w):
                y = funcol.all_reduce(x @ w_down, op, dist.group.WORLD)
                h = y + res
                return rms_norm(h, norm_w), h
            rows = 1 if op == "avg" else 8  # one row: its size-1 dim must not block the fusion
            torch.manual_seed(rank)
            x = torch.randn(rows, 32, device=device(), dtype=dtype)
            w = torch.randn(32, 64, device=device(), dtype=dtype) / 8
            torch.manual_seed(0)
            res, norm_w = torch.randn(rows, 64, device=device(), dtype=dtype), torch.randn(64, device=device(), dtype=dtype)
            with config.patch(dump_dir=f"{dump_dir}/{dtype}_{op}".replace("torch.", "")):
                out = torch.compile(step, backend="commfuse", dynamic=False)(x, w, res, norm_w)
            for o, r in zip(out, step(x, w, res, norm_w)):
                torch.testing.assert_close(o, r, atol=tol[dtype], rtol=tol[dtype], msg=f"{op} {dtype}")
    return True


def test_all_reduce_residual_rmsnorm_is_one_kernel(tmp_path):
    run_ranks(_ar_add_rmsnorm, WORLD, args=(str(tmp_path),))
    for path in glob.glob(f"{tmp_path}/*/rank0/*/summary.json"):
        s = json.load(open(path))
        code = open(path.replace("summary.json", "output_code.py")).read()
        # producers: the mm writes the comm buffer (aten's in fp32, our few-row template in
        # bf16); then exactly one kernel does the rest
        if "bfloat16" in path:
            assert not s["extern_calls"] and [k.get("template") for k in s["kernels"]] == ["mm", None], s["kernels"]
        else:
            assert s["extern_calls"] == ["aten.mm.out"] and len(s["kernels"]) == 1, s
        kernel = s["kernels"][-1]
        assert kernel["collective"] == "all_reduce" and kernel["reduction"], kernel
        assert len(kernel["writes"]) == 2  # the normalized output and the residual stream h
        (buf,) = s["comm_buffers"]
        assert not buf["copy_in"]
        check_peer_sum(code, buf["name"], WORLD, kernel=f"def {kernel['name']}(")


def _bf16_sum_then_fp32(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config

    def fn(a, b):  # a bf16 all-reduce, used in fp32 arithmetic in the same kernel
        return funcol.all_reduce(a.bfloat16(), "sum", dist.group.WORLD) + funcol.all_reduce(b, "sum", dist.group.WORLD)
    torch.manual_seed(7 + rank)
    a, b = torch.randn(4, 8, device=device()) * (1 + 5 * rank), torch.randn(4, 8, device=device())
    want, got = fn(a, b), {}
    for emulate in (False, True):
        torch._dynamo.reset()
        with config.patch(emulate_precision_casts=emulate):
            got[emulate] = (torch.compile(fn, backend="commfuse")(a, b) - want).abs().max().item()
    return got


@pytest.mark.skipif(WORLD != 2, reason="c10d rounds the sum once at 2 ranks; more ranks, in their order")
def test_a_bf16_all_reduce_is_rounded_as_c10d_rounds_it_under_emulate_precision_casts():
    """Fused with its fp32 consumer, a bf16 all-reduce's sum stays fp32 (within bf16's rounding of
    eager's); with emulate_precision_casts it is rounded to bf16 first, as c10d's result is: eager's bits."""
    for got in run_ranks(_bf16_sum_then_fp32, WORLD):
        assert got[True] == 0 and got[False] < 0.125, got


def _other_epilogues(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    g = dist.group.WORLD
    torch.manual_seed(0)
    w, bias = torch.randn(32, 64, device=device()) / 8, torch.randn(64, device=device())
    ln_w, ln_b = torch.rand(64, device=device()) + 0.5, torch.randn(64, device=device())

    def bias_layernorm_gelu(x, res):
        h = funcol.all_reduce(x @ w, "sum", g) + bias + res
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(h, (64,), ln_w, ln_b)), h

    def quantize(x, res):  # per-row absmax int8
        h = funcol.all_reduce(x @ w, "sum", g) + res
        scale = h.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 127
        return torch.round(h / scale).clamp(-127, 127).to(torch.int8), scale
    torch.manual_seed(rank)
    x, res = torch.randn(8, 32, device=device()), torch.randn(8, 64, device=device())
    for fn in (bias_layernorm_gelu, quantize):
        torch._dynamo.reset()
        with config.patch({"dump_dir": f"{dump_dir}/{fn.__name__}"}):
            out = torch.compile(fn, backend="commfuse", dynamic=False)(x, res)
        for o, r in zip(out, fn(x, res)):
            if o.dtype == torch.int8:  # a value at a rounding boundary may land one step away
                assert (o.int() - r.int()).abs().max() <= 1, fn.__name__
            else:
                torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4, msg=fn.__name__)
    return True


def test_layernorm_gelu_and_quantize_fuse_into_the_comm_kernel(tmp_path):
    run_ranks(_other_epilogues, WORLD, args=(str(tmp_path),))
    for name in ("bias_layernorm_gelu", "quantize"):
        ((s, (kernel,), code),) = _comm_kernels(tmp_path / name)
        # the mm writes the comm buffer; one kernel reduces, adds, normalizes (or quantizes), writes both
        assert s["extern_calls"] == ["aten.mm.out"] and len(s["kernels"]) == 1, (name, s["kernels"])
        assert kernel["reduction"] and len(kernel["writes"]) == 2, (name, kernel)
        (buf,) = s["comm_buffers"]
        check_peer_sum(code, buf["name"], WORLD, kernel=f"def {kernel['name']}(")


def _replays(rank, world, steps):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    torch.manual_seed(0)
    w_up = torch.randn(64, 96, device=device(), dtype=torch.bfloat16) / 8
    w_down = torch.randn(96, 64, device=device(), dtype=torch.bfloat16) / 10
    norm_w = torch.rand(64, device=device(), dtype=torch.bfloat16) + 0.5

    def block(x, res):
        y = funcol.all_reduce(torch.nn.functional.silu(x @ w_up) @ w_down, "sum", g)
        h = y + res
        return rms_norm(h, norm_w), h
    fused = torch.compile(block, backend="commfuse", options={"cuda_graphs": True})
    torch._dynamo.reset()
    nccl = torch.compile(block, backend="commfuse", options={"comm.enabled": False})
    worst = 0.0
    for step in range(steps):
        torch.manual_seed(1000 + step + rank)
        x = torch.randn(8, 64, device=device(), dtype=torch.bfloat16)
        res = torch.randn(8, 64, device=device(), dtype=torch.bfloat16)
        got, want = fused(x, res), nccl(x, res)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2, msg=f"step {step}")
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


@pytest.mark.gpu
def test_one_thousand_cuda_graph_replays_match_nccl():
    # every one of the 1000 steps is compared inside (assert_close, bf16 tolerance); the largest
    # absolute difference is one bf16 ulp of the outputs' magnitude
    worst = run_ranks(_replays, WORLD, args=(1000,))
    assert max(worst) <= 0.125, worst


def _two_shot(rank, world, dump_dir, table):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from commfuse import config
    g = dist.group.WORLD
    c10d = torch.ops._c10d_functional
    for n in (1, 37, 4096):  # sizes not divisible by the world size included
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for op in ("sum", "avg", "max"):
                torch._dynamo.reset()
                fn = lambda x: funcol.all_reduce(x * 2, op, g) - 1  # noqa: E731
                torch.manual_seed(rank)
                x = torch.randn(n, device=device(), dtype=dtype)
                with config.patch({"comm.algorithm": "two_shot", "comm.max_programs": 2}):
                    out = torch.compile(fn, backend="commfuse")(x)
                want = fn(x.float()).to(dtype)  # reduced in fp32 like our kernels (gloo rounds each partial sum)
                torch.testing.assert_close(out, want, atol=tol, rtol=tol, msg=f"{n} {dtype} {op}")

    def fused(x, w_down, res, norm_w):  # the epilogue is row-local: it fuses into the two-shot kernel
        h = funcol.all_reduce(x @ w_down, "sum", g) + res
        return rms_norm(h, norm_w), h

    def shared(x):  # the input is read again afterwards: the kernel must not reduce into it
        y = x * 2
        return funcol.all_reduce(y, "sum", g) + y

    def inplace(x):  # all_reduce_: the standalone two-shot gathers every share into the buffer
        y = x * 3
        c10d.all_reduce_(y, "sum", g.group_name)
        return (c10d.wait_tensor(y) + 1,)
    torch.manual_seed(rank)
    x, w = torch.randn(12, 32, device=device()), torch.randn(32, 64, device=device()) / 8
    res, norm_w = torch.randn(12, 64, device=device()), torch.randn(64, device=device())
    for name, fn, args in (("fused", fused, (x, w, res, norm_w)), ("shared", shared, (x,)),
                           ("inplace", inplace, (x,)), ("one_row", fused, (x[:1], w, res[:1], norm_w))):
        torch._dynamo.reset()
        with config.patch({"comm.algorithm": "two_shot", "comm.max_programs": 4, "dump_dir": f"{dump_dir}/{name}"}):
            if name == "inplace":
                from torch.fx.experimental.proxy_tensor import make_fx
                from commfuse.backend import compile_graph
                out = compile_graph(make_fx(fn)(x), [x])([x])
            else:
                out = torch.compile(fn, backend="commfuse", dynamic=False)(*args)
        for o, r in zip(out, fn(*args)):
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    # the choice follows the table given to it
    torch._dynamo.reset()
    fn = lambda x: funcol.all_reduce(x * 2, "sum", g)  # noqa: E731
    with config.patch({"comm.table": table, "dump_dir": f"{dump_dir}/table"}):
        for n in (256, 8192):  # 1 KiB: one-shot is fastest in the table; 32 KiB: two-shot
            x = torch.randn(n, device=device())
            torch.testing.assert_close(torch.compile(fn, backend="commfuse", dynamic=False)(x), fn(x))
    # with a norm fused, from the table's fused measurements, by whether the producer is pointwise
    x_mm, x_pw = torch.randn(12, 32, device=device()), torch.randn(12, 64, device=device())
    for name, produce, arg, row_max in (("mm", lambda x: x @ w, x_mm, 8192), ("pointwise", lambda x: x * 2, x_pw, 8192),
                                        ("mm_looped_rows", lambda x: x @ w, x_mm, 32)):
        torch._dynamo.reset()

        def step(x, res, produce=produce):
            h = funcol.all_reduce(produce(x), "sum", g) + res
            return rms_norm(h, norm_w), h
        with config.patch({"comm.table": table, "dump_dir": f"{dump_dir}/fused_{name}",
                           "comm.persistent_reduction_max": row_max}):
            out = torch.compile(step, backend="commfuse", dynamic=False)(arg, res)
        for o, r in zip(out, step(arg, res)):
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    return True


def _comm_kernels(dump_dir):
    out = []
    for path in sorted(glob.glob(f"{dump_dir}/rank0/*/summary.json")):
        s = json.load(open(path))
        out.append((s, [k for k in s["kernels"] if k.get("collective")],
                    open(path.replace("summary.json", "output_code.py")).read()))
    return out


def test_two_shot_and_table_driven_choice(tmp_path):
    table = tmp_path / "table.json"
    host = host_key(WORLD, "cuda" if use_cuda(WORLD) else "cpu")  # the table is for this machine
    table.write_text(json.dumps({"host": host,
                                 "measurements": [
                                     {"bytes": 1024, "one_shot": 5.0, "two_shot": 9.0, "c10d": 20.0},
                                     {"bytes": 32768, "one_shot": 9.0, "two_shot": 7.0, "c10d": 20.0}],
                                 "fused": [  # 12 rows x 64 fp32 columns, as in _two_shot
                                     {"rows": 12, "row_bytes": 256, "prologue": False, "one_shot": 9.0, "two_shot": 7.0},
                                     {"rows": 12, "row_bytes": 256, "prologue": True, "one_shot": 6.0,
                                      "one_shot_apart": 5.0, "two_shot": 7.0}]}))
    run_ranks(_two_shot, WORLD, args=(str(tmp_path / "dumps"), str(table)))
    # residual add + RMSNorm run inside the two-shot kernel: each rank reduces its share of every
    # row block into its own buffer, passes a release barrier, then gathers and normalizes
    ((s, (kernel,), code),) = _comm_kernels(tmp_path / "dumps/fused")
    assert s["extern_calls"] == ["aten.mm.out"] and len(s["kernels"]) == 1
    assert kernel["algorithm"] == "two_shot" and kernel["reduction"] and len(kernel["writes"]) == 2, kernel
    (release,) = re.findall(r'sem="release"|st\.release\.', code)  # interpreter | PTX
    (buf,) = s["comm_buffers"]  # its share summed over the peers into its own copy, then the gather
    FileCheck().check("mine = ").check_next(f"tl.store(ptr_{buf['name']} + (").check_same(
        f"tl.load({buf['name']}_peer0 + (").check_same("& mine").check(release).check(
        f"tl.load({buf['name']}_peer0 + (").run(code)
    # a buffer read again later is read one-shot; in place, the standalone two-shot kernel
    ((s, (kernel,), _),) = _comm_kernels(tmp_path / "dumps/shared")
    assert kernel["algorithm"] == "one_shot", kernel
    (plan,) = s["comm_plans"]  # the plan says so, and why: codegen renders it, never re-decides
    assert plan["algorithm"] == "one_shot" and "two-shot cannot gather" in plan["reason"], plan
    ((s, (kernel,), code),) = _comm_kernels(tmp_path / "dumps/inplace")
    assert kernel["algorithm"] == "two_shot", kernel
    check_reduced_in_place(code, s["comm_buffers"][0]["name"], kernel["name"])
    algos = []
    for s, comm, _ in _comm_kernels(tmp_path / "dumps/table"):
        algos.append(comm[0]["algorithm"])
        if algos[-1] == "two_shot":
            assert "table.json" in s["comm_plans"][0]["reason"]
    assert algos == ["one_shot", "two_shot"], algos
    # a single row: two-shot too (the row's index has no row variable)
    ((s, (kernel,), _),) = _comm_kernels(tmp_path / "dumps/one_row")
    assert kernel["algorithm"] == "two_shot" and len(s["kernels"]) == 1, kernel
    # 3 KiB alone is one-shot in the table; with the norm fused after an mm, two-shot; after a
    # pointwise producer, one-shot with the producer kept in a kernel of its own
    for name, want, kernels in (("mm", "two_shot", 1), ("pointwise", "one_shot_apart", 2)):
        ((s, (kernel,), _),) = _comm_kernels(tmp_path / f"dumps/fused_{name}")
        assert kernel["algorithm"] == want.replace("_apart", "") and kernel["reduction"], (name, kernel)
        assert len(s["kernels"]) == kernels, s["kernels"]
        (choice,) = s["comm_plans"]
        assert choice["algorithm"] == want and "fused row epilogue at 12 rows" in choice["reason"], choice
    # rows too long for one block: two-shot cannot gather them, the choice for the all-reduce alone stays
    ((s, (kernel,), _),) = _comm_kernels(tmp_path / "dumps/fused_mm_looped_rows")
    assert kernel["algorithm"] == "one_shot" and not kernel["persistent"], kernel
    assert all("epilogue" not in c["reason"] and c["algorithm"] == "one_shot" for c in s["comm_plans"]), s
