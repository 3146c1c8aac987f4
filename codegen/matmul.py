"""The few-row matmul kernel (`ir.MatmulTemplate`): out[M, N] = a[M, K] @ b[K, N], M <= 16.

Decode-sized products are a stream of the weight `b` past a tiny `a`. Each program owns 64
columns and walks K (or 1/SPLIT_K of it) in `BLOCK_K` steps: it loads a [BLOCK_M, BLOCK_K] tile of
`a` — through a's loader, so a pointwise producer of `a` (the prologue) is computed right there —
and a [BLOCK_K, 64] tile of `b`, and accumulates their tl.dot in fp32. With SPLIT_K > 1 the
programs of one column block add their partial sums atomically into an fp32 workspace; the last
to arrive (a counter per column block) stores the result and zeroes workspace and counter for
the next call, so the kernel needs no second pass and replays under CUDA graphs.

`a`'s loader is written by the ordinary Triton kernel writer (`TritonKernel`), with the tile's rows
as its x and the reduced dim as its r, so every op it can write can be a prologue. A group of
matmuls of one `a` (commfuse/mm_group.py) is one kernel over all their column blocks, a branch per
member (or per epilogue's members, computed side by side), and an epilogue is written by the same
writer over the [rows, columns] tile; a read of a member half a block of columns off (rotate_half)
is that member's tile with each block's halves swapped.
"""
from __future__ import annotations

import itertools
import re

import torch

from commfuse import ir, sizevars
from commfuse.mm_group import member_index, tile_width
from commfuse.runtime.loader import interpreting
from commfuse.scheduler import RSYM, XSYM
from commfuse.virtualized import V

from .common import AFTER_PREDECESSOR, IndentedBuffer, triton_dtype
from .triton import TritonKernel
from .triton_ops import TritonOps, Var, store_text


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
        self.internal, self.block_shape, self.epilogue = set(), "[XBLOCK, RBLOCK]", False
        self.shifted: dict = {}  # an epilogue's member -> (its index, block, register): epilogue_shifts
        self.new_section(loop=True)

    def shape(self) -> str:
        return self.block_shape

    def index_str(self, index) -> str:  # an epilogue's columns are `cols`: `rindex` is the K loop's
        text = super().index_str(index)
        return re.sub(r"\brindex\b", "cols", text) if self.epilogue else text

    def mask(self, loads=True) -> str:  # ... and its lanes `omask` (of the last program in, split)
        return " & ".join(["omask"] + [f"({m})" for m in self.mask_stack] * loads) if self.epilogue else super().mask(loads)

    def block_ptr(self, index, store=False):
        return None  # plain pointer loads: the tile's row and K offsets are not a block's

    def load(self, name, index):
        if self.epilogue and name in self.shifted and not sizevars.equal(index, self.shifted[name][0]):
            return self._swapped(name)
        return self._load(name, index)

    def _swapped(self, name) -> Var:
        """The member's tile with the halves of each block of columns swapped: the value half a
        block off each element's own (epilogue_shifts proved every read of it stays in the block)."""
        _, block, reg = self.shifted[name]
        sw = f"{reg}_sw"
        if not any(line.startswith(f"{sw} = ") for line in self.cur.body.lines):
            self.cur.body.writelines([
                f"{sw} = tl.permute(tl.reshape({reg}, [XBLOCK, BLOCK_N // {block}, 2, {block // 2}]), (0, 1, 3, 2))",
                f"{sw}_lo, {sw}_hi = tl.split({sw})",
                f"{sw} = tl.reshape(tl.permute(tl.join({sw}_hi, {sw}_lo), (0, 1, 3, 2)), [XBLOCK, BLOCK_N])"])
        return Var(sw, V.graph.get_dtype(name))

    def _load(self, name, index):
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


