"""Memory-aware fusion and scheduling: read-accumulation limits, in-place updates, matmuls written
into their cat, peak-memory orders and the estimate, buffer reuse."""
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck

from commfuse import config
from tests.common import ALLOC, DEVICE, compile_and_run, count

N = 16
F32 = torch.float32.itemsize


def _mm_outputs(code: str) -> set:
    return set(re.findall(r"aten\.mm\.out\(.*out=(buf\d+)\)", code))


def _launches(code: str) -> list:
    """Kernel launches and extern calls of `call`, in order."""
    body = code.split("def call(args):")[1]
    return [line.strip() for line in body.splitlines() if re.match(r"\s+(cf_\w+_launch\d+\(|aten\.)", line)]


# ----------------------------------------------------------------------------- read accumulation
def accumulate(x, ws):
    total = x
    for w in ws:
        total = total + x @ w
    return total


def _accumulation(tmp_path, **options):
    torch.manual_seed(0)
    x, ws = torch.randn(N, N, device=DEVICE), [torch.randn(N, N, device=DEVICE) for _ in range(10)]
    out, dumps = compile_and_run(accumulate, x, ws, tmp_path=tmp_path, **options)
    torch.testing.assert_close(out, accumulate(x, ws), atol=1e-4, rtol=1e-4)
    summary, code = dumps.only()
    mms = _mm_outputs(code)
    assert len(mms) == 10
    return [set(k["reads"]) & mms for k in summary["kernels"]]


def test_accumulation_without_thresholds_is_one_kernel(tmp_path):
    reads = _accumulation(tmp_path, realize_acc_reads_threshold=1000, realize_acc_reads_size_threshold=None)
    assert [len(r) for r in reads] == [10]  # one kernel keeps all ten matmul outputs alive


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_size_threshold_bounds_reads_per_kernel(tmp_path, k):
    reads = _accumulation(tmp_path, realize_acc_reads_size_threshold=k * N * N * F32)
    assert max(len(r) for r in reads) <= k, reads
    assert len(set().union(*reads)) == 10


def test_accumulation_count_threshold_alone_still_fuses(tmp_path):
    # realizing by count bounds inlined bodies; the scheduler fuses the pieces back (no memory cost)
    reads = _accumulation(tmp_path, realize_acc_reads_threshold=3)
    assert [len(r) for r in reads] == [10]


# ----------------------------------------------------------------------------- in-place updates
def _in_place(summary) -> dict:
    return {b["name"]: b["in_place_of"] for b in summary["buffers"] if "in_place_of" in b}


def test_matmul_then_layer_norm_writes_over_the_matmul_output(tmp_path):
    a, b = torch.randn(8, 24, device=DEVICE), torch.randn(24, 32, device=DEVICE)
    w, bias = torch.randn(32, device=DEVICE), torch.randn(32, device=DEVICE)
    fn = lambda a, b, w, bias: F.layer_norm(a @ b, (32,), w, bias)  # noqa: E731
    out, dumps = compile_and_run(fn, a, b, w, bias, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b, w, bias), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    (mm,) = _mm_outputs(code)
    assert len(summary["kernels"]) == 1
    (kernel,) = summary["kernels"]
    assert _in_place(summary) == {kernel["writes"][0]: mm}
    # the alias is made right before the kernel that writes it, which still reads the matmul output
    FileCheck().check(f"out={mm})").check(f"{kernel['writes'][0]} = {mm}  # in place over {mm}").check_next(
        f"{kernel['name']}_launch").check_same(f"), {mm}, ").run(code)


@pytest.mark.parametrize("case", ["tiled", "looped_softmax", "looped_layer_norm"])
def test_in_place_in_tiled_and_multi_pass_kernels(tmp_path, case):
    fn, shapes = {
        "tiled": (lambda a, b, c: (a @ b) + c.t(), [(64, 32), (32, 64), (64, 64)]),
        # rows longer than persistent_reduction_max: the kernel reads the row in several passes
        "looped_softmax": (lambda a, b, c: torch.softmax(a @ b, -1) + c, [(4, 32), (32, 9000), (1, 9000)]),
        "looped_layer_norm": (lambda a, b, c: F.layer_norm(a @ b, (9000,)) * c, [(4, 32), (32, 9000), (1, 9000)]),
    }[case]
    args = [torch.randn(*s, device=DEVICE) for s in shapes]
    out, dumps = compile_and_run(fn, *args, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(*args), atol=1e-4, rtol=1e-4)
    summary, code = dumps.only()
    (mm,) = _mm_outputs(code)
    assert list(_in_place(summary).values()) == [mm]


