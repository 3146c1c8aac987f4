"""The comm kernels' barrier, as Triton source (codegen/comm.py's kernels, and the standalone one of
runtime/async_tp.py). How it works: codegen/comm.py's docstring."""
from __future__ import annotations

from .symm import timeout_word

BARRIER_STEP = "epoch += 1"  # one per barrier in a kernel's source (the plan check counts them)

# On the GPU the barrier's lanes are one per thread (no thread holds a copy of another's lane, so
# each signal is sent once) and the memory order is spelled out in PTX; Triton's interpreter has
# no inline PTX and takes the same steps with atomics.
LANES = 1024  # >= the threads of any kernel (32 warps)
_SIGNAL = ("{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.{sem}.sys.global.b32 [$1], $3; "
           "mov.b32 $0, 0; }}")
_POLL = "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.acquire.sys.global.b32 $0, [$1]; }"


def barrier_lines(world: int, params: dict, release: bool, inline_ptx: bool) -> list[str]:
    """One barrier of program `slot`: bump the epoch, store it in every peer's slot, wait until every
    peer's entry in our slot has reached it. `release`: this program's earlier writes must be
    visible to the peers once they pass (otherwise they only learn that it got here)."""
    own, rank, w = params["@sig_own"], params["@rank"], world
    dst = params[f"@sig{w - 1}"]
    for p in reversed(range(w - 1)):  # lane p points at peer p's pad
        dst = f"tl.where(peer == {p}, {params[f'@sig{p}']}, {dst})"
    lanes = LANES if inline_ptx else max(2, 1 << (w - 1).bit_length())
    lines = ["tl.debug_barrier()  # every thread's loads and stores come before the signal",
             BARRIER_STEP,
             f"peer = tl.arange(0, {lanes})",
             f"live = (peer != {rank}) & (peer < {w})"]
    sem = "release" if release else "relaxed"
    if inline_ptx:
        lines += [f"tl.inline_asm_elementwise({_SIGNAL.format(sem=sem)!r}, \"=r,l,r,r\", "
                  f"[{dst} + slot + {rank}, live.to(tl.int32), epoch + tl.zeros_like(peer)], "
                  "dtype=tl.int32, is_pure=False, pack=1)"]
        poll = (f"tl.inline_asm_elementwise({_POLL!r}, \"=r,l,r\", [{own} + slot + peer, live.to(tl.int32)], "
                "dtype=tl.int32, is_pure=False, pack=1)")
    else:
        lines += [f"tl.atomic_xchg({dst} + slot + {rank}, epoch + tl.zeros_like(peer), live, "
                  f"sem=\"{sem}\", scope=\"sys\")"]
        poll = f"tl.load({own} + slot + peer, live, other=0, volatile=True)"
    # the wait is bounded, at no cost where no peer is missing: the clock starts in the loop, and a
    # wait that gives up (deadline -1: a peer gone or late, runtime/triton_helpers.py) leaves it
    hdr = timeout_word(w)
    lines += [f"seen = {poll}",
              "deadline = tl.full([], 0, tl.int64)",
              "while (tl.min(tl.where(live, seen - epoch, 0)) < 0) & (deadline >= 0):",
              f"    deadline = triton_helpers.barrier_deadline(deadline, {own} + {hdr}, {dst} + {hdr}, "
              "tl.where(live & (seen < epoch), peer, -1))",
              f"    seen = {poll}"]
    if not inline_ptx:  # the volatile polls carry no order: one acquire on what they saw
        lines.append(f"tl.atomic_add({own} + slot + peer, 0, live, sem=\"acquire\", scope=\"sys\")")
    lines.append("tl.debug_barrier()  # and every thread's reads of the peers come after it")
    return lines


def standalone_params(world: int) -> dict:
    """The standalone kernels' own parameter names for the barrier's arguments."""
    return {f"@sig{r}": f"sig{r}" for r in range(world)} | {"@sig_own": "sig_own", "@rank": "rank"}


def barrier_kernel(world: int, inline_ptx: bool) -> str:
    """Source of `cf_barrier(sig0, .., sig_own, rank)`: one program that only meets its peers, in slot
    0 of its pool, between the ops of a runtime op (runtime/async_tp.py) that reads or writes them."""
    params = standalone_params(world)
    body = ["slot = 0", "epoch = tl.load(sig_own + rank, volatile=True)",
            *barrier_lines(world, params, release=True, inline_ptx=inline_ptx), "tl.store(sig_own + rank, epoch)"]
    return "\n".join(["import triton", "import triton.language as tl", "from commfuse.runtime import triton_helpers",
                      "", "constants = {}", "", "", "@triton.jit", f"def cf_barrier({', '.join(params.values())}):",
                      *("    " + line for line in body)]) + "\n"