def render(nodes: list, internal: set, name: str) -> tuple[str, dict]:
    """The kernel of a matmul group (mm_group.py; one member when alone), and what the wrapper
    needs to launch it. The programs run over the members' column blocks end to end: a segment of
    them computes one member, or the members an epilogue reads (one accumulator each, over the
    same columns) and then the epilogue. Every segment loads `a` through the same loader."""
    members = [n.buf for n in nodes if isinstance(n.buf, ir.MatmulTemplate)]
    which = {b.name: i for i, b in enumerate(members)}
    segments = [([which[r] for r in sorted(e.read_names) if r in which], e) for e in nodes if not e.is_extern()]
    paired = {i for seg, _ in segments for i in seg}
    segments += [([i], None) for i in range(len(members)) if i not in paired]
    first = members[0]
    m, k = (int(s) for s in first.a_size)
    ns = [int(b.layout.size[1]) for b in members]
    shifts = [e.half_swaps if e else {} for _, e in segments]  # (mm_group.epilogue_shifts)
    cfg = V.choices.mm_template_config(m, sum(ns[seg[0]] * len(seg) for seg, _ in segments), k, first.get_device(),
                                       dots=max(len(seg) for seg, _ in segments), width=tile_width(shifts))
    block_n, split = cfg["BLOCK_N"], cfg["SPLIT_K"]
    stored = [b.name not in internal for b in members]
    loads = OperandLoads(m, k, prefetch=first.prologue)
    with V.set_ops(TritonOps(loads)):
        a = first.a_loader([XSYM, RSYM])
    loads.producer.update({n.name: n for n in nodes if n.is_extern()})  # the epilogues read these
    loader, epilogues = loads.cur.body, [_epilogue(loads, e, seg, members, m, ns[seg[0]], shift) if e else None
                                         for (seg, e), shift in zip(segments, shifts)]
    dtype = triton_dtype(first.get_dtype())
    # Triton's interpreter multiplies bf16 tiles wrongly: there the dot takes the rounded values as fp32
    operand = ".to(tl.float32)" if interpreting() else ""
    pointers = [p for i in range(len(members)) for p in [f"b{i}_ptr"] + [f"out{i}_ptr"] * stored[i]]
    ints = [p for i in range(len(members)) for p in [f"N{i}", f"stride_bk{i}", f"stride_bn{i}"] +
            [f"stride_om{i}", f"stride_on{i}"] * stored[i]]
    params = list(loads.args.values()) + [str(s) for s in sorted(loads.size_symbols, key=str)]
    blocks = [-(-ns[seg[0]] // block_n) for seg, _ in segments]
    ws_base = list(itertools.accumulate([0] + [blocks[j] * block_n for j, (seg, _) in enumerate(segments) for _ in seg]))
    ws_of = dict(zip([i for seg, _ in segments for i in seg], ws_base))
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {name}({', '.join(params + pointers)}, ws_ptr, lock_ptr, xnumel, rnumel, {', '.join(ints)}, "
                   "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):")
    with code.indent():
        if V.choices.dependent_launch(first.get_device()):
            code.writeline(AFTER_PREDECESSOR)
        code.writelines(["pid = tl.program_id(0)", "xindex = tl.arange(0, XBLOCK)[:, None]", "xmask = xindex < xnumel",
                         "k_len = tl.cdiv(rnumel, SPLIT_K * RBLOCK) * RBLOCK  # this program's share of K",
                         "k_start = tl.program_id(1) * k_len"])
        start = 0
        for (seg, epilogue), count, body in zip(segments, blocks, epilogues):
            if len(segments) > 1:  # this segment's programs
                code.writeline(f"if pid < {start + count}:" if start == 0 else f"if (pid >= {start}) & (pid < {start + count}):")
            with code.indent(1 if len(segments) > 1 else 0):
                n_even = ns[seg[0]] % block_n == 0 and k % (cfg["BLOCK_K"] * split) == 0
                code.writelines([f"cols = (pid - {start}) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]" if start else
                                 "cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"] +
                                [f"acc{i} = tl.zeros([XBLOCK, BLOCK_N], tl.float32)" for i in seg])
                _k_loop(code, loads, loader, a, dtype, operand, seg, n_even)
                code.writeline(f"omask = xmask & (cols < N{seg[0]})")
                if split > 1:
                    _split_k_sum(code, seg, ws_of, ws_base[-1])
                with code.indent(1 if split > 1 else 0):  # (split: in the last program in)
                    for i in seg:
                        if stored[i]:
                            value = store_text(f"acc{i}", torch.float32, members[i].get_dtype())
                            code.writeline(f"tl.store(out{i}_ptr + xindex * stride_om{i} + cols * stride_on{i}, {value}, omask)")
                    if body is not None:
                        code.splice(body)
            start += count
    meta = {"loader_args": list(loads.args), "size_symbols": sorted(loads.size_symbols, key=str), "m": m, "k": k,
            "cfg": cfg, "programs": start, "ws_columns": ws_base[-1], "stored": stored, "members": members}
    return code.getvalue(), meta


def _k_loop(code, loads, loader, a: str, dtype: str, operand: str, seg: list, even: bool):
    """The walk over K: a's tile through its loader, then each member's tile of b and its dot."""
    code.writelines(["rindex = k_start + tl.arange(0, RBLOCK)[None, :]", "rmask = rindex < rnumel"])
    code.writelines(f"{reg} = {text}" for reg, text in loads.prefetch)  # the first step's
    code.splice(loads.sections[0].init)  # the prologue's loads of row values ([XBLOCK, 1])
    code.writeline("for roffset in range(k_start, k_start + k_len, RBLOCK):")
    with code.indent():
        code.writelines([f"{reg}_now = {reg}" for reg, _ in loads.prefetch])
        if loads.prefetch:
            code.writelines(["rindex = roffset + RBLOCK + tl.arange(0, RBLOCK)[None, :]  # the next step's",
                             "rmask = rindex < rnumel"])
            code.writelines(f"{reg} = {text}" for reg, text in loads.prefetch)
        code.writelines(["rindex = roffset + tl.arange(0, RBLOCK)[None, :]", "rmask = rindex < rnumel"])
        code.splice(loader)
        code.writelines([f"a = {a}.to({dtype}){operand}", "kk = roffset + tl.arange(0, RBLOCK)[:, None]"])
        for i in seg:
            code.writeline(f"b_ptrs = b{i}_ptr + kk * stride_bk{i} + cols * stride_bn{i}")
            code.writeline(f"b = tl.load(b_ptrs){operand}" if even else
                           f"b = tl.load(b_ptrs, (kk < rnumel) & (cols < N{i}), other=0){operand}")
            code.writeline(f"acc{i} = tl.dot(a, b, acc{i})")


def _split_k_sum(code, seg: list, ws_of: dict, width: int):
    """The programs of one column block add their partial sums atomically into an fp32 workspace
    (a column range per member); the last to arrive takes the totals, and leaves workspace and
    counter zeroed for the next call. Its stores follow in the `if` left open here."""
    for i in seg:
        code.writelines([f"ws{i} = ws_ptr + xindex * {width} + {ws_of[i]} + cols",
                         f"tl.atomic_add(ws{i}, acc{i}, omask, sem=\"relaxed\")"])
    code.writelines(["tl.debug_barrier()  # every thread's partial sums come before the count (release)",
                     "arrived = tl.atomic_add(lock_ptr + pid, 1, sem=\"acq_rel\")",
                     "if arrived == SPLIT_K - 1:  # the last in: every partial sum is in the workspace",
                     "    tl.debug_barrier()"])
    for i in seg:
        code.writelines([f"    acc{i} = tl.where(omask, tl.atomic_add(ws{i}, tl.zeros_like(acc{i}), omask), 0.0)",
                         f"    tl.store(ws{i}, tl.zeros_like(acc{i}), omask)  # zeroed for the next call"])
    code.writeline("    tl.atomic_xchg(lock_ptr + pid, 0)")


def _epilogue(loads: OperandLoads, node, seg: list, members: list, m: int, n: int, shifts: dict) -> IndentedBuffer:
    """The epilogue's body on the [XBLOCK, BLOCK_N] tile of its columns (as `r`), in a section of
    its own: each member it reads is its accumulator, rounded to the member's dtype as a stored
    value would be (or that, its blocks' halves swapped: `shifts`); its other loads and its store
    through the ordinary kernel writer."""
    loads.new_section(loop=True)
    loads.R, loads.prefetching, loads.block_shape, loads.epilogue = n, False, "[XBLOCK, BLOCK_N]", True
    loads.mask_stack = []  # each epilogue is a branch of its own: no bounds mask of another's loads
    for i in seg:
        buf = members[i]
        loads.cur.body.writeline(f"mv{i} = {store_text(f'acc{i}', torch.float32, buf.get_dtype())}.to(tl.float32)")
        loads.values[buf.name] = (loads.cur.id, Var(f"mv{i}", buf.get_dtype()), None)
        if buf.name in shifts:
            loads.shifted[buf.name] = (member_index(buf, m), shifts[buf.name], f"mv{i}")
    with V.set_ops(TritonOps(loads)):
        node.run_body(node.body_index(node.kernel_index_map(m, n)))
    loads.cur.init.splice(loads.cur.body)  # after its loads of row values ([XBLOCK, 1])
    return loads.cur.init
