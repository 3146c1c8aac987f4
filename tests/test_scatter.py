"""Values added at indices (`index_put` with accumulate: an embedding's, an upsample's backward) by atomic adds
(runtime/scatter.py), against eager; aten's op where the adds must be deterministic or are not fp32."""
import json
import os
import subprocess
import sys

import pytest
import torch

from commfuse import config
from tests.common import DEVICE, Dumps, compile_and_run

aten = torch.ops.aten
ROWS = "commfuse.index_add_at_.default"


def add_rows(w, idx, v):
    return aten.index_put(torch.zeros_like(w), [idx], v, accumulate=True) + w


@pytest.mark.parametrize("index", ["mixed", "all_zero_int32_2d"])
@pytest.mark.parametrize("values", ["rows", "broadcast"])
def test_repeated_and_negative_indices_add_up(tmp_path, values, index):
    w = torch.randn(10, 3, 40, device=DEVICE)
    idx = torch.tensor([0, 0, 0, -1, 3, 3, 9, 0], device=DEVICE) if index == "mixed" else \
        torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)  # token-type ids: every row into one
    v = torch.randn(*idx.shape, 3, 40, device=DEVICE) if values == "rows" else torch.randn(3, 40, device=DEVICE)
    out, dumps = compile_and_run(add_rows, w, idx, v, tmp_path=tmp_path)
    torch.testing.assert_close(out, add_rows(w, idx, v))
    summary, _ = dumps.only()
    assert ROWS in summary["extern_calls"] and "aten.index_put_.default" not in summary["extern_calls"], summary


def add_at_pixels(w, rows, cols, v):  # past the batch and channel dims, as an upsample's backward
    return aten.index_put(torch.zeros_like(w), [None, None, rows, cols], v, accumulate=True) + w


@pytest.mark.parametrize("case", ["pixels", "trailing"])
def test_values_add_up_at_indices_past_leading_dims(tmp_path, case):
    """Indexed dims after slices (and before others): each (leading, index, trailing) value lands
    at its place; repeated, negative and broadcast indices add up as in eager."""
    w = torch.randn(2, 3, 7, 5, device=DEVICE)
    rows = torch.tensor([[0], [0], [-1], [3], [6]], device=DEVICE)  # (5, 1) against (4,): (5, 4)
    cols = torch.tensor([0, 4, 4, -2], device=DEVICE)
    if case == "pixels":
        fn, v = add_at_pixels, torch.randn(2, 3, 5, 4, device=DEVICE)
    else:
        def fn(w, rows, cols, v):
            return aten.index_put(torch.zeros_like(w), [None, rows, cols], v, accumulate=True) + w
        w, v = torch.randn(2, 7, 5, 3, device=DEVICE), torch.randn(2, 5, 4, 3, device=DEVICE)
    out, dumps = compile_and_run(fn, w, rows, cols, v, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(w, rows, cols, v))
    calls = dumps.only()[0]["extern_calls"]
    assert ROWS in calls and "aten.index_put_.default" not in calls, calls


def test_bilinear_upsample_backward_adds_atomically(tmp_path):
    """F.interpolate(bilinear)'s backward decomposes to accumulating index_puts at (row, column)
    indices, in fp32 for bf16 inputs too; aten's sorting kernel for them took Segformer's step
    from 21 to 313 ms on an H100. Gradients against eager."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, device=DEVICE, requires_grad=True)
    probe = torch.randn(2, 3, 24, 20, device=DEVICE)

    def fn(x):
        return (torch.nn.functional.interpolate(x, scale_factor=4, mode="bilinear") * probe).sum()
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        torch.compile(fn, backend="commfuse")(x).backward()
    got, x.grad = x.grad, None
    fn(x).backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-5)
    dumps = Dumps(tmp_path)
    backward = next(g for g in dumps.graphs() if "_backward_" in g)
    calls = dumps.summary(backward)["extern_calls"]
    assert calls.count(ROWS) == 4 and "aten.index_put_.default" not in calls, calls  # one per tap


def test_indices_apart_run_through_aten(tmp_path):
    """Indexed dims with a slice between them put the broadcast dims first: aten's op."""
    w, v = torch.randn(4, 3, 5, device=DEVICE), torch.randn(2, 3, device=DEVICE)
    a, b = torch.tensor([0, 0], device=DEVICE), torch.tensor([1, 1], device=DEVICE)

    def fn(w, a, b, v):
        return aten.index_put(torch.zeros_like(w), [a, None, b], v, accumulate=True) + w
    out, dumps = compile_and_run(fn, w, a, b, v, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(w, a, b, v))
    assert ROWS not in dumps.only()[0]["extern_calls"]


