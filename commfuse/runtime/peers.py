"""What a rank knows of its peers while it waits for them: alive, exited, or late.

Each rank writes a header line into its symmetric pool's signal pad (after the barrier slots,
`symm.timeout_word`): the barrier timeout its kernels use, its pid and pid namespace, its state
(set by its exit handlers), and why its own barriers gave up. A comm kernel that waits reads its
peers' states (and, on a CPU, checks their pids); when it gives up it records why in its own
header and leaves the barrier; the host reads that and raises `PeerError`.
"""
from __future__ import annotations

import os
import socket
import time

# words of a rank's header line
H_TIMEOUT, H_PID, H_NS, H_STATE, H_FAIL, H_MISSING = range(6)
STATES = {1: "exited", 2: "raised an uncaught exception"}   # H_STATE, written by the rank's exit handlers
REASONS = {1: "timed out", 2: "peer gone"}                  # H_FAIL, written by its comm kernels
PID_CHECK_S = 0.2  # a waiting barrier looks at its peers' processes at most this often


class PeerError(RuntimeError):
    """A peer rank died, gave up, or did not arrive within the configured timeout (`late`)."""

    def __init__(self, message: str, ranks=(), late: bool = False):
        super().__init__(message)
        self.ranks, self.late = list(ranks), late


def pid_namespace() -> int:
    """This process's pid namespace (an inode), as an int32: a pid means the same process only there."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0x7FFFFFFF
    except OSError:
        return 1


def proc_id() -> str:
    return f"{socket.gethostname()}:{pid_namespace()}:{os.getpid()}"


def pid_gone(pid: int) -> bool:
    """The process is gone or a zombie (a dead child not yet reaped by its parent)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X", "x")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def proc_gone(ident: str | None) -> bool:
    """A `proc_id` of a peer is gone; False where its pid cannot be seen from here (another host)."""
    if not ident:
        return False
    host, ns, pid = ident.rsplit(":", 2)
    return host == socket.gethostname() and int(ns) == pid_namespace() and pid_gone(int(pid))


_last_check = [0.0, False]


def any_pid_gone(pids, namespaces) -> bool:
    """Whether any of these peers (pid 0: none) has exited; looked up every PID_CHECK_S at most, the
    result held in between. Called only while a barrier waits."""
    now = time.monotonic()
    if now - _last_check[0] >= PID_CHECK_S:
        own = pid_namespace()
        _last_check[:] = [now, any(pid_gone(int(p)) for p, ns in zip(pids, namespaces) if p > 0 and ns == own)]
    return _last_check[1]


def describe(rank: int, ranks: list, headers, group: str, global_rank) -> str:
    """Why rank `rank`'s barrier gave up and what each rank in `ranks` is now, from the headers
    (one int list per rank of the group)."""
    parts = []
    for r in ranks:
        h = headers[r]
        name = f"rank {global_rank(r)}" + (f" (rank {r} of group {group})" if global_rank(r) != r else "")
        if h[H_STATE] in STATES:
            parts.append(f"{name} {STATES[h[H_STATE]]}")
        elif h[H_PID] and h[H_NS] == pid_namespace() and pid_gone(h[H_PID]):
            parts.append(f"{name} is gone (pid {h[H_PID]} exited or was killed)")
        elif h[H_FAIL]:
            parts.append(f"{name} gave up waiting for rank(s) {missing_ranks(h, global_rank)}")
        else:
            parts.append(f"{name} did not arrive (still in other work: a long host step, code on that rank only, or "
                         "a graph it compiled for other input shapes or dtypes than this rank's: compare what each "
                         "rank passes to the compiled function)")
    return "; ".join(parts) or f"rank {global_rank(rank)} gave up"


def missing_ranks(header, global_rank=lambda r: r) -> list:
    return [global_rank(r) for r in range(31) if header[H_MISSING] >> r & 1]
