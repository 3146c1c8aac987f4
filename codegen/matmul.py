"""The few-row matmul kernel (`ir.MatmulTemplate`): out[M, N] = a[M, K] @ b[K, N], M <= 16.

Decode-sized products are a stream of the weight `b` past a tiny `a`. Each program owns 64
columns and walks K (or 1/SPLIT_K of it) in `BLOCK_K` steps: it loads a [BLOCK_M, BLOCK_K] tile of
`a` — through a's loader, so a pointwise producer of `a` (the prologue) is computed right there —
and a [BLOCK_K, 64] tile of `b`, and accumulates their tl.dot in fp32. With SPLIT_K > 1 the
programs of one column block add their partial sums atomically into an fp32 workspace; the last
to arrive (a counter per column block) stores the result and zeroes workspace and counter for
the next call, so the kernel needs no second pass and replays under CUDA graphs.

`a`'s loader is written by the ordinary Triton kernel writer (`TritonKernel`), with the tile's rows
as its x and the reduced dim as its r, so every op it can write can be a prologue.
"""
from __future__ import annotations

import itertools

import torch

from commfuse import ir
from commfuse.runtime.loader import interpreting
from commfuse.scheduler import RSYM, XSYM
from commfuse.virtualized import V

from .common import IndentedBuffer, triton_dtype
from .triton import TritonKernel
from .triton_ops import TritonOps, store_text


class OperandLoads(TritonKernel):
    """Writes `a`'s loader on the [XBLOCK, RBLOCK] tile: loads, and the prologue's ops. Only the
    state of TritonKernel that loads, index text and `ops` use; no group, no stores."""

    def __init__(self, m, k, prefetch: bool):  # noqa: super().__init__ wants a fused group
        self.X, self.R, self.prefetching = m, k, prefetch
        self.is_red, self.persistent, self.tiled, self.int64 = True, False, False, False
        self.args, self.size_symbols, self.values, self.producer = {}, set(), {}, {}
        self.sections, self.mask_stack, self.block_ptr_accesses = [], [], set()
        self.tmp, self.recompute, self.uses_assert, self.comm = itertools.count(), False, False, None
        self.prefetch: list[tuple[str, str]] = []  # (register, load text) of the next step
        self.new_section(loop=True)

    def block_ptr(self, index, store=False):
        return None  # plain pointer loads: the tile's row and K offsets are not a block's

    def load(self, name, index):
        """With a prologue, issued one step ahead (into `prefetch`, read at the top of the next
        step): Triton does not pipeline a load whose value goes through other ops before the dot,
        so each step would wait for it (44 µs instead of 18 for the decode's down projection).
        A plain operand load is left to Triton's pipelining."""
        n = len(self.cur.body.lines)
        var = super().load(name, index)
        lines = self.cur.body.lines
        if self.prefetching and len(lines) == n + 1 and lines[-1].startswith(f"{var.name} = tl.load("):  # a new load
            reg = f"pf{len(self.prefetch)}"
            self.prefetch.append((reg, lines.pop().split(" = ", 1)[1]))
            self.cur.body.writeline(f"{var.name} = {reg}_now")
        return var


def render(buf: ir.MatmulTemplate, name: str) -> tuple[str, dict]:
    """The kernel's source, and what the wrapper needs to launch it."""
    m, k = (int(s) for s in buf.a_size)
    n = int(buf.layout.size[1])
    cfg = V.choices.mm_template_config(m, n, k, buf.get_device())
    loads = OperandLoads(m, k, prefetch=buf.prologue)
    with V.set_ops(TritonOps(loads)):
        a = buf.a_loader([XSYM, RSYM])
    dtype = triton_dtype(buf.get_dtype())
    # Triton's interpreter multiplies bf16 tiles wrongly: there the dot takes the rounded values as fp32
    operand = ".to(tl.float32)" if interpreting() else ""
    params = list(loads.args.values()) + [str(s) for s in sorted(loads.size_symbols, key=str)]
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {name}({', '.join(params)}, b_ptr, out_ptr, ws_ptr, lock_ptr, xnumel, rnumel, N, "
                   "stride_bk, stride_bn, stride_om, stride_on, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, "
                   "BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr):")
    with code.indent():
        code.writelines([
            "xindex = tl.arange(0, XBLOCK)[:, None]",
            "xmask = xindex < xnumel",
            "cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
            "k_len = tl.cdiv(rnumel, SPLIT_K * RBLOCK) * RBLOCK  # this program's share of K",
            "k_start = tl.program_id(1) * k_len",
            "acc = tl.zeros([XBLOCK, BLOCK_N], tl.float32)",
            "rindex = k_start + tl.arange(0, RBLOCK)[None, :]",
            "rmask = rindex < rnumel"])
        code.writelines(f"{reg} = {text}" for reg, text in loads.prefetch)  # the first step's
        code.writeline("for roffset in range(k_start, k_start + k_len, RBLOCK):")
        with code.indent():
            code.writelines([f"{reg}_now = {reg}" for reg, _ in loads.prefetch])
            if loads.prefetch:
                code.writelines(["rindex = roffset + RBLOCK + tl.arange(0, RBLOCK)[None, :]  # the next step's",
                                 "rmask = rindex < rnumel"])
                code.writelines(f"{reg} = {text}" for reg, text in loads.prefetch)
            code.writelines(["rindex = roffset + tl.arange(0, RBLOCK)[None, :]",
                             "rmask = rindex < rnumel"])
            code.splice(loads.cur.body)
            code.writelines([
                f"a = {a}.to({dtype}){operand}",
                "kk = roffset + tl.arange(0, RBLOCK)[:, None]",
                "b_ptrs = b_ptr + kk * stride_bk + cols * stride_bn",
                "if EVEN:",
                f"    b = tl.load(b_ptrs){operand}",
                "else:",
                f"    b = tl.load(b_ptrs, (kk < rnumel) & (cols < N), other=0){operand}",
                "acc = tl.dot(a, b, acc)"])
        code.writelines([
            "out = out_ptr + xindex * stride_om + cols * stride_on",
            "omask = xmask & (cols < N)",
            "if SPLIT_K == 1:",
            f"    tl.store(out, {store_text('acc', torch.float32, buf.get_dtype())}, omask)",
            "else:",
            "    ws = ws_ptr + xindex * N + cols",
            "    tl.atomic_add(ws, acc, omask, sem=\"relaxed\")",
            "    tl.debug_barrier()  # every thread's partial sums come before the count (release)",
            "    arrived = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem=\"acq_rel\")",
            "    if arrived == SPLIT_K - 1:  # the last in: every partial sum is in the workspace",
            "        tl.debug_barrier()",
            "        total = tl.atomic_add(ws, tl.zeros_like(acc), omask)  # read where the adds went",
            "        tl.store(ws, tl.zeros_like(acc), omask)  # and leave it zeroed for the next call",
            f"        tl.store(out, {store_text('tl.where(omask, total, 0.0)', torch.float32, buf.get_dtype())}, omask)",
            "        tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)"])
    even = n % cfg["BLOCK_N"] == 0 and k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]) == 0
    meta = {"loader_args": list(loads.args), "size_symbols": sorted(loads.size_symbols, key=str),
            "m": m, "n": n, "k": k, "cfg": cfg, "even": even, "column_blocks": -(-n // cfg["BLOCK_N"])}
    return code.getvalue(), meta