def test_embedding_gradient_with_one_id_everywhere(tmp_path):
    """Token-type ids, all 0 but one column: every row's gradient goes to one or two rows."""
    torch.manual_seed(0)
    emb, ref = torch.nn.Embedding(20, 48).to(DEVICE), torch.nn.Embedding(20, 48).to(DEVICE)
    ref.load_state_dict(emb.state_dict())
    ids = torch.zeros(4, 64, dtype=torch.long, device=DEVICE)
    ids[:, 3] = 5
    def step(m, ids):
        return m(ids).square().sum()
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):  # the backward compiles at its first call
        torch.compile(lambda ids: step(emb, ids), backend="commfuse")(ids).backward()
    step(ref, ids).backward()
    # fp32 sums of a few hundred rows, added in another order than aten's
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-4)
    dumps = Dumps(tmp_path)
    calls = [dumps.summary(g)["extern_calls"] for g in dumps.graphs()]
    assert len(calls) == 2 and ROWS in calls[1], calls


def test_half_precision_index_add_sums_in_fp32(tmp_path):
    """The gradient of index_select in bf16 (an MoE's expert biases, a row per token: gpt-oss's
    repeat_interleave) is an index_add, summed in fp32 and rounded once. As the accumulating
    index_put it decomposes to, each of a row's 32 adds rounded: three times eager's error."""
    torch.manual_seed(0)
    w, b = torch.randn(256, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE, dtype=torch.float64)
    rows = torch.arange(256, device=DEVICE) // 32

    def grad(fn, dtype):
        x = b.detach().to(dtype).requires_grad_()
        (fn(x).float() * w).sum().backward()
        return x.grad.double()
    spread = lambda x: x.index_select(0, rows)  # noqa: E731
    want = grad(spread, torch.float64)
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        got = grad(torch.compile(spread, backend="commfuse"), torch.bfloat16)
    error = lambda g: ((g - want).norm() / want.norm()).item()  # noqa: E731
    eager = error(grad(spread, torch.bfloat16))
    assert error(got) <= 1.1 * eager, (error(got), eager)
    dumps = Dumps(tmp_path)
    assert ROWS in dumps.summary(dumps.graphs()[-1])["extern_calls"]  # (atomic adds, in fp32)


@pytest.mark.parametrize("case", ["deterministic", "float64"])
def test_aten_keeps_what_atomic_adds_cannot_do_exactly(tmp_path, case):
    dtype = torch.float64 if case == "float64" else torch.float32
    w, idx = torch.randn(6, 8, device=DEVICE, dtype=dtype), torch.tensor([1, 1, 2], device=DEVICE)
    v = torch.randn(3, 8, device=DEVICE, dtype=dtype)
    if case == "deterministic":  # compiled first without: the graph cache must not hand that back
        compile_and_run(add_rows, w, idx, v, tmp_path=tmp_path / "nondeterministic")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(case == "deterministic")
    try:
        out, dumps = compile_and_run(add_rows, w, idx, v, tmp_path=tmp_path)
    finally:
        torch.use_deterministic_algorithms(before)
    torch.testing.assert_close(out, add_rows(w, idx, v))
    summary, _ = dumps.only()
    assert "aten.index_put_.default" in summary["extern_calls"] and ROWS not in summary["extern_calls"], summary


