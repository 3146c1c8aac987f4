"""Triton comm kernels over symmetric memory.

One-shot all-reduce: every rank reads every peer's copy of the input and reduces it
locally. A barrier over signal pads (each program owns one int32 slot per peer on each
rank) opens the kernel — all inputs are written — and closes it — nobody rewrites its
input while a peer may still read it. Each wait swaps its slot back from 1 to 0, so the
pads are clean after every call and CUDA-graph replays stay correct.
"""
from __future__ import annotations

import torch

from commfuse import config

import dataclasses

from .common import IndentedBuffer, triton_dtype

COMBINE = {"sum": "{a} + {b}", "avg": "{a} + {b}", "max": "tl.maximum({a}, {b})",
           "min": "tl.minimum({a}, {b})"}


def _barrier(code: IndentedBuffer, world: int) -> None:
    for p in range(world):  # tell each peer that this program got here
        code.writeline(f"if rank != {p}:")
        with code.indent():
            code.writeline(f"while tl.atomic_cas(sig{p} + slot + rank, 0, 1, sem=\"release\", scope=\"sys\") != 0:")
            code.writeline("    pass")
    for p in range(world):  # and wait until each peer told us
        code.writeline(f"if rank != {p}:")
        with code.indent():
            code.writeline(f"while tl.atomic_cas(sig_own + slot + {p}, 1, 0, sem=\"acquire\", scope=\"sys\") != 1:")
            code.writeline("    pass")


def _reduce_peers(code: IndentedBuffer, world: int, reduce_op: str) -> None:
    """acc = every peer's `offs` elements, combined in fp32."""
    code.writeline(f"acc = {combine([f'tl.load(in{p} + offs, mask, other=0).to(tl.float32)' for p in range(world)], reduce_op, world)}")


def _signature(name: str, world: int) -> IndentedBuffer:
    """The shared head of the standalone all-reduce kernels: peers' inputs, output, signal pads."""
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {name}({', '.join(f'in{p}' for p in range(world))}, out, "
                   f"{', '.join(f'sig{p}' for p in range(world))}, sig_own, rank, numel, "
                   "BLOCK: tl.constexpr, NPROG: tl.constexpr):")
    with code.indent():
        code.writeline("pid = tl.program_id(0)")
        code.writeline(f"slot = pid * {world}")
    return code


def one_shot_all_reduce(name: str, world: int, reduce_op: str, dtype: torch.dtype, inplace: bool) -> str:
    code = _signature(name, world)
    with code.indent():
        _barrier(code, world)
        code.writeline("for start in range(pid * BLOCK, numel, NPROG * BLOCK):")
        with code.indent():
            code.writeline("offs = start + tl.arange(0, BLOCK)")
            code.writeline("mask = offs < numel")
            acc = "acc"
            _reduce_peers(code, world, reduce_op)
            if inplace:  # every peer has read this chunk of our buffer before we overwrite it
                _barrier(code, world)
            code.writeline(f"tl.store(out + offs, {acc}.to({triton_dtype(dtype)}), mask)")
        if not inplace:
            _barrier(code, world)
    return code.getvalue()


def two_shot_all_reduce(name: str, world: int, reduce_op: str, dtype: torch.dtype) -> str:
    """Reduce-scatter then all-gather over symmetric memory: rank r reduces chunk r from every
    peer into its own buffer (no peer reads chunk r of it), then everyone gathers the chunks.
    Each rank moves 2N bytes instead of the one-shot's W*N."""
    tdt = triton_dtype(dtype)
    code = _signature(name, world)
    with code.indent():
        code.writeline(f"chunk = tl.cdiv(numel, {world})")
        _barrier(code, world)
        code.writeline("for start in range(pid * BLOCK, chunk, NPROG * BLOCK):  # reduce my chunk")
        with code.indent():
            code.writeline("offs = rank * chunk + start + tl.arange(0, BLOCK)")
            code.writeline("mask = (offs < numel) & (start + tl.arange(0, BLOCK) < chunk)")
            _reduce_peers(code, world, reduce_op)
            for p in range(world):  # into my own buffer (in{rank}), where the peers will find it
                code.writeline(f"if rank == {p}:")
                code.writeline(f"    tl.store(in{p} + offs, acc.to({tdt}), mask)")
        _barrier(code, world)
        code.writeline("for start in range(pid * BLOCK, chunk, NPROG * BLOCK):  # gather every chunk")
        with code.indent():
            code.writeline("sub = start + tl.arange(0, BLOCK)")
            for p in range(world):
                code.writeline(f"offs = {p} * chunk + sub")
                code.writeline("mask = (offs < numel) & (sub < chunk)")
                code.writeline(f"tl.store(out + offs, tl.load(in{p} + offs, mask, other=0), mask)")
        _barrier(code, world)
    return code.getvalue()


def launch_config(numel: int) -> dict:
    block = config.comm.block
    nprog = max(1, min(config.comm.max_programs, -(-numel // block)))
    return {"BLOCK": block, "NPROG": nprog, "num_warps": 4}


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


@dataclasses.dataclass
class KernelComm:
    group: str
    world: int

    def sync_args(self) -> list[str]:
        return [f"@sig{r}" for r in range(self.world)] + ["@sig_own", "@rank"]

    def barrier(self, code: IndentedBuffer, params: dict) -> None:
        sig = {r: params[f"@sig{r}"] for r in range(self.world)}
        own, rank = params["@sig_own"], params["@rank"]
        code.writeline(f"slot = tl.program_id(0) * {self.world}")
        for p in range(self.world):
            code.writeline(f"if {rank} != {p}:")
            code.writeline(f"    while tl.atomic_cas({sig[p]} + slot + {rank}, 0, 1, sem=\"release\", scope=\"sys\") != 0:")
            code.writeline("        pass")
        for p in range(self.world):
            code.writeline(f"if {rank} != {p}:")
            code.writeline(f"    while tl.atomic_cas({own} + slot + {p}, 1, 0, sem=\"acquire\", scope=\"sys\") != 1:")
            code.writeline("        pass")


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
