"""Layout optimisation of convolution graphs (`conv_channels_last`): convolutions run on
channels_last inputs and weights, their outputs and the BatchNorm / ReLU / residual / pooling
buffers between them stay channels_last (no transposing copy between convolutions), graph outputs
keep eager's strides, and the backward reads the forward's saved activations in their own layout.
Also: convolution's generated `out=` overload (a copy after the op) is not used, and max-pool is
lowered to our kernels, indices and backward included; a biased convolution's bias gradient is a
generated sum."""
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from commfuse.runtime import support

from tests.common import DEVICE, compile_and_run


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + x)


class Net(nn.Module):
    """conv-bn-relu-maxpool, a residual block, then a head (or the feature map itself)."""

    def __init__(self, head=True):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.block = Block(8)
        self.fc = nn.Linear(8, 10) if head else None

    def forward(self, x):
        x = self.block(F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, 1))
        return self.fc(x.mean((2, 3))) if self.fc is not None else x


def _net(train, head=True):
    torch.manual_seed(0)
    return Net(head).to(DEVICE).train(train)


def _input(channels_last=False):
    x = torch.randn(2, 3, 16, 16, device=DEVICE)
    return x.to(memory_format=torch.channels_last) if channels_last else x


@pytest.fixture
def relayouts(monkeypatch):
    """Every aten result the wrapper had to copy into the layout it expected: [(got, wanted)]."""
    copies, original = [], support.as_meta_layout

    def spy(t, size, stride, dtype=None):
        if any(a != b and n > 1 for a, b, n in zip(t.stride(), stride, size)):
            copies.append((t.stride(), tuple(stride)))
        return original(t, size, stride, dtype)
    monkeypatch.setattr(support, "as_meta_layout", spy)
    return copies


def _channels_last(size, stride) -> bool:
    n, c, h, w = size
    want = (c * h * w, 1, w * c, c)
    return all(a == b or d == 1 for a, b, d in zip(stride, want, size))


def _shapes(text):
    return tuple(int(v) for v in text.split(",") if v.strip())


def _four_d(code):
    """(what, size, stride) of every 4-D buffer the wrapper allocates or takes from aten."""
    out = []
    for m in re.finditer(r"(\w+) = (empty_strided(?:_cuda)?|as_meta_layout)\((.*)\((\d+, \d+, \d+, \d+)\), \((\d+, \d+, \d+, \d+)\)", code):
        out.append((m.group(1), _shapes(m.group(4)), _shapes(m.group(5))))
    return out


def _convolutions(code):
    return re.findall(r"aten\.convolution(?:_backward)?\.default\((\w+), (\w+), (\w+)", code)


def test_inference_runs_convolutions_channels_last(tmp_path, relayouts):
    net, x = _net(False), _input()
    with torch.no_grad():
        expected = net(x)
        out, dumps = compile_and_run(net, x, tmp_path=tmp_path, conv_channels_last=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    summary, code = dumps.only()
    assert "max_pool2d" not in str(summary["fallback_ops"]), summary["fallback_ops"]  # our kernel
    assert "convolution.out" not in code  # a generated out=: the op, then a copy
    buffers = _four_d(code)
    assert buffers and all(_channels_last(size, stride) for _, size, stride in buffers), buffers
    assert not relayouts, relayouts  # aten's conv outputs came back channels_last
    # the convolutions read our buffers: the input and weights once copied, the rest written so
    assert len(_convolutions(code)) == 3
    # the image and 3 weights copied once; 3 conv outputs; bn-relu-pool in one kernel, the block's bn-relu
    assert len(buffers) == 4 + 3 + 2, buffers


def test_training_matches_eager_and_backward_keeps_the_layout(tmp_path, relayouts):
    net, x = _net(True), _input().requires_grad_()
    ref, rx = _net(True), x.detach().clone().requires_grad_()
    out, dumps = compile_and_run(net, x, tmp_path=tmp_path, conv_channels_last=True)
    expected = ref(rx)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad, rx.grad, atol=1e-4, rtol=1e-4)
    assert x.grad.stride() == rx.grad.stride()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
        assert p.grad.stride() == q.grad.stride(), name  # a user-visible output: eager's strides
    for a, b in zip(net.buffers(), ref.buffers()):  # running statistics
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not relayouts, relayouts
    forward, backward = dumps.graphs()
    fcode, bcode = dumps.code(forward), dumps.code(backward)
    assert all(_channels_last(size, stride) for _, size, stride in _four_d(fcode)), _four_d(fcode)
    # the forward's saved activations left channels_last; AOTAutograd restrided the backward's inputs
    saved = dumps.summary(forward)["output_strides"]
    assert sum(1 for s in saved if s and len(s) == 4 and s[1] == 1 and s[3] == 8) >= 6, saved
    # the backward's 4-D buffers are channels_last but for the gradients it returns in eager's
    # (contiguous) strides, each copied from conv's channels_last one: weights' and the input's
    returned = {(8, 3, 3, 3), (8, 8, 3, 3), (2, 3, 16, 16)}
    nchw = [(n, size) for n, size, stride in _four_d(bcode) if not _channels_last(size, stride)]
    assert nchw and all(size in returned for _, size in nchw), nchw
    assert len(_convolutions(bcode)) == 3


