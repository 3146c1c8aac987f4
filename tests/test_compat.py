"""Version differences (commfuse/compat.py) that the rest of the suite would only show as a wall of
unrelated failures."""
import pytest
import torch

from commfuse.runtime.loader import interpreting, load_module

LOOP_KERNEL = """
import triton
import triton.language as tl
constants = {}

@triton.jit
def double(x, y, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, 4 * BLOCK):  # a loop bound that is a kernel argument
        offs = start + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)
"""


@pytest.mark.skipif(not interpreting(), reason="the interpreter's scalar conversion")
def test_interpreted_loop_bound_from_a_kernel_argument():
    # triton < 3.7 with numpy >= 2.4: "only 0-dimensional arrays can be converted to Python scalars"
    # unless compat.patch_interpreter_index is in place (load_module applies it)
    module, _ = load_module(LOOP_KERNEL, {})
    x = torch.randn(1000)
    y = torch.zeros_like(x)
    module.double[(4,)](x, y, x.numel(), BLOCK=64)
    torch.testing.assert_close(y, x * 2)
