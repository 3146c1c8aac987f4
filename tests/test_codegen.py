"""Properties of the generated code: fusion into single kernels, extern calls, dumps."""
import itertools
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck

from tests.common import ALLOC, DEVICE, compile_and_run, count, kernel_defs


def test_relu_add_sum_is_one_kernel(tmp_path):
    x = torch.randn(16, 48, device=DEVICE)
    out, dumps = compile_and_run(lambda x: (x.relu() + 1).sum(-1), x, tmp_path=tmp_path)
    torch.testing.assert_close(out, (x.relu() + 1).sum(-1))
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    assert len(kernel_defs(code)) == 1
    assert summary["extern_calls"] == []


def test_split_heads_of_a_key_transposed_stay_a_view(tmp_path):
    """MobileViT's attention: view into heads, permute, transpose. The index of that view, with
    x % 24 // 24 among its terms, is affine: the bmm reads the linear's output, no copy kernel."""
    def fn(x, wq, bq, wk, bk):
        q = F.linear(x, wq, bq).view(8, 1, 24).view(8, 1, -1, 12).permute(0, 2, 1, 3)
        k = F.linear(x, wk, bk).view(8, 1, 24).view(8, 1, -1, 12).permute(0, 2, 1, 3)
        return torch.matmul(q, k.transpose(-1, -2))
    args = [torch.randn(*s, device=DEVICE) for s in ((8, 24), (24, 24), (24,), (24, 24), (24,))]
    out, dumps = compile_and_run(fn, *args, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)
    summary, _ = dumps.only()
    assert not [k for k in summary["kernels"] if k["name"].startswith("cf_poi")], summary["kernels"]


def test_layer_norm_forward_is_one_kernel(tmp_path):
    x, w, b = torch.randn(8, 96, device=DEVICE), torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    fn = lambda x, w, b: F.layer_norm(x, (96,), w, b)  # noqa: E731
    out, dumps = compile_and_run(fn, x, w, b, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, w, b), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1, summary["kernels"]
    # mean, rstd and the output are all stored from that one kernel (they are graph outputs of
    # the forward graph only when training; here only the normalized output leaves it)
    assert summary["kernels"][0]["reads"] == sorted(["arg0_1", "arg1_1", "arg2_1"]) or \
        set(summary["kernels"][0]["reads"]) <= {"arg0_1", "arg1_1", "arg2_1", "primals_1", "primals_2", "primals_3"}


def test_softmax_one_kernel_and_looped_reduction(tmp_path):
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    x = torch.randn(4, 9000, device=DEVICE)  # longer than persistent_reduction_max: the row is looped
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    FileCheck().check("def cf_").check("for roffset in range(0, rnumel, RBLOCK):").check("tl.store(").run(code)
    assert summary["kernels"][0]["persistent"] is False


def test_a_rows_scalars_load_once_before_its_pass(tmp_path):
    """In a looped row, values the same for every element of the row (a row statistic, a 0-d
    tensor) are loaded as one [XBLOCK, 1] block before the loop, not per lane in every step."""
    fn = lambda x, m, s: ((x - m[:, None]) * s).sum(1)  # noqa: E731
    x, m, s = torch.randn(4, 300, device=DEVICE), torch.randn(4, device=DEVICE), torch.tensor(1.5, device=DEVICE)
    out, dumps = compile_and_run(fn, x, m, s, tmp_path=tmp_path, persistent_reduction_max=64)
    torch.testing.assert_close(out, fn(x, m, s))
    summary, code = dumps.only()
    assert summary["kernels"][0]["persistent"] is False
    FileCheck().check("tl.load(ptr_arg0_1 + (xindex), xmask, other=0)").check(
        "tl.load(ptr_arg2_1 + ((0) + tl.zeros([XBLOCK, 1], tl.int32)), xmask, other=0)").check(
        "for roffset in range(0, rnumel, RBLOCK):").check("tl.load(ptr_arg1_1 + (rindex + 300*xindex)").run(code)


