"""Symmetric memory behind one interface, two backends.

A `SymmPool` is one allocation of `nbytes` per rank of a process group, at the same
size on every rank, followed by a signal pad of int32 slots for the comm kernels' barriers
(ours, not torch's pad, so torch's symm_mem kernels on the same pool keep theirs).
Each rank sees its own buffer and its peers' (`peer_views`), so kernels can read the
peers' data directly.
  CUDA: torch.distributed._symmetric_memory (allocation, rendezvous, peer buffers, pads).
  CPU:  an emulation over shared-memory files among the ranks of one host.
Pools are made at the first call of a compiled graph (never during CUDA-graph
capture) and kept for its life.
"""
from __future__ import annotations

import logging
import os
import uuid

import torch
import torch.distributed as dist

from . import peers
from .plan_check import check_plans_agree, eager_frames, meet, peer_wait_s

ALIGN = 128          # bytes: every buffer starts on a vectorizable boundary
SIGNAL_PROGRAMS = 1024  # comm-kernel programs that own a barrier slot (the grid of one kernel)


def signal_stride(world: int) -> int:
    """int32s per program slot: one flag per peer (and this rank's epoch counter), padded to whole
    128-byte lines so that programs never poll or signal on a line another program uses."""
    return 32 * -(-world // 32)


def signal_bytes(world: int) -> int:
    return (timeout_word(world) + 32) * 4  # the slots, then one line: the rank's header


def timeout_word(world: int) -> int:
    """The int32 of a rank's own pad, past every slot, where its header starts (runtime/peers.py):
    first how many ms a barrier may wait (triton_helpers.barrier_deadline)."""
    return SIGNAL_PROGRAMS * signal_stride(world)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def group_of(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


class SymmPool:
    # The pool and its views outlive the call that made them, and every graph shares them: made
    # under inference_mode (allocation, or a dtype view even of a normal tensor), they would be
    # inference tensors, which no op outside it may write (an mm's out=).
    @torch.inference_mode(False)
    def __init__(self, group_name: str, device: torch.device, nbytes: int, meet_timeout_s: float | None = None):
        """`meet_timeout_s`: how long each step of the ranks' rendezvous waits for a missing rank
        (None: comm.plan_check_timeout_s)."""
        self.group_name, self.device, self.nbytes = group_name, torch.device(device), align(max(nbytes, ALIGN))
        group = group_of(group_name)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.meet_timeout_s = meet_timeout_s
        if self.device.type == "cuda":
            self._init_cuda(group)
        else:
            self._init_shared_memory(group)
        self._cache: dict = {}
        self.set_barrier_timeout(None)
        self.failed = None  # the PeerError this pool's kernels gave up with: every later call raises it
        _on_exit_mark_pools()

    def _meet(self, step: str, value: str = "") -> dict:
        """A step of the pool's creation, every rank of its group at it (by name: the pool holds no
        process group, which `destroy_process_group` would then leave to the interpreter's exit)."""
        return meet(group_of(self.group_name), f"the creation of the {self.nbytes}-byte symmetric pool on "
                    f"{self.device} ({step})", value, self.meet_timeout_s)

    def set_barrier_timeout(self, seconds: float | None) -> None:
        """Bound the comm kernels' barrier waits: `seconds` (None: `peer_wait_s`'s default)."""
        seconds = peer_wait_s(seconds, group_of(self.group_name), self.device)
        self.signals[self.rank][timeout_word(self.world_size)] = int(min(max(seconds, 1e-3) * 1000, 2**31 - 1))
        self.timeout_s = seconds

    def _write_header(self):
        """This rank's pid and pid namespace, where waiting peers look (before the ranks' barrier)."""
        hdr = timeout_word(self.world_size)
        self.signals[self.rank][hdr + peers.H_PID: hdr + peers.H_NS + 1] = torch.tensor(
            [os.getpid(), peers.pid_namespace()], dtype=torch.int32)
        if self.device.type == "cuda":  # the host learns of its kernels' give-ups by a copy each call
            self.fail_host = torch.zeros(2, dtype=torch.int32).pin_memory()

    def headers(self) -> list:
        hdr = timeout_word(self.world_size)
        return [s[hdr: hdr + 6].tolist() for s in self.signals]

    def mark(self, state: int) -> None:
        """This rank is going (runtime/peers.py: STATES): its peers' waits end now, not at the timeout."""
        word = timeout_word(self.world_size) + peers.H_STATE
        if int(self.signals[self.rank][word]) == 0 or state > 1:
            self.signals[self.rank][word] = state
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def failure(self, where, start: bool) -> peers.PeerError | None:
        """The error of a wait that gave up, by this rank's kernels or (CPU) by a peer's, or, at a
        call's `start`, of a peer gone (after a kernel it may have left rightly). On a GPU it reads the copy of the own header that the previous call
        queued (no synchronization), so it is one or two calls late."""
        if self.failed is not None:
            return self.failed
        if self.device.type == "cuda":
            own = self.fail_host.tolist()
            if not torch.cuda.is_current_stream_capturing():
                hdr = timeout_word(self.world_size) + peers.H_FAIL
                self.fail_host.copy_(self.signals[self.rank][hdr: hdr + 2], non_blocking=True)
            if not own[0]:
                return None
        heads = self.headers()  # on a GPU, a synchronization: only once a wait gave up
        gone = [r for r, h in enumerate(heads) if r != self.rank and (h[peers.H_STATE] and start or h[peers.H_FAIL])]
        if not heads[self.rank][peers.H_FAIL] and not gone:
            return None
        where, group = where(), group_of(self.group_name)
        global_rank = lambda r: dist.get_global_rank(group, r)  # noqa: E731
        me, mine = global_rank(self.rank), heads[self.rank]
        if mine[peers.H_FAIL]:
            ranks = [r for r in range(self.world_size) if mine[peers.H_MISSING] >> r & 1]
            what = (f"rank {me} gave up waiting for rank(s) {[global_rank(r) for r in ranks]} "
                    f"({peers.REASONS.get(mine[peers.H_FAIL])}) at a barrier of {where[0]}: ")
        else:
            ranks = gone
            what = f"rank {me} cannot run {where[1]}: "
        self.failed = peers.PeerError(
            f"commfuse: {what}{peers.describe(self.rank, ranks, heads, self.group_name, global_rank)}"
            f"{eager_frames([global_rank(r) for r in ranks])}. "
            f"Process group {self.group_name}; comm.barrier_timeout_s={self.timeout_s:g} s bounds the wait for a "
            "live peer, a peer's exit ends it at once. The pool's ranks can no longer meet: end the job",
            [global_rank(r) for r in ranks])
        return self.failed

    # backends -----------------------------------------------------------------
    def _init_cuda(self, group):
        import torch.distributed._symmetric_memory as symm_mem
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("commfuse: symmetric memory must be allocated before CUDA-graph capture; "
                               "run the compiled function once before capturing it")
        self._meet("every rank arrived")  # torch's rendezvous would wait for a missing rank unbounded
        total = self.nbytes + signal_bytes(self.world_size)
        whole = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(whole, group.group_name)
        self.handle = handle
        maps = [handle.get_buffer(r, (total,), torch.uint8) for r in range(self.world_size)]
        self.local, self.peers = whole[: self.nbytes], [m[: self.nbytes] for m in maps]
        self.signals = [m[self.nbytes:].view(torch.int32) for m in maps]
        self.signals[self.rank].zero_()
        self._write_header()
        torch.cuda.synchronize(self.device)
        self._meet("headers written")

    def _init_shared_memory(self, group):
        # rank 0 names the allocation; everyone creates its file, then maps the others'
        token = self._meet("every rank arrived", uuid.uuid4().hex)[dist.get_global_rank(group, 0)]
        total = self.nbytes + signal_bytes(self.world_size)
        paths = [os.path.join(_shm_dir(), f"commfuse_{token}_{r}") for r in range(self.world_size)]
        with open(paths[self.rank], "wb") as f:
            f.truncate(total)
        self._meet("files made")
        maps = [torch.from_file(p, shared=True, size=total, dtype=torch.uint8) for p in paths]
        self.local, self.paths = maps[self.rank][: self.nbytes], paths
        self.peers = [m[: self.nbytes] for m in maps]
        self.signals = [m[self.nbytes:].view(torch.int32) for m in maps]
        self._write_header()
        self._meet("headers written")
        os.unlink(paths[self.rank])  # the mappings stay valid; nothing is left behind

    # views --------------------------------------------------------------------
    @torch.inference_mode(False)
    def view(self, offset: int, size, stride, dtype) -> torch.Tensor:
        """This rank's tensor at `offset` bytes into the pool (the same object every call)."""
        key = ("local", offset, tuple(size), tuple(stride), dtype)
        if key not in self._cache:
            self._check(offset, size, stride, dtype)
            base = self.local[offset:].view(dtype)
            self._cache[key] = base.as_strided(size, stride)
        return self._cache[key]

    @torch.inference_mode(False)
    def peer_views(self, offset: int, numel: int, dtype) -> list[torch.Tensor]:
        key = ("peers", offset, numel, dtype)
        if key not in self._cache:
            self._check(offset, [numel], [1], dtype)
            self._cache[key] = [p[offset: offset + numel * dtype.itemsize].view(dtype) for p in self.peers]
        return self._cache[key]

    def _check(self, offset, size, stride, dtype):
        span = (1 + sum((n - 1) * s for n, s in zip(size, stride))) * dtype.itemsize if all(size) else 0
        if offset % ALIGN or offset + span > self.nbytes:
            raise RuntimeError(f"commfuse: pool slice [{offset}, {offset + span}) outside the "
                               f"{self.nbytes}-byte pool of group {self.group_name}")


_exit_hooked = []


def _on_exit_mark_pools() -> None:
    """Once per process: at exit (normal, an uncaught exception, a multiprocessing child's end) mark
    this rank gone in every pool, so that a peer waiting at a barrier stops now. os._exit and
    SIGKILL run no handler: on a CPU the peers see the pid gone; on a GPU they wait out the timeout."""
    if _exit_hooked:
        return
    _exit_hooked.append(True)
    import atexit
    import multiprocessing.util
    import sys

    def mark(state):
        for pool in list(shared_pools.pools.values()):
            try:
                pool.mark(state)
            except Exception:  # the device or the mapping may be gone already
                pass
    previous = sys.excepthook

    def excepthook(*exc):
        mark(2)
        previous(*exc)
    sys.excepthook = excepthook
    atexit.register(mark, 1)
    multiprocessing.util.Finalize(None, mark, args=(1,), exitpriority=100)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


class SharedPools:
    """One pool per (group, device) in the process, shared by every compiled graph.

    Graphs run one after another, so each plans from offset 0 and the pool is as large as the
    largest plan. Growing it replaces the allocation (generation + 1); graphs notice and re-take
    their views. Growing is never done during CUDA-graph capture."""

    def __init__(self):
        self.pools: dict = {}
        self.generation: dict = {}
        self.replaced = 0  # pools reallocated larger: a CUDA graph captured before uses freed memory

    def get(self, group_name: str, device, nbytes: int, tag: str = "", meet_timeout_s: float | None = None) -> SymmPool:
        """`tag`: a pool of its own beside the graphs' (runtime/async_tp.py's workspace)."""
        key = (group_name, str(torch.device(device))) + ((tag,) if tag else ())
        pool = self.pools.get(key)
        if pool is None or pool.nbytes < nbytes:
            if pool is not None and torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"commfuse: the symmetric pool of group {group_name} must grow from {pool.nbytes} to "
                    f"{nbytes} bytes during CUDA-graph capture; run every compiled graph once before capturing")
            self.replaced += pool is not None
            self.pools[key] = pool = SymmPool(group_name, device, max(nbytes, pool.nbytes if pool else 0), meet_timeout_s)
            self.generation[key] = self.generation.get(key, 0) + 1
        return pool

    def gen(self, group_name: str, device) -> int:
        return self.generation.get((group_name, str(torch.device(device))), 0)

    def report(self) -> dict:
        """{group: {device: bytes}} of the pools allocated in this process."""
        out: dict = {}
        for (group, device, *tag), pool in self.pools.items():
            out.setdefault(group, {})[device + "".join(f" ({t})" for t in tag)] = pool.nbytes
        return out


shared_pools = SharedPools()


class CommState:
    """A compiled graph's view of its comm buffers: checked across ranks at the first call, then
    the same tensors (same pool, same offsets) on every call."""

    def __init__(self, graph_id: str, pools: dict, buffers: list, protocol: list = (), program: list = (),
                 checked: list = (), timeout_s=None, barrier_timeout_s=None, at_break=None):
        self.graph_id, self.pools_needed, self.buffers = graph_id, pools, buffers
        self.barrier_timeout_s = barrier_timeout_s  # the compile's comm.barrier_timeout_s
        self.timeout_s = timeout_s  # and its comm.plan_check_timeout_s, for the pools' rendezvous
        groups = {g: group_of(g) for g in [*(g for g, _, _ in pools.values()), *checked]}  # (`checked`: no pool)
        check_plans_agree(graph_id, pools, buffers, groups, list(protocol), list(program), timeout_s, at_break)
        self.collectives = {p["kernel"]: p["collectives"] for p in protocol}  # for the errors
        self.refresh()

    def refresh(self):
        self.pools = {name: shared_pools.get(g, d, n, meet_timeout_s=self.timeout_s)
                      for name, (g, d, n) in self.pools_needed.items()}
        self.gens = {name: shared_pools.gen(g, d) for name, (g, d, _) in self.pools_needed.items()}
        if self.barrier_timeout_s is not None:  # a pool shared by graphs takes the last one's
            for pool in self.pools.values():
                pool.set_barrier_timeout(self.barrier_timeout_s)
        self.tensors = {}
        for b in self.buffers:
            pool = self.pools[b["pool"]]
            self.tensors[b["name"]] = pool.view(b["offset"], b["size"], b["stride"], b["dtype"])
            self.tensors["peers_" + b["name"]] = pool.peer_views(b["offset"], b["numel"], b["dtype"])

    def current(self) -> "CommState":
        if any(shared_pools.gen(g, d) != self.gens[name] for name, (g, d, _) in self.pools_needed.items()):
            self.refresh()
        self.check(None)
        return self

    def check(self, kernel: str | None) -> None:
        """Raise the error of a barrier that gave up: after comm kernel `kernel` (CPU: the wrapper
        checks after each), or at a call's start (None: an earlier kernel, maybe of another graph)."""
        for pool in self.pools.values():
            err = pool.failure(lambda: self.where(kernel), kernel is None)  # the text only for an error
            if err is not None:
                raise err

    def where(self, kernel: str | None) -> tuple[str, str]:
        """(the comm kernel whose wait gave up, the graph about to run), for the error."""
        def kernel_text(k):
            return f"{k} (" + ", ".join(f"{c['collective']} {c['reduce_op']} at offset {c['offset']} of pool "
                                        f"{c['pool']}" for c in self.collectives.get(k, [])) + ")"
        graph = f"graph {self.graph_id} (comm kernels: {', '.join(map(kernel_text, self.collectives))})"
        if kernel is None:  # a GPU learns of a give-up a call or two late
            return f"a comm kernel that ran before this call of {graph}", graph
        return f"comm kernel {kernel_text(kernel)} of graph {self.graph_id}", graph

    def __getitem__(self, name):
        return self.tensors[name] if name in self.tensors else self.pools[name]


def comm_report() -> dict:
    """Pool bytes per process group and device, allocated so far in this process."""
    report = shared_pools.report()
    logging.getLogger("commfuse").info("commfuse: symmetric pools: %s", report)
    return report
