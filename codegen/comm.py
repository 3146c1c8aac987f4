"""Triton comm kernels over symmetric memory.

One-shot all-reduce: every rank reads every peer's copy of the input and reduces it
locally. A barrier opens the kernel — every rank's input is written — and closes it —
nobody rewrites its input while a peer may still read it.

The barrier is program by program: program i of each rank meets program i of every peer.
Program i owns one slot of the signal pad (`signal_stride` int32s, whole cache lines): entry
p of the slot is where peer p signals, entry `rank` holds the program's epoch — how many
barriers it has passed, kept across calls. A barrier bumps the epoch, stores it into every
peer's slot at once (one lane per peer), then polls its own slot until every peer's entry has
caught up. Values only grow, so pads never need resetting and CUDA-graph replays stay correct;
a peer that already went one barrier further only left a larger value.
"""
from __future__ import annotations

import dataclasses

import torch

from commfuse.runtime.barrier import BARRIER_STEP, barrier_lines, standalone_params  # noqa: F401  (the wrapper counts BARRIER_STEPs)
from commfuse.runtime.loader import interpreting
from commfuse.runtime.symm import group_of, signal_stride

from .common import IndentedBuffer
from .triton_ops import store_text

# max / min propagate NaN, as torch.maximum does (tl.maximum drops it: a rank's NaN vanished)
COMBINE = {"sum": "{a} + {b}", "avg": "{a} + {b}", "max": "triton_helpers.max_nan({a}, {b})",
           "min": "triton_helpers.min_nan({a}, {b})"}


@dataclasses.dataclass
class KernelComm:
    """The barriers of a kernel that reads its peers' buffers. `params` maps the arguments named by
    `sync_args` to the kernel's parameter names."""
    group: str
    world: int

    def sync_args(self) -> list[str]:
        return [f"@sig{r}" for r in range(self.world)] + ["@sig_own", "@rank"]

    def enter(self, code: IndentedBuffer, params: dict, wait: bool = True) -> None:
        """This program's slot and epoch; with `wait`, a barrier: every rank's input is written (by
        earlier kernels: visible once they ended). A kernel that writes its own input (a fused
        prologue) synchronizes later, after the stores."""
        own, rank = params["@sig_own"], params["@rank"]
        code.writeline(f"slot = tl.program_id(0) * {signal_stride(self.world)}")
        code.writeline(f"epoch = tl.load({own} + slot + {rank}, volatile=True)")
        if wait:
            self.barrier(code, params, release=False)

    def leave(self, code: IndentedBuffer, params: dict, wait: bool = True) -> None:
        """Nobody rewrites its input while a peer may still read it. A relaxed signal suffices (and
        saves ~0.7 µs on H200): every peer load fed a store that precedes the CTA barrier before
        the signal, so each had returned its value before any thread signals. Without `wait`
        (inputs that stay unwritten until the next comm kernel of their pool has passed its
        first barrier: memory.plan_comm_pools) only the epoch is kept."""
        if wait:
            self.barrier(code, params, release=False)
        code.writeline(f"tl.store({params['@sig_own']} + slot + {params['@rank']}, epoch)")

    def barrier(self, code: IndentedBuffer, params: dict, release: bool = True) -> None:
        for line in barrier_lines(self.world, params, release, inline_ptx=not interpreting()):
            code.writeline(line)


def _reduce_peers(code: IndentedBuffer, world: int, reduce_op: str) -> None:
    """acc = every peer's `offs` elements, combined in fp32."""
    code.writeline(f"acc = {combine([f'tl.load(in{p} + offs, mask, other=0).to(tl.float32)' for p in range(world)], reduce_op, world)}")


def _signature(name: str, world: int) -> tuple[IndentedBuffer, KernelComm, dict]:
    """The shared head of the standalone all-reduce kernels: peers' inputs, output, signal pads."""
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {name}({', '.join(f'in{p}' for p in range(world))}, out, "
                   f"{', '.join(f'sig{p}' for p in range(world))}, sig_own, rank, numel, "
                   "BLOCK: tl.constexpr, NPROG: tl.constexpr):")
    with code.indent():
        code.writeline("pid = tl.program_id(0)")
    return code, KernelComm("", world), standalone_params(world)