def test_layer_norm_reading_at_another_index_is_not_in_place(tmp_path):
    # the kernel reads the matmul output transposed: writing row x over it would clobber
    # elements that other rows still have to read
    a, b = torch.randn(32, 24, device=DEVICE), torch.randn(24, 32, device=DEVICE)
    fn = lambda a, b: F.layer_norm((a @ b).t() * 2, (32,))  # noqa: E731
    out, dumps = compile_and_run(fn, a, b, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    assert _in_place(summary) == {}
    count(code, "in place", 0)


def test_no_in_place_over_a_buffer_read_later(tmp_path):
    a, b = torch.randn(N, N, device=DEVICE), torch.randn(N, N, device=DEVICE)
    def fn(a, b):
        y = a @ b
        return y.relu() @ y
    out, dumps = compile_and_run(fn, a, b, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b), atol=1e-4, rtol=1e-4)
    summary, _ = dumps.only()
    assert _in_place(summary) == {}


# ----------------------------------------------------------------------------- matmul into cat
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_of_matmuls_has_no_copy_kernel(tmp_path, dim):
    a, b = torch.randn(8, 16, device=DEVICE), torch.randn(16, 12, device=DEVICE)
    c, d = torch.randn(8, 16, device=DEVICE), torch.randn(16, 12, device=DEVICE)
    fn = lambda a, b, c, d: torch.cat([a @ b, c @ d], dim)  # noqa: E731
    out, dumps = compile_and_run(fn, a, b, c, d, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b, c, d), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    assert summary["kernels"] == []
    assert len(summary["buffers"]) == 1  # the cat, allocated once
    cat = summary["buffers"][0]["name"]
    # the cat is allocated, then each matmul writes its slice of it through out=
    slices = re.findall(rf"(buf\d+) = reinterpret_tensor\({cat}, \(8, 12\)", code)
    assert len(slices) == 2 and set(slices) == _mm_outputs(code), slices
    check = FileCheck().check(f"{cat} = {ALLOC}(")
    for buf in slices:
        check = check.check(f"{buf} = reinterpret_tensor({cat}, (8, 12)").check_next("aten.mm.out(").check_same(f"out={buf})")
    check.run(code)


def test_cat_of_matmul_and_other_value_copies(tmp_path):
    a, b, x = torch.randn(8, 16, device=DEVICE), torch.randn(16, 12, device=DEVICE), torch.randn(8, 12, device=DEVICE)
    fn = lambda a, b, x: torch.cat([a @ b, x.sin()], 1)  # noqa: E731
    out, dumps = compile_and_run(fn, a, b, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b, x), atol=1e-5, rtol=1e-5)
    summary, _ = dumps.only()
    assert len(summary["kernels"]) == 1


def test_matmul_with_other_users_is_not_placed_in_the_cat(tmp_path):
    a, b, c = torch.randn(8, 16, device=DEVICE), torch.randn(16, 12, device=DEVICE), torch.randn(16, 12, device=DEVICE)

    def fn(a, b, c):
        y = a @ b
        return torch.cat([y, a @ c], 1), y.relu()
    out, dumps = compile_and_run(fn, a, b, c, tmp_path=tmp_path)
    for o, r in zip(out, fn(a, b, c)):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- peak memory order
M = 64
BIG, ROW = M * M * F32, M * F32   # a matmul output, a row sum


def two_branches(x, w1, w2):
    a = x @ w1      # M x M: BIG
    b = x @ w2      # M x 2M: 2 BIG (the two row sums cannot fuse: different row lengths)
    return a.sum(1) + b.sum(1)


def _branch_inputs():
    return torch.randn(M, M, device=DEVICE), torch.randn(M, M, device=DEVICE), torch.randn(M, 2 * M, device=DEVICE)


def test_order_finishes_one_branch_before_starting_the_next(tmp_path):
    x, w1, w2 = _branch_inputs()
    out, dumps = compile_and_run(two_branches, x, w1, w2, tmp_path=tmp_path)
    torch.testing.assert_close(out, two_branches(x, w1, w2), atol=1e-3, rtol=1e-4)
    summary, code = dumps.only()
    assert [s.startswith("aten.mm") for s in _launches(code)] == [True, False, True, False], code
    # program order: mm a, mm b (BIG + 2 BIG alive), sum a (+ ROW), sum b + add
    assert summary["peak_memory_by_order"]["original"] == 3 * BIG + ROW
    # chosen: mm a (BIG), sum a (BIG + ROW), mm b (ROW + 2 BIG), sum b + add written over the
    # row sum of a (2 BIG + ROW)
    assert summary["peak_memory_estimate"] == 2 * BIG + ROW