def test_out_of_range_index_raises(tmp_path):
    w, v = torch.randn(10, 8, device=DEVICE), torch.randn(2, 8, device=DEVICE)
    if DEVICE == "cuda":
        pytest.skip("a device-side assert poisons the CUDA context; checked on CPU")
    with pytest.raises(Exception, match="index out of bounds"):
        compile_and_run(add_rows, w, torch.tensor([1, 10]), v, tmp_path=tmp_path)


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("bad", [[5, 0], [-1, 0]])
def test_gather_and_scatter_reject_what_aten_rejects(op, bad):
    """aten's gather and scatter take no index past the dim and no negative one (x[idx] does):
    ours assert so too, where a scatter dropped such an index and returned x, and a gather
    read the last element for -1. At the first call (the aten rerun's error) and at a later one
    (the kernel's)."""
    fn = {"gather": lambda x, i: torch.gather(x, 0, i) * 3, "scatter": lambda x, i: x.scatter(0, i, 2.0) * 3}[op]
    if DEVICE == "cuda":
        pytest.skip("a device-side assert poisons the CUDA context; checked on CPU")
    x = torch.arange(5.0)
    for calls in ([bad], [[1, 3], bad]):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="commfuse")
        for good in calls[:-1]:
            torch.testing.assert_close(compiled(x, torch.tensor(good)), fn(x, torch.tensor(good)))
        with pytest.raises(Exception, match="out of bounds"):
            compiled(x, torch.tensor(bad))


@pytest.mark.gpu
def test_index_on_the_host_runs_through_aten(tmp_path):
    """aten takes a CPU index for a CUDA target; the kernel could not read it."""
    w, v, idx = torch.randn(6, 8, device="cuda"), torch.randn(3, 8, device="cuda"), torch.tensor([1, 1, 2])
    out, dumps = compile_and_run(add_rows, w, idx, v, tmp_path=tmp_path)
    torch.testing.assert_close(out, add_rows(w, idx, v))
    assert ROWS not in dumps.only()[0]["extern_calls"]


SCRIPT = """
import json, pathlib, sys, torch, commfuse
from commfuse import config
w, idx, v = (t.to(sys.argv[2]) for t in (torch.ones(10, 3, 40), torch.tensor([0, 0, 3, 9]), torch.full((4, 3, 40), 2.0)))
fn = lambda w, idx, v: torch.ops.aten.index_put(torch.zeros_like(w), [idx], v, accumulate=True) + w
with config.patch(dump_dir=sys.argv[1]):
    out = torch.compile(fn, backend="commfuse")(w, idx, v)
summary = json.load(open(next(pathlib.Path(sys.argv[1]).rglob("timing.json"))))
print(json.dumps([summary["cache_hit"], torch.equal(out, fn(w, idx, v))]))
"""


def test_a_graph_from_the_cache_runs_in_a_new_process(tmp_path):
    """The generated code calls torch.ops.commfuse.index_add_at_; loaded from the on-disk cache
    in a process that lowered nothing, it registers the op itself."""
    env = dict(os.environ, COMMFUSE_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    for hit in (False, True):
        run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / str(hit)), DEVICE], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == [hit, True], run.stdout


def masked_embedding(ids, table, lo: int, hi: int):
    """DTensor's vocab-parallel embedding on one shard: ids outside [lo, hi) read row 0, then zeroed."""
    mask = (ids < lo) | (ids >= hi)
    local = ids - lo
    local[mask] = 0
    rows = table[local]
    rows[mask] = 0.0
    return rows * 2


def test_a_bool_mask_and_one_value_is_a_pointwise_where(tmp_path):
    """`x[mask] = v` with one value runs in a kernel of ours: aten's op finds the mask's positions with
    nonzero, a sync with the host that a CUDA graph cannot capture (it failed HF generate's capture)."""
    ids = torch.tensor([[3, 9, -1], [1, 12, 7]], device=DEVICE)
    table = torch.randn(8, 4, device=DEVICE)
    out, dumps = compile_and_run(masked_embedding, ids, table, 0, 8, tmp_path=tmp_path)
    torch.testing.assert_close(out, masked_embedding(ids.clone(), table, 0, 8))
    summary, code = dumps.only()
    assert not [c for c in summary["extern_calls"] if "index_put" in c] and "index_put" not in code, summary["extern_calls"]
