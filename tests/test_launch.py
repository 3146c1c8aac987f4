"""Launch sites (runtime/launch.py): under the key of a graph's first call, each site launches
its compiled kernel directly; a call under any other key (an input aligned otherwise, other
sizes) goes through the JIT, which specializes for it."""
import collections
import re

import pytest
import torch

from commfuse.choices import Choices
from commfuse.runtime import launch
from commfuse.runtime.launch import Launches, Site
from tests.common import DEVICE, compile_and_run

Param = collections.namedtuple("Param", "name is_constexpr")


class Kernel:
    """Stands in for a JITFunction: records JIT launches and direct ones."""
    params = [Param("x", False), Param("n", False), Param("XBLOCK", True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def jit(*args, **options):
            self.log.append(("jit", grid, args, options))
            return Compiled(self.log)
        return jit


class Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 100 + index, raising=False)
    monkeypatch.setattr(launch, "_hooks_idle", lambda: True)


def test_sites_launch_directly_under_the_first_calls_key(stream):
    kernel, sites = Kernel(), Launches(1)
    site = Site(kernel, dict(XBLOCK=64, num_warps=4))
    site(sites.begin((0, 8)), (2, 1, 1), "x", 8)  # first call: through the JIT, which compiles
    site(sites.begin((0, 8)), (2, 1, 1), "x", 8)
    site(sites.begin((4, 8)), (2, 1, 1), "y", 8)  # an input 4 bytes past alignment: the JIT again
    site(sites.begin((0, 9)), (3, 1, 1), "x", 9)  # other sizes: the JIT again
    site(sites.begin((0, 8)), (2, 1, 1), "z", 8)
    assert [e[0] for e in kernel.log] == ["jit", "direct", "jit", "jit", "direct"]
    assert kernel.log[0] == ("jit", (2, 1, 1), ("x", 8), {"XBLOCK": 64, "num_warps": 4})
    # grid, the device's stream, the compiled function, no hooks, the arguments, then the constexprs
    assert kernel.log[4] == ("direct", (2, 1, 1, 101, "function", "metadata", None, None, None, "z", 8, 64))


def test_without_a_stream_every_launch_goes_through_the_jit(stream, monkeypatch):
    kernel = Kernel()
    site = Site(kernel, dict(XBLOCK=64))
    for _ in range(3):  # a CPU graph (the interpreter) never has one
        site(None, (1, 1, 1), "x", 8)
    sites = Launches(0)
    monkeypatch.setattr(launch, "_hooks_idle", lambda: False)  # a launch hook (a profiler) is set
    for _ in range(3):
        site(sites.begin(()), (1, 1, 1), "x", 8)
    assert [e[0] for e in kernel.log] == ["jit"] * 6 and site.bound is None


def test_a_constexpr_left_to_its_default_keeps_the_jit(stream):
    kernel, sites = Kernel(), Launches(0)
    site = Site(kernel, dict(num_warps=4))  # XBLOCK not passed: only the JIT knows its value
    for _ in range(2):
        site(sites.begin(()), (1, 1, 1), "x", 8)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]


@pytest.mark.gpu
def test_an_input_aligned_otherwise_is_launched_for_its_alignment():
    """Triton vectorizes loads of a 16-byte-aligned pointer: the graph's first call binds kernels
    compiled for aligned inputs, and a view 4 bytes in must not run them."""
    def fn(x, y):
        return torch.softmax(x * 2 + y, -1)
    compiled = torch.compile(fn, backend="commfuse", dynamic=False)
    storage = torch.randn(64 * 256 + 4, device="cuda")
    y = torch.randn(64, 256, device="cuda")
    for offset in (0, 0, 1, 0, 1, 4):
        x = storage[offset:offset + 64 * 256].view(64, 256)
        torch.testing.assert_close(compiled(x, y), fn(x, y))


class _Dependent(Choices):
    def dependent_launch(self, device):  # Hopper's choice, forced: the interpreter waits for nothing
        return True


def test_dependent_launch_waits_first(tmp_path):
    """Where kernels launch as programmatic dependents (Choices.dependent_launch), each generated
    kernel (pointwise and reduction, matmul, decode attention) waits for the kernel ahead before it
    touches memory, and launches with `launch_pdl`. Results are eager's."""
    def step(x, w1, w2, q, k, v):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)
        y = torch.nn.functional.silu(h @ w1.t()) @ w2.t()
        return y, torch.nn.functional.scaled_dot_product_attention(q, k, v)

    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    args = (torch.randn(4, 64, **bf), torch.randn(96, 64, **bf) / 8, torch.randn(64, 96, **bf) / 8,
            torch.randn(2, 4, 1, 16, **bf), torch.randn(2, 4, 40, 16, **bf), torch.randn(2, 4, 40, 16, **bf))
    want = step(*args)
    got, dumps = compile_and_run(step, *args, tmp_path=tmp_path, choices=_Dependent(), decode_attention=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    _, code = dumps.only()
    kernels = re.findall(r"^def (cf_\w+)\(.*?\):\n(.*?)(?=^\S|\Z)", code, re.S | re.M)
    assert {"mm", "attn", "red"} <= {name.split("_")[1] for name, _ in kernels}, [n for n, _ in kernels]
    for name, body in kernels:
        assert body.lstrip().startswith("triton_helpers.after_predecessor()\n"), (name, body)
    sites = re.findall(r"^\w+_launch\d+ = Site\((\w+), dict\((.*)\)\)$", code, re.M)
    assert sites and all("launch_pdl=True" in options for _, options in sites), sites