def test_program_order_kept_without_reordering(tmp_path):
    x, w1, w2 = _branch_inputs()
    out, dumps = compile_and_run(two_branches, x, w1, w2, tmp_path=tmp_path, reorder_for_peak_memory=False)
    torch.testing.assert_close(out, two_branches(x, w1, w2), atol=1e-3, rtol=1e-4)
    summary, code = dumps.only()
    assert [s.startswith("aten.mm") for s in _launches(code)] == [True, True, False, False], code
    assert summary["peak_memory_estimate"] == 3 * BIG + ROW
    assert summary["peak_memory_by_order"] == {"original": 3 * BIG + ROW}


def test_random_ops_keep_their_order(tmp_path):
    # drawing ra first would lower the peak (rb is big and read last), but must not change
    # which numbers each draw gets from aten (fp64 draws are aten's; others are keyed streams)
    def fn(x, w):
        rb = torch.rand(M, 4 * M, device=x.device, dtype=x.dtype)
        ra = torch.rand(M, M, device=x.device, dtype=x.dtype)
        return (x @ w * ra).sum(1) + rb.sum(1)
    x, w = (torch.randn(M, M, device=DEVICE, dtype=torch.float64) for _ in range(2))
    torch.manual_seed(1)
    ref = fn(x, w)
    torch.manual_seed(1)
    out, dumps = compile_and_run(fn, x, w, tmp_path=tmp_path)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
    _, code = dumps.only()
    assert re.findall(r"aten\.rand\.default\(\[(\d+, \d+)\]", code) == ["64, 256", "64, 64"]


def test_estimate_of_a_chain_by_hand(tmp_path):
    # mm (BIG) -> relu in place over it -> mm (BIG, the relu output still read) -> sum(1) (ROW)
    x, w = torch.randn(M, M, device=DEVICE), torch.randn(M, M, device=DEVICE)
    fn = lambda x, w: ((x @ w).relu() @ w).sum(1)  # noqa: E731
    out, dumps = compile_and_run(fn, x, w, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, w), atol=1e-3, rtol=1e-4)
    summary, _ = dumps.only()
    assert len(_in_place(summary)) == 1
    assert summary["peak_memory_estimate"] == 2 * BIG


def test_gpt_block_order_never_worse_than_program_order(tmp_path):
    from tests.test_models import Block
    torch.manual_seed(0)
    model, ref = Block().to(DEVICE), Block().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    tokens, targets = torch.randint(0, 64, (2, 8), device=DEVICE), torch.randint(0, 64, (2, 8), device=DEVICE)
    loss, dumps = compile_and_run(model, tokens, targets, tmp_path=tmp_path)
    loss.backward()
    ref(tokens, targets).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    for graph in dumps.graphs():
        summary = dumps.summary(graph)
        by_order = summary["peak_memory_by_order"]
        assert set(by_order) == {"original", "least_peak_first", "bfs", "dfs"}
        assert summary["peak_memory_estimate"] == min(by_order.values()) <= by_order["original"]