def one_shot_all_reduce(name: str, world: int, reduce_op: str, dtype: torch.dtype, inplace: bool) -> str:
    code, sync, params = _signature(name, world)
    with code.indent():
        sync.enter(code, params)
        code.writeline("for start in range(pid * BLOCK, numel, NPROG * BLOCK):")
        with code.indent():
            code.writeline("offs = start + tl.arange(0, BLOCK)")
            code.writeline("mask = offs < numel")
            acc = "acc"
            _reduce_peers(code, world, reduce_op)
            if inplace:  # every peer has read this chunk of our buffer before we overwrite it
                sync.barrier(code, params)
            code.writeline(f"tl.store(out + offs, {store_text(acc, torch.float32, dtype)}, mask)")
        sync.leave(code, params)
    return code.getvalue()


def two_shot_all_reduce(name: str, world: int, reduce_op: str, dtype: torch.dtype, inplace: bool = False) -> str:
    """Reduce-scatter then all-gather over symmetric memory: rank r reduces chunk r from every
    peer into its own buffer (no peer reads chunk r of it), then everyone gathers the chunks.
    Each rank moves 2N bytes instead of the one-shot's W*N. The same kernel runs in place: every
    chunk is gathered only after the barrier that follows its reduction."""
    code, sync, params = _signature(name, world)
    with code.indent():
        code.writeline(f"chunk = tl.cdiv(numel, {world})")
        sync.enter(code, params)
        code.writeline("for start in range(pid * BLOCK, chunk, NPROG * BLOCK):  # reduce my chunk")
        with code.indent():
            code.writeline("offs = rank * chunk + start + tl.arange(0, BLOCK)")
            code.writeline("mask = (offs < numel) & (start + tl.arange(0, BLOCK) < chunk)")
            _reduce_peers(code, world, reduce_op)
            for p in range(world):  # into my own buffer (in{rank}), where the peers will find it
                code.writeline(f"if rank == {p}:")
                code.writeline(f"    tl.store(in{p} + offs, {store_text('acc', torch.float32, dtype)}, mask)")
        sync.barrier(code, params)
        code.writeline("for start in range(pid * BLOCK, chunk, NPROG * BLOCK):  # gather every chunk")
        with code.indent():
            code.writeline("sub = start + tl.arange(0, BLOCK)")
            for p in range(world):
                code.writeline(f"offs = {p} * chunk + sub")
                code.writeline("mask = (offs < numel) & (sub < chunk)")
                code.writeline(f"tl.store(out + offs, tl.load(in{p} + offs, mask, other=0), mask)")
        sync.leave(code, params)
    return code.getvalue()


# ------------------------------------------------------------------------------- fused kernels
# An all-reduce lowered as a loop body (`ops.peer_reduce`) fuses like any pointwise node: its
# consumers (residual add, RMSNorm, casts...) run in the same kernel, right where the peers'
# values are combined. The kernel then synchronizes with its peers as the one-shot kernel does.

def peer_arg(name: str, rank: int) -> str:
    return f"{name}@peer{rank}"


def combine(loads: list[str], reduce_op: str, world: int) -> str:
    acc = loads[0]
    for b in loads[1:]:
        acc = COMBINE[reduce_op].format(a=acc, b=b)
    return f"({acc}) / {world}" if reduce_op == "avg" else acc


def arg_value(key: str, pool: str) -> str:
    """Wrapper source for a comm kernel argument named by `peer_arg` / `KernelComm.sync_args`."""
    if "@peer" in key:
        name, r = key.split("@peer")
        return f"comm['peers_{name}'][{r}]"
    what = key[1:]
    if what == "rank":
        return f"comm[{pool!r}].rank"
    if what == "sig_own":
        return f"comm[{pool!r}].signals[comm[{pool!r}].rank]"
    return f"comm[{pool!r}].signals[{what[3:]}]"


def arg_spec(key: str, dtype_of, group: str):
    """What `arg_value` passes, as `_launches` lists it: a peer buffer's dtype, a signal pad's
    (int32), this rank in the group (Triton specializes on its value)."""
    if "@peer" in key:
        return dtype_of(key.split("@peer")[0])
    if key == "@rank":
        return torch.distributed.get_rank(group_of(group))
    return torch.int32