def test_unlowered_op_is_an_extern_call(tmp_path):
    fn = lambda a, b: torch.mm(a, b).relu() + torch.sort(a, -1).values.sum()  # noqa: E731
    a, b = torch.randn(8, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    out, dumps = compile_and_run(fn, a, b, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(a, b), atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    assert "aten.mm.out" in summary["extern_calls"]
    assert any("sort" in c for c in summary["extern_calls"])
    out_buf = re.search(r"aten\.mm\.out\(arg0_1, arg1_1, out=(buf\d+)\)", code).group(1)
    FileCheck().check(f"{out_buf} = {ALLOC}((8, 8), (8, 1)").check_next(  # the wrapper allocated mm's output
        f"aten.mm.out(arg0_1, arg1_1, out={out_buf})").run(code)


def test_intermediate_buffer_not_stored(tmp_path):
    fn = lambda x: (x.exp() * 2).sin() + 1  # noqa: E731
    x = torch.randn(100, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    count(code, "tl.store(", 1)


def test_horizontal_fusion_of_shared_reads(tmp_path):
    fn = lambda x: (x.sum(-1), x.amax(-1))  # noqa: E731
    x = torch.randn(8, 40, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    count(code, "tl.load(", 1)


def test_repeated_layers_share_kernels(tmp_path):
    """Layers whose kernels differ only in their buffers: one kernel per distinct code, launched
    once per layer, compiled once. A layer of another width keeps its own kernel."""
    ws = [torch.randn(32, device=DEVICE) for _ in range(4)] + [torch.randn(48, device=DEVICE)]
    m = torch.randn(32, 32, device=DEVICE) / 8

    def fn(x, z):
        for w in ws[:-1]:  # the matmul (an extern) ends each layer's kernel
            x = (x + F.gelu(F.layer_norm(x, w.shape) * w)) @ m
        return x, F.gelu(F.layer_norm(z, ws[-1].shape) * ws[-1])
    x, z = torch.randn(8, 32, device=DEVICE), torch.randn(8, 48, device=DEVICE)
    out, dumps = compile_and_run(fn, x, z, tmp_path=tmp_path, mm_template=False)
    torch.testing.assert_close(out, fn(x, z))
    summary, code = dumps.only()
    defs = [re.match(r"def (\w+)\(", d).group(1) for d in kernel_defs(code)]
    launched = [k["name"] for k in summary["kernels"]]
    assert launched == [defs[0]] * 4 + [defs[1]], (launched, defs)
    assert len(re.findall(r"^\s+\(cf_\w+, ", code, re.M)) == 2  # one `_launches` entry each: compiled once


def test_transposed_input_tiles_2d(tmp_path):
    fn = lambda x, y: x + y.t()  # noqa: E731
    x, y = torch.randn(64, 32, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    out, dumps = compile_and_run(fn, x, y, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, y))
    summary, code = dumps.only()
    assert len(summary["kernels"]) == 1
    assert summary["kernels"][0]["tiled"] is True
    count(code, "tl.program_id(1)", 1)


def test_gather_across_a_layout_tiles_2d(tmp_path):
    """A bilinear upsample of channels-last data into NCHW (Segformer's decode head; the
    decomposition writes NCHW): each output row gathers pixels whose channels lie contiguous down
    the rows. Tiled, both sides coalesce; 1-D, each lane of a warp reads its own sector."""
    fn = lambda x: torch.nn.functional.interpolate(x.permute(0, 3, 1, 2), scale_factor=4, mode="bilinear")  # noqa: E731
    x = torch.randn(2, 8, 8, 32, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, _ = dumps.only()
    (gather,) = [k for k in summary["kernels"] if "arg0_1" in k["reads"]]  # its weights are apart
    assert gather["tiled"], summary["kernels"]


def test_contiguous_pointwise_stays_1d(tmp_path):
    fn = lambda x, y: x + y  # noqa: E731
    x, y = torch.randn(64, 32, device=DEVICE), torch.randn(64, 32, device=DEVICE)
    out, dumps = compile_and_run(fn, x, y, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, y))
    summary, code = dumps.only()
    assert summary["kernels"][0]["tiled"] is False
    count(code, "tl.program_id(1)", 0)


def test_dump_layout_and_summary(tmp_path):
    fn = lambda x: torch.mm(x, x).relu().sum(0)  # noqa: E731
    x = torch.randn(8, 8, device=DEVICE)
    compile_and_run(fn, x, tmp_path=tmp_path)
    (graph,) = sorted((tmp_path / "rank0").iterdir())
    for name in ("fx_graph.txt", "ir_pre_fusion.txt", "ir_post_fusion.txt", "output_code.py", "summary.json"):
        assert (graph / name).is_file(), name
    summary = json.loads((graph / "summary.json").read_text())
    for key in ("kernels", "extern_calls", "buffers", "comm_buffers", "peak_memory_estimate"):
        assert key in summary
    assert summary["comm_buffers"] == []
    kernel = summary["kernels"][0]
    assert kernel["reads"] and all(re.fullmatch(r"arg\d+_\d+|buf\d+", r) for r in kernel["reads"]), kernel
    assert all(b["bytes"] > 0 for b in summary["buffers"])
    # the dumped module is runnable on its own
    import importlib.util
    spec = importlib.util.spec_from_file_location("dumped", graph / "output_code.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (res,) = mod.call([x.clone()])
    torch.testing.assert_close(res, fn(x))


def test_post_fusion_dump_shows_code_per_node_and_group(tmp_path):
    fn = lambda x: torch.softmax(x, -1) + torch.mm(x, x).sum()  # noqa: E731
    x = torch.randn(8, 8, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x), atol=1e-5, rtol=1e-5)
    (graph,) = dumps.graphs()
    text = open(os.path.join(graph, "ir_post_fusion.txt")).read()
    summary, code = dumps.only()
    fused = [k for k in summary["kernels"] if len(k["nodes"]) > 1]
    assert fused
    for k in fused:  # each node of a fused group renders its own kernel, then the group its kernel
        check = FileCheck().check(f"Group({'+'.join(k['nodes'])}, ")
        for name in k["nodes"]:
            check = check.check(f"| def cf_{name}(")
        check.check("kernel:").check_next("| @triton.jit").check_next(f"| def {k['name']}(").run(text)
        after = text.split(f"| def {k['name']}(")[1].splitlines()[1:]
        body = [line.split("| ", 1)[1] for line in itertools.takewhile(lambda l: "| " in l, after)]  # noqa: E741
        assert len(body) > 3 and "\n".join(body) in code
    FileCheck().check("kernel:").check_next("| # extern: ").check_same("ExternKernel aten.mm.out(").run(text)


def test_bfloat16_rounds_to_nearest_even(tmp_path):
    """Triton's interpreter truncates in `.to(tl.bfloat16)` (a GPU rounds): casts, stores of fp32
    values and of reductions into bf16 must still match torch's rounding bit for bit (with every op
    rounded as eager rounds it)."""
    ties = 1 + torch.arange(8) * 2.0 ** -7 + 2.0 ** -8   # halfway between two bf16 values
    x = torch.cat([ties, -ties, torch.randn(500) * 100]).to(DEVICE)
    x64 = x.double() + 1e-12
    cases = [
        (lambda x: x.bfloat16(), x),                      # to_dtype
        (lambda x: x.bfloat16() * 3 + 1, x),             # fp32 math stored into a bf16 buffer
        (lambda x: x.view(-1, 4).bfloat16().sum(1), x),  # a reduction stored as bf16
        (lambda x: x.to(torch.bfloat16), x64),            # fp64 goes through fp32, as in torch
        (lambda x: x.view(-1, 4).bfloat16().sum(1).float() * 3, x),    # a row sum rounded, then used
        (lambda x: x.view(-1, 4).bfloat16().sum(0).float() / 7, x),    # a column sum (looped), alike
    ]
    for i, (fn, inp) in enumerate(cases):
        out, _ = compile_and_run(fn, inp, tmp_path=tmp_path / str(i), emulate_precision_casts=True)
        assert torch.equal(out, fn(inp)), (i, (out.float() - fn(inp).float()).abs().max())


def test_cat_of_gathered_values():
    """A cat whose inputs load through an index (RoPE's backward with cos[positions]): the bounds
    mask of an indirect load inside one masked part must not outlive it (the next part loaded
    under both masks and read zeros)."""
    def f(m, table, idx):
        y = m * table[idx]
        return torch.cat([y[:, 4:], y[:, :4]], -1)
    torch.manual_seed(0)
    args = (torch.randn(8, 8, device=DEVICE), torch.randn(16, 8, device=DEVICE), torch.arange(8, device=DEVICE))
    torch.testing.assert_close(torch.compile(f, backend="commfuse")(*args), f(*args))


def test_bf16_values_stay_fp32_between_ops_unless_asked(tmp_path):
    """Type promotion's cast after each bf16 op is not rounded inside a kernel (only the store
    and the program's own casts round), unless emulate_precision_casts asks for eager's rounding."""
    x = torch.randn(64, 32, device=DEVICE).to(torch.bfloat16)
    fn = lambda x: ((x * 0.5 + 1.0) * x).to(torch.float32).to(torch.bfloat16) - x  # noqa: E731
    store = DEVICE == "cpu"  # a GPU's store cast rounds by itself; the interpreter's needs the bits rounded
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path / "fp32")
    torch.testing.assert_close(out, fn(x), atol=2e-2, rtol=2e-2)
    count(dumps.only()[1], "0x7FFF", 1 + store)  # the explicit .to(bfloat16) (and the store)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path / "eager", emulate_precision_casts=True)
    torch.testing.assert_close(out, fn(x), atol=0, rtol=0)  # every op rounded as eager rounds it
    count(dumps.only()[1], "0x7FFF", 5 + store)  # mul, add, mul, the .to(bfloat16), sub (and the store)


def test_residual_stream_is_stored_not_reread(tmp_path):
    """h = h + f(norm(h)), layer after layer: h has two users (the next norm and the next add). Were
    it inlined, each layer's kernels would re-read every earlier layer's output; stored once a
    body reads more than realize_reads_threshold buffers, no kernel reads more than one past it."""
    ws = [torch.randn(32, 32, device=DEVICE) / 6 for _ in range(8)]

    def fn(h, *ws):
        for w in ws:
            h = h + F.layer_norm(h, (32,)) @ w
        return h
    h = torch.randn(16, 32, device=DEVICE)
    widest = {}
    for name, threshold in (("inlined", 1000), ("stored", 4)):
        out, dumps = compile_and_run(fn, h, *ws, tmp_path=tmp_path / name, realize_reads_threshold=threshold,
                                     realize_acc_reads_threshold=1000)
        torch.testing.assert_close(out, fn(h, *ws), atol=1e-4, rtol=1e-4)
        widest[name] = max(len(k["reads"]) for k in dumps.only()[0]["kernels"])
    assert widest["stored"] <= 5 < widest["inlined"], widest


def test_unaligned_rows_are_padded_for_matmuls(tmp_path):
    """Logits 1001 wide (GPT-2's 50257 in small): the matmul writes rows 1004 wide (on a padded
    weight), the log-softmax reads them there, and the output the user gets has eager's strides."""
    h, w = torch.randn(32, 64, device=DEVICE), torch.randn(1001, 64, device=DEVICE)
    fn = lambda h, w: torch.log_softmax(h @ w.t(), -1) * 2  # noqa: E731
    out, dumps = compile_and_run(fn, h, w, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    torch.testing.assert_close(out, fn(h, w), atol=1e-4, rtol=1e-4)
    assert out.stride() == (1001, 1)
    code = dumps.only()[1]
    mm_out = re.search(r"aten\.mm\.out\(.*out=(buf\d+)\)", code).group(1)
    FileCheck().check(f"{mm_out} = {ALLOC}((32, 1004), (1004, 1)").check("aten.mm.out(").run(code)
    out, dumps = compile_and_run(fn, h, w, tmp_path=tmp_path / "off", pad_rows=False)
    FileCheck().check(f"{ALLOC}((32, 1001), (1001, 1)").check("aten.mm.out(").run(dumps.only()[1])


def test_padded_rows_through_backward(tmp_path):
    """The same with gradients: the log-softmax backward's output (a generated buffer, padded)
    feeds both matmuls of the backward."""
    h = torch.randn(32, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(1001, 64, device=DEVICE, requires_grad=True)
    fn = lambda h, w: torch.log_softmax(h @ w.t(), -1)[:, :7].sum()  # noqa: E731
    fn(h, w).backward()
    want = h.grad, w.grad
    h.grad = w.grad = None
    out, dumps = compile_and_run(fn, h, w, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    out.backward()
    for got, exp in zip((h.grad, w.grad), want):
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    backward = dumps.code(dumps.graphs()[1])
    assert "(32, 1001), (1004, 1)" in backward, backward  # the log-softmax backward's output


def test_padded_logits_are_returned_padded(tmp_path):
    """A padded matmul's output that the user gets is that padded view, as Inductor's padded
    matmuls return theirs (`keep_padded_outputs`), not a copy into eager's strides; off, a copy."""
    h, w = torch.randn(32, 64, device=DEVICE), torch.randn(1001, 64, device=DEVICE)
    fn = lambda h, w: h @ w.t()  # noqa: E731
    for keep, stride in ((None, (1004, 1)), (False, (1001, 1))):
        out, _ = compile_and_run(fn, h, w, tmp_path=tmp_path / str(keep), pad_rows=True, pad_rows_min_bytes=0,
                                 keep_padded_outputs=keep)
        torch.testing.assert_close(out, fn(h, w), atol=1e-4, rtol=1e-4)
        assert out.stride() == stride


def test_cross_entropy_saves_row_statistics_not_probabilities(tmp_path):
    """A language model's loss: the forward saves the logits (a user output anyway), each row's
    max and log-sum, never a vocabulary-wide log-softmax, which the backward recomputes. The logits
    stay padded through both graphs (AOTAutograd restrides the backward's input to them)."""
    h = torch.randn(32, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(1001, 64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 1001, (32,), device=DEVICE)

    def fn(h, w, t):
        logits = h @ w.t()
        return logits, torch.nn.functional.cross_entropy(logits, t)

    logits, loss = fn(h, w, t)
    loss.backward()
    want = logits, loss, h.grad, w.grad
    h.grad = w.grad = None
    (logits, loss), dumps = compile_and_run(fn, h, w, t, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    loss.backward()
    for got, exp in zip((logits, loss, h.grad, w.grad), want):
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    assert logits.stride() == (1004, 1)
    forward, backward = dumps.graphs()
    with open(os.path.join(backward, "fx_graph.txt")) as f:
        inputs = next(line for line in f if "def forward(" in line)
    assert inputs.count("f32[32, 1001]") == 2, inputs  # the logits and their gradient (a tangent)
    assert inputs.count("f32[32, 1]") == 2, inputs     # the max and the log of the sum
    assert dumps.summary(forward)["output_strides"][0] == [1004, 1]


def test_pow_by_small_integer_is_multiplications(tmp_path):
    """GPT-2's GELU cubes its input (`torch.pow(x, 3.0)`): multiplications, not exp2/log2 with
    special cases (pow_float); x ** -2 reuses the square. A fractional exponent takes pow_float."""
    x = torch.randn(4, 33, device=DEVICE)
    fn = lambda x: 0.5 * x * (1.0 + torch.tanh(0.79788 * (x + 0.044715 * torch.pow(x, 3.0)))) + x ** -2  # noqa: E731
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x), atol=1e-5, rtol=1e-5)
    code = dumps.only()[1]
    count(code, "pow_float", 0)
    FileCheck().check("tmp0 = tl.load(").check("tmp3 = tmp0 * tmp0").check_next("tmp4 = tmp3 * tmp0") \
        .check("1.0 / tmp3").run(code)
    out, dumps = compile_and_run(lambda x: x ** 2.5, x.abs(), tmp_path=tmp_path / "frac")
    count(dumps.only()[1], "triton_helpers.pow_float(", 1)


def test_integer_pow_with_negative_exponent_errors_as_eager(tmp_path):
    x = torch.arange(-3, 4, device=DEVICE)
    for n in (-1, -2):
        with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
            x ** n
        with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
            compile_and_run(lambda x: x ** n, x, tmp_path=tmp_path / str(-n))


@pytest.mark.parametrize("bias", [False, True])
def test_unaligned_matmul_runs_on_padded_operands(tmp_path, bias):
    """K and N not multiples of 16 bytes: the matmul runs on zero-padded copies (same product) into
    an aligned output, sliced back; forward and backward match eager."""
    x = torch.randn(24, 37, device=DEVICE, requires_grad=True)
    w = torch.randn(1001, 37, device=DEVICE, requires_grad=True)
    b = torch.randn(1001, device=DEVICE, requires_grad=True) if bias else None
    fn = lambda x, w, b: F.linear(x, w, b).relu().sum(-1)  # noqa: E731
    fn(x, w, b).sum().backward()
    want = [t.grad for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    out, dumps = compile_and_run(fn, x, w, b, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    out.sum().backward()
    torch.testing.assert_close(out, fn(x, w, b), atol=1e-4, rtol=1e-4)
    for t, g in zip([t for t in (x, w, b) if t is not None], want):
        torch.testing.assert_close(t.grad, g, atol=1e-4, rtol=1e-4)
    forward = dumps.code(dumps.graphs()[0])
    op = "aten.addmm.out(" if bias else "aten.mm.out("
    out_buf = re.search(re.escape(op) + r".*out=(buf\d+)\)", forward).group(1)
    FileCheck().check(f"{out_buf} = {ALLOC}((24, 1004), (1004, 1)").check(op).run(forward)


def test_aligned_operand_is_not_copied_for_padding(tmp_path):
    """Only the operand whose dims are unaligned is padded (a copy); K already aligned: x as it is."""
    x, w = torch.randn(24, 32, device=DEVICE), torch.randn(1001, 32, device=DEVICE)
    out, dumps = compile_and_run(lambda x, w: x @ w.t(), x, w, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    torch.testing.assert_close(out, x @ w.t(), atol=1e-4, rtol=1e-4)
    summary, code = dumps.only()
    assert re.search(r"aten\.mm\.out\(arg\d+_1, (buf\d+|reinterpret_tensor\(buf\d+, [^)]*\), [^)]*\), \d+\)), out=buf\d+\)",
                     code), code  # x straight from the input
    assert len(summary["kernels"]) == 1, summary["kernels"]  # w padded; the output returned padded
    assert out.stride() == (1004, 1)


def test_transposed_weight_is_padded_in_its_own_layout(tmp_path):
    """`h @ w.t()` with w's rows unaligned: the padded copy of w.t() is stored transposed (a copy
    that streams, which cuBLAS takes transposed), not transposed into a row-major [K, N]."""
    h, w = torch.randn(32, 64, device=DEVICE), torch.randn(1001, 64, device=DEVICE)
    out, dumps = compile_and_run(lambda h, w: h @ w.t(), h, w, tmp_path=tmp_path, pad_rows=True,
                                 pad_rows_min_bytes=0, mm_template=False)
    torch.testing.assert_close(out, h @ w.t(), atol=1e-4, rtol=1e-4)
    # w's rows as stored, padded: w.t() is its transposed view
    FileCheck().check(f"buf0 = {ALLOC}((1004, 64), (64, 1)") \
        .check("aten.mm.out(arg").check_same("reinterpret_tensor(buf0, (64, 1004), (1, 64), 0)").run(dumps.only()[1])


def test_transposed_left_operand_pads_m_and_shares_the_copy(tmp_path):
    """An LM head's backward: `g @ w` pads g's rows (K) and `gᵀ @ h` has g's unaligned row length
    as M, its leading dimension. Both read one zero-padded copy of g (gᵀ as its transposed view);
    the weight gradient's extra rows are sliced off."""
    g, w, h = (torch.randn(32, 1001, device=DEVICE), torch.randn(1001, 64, device=DEVICE),
               torch.randn(32, 64, device=DEVICE))
    fn = lambda g, w, h: (g @ w, g.t() @ h)  # noqa: E731
    (dh, dw), dumps = compile_and_run(fn, g, w, h, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0,
                                      mm_template=False)
    for got, want in zip((dh, dw), fn(g, w, h)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert dw.shape == (1001, 64)
    code = dumps.only()[1]
    padded = re.search(rf"(buf\d+) = {ALLOC}\(\(32, 1004\), \(1004, 1\)", code).group(1)
    count(code, f"{ALLOC}((32, 1004)", 1)  # one copy of g
    FileCheck().check(f"aten.mm.out(reinterpret_tensor({padded}, (1004, 32), (1, 1004), 0), arg").run(code)
    FileCheck().check(f"aten.mm.out({padded}, buf").run(code)


def test_a_computed_operand_is_stored_once_padded(tmp_path):
    """A loss gradient (pointwise over the logits, here 3-D as a model has it) that `g @ w` pads:
    one buffer stores it, zero-padded, and `gᵀ @ h` reads that copy, where each matmul had
    computed and stored a padded copy of its own."""
    x, w, h = (torch.randn(2, 16, 1001, device=DEVICE), torch.randn(1001, 64, device=DEVICE),
               torch.randn(32, 64, device=DEVICE))

    def fn(x, w, h):
        g = (torch.sigmoid(x) * 3).reshape(32, 1001)
        return g @ w, g.t() @ h, g.sum(0)
    outs, dumps = compile_and_run(fn, x, w, h, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0,
                                  mm_template=False)
    for got, want in zip(outs, fn(x, w, h)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    code = dumps.only()[1]
    padded = re.search(rf"(buf\d+) = {ALLOC}\(\(32, 1004\), \(1004, 1\)", code).group(1)
    count(code, f"{ALLOC}((32, 1004)", 1)  # the gradient stored once, padded
    FileCheck().check(f"aten.mm.out({padded}, buf").run(code)
    FileCheck().check(f"aten.mm.out(reinterpret_tensor({padded}, (1004, 32), (1, 1004), 0), arg").run(code)


def test_as_strided_over_padded_rows_reads_eager_storage(tmp_path):
    """GPT-2's qkv split reaches lowering as `as_strided` with strides that count in eager's
    storage of the matmul's output (102 wide); ours has padded rows (104): it is stored as eager
    lays it out first, never read with eager's strides over our padding."""
    x, w, b = torch.randn(2, 8, 34, device=DEVICE), torch.randn(34, 102, device=DEVICE), torch.randn(102, device=DEVICE)

    def fn(x, w, b):
        q, k, v = torch.addmm(b, x.view(-1, 34), w).view(2, 8, 102).split(34, dim=2)
        return q * 2 + v.view(2, 8, 2, 17).transpose(1, 2).reshape(2, 8, 34)
    out, dumps = compile_and_run(fn, x, w, b, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    torch.testing.assert_close(out, fn(x, w, b), atol=1e-4, rtol=1e-4)
    assert "as_strided" in open(dumps.graphs()[0] + "/fx_graph.txt").read()  # the case this is about
    FileCheck().check("(16, 104), (104, 1)").check("aten.addmm.out(").run(dumps.only()[1])


def test_split_of_padded_matmul_output(tmp_path):
    """A split of a matmul output with unaligned rows (Mamba's x_proj: dt, B, C): the split is
    as_strided with eager's strides, which must not address our row-padded storage."""
    x, w, w2 = (torch.randn(*s, device=DEVICE) for s in ((2, 8, 64), (10, 64), (64, 2)))

    def fn(x, w, w2):
        dt, b, c = F.linear(x, w).split([2, 4, 4], dim=-1)
        return F.linear(dt, w2), b.transpose(1, 2) + 1, c.transpose(1, 2).contiguous()
    out, dumps = compile_and_run(fn, x, w, w2, tmp_path=tmp_path, pad_rows=True, pad_rows_min_bytes=0)
    for got, want in zip(out, fn(x, w, w2), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert "aten.mm.out(" in dumps.only()[1]  # the padded path was taken


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_split_of_a_masked_transpose_reads_eager_storage(tmp_path, dynamic):
    """Mamba2 with padding: the transposed conv output times the mask keeps eager's permuted order
    (strides (640, 1, 8)), and its split reaches lowering as as_strided with those strides. Ours is
    stored in eager's order first (it was a whole-graph fallback: "as_strided over a storage laid
    out unlike eager's"); backward too, and at symbolic sizes."""
    x, m = torch.randn(2, 80, 8, device=DEVICE, requires_grad=True), torch.randn(2, 8, 1, device=DEVICE)

    def fn(x, m):
        a, b, c = (x.transpose(1, 2) * m).split([64, 8, 8], dim=-1)
        return a * 2 + 1, (b * c).sum(-1)
    out, dumps = compile_and_run(fn, x, m, tmp_path=tmp_path, dynamic=dynamic, fallback_on_error=False)
    want = fn(x, m)
    for got, w in zip(out, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    grad = torch.autograd.grad(sum(o.sum() for o in out), x)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(sum(o.sum() for o in want), x)[0], atol=1e-5, rtol=1e-5)
    assert any("as_strided" in open(g + "/fx_graph.txt").read() for g in dumps.graphs())  # the case this is about


def test_offsets_past_int32_in_a_read_buffer(tmp_path):
    """A kernel computing 4 elements from the end of a 2**31 + 8 element input: its loads reach
    past int32, so its indices are int64 (the interpreter refused the offset as an int32 scalar)."""
    x = torch.zeros(2**31 + 8, dtype=torch.int8, device=DEVICE)
    x[-4:] = torch.arange(1, 5, dtype=torch.int8, device=DEVICE)
    out, dumps = compile_and_run(lambda t: (t * 2)[-4:], x, tmp_path=tmp_path)
    assert out.tolist() == [2, 4, 6, 8]
    assert "tl.program_id(0).to(tl.int64)" in dumps.only()[1]
    # a reduction's along its rows too: `rindex + 2147483643` wrapped past int32 (out of bounds)
    out, dumps = compile_and_run(lambda t: t[2**31 - 5:].sum(), x, tmp_path=tmp_path / "red")
    assert out.item() == 1 + 2 + 3 + 4
    assert "rbase = tl.arange(0, RBLOCK)[None, :].to(tl.int64)" in dumps.only()[1]


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upsampling_indexes_without_device_asserts(tmp_path, mode):
    """Upsampling gathers through aten._unsafe_index, whose indices are in bounds by construction.
    Decomposed into aten.index, it got a bounds assert per load, which compiles the kernel in
    Triton's debug mode."""
    fn = lambda x: F.interpolate(x, scale_factor=2, mode=mode) * 3  # noqa: E731
    x = torch.randn(1, 2, 5, 6, device=DEVICE)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert "device_assert" not in code and "debug=True" not in code
    assert summary["fallback_ops"] == []