# ----------------------------------------------------------------------------- buffer reuse
def test_freed_buffer_reused_by_another_shape_of_the_same_bytes(tmp_path):
    a, b, d = torch.randn(8, 4, device=DEVICE), torch.randn(4, 16, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    fn = lambda a, b, d: (a @ b).relu().t() @ d  # noqa: E731  (8, 16) freed, then (16, 8) allocated
    out, dumps = compile_and_run(fn, a, b, d, tmp_path=tmp_path, inplace_buffers=False)
    torch.testing.assert_close(out, fn(a, b, d), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    (mm0, mm1) = sorted(_mm_outputs(code), key=lambda n: int(n[3:]))
    FileCheck().check(f"out={mm0})").check(
        f"{mm1} = reinterpret_tensor({mm0}, (16, 8), (8, 1), 0); del {mm0}  # reuse").check_next(
        "aten.mm.out(").check_same(f"out={mm1})").run(code)


def test_buffer_aliased_by_an_extern_output_is_never_reused(tmp_path):
    x, m = torch.randn(64, device=DEVICE), torch.randn(4, 4, device=DEVICE)

    def fn(x, m):
        u = (x * 2).unfold(0, 4, 4)   # aten returns a view of the buffer holding x * 2
        return u @ m                  # allocated after that buffer's last reader: same bytes
    with config.patch(fallback_ops=["aten.unfold"]):  # (lowered as a view of ours otherwise)
        out, dumps = compile_and_run(fn, x, m, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, m))
    summary, code = dumps.only()
    count(code, "= aten.unfold.default(", 1)
    assert not any("reuses" in b or "in_place_of" in b for b in summary["buffers"])
    # the estimate keeps the viewed buffer alive as long as its view
    assert summary["peak_memory_estimate"] == 2 * 64 * F32


# ----------------------------------------------------------------------------- backward inputs
class MLP(torch.nn.Module):
    """bench/memory.py's MLP, small: residual Linear -> GELU -> Linear layers, a scalar loss."""

    def __init__(self, dim=16, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def _mlp_backward(tmp_path, **options):
    """(backward summary, backward code, its input names) of the MLP's fwd+bwd, checked against eager."""
    torch.manual_seed(0)
    model, ref = MLP().to(DEVICE), MLP().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(32, 16, device=DEVICE)
    loss, dumps = compile_and_run(model, x, tmp_path=tmp_path, **options)
    loss.backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    (graph,) = [g for g in dumps.graphs() if "_backward_" in os.path.basename(g)]
    code = dumps.code(graph)
    inputs = re.search(r"def _?call\(args\):\n\s+(.*) = args", code).group(1).replace(",", " ").split()
    return dumps.summary(graph), code, inputs


def test_backward_frees_each_input_after_its_last_use(tmp_path):
    # The saved activations come in `args`, whose references AOTAutograd drops: ours are the last.
    summary, code, inputs = _mlp_backward(tmp_path)
    body = code.split("args.clear()\n")[1].splitlines()
    returned = set(re.findall(r"\w+", body[-1]))
    for name in inputs:
        if name in returned:
            continue
        uses = [i for i, line in enumerate(body) if re.search(rf"\b{name}\b", line) and "del " not in line]
        freed = [i for i, line in enumerate(body) if re.match(rf"\s*del .*\b{name}\b", line)
                 or re.search(rf"= {name}; del {name}\b", line)]
        assert len(freed) == 1, (name, code)
        # nothing but other frees between its last use and its own
        assert all(re.match(r"\s*del ", line) for line in body[max(uses, default=-1) + 1:freed[0]]), (name, code)


def test_backward_writes_over_saved_activations(tmp_path):
    # donated inputs (the saved activations) are ours: a kernel that reads one last writes in place
    summary, code, inputs = _mlp_backward(tmp_path)
    over_inputs = {b["in_place_of"] for b in summary["buffers"] if b.get("in_place_of") in inputs}
    assert over_inputs and not over_inputs & {"tangents_1"}, code
    assert not any(re.match(r"primals_\d+$", n) for n in over_inputs)  # parameters are not ours


def test_backward_never_writes_over_a_saved_activation_the_user_sees(monkeypatch):
    # AOTAutograd's donated indices are not trusted (with an effect token, torch 2.13's are off
    # by one): `y` is returned and saved for exp's backward, so it is never overwritten, even
    # when AOTAutograd names every saved tensor donated.
    from torch._functorch._aot_autograd import graph_compile
    monkeypatch.setattr(graph_compile, "collect_bw_donated_buffer_idxs",
                        lambda fw, bw, meta: list(range(len(bw.graph.find_nodes(op="placeholder")) - 1)))
    x, g = torch.randn(64, device=DEVICE, requires_grad=True), torch.randn(64, device=DEVICE)
    y = torch.compile(lambda x: x.exp(), backend="commfuse")(x)
    before = y.detach().clone()
    y.backward(g)
    torch.testing.assert_close(y.detach(), before)
    torch.testing.assert_close(x.grad, g * before)


def test_backward_estimate_counts_saved_activations(tmp_path):
    # The backward starts with the saved activations alive and frees them as it goes: its
    # estimate is at least their bytes, and with nothing freed it would be more.
    summary, code, inputs = _mlp_backward(tmp_path)
    rows, dim = 32, 16
    # each layer saves its input (rows x dim), fc1's output and GELU's (rows x 4 dim)
    saved = 2 * rows * (dim + 2 * 4 * dim) * F32
    assert summary["peak_memory_estimate"] >= saved
    kept, _, _ = _mlp_backward(tmp_path / "kept", inplace_buffers=False)
    assert summary["peak_memory_estimate"] <= kept["peak_memory_estimate"]


def test_measured_mlp_peak_at_most_eager_and_near_the_estimate(tmp_path):
    # torch.profiler sees every CPU allocation (bench/memory.py --cpu); compare one fwd+bwd step
    from bench.memory import cpu_peaks, step
    from torch.profiler import profile
    if DEVICE != "cpu":
        pytest.skip("measures CPU allocations")

    def peaks(model, x):
        step(model, (x,))  # compiles
        with profile(profile_memory=True) as prof:
            step(model, (x,))
        return cpu_peaks(prof)
    torch.manual_seed(0)
    model, x = MLP(dim=32, layers=3), torch.randn(128, 32)
    eager = peaks(model, x)
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path)):
        ours = peaks(torch.compile(model, backend="commfuse"), x)
    from tests.common import Dumps
    estimate = max(Dumps(tmp_path).summary(g)["peak_memory_estimate"] for g in Dumps(tmp_path).graphs())
    assert ours["less_workspace"] <= eager["less_workspace"], (ours, eager)
    # the estimate leaves out the loss and the tangent, and on CPU one activation-sized buffer is
    # measured freed later than its `del` (unexplained, see docs/results.md): a few activations
    assert estimate <= ours["less_workspace"] <= estimate + 4 * 128 * 32 * F32, (ours, estimate)