@pytest.mark.parametrize("channels_last", [False, True])
def test_outputs_keep_eager_strides(tmp_path, channels_last):
    net, x = _net(False, head=False), _input(channels_last)
    with torch.no_grad():
        expected = net(x)
        out, _ = compile_and_run(net, x, tmp_path=tmp_path, conv_channels_last=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out.stride() == expected.stride()


def test_off_by_default_on_cpu(tmp_path):
    net, x = _net(False), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        _, dumps = compile_and_run(net.cpu(), x, tmp_path=tmp_path)
    _, code = dumps.only()
    assert all(stride[1] != 1 for _, size, stride in _four_d(code)), _four_d(code)
    assert "aten.convolution.default(" in code and "convolution.out" not in code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", [(3, 2, 1), (2, 2, 0), ((3, 2), (1, 2), (1, 0)), (3, 2, 0, 1, True), (2, 2, 1, 1, True)])
def test_max_pool_values_and_indices(tmp_path, dtype, args):
    """Ties (the first maximum wins), NaN (the last NaN wins), -inf beside padding, a channel of
    -inf (whose index aten picks by device and layout), ceil_mode's windows past the end, and a
    channels_last input."""
    x = torch.randint(-3, 3, (2, 3, 9, 10), device=DEVICE).to(dtype)
    x[0, 0, 1, 1], x[0, 0, 1, 2], x[1, 2, 3, 3] = float("nan"), float("nan"), float("nan")
    x[1, 1] = float("-inf")
    for inp in (x, x.to(memory_format=torch.channels_last)):
        fn = lambda t: torch.ops.aten.max_pool2d_with_indices.default(t, *args)  # noqa: E731
        (values, indices), dumps = compile_and_run(fn, inp, tmp_path=tmp_path / str(inp.is_contiguous()))
        ev, ei = fn(inp)
        torch.testing.assert_close(values, ev, equal_nan=True)
        assert torch.equal(indices, ei)
        summary, _ = dumps.only()
        assert not summary["fallback_ops"], summary["fallback_ops"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", [(3, 2, 1), (2, 2, 0), ((3, 2), (1, 2), (1, 0)), (3, 2, 1, 1, True), (3, 1, 1, 2)])
def test_max_pool_backward_gathers(tmp_path, dtype, args):
    """The backward is a gather over the windows that may cover a position: overlapping windows
    (a position taken by several), ceil_mode, dilation, channels_last and an unbatched input,
    against aten given the same indices."""
    x = torch.randn(2, 3, 9, 10, device=DEVICE).to(dtype)
    kernel, stride, padding, dilation, ceil = (list(args) + [1, False])[:5]
    for name, inp in (("nchw", x), ("nhwc", x.to(memory_format=torch.channels_last)), ("chw", x[0])):
        _, indices = torch.ops.aten.max_pool2d_with_indices.default(inp, kernel, stride, padding, dilation, ceil)
        grad = torch.randn(indices.shape, device=DEVICE).to(dtype)
        fn = lambda g, t, i: torch.ops.aten.max_pool2d_with_indices_backward.default(  # noqa: E731
            g, t, kernel, stride, padding, dilation, ceil, i)
        out, dumps = compile_and_run(fn, grad, inp, indices, tmp_path=tmp_path / name)
        # summed in fp32 and rounded once (aten's bf16 sums round at every add)
        torch.testing.assert_close(out, fn(grad.float(), inp.float(), indices).to(dtype))
        summary, _ = dumps.only()
        assert not summary["fallback_ops"], summary["fallback_ops"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", [(3, 2, 1, False, False, None), (2, 2, 0, False, True, None), (3, 2, 1, True, True, None),
                                  ((3, 2), (1, 2), (1, 0), True, False, None), (3, 2, 0, True, True, None),
                                  ((2, 3), (3, 1), (1, 1), True, False, 4)])
def test_avg_pool_forward_and_backward(tmp_path, dtype, args):
    """Divisors by aten's rules (padding counted or not, ceil_mode's windows past the padding, an
    override), overlapping windows in the backward's gather; NCHW, channels_last and unbatched."""
    x = torch.randn(2, 3, 9, 10, device=DEVICE).to(dtype)
    kernel, stride, padding, ceil, include_pad, override = args
    pool = lambda t: torch.ops.aten.avg_pool2d.default(t, kernel, stride, padding, ceil, include_pad, override)  # noqa: E731
    back = lambda g, t: torch.ops.aten.avg_pool2d_backward.default(  # noqa: E731
        g, t, kernel, stride, padding, ceil, include_pad, override)
    for name, inp in (("nchw", x), ("nhwc", x.to(memory_format=torch.channels_last)), ("chw", x[0])):
        grad = torch.randn(pool(inp).shape, device=DEVICE).to(dtype)
        for fn, args_ in ((pool, (inp,)), (back, (grad, inp))):
            out, dumps = compile_and_run(fn, *args_, tmp_path=tmp_path / name / str(fn is back))
            # summed in fp32 and rounded once; the reference on NCHW tensors: aten's CUDA
            # avg_pool2d_backward is wrong for channels_last inputs (torch 2.11)
            torch.testing.assert_close(out, fn(*(a.float().contiguous() for a in args_)).to(dtype))
            summary, _ = dumps.only()
            assert not summary["fallback_ops"], summary["fallback_ops"]


def test_conv_bias_gradient_is_our_reduction(tmp_path):
    """A biased convolution's backward asks aten for the input and weight gradients only; the bias
    gradient is a generated sum, and every gradient matches eager."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Hardswish(), nn.Conv2d(6, 4, 1)).to(DEVICE)
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    out, dumps = compile_and_run(net, x, tmp_path=tmp_path)
    out.square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
    code = dumps.code(dumps.graphs()[1])
    masks = re.findall(r"aten\.convolution_backward\.default\(.*(\[\w+, \w+, \w+\])\)", code)
    assert sorted(masks) == ["[False, True, False]", "[True, True, False]"], masks


def test_max_pool_saves_int8_offsets_for_its_backward(tmp_path):
    """The forward saves each window's int8 tap number, not int64 indices (8x the bytes); the
    backward compares it with each window's tap number as it is (no indices made from it, no
    division), and the gradient matches eager's."""
    x = torch.randn(2, 4, 16, 16, device=DEVICE, requires_grad=True)
    fn = lambda t: F.max_pool2d(torch.relu(t), 3, 2, 1)  # noqa: E731
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    out.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    fn(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    forward = dumps.code(dumps.graphs()[0])
    pooled = re.findall(r"empty_strided(?:_cuda)?\(\(2, 4, 8, 8\), \([\d, ]+\), (?:device=.*?, dtype=)?torch\.(\w+)\)", forward)
    assert sorted(pooled) == ["float32", "int8"], pooled
    backward = dumps.code(next(g for g in dumps.graphs() if "backward" in g))
    assert "div_floor" not in backward and "remainder" not in backward, backward
    assert re.search(r"tmp\d+ = tl\.full\(\[XBLOCK\], 8, tl\.int32\)", backward), backward  # the last of 9 taps


@pytest.mark.parametrize("case", ["offset", "before_own_start", "two_d", "view_in_graph", "own_offset"])
def test_as_strided_counts_its_offset_in_the_inputs_storage(case):
    """as_strided's storage_offset counts from the start of eager's storage, where an input (a slice
    of a larger tensor) may sit past it; ours reads from the input's own data."""
    base = torch.randn(100, device=DEVICE)
    x, fn = {
        "offset": (base[10:], lambda x: x.as_strided((3, 4), (4, 1), 20) + 1),
        "before_own_start": (base[10:], lambda x: x.as_strided((3, 4), (4, 1), 5) - 1),
        "two_d": (base[10:].view(9, 10)[2:], lambda x: x.as_strided((2, 3), (10, 2), 37) * 3),
        "view_in_graph": (base[10:], lambda x: x[2:].as_strided((2, 2), (3, 1), 14) + x[5:].as_strided((2, 2), (3, 1), 4)),
        "own_offset": (base[10:], lambda x: x[3:].as_strided((3, 4), (4, 1)) * 2),
    }[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="commfuse", dynamic=False)
    torch.testing.assert_close(compiled(x), fn(x))