# ----------------------------------------------------------------------------- copies avoided
def test_value_and_its_view_stored_once(tmp_path):
    # the softmax probabilities: returned (saved for backward) and read through a view by bmm
    def fn(s, v):
        p = torch.softmax(s, -1)
        return torch.bmm(p.view(8, 16, 16), v), p
    s, v = torch.randn(2, 4, 16, 16, device=DEVICE), torch.randn(8, 16, 4, device=DEVICE)
    out, dumps = compile_and_run(fn, s, v, tmp_path=tmp_path)
    for a, b in zip(out, fn(s, v)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    (kernel,) = summary["kernels"]
    (probs,) = kernel["writes"]
    # the kernel writes the probabilities, then bmm reads them through a view: no copy between
    FileCheck().check(f"{kernel['name']}_launch0(").check_same(f", {probs}, ").check_not("cf_").check(
        f"aten.bmm.out(reinterpret_tensor({probs}, (8, 16, 16)").run(code)
    count(code, "reinterpret_tensor(", 1)


def test_cross_entropy_and_embedding_backward_without_copies(tmp_path):
    # cross entropy's backward scatters -1 into zeros, one element per row: pointwise, no aten
    # scatter (which allocates a copy); embedding's backward accumulates rows into zeros in place
    torch.manual_seed(0)
    w = torch.randn(20, 8, device=DEVICE, requires_grad=True)
    tokens, targets = torch.randint(0, 20, (4, 6), device=DEVICE), torch.randint(0, 20, (24,), device=DEVICE)
    fn = lambda w, t, y: F.cross_entropy(F.embedding(t, w).view(24, 8) @ w.t(), y)  # noqa: E731
    loss, dumps = compile_and_run(fn, w, tokens, targets, tmp_path=tmp_path)
    loss.backward()
    grad, w.grad = w.grad, None
    fn(w, tokens, targets).backward()
    torch.testing.assert_close(grad, w.grad, atol=1e-5, rtol=1e-5)
    (graph,) = [g for g in dumps.graphs() if "_backward_" in os.path.basename(g)]
    summary = dumps.summary(graph)
    assert not any("scatter" in op for op in summary["fallback_ops"] + summary["extern_calls"])
    assert "commfuse.index_add_at_.default" in summary["extern_calls"]  # in place, atomic adds
    assert "aten.index_put.out" not in summary["extern_calls"]


def four_scatters(g, idx, w):
    """Four values from one input, each added at its own indices by its own extern (the shape of
    an upsample's backward: a tap's weight times the gradient, per tap)."""
    out = 0
    for k in range(4):
        out = out + torch.ops.aten.index_put(torch.zeros(8, 64, device=g.device), [idx[k]], g * w[k],
                                             accumulate=True)
    return out


def test_values_for_separate_externs_are_not_held_together(tmp_path):
    """Fused, the four values (1 MiB each) would be computed at once and held until the last
    extern ran; each is computed before its own extern instead, and the peak holds one."""
    g, w = torch.randn(4096, 64, device=DEVICE), torch.randn(4, device=DEVICE)
    idx = torch.randint(0, 8, (4, 4096), device=DEVICE)
    out, dumps = compile_and_run(four_scatters, g, idx, w, tmp_path=tmp_path)
    torch.testing.assert_close(out, four_scatters(g, idx, w), rtol=1e-5, atol=1e-4)
    summary, code = dumps.only()
    values = re.findall(r"index_add_at_\.default\(\w+, \[[^]]*\], \d+, (\w+)\)", code)
    writers = [i for i, k in enumerate(summary["kernels"]) for v in values if v in k["writes"]]
    assert len(values) == 4 and len(writers) == 4 and len(set(writers)) == 4, (values, summary["kernels"])
    value_bytes = 4096 * 64 * 4
    assert summary["peak_memory_estimate"] < 2 * value_bytes, summary["peak_memory_estimate"]
