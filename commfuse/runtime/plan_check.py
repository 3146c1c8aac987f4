"""Cross-rank check of comm-buffer plans, at the first call of each compiled graph.

Every rank publishes its plan under a per-group sequence number in the c10d store and reads the
others'. Plans are deterministic functions of the graph and config, so they must be equal; if a rank
compiled another graph (a rank-dependent branch) or another config, every rank raises an error that
names the graph and the first differing buffer. The graphs themselves may differ where the plans
agree: a rank-dependent constant (a vocabulary shard's offset) changes a graph, not its
collectives. A rank that never arrives (it took a branch with no collective) is reported after
`comm.plan_check_timeout_s`, instead of a hang in the pool rendezvous.
"""
from __future__ import annotations

import datetime
import json
import re

import torch.distributed as dist

from commfuse import config

_sequence: dict = {}


def _describe(buffers: list) -> list:
    """What the ranks must agree on for a comm buffer: its slice of the pool and its layout. Not its
    name: a rank that ran one more op before the collective numbers its buffers on from there."""
    return [[b["pool"], b["offset"], b["bytes"], str(b["dtype"]), list(b["size"]), list(b["stride"])] for b in buffers]


def _kernel(name: str) -> str:
    """A comm kernel's name without its schedule step (`cf_allreduce_pw_sum_3`: the ops fused
    with the collective, which the ranks must agree on; not where it falls in the schedule)."""
    return re.sub(r"_\d+$", "", name)


def check_plans_agree(graph_id: str, pools: dict, buffers: list, groups: dict, protocol: list = (),
                      timeout_s: float | None = None) -> None:
    """`groups`: the process group of each group name in `pools`. `protocol`: each comm kernel's
    [name, algorithm, programs, barriers] in launch order; ranks that differ there (another
    algorithm, grid or prologue, from a differing config or table) would wait at barriers the
    others never reach."""
    from torch.distributed.distributed_c10d import _get_default_store  # c10d internals: only when checking
    timeout_s = config.comm.plan_check_timeout_s if timeout_s is None else timeout_s  # the compile's option
    for group_name in sorted({g for g, _, _ in pools.values()}):
        # the ranks of a group compare that group's pools: a sub-group's name differs between the
        # ranks of WORLD ({0, 1} and {2, 3} of a 2-D mesh), rightly
        own = {k: [g, n] for k, (g, _d, n) in pools.items() if g == group_name}
        bufs = [b for b in buffers if b["pool"] in own]
        mine = json.dumps({"graph": graph_id.split("_", 1)[1], "pools": own,
                           "protocol": [[_kernel(p[0]), *p[1:]] for p in protocol], "buffers": _describe(bufs),
                           "names": {"buffers": [b["name"] for b in bufs], "kernels": [p[0] for p in protocol]}})
        ranks = dist.get_process_group_ranks(groups[group_name])
        seq = _sequence[group_name] = _sequence.get(group_name, 0) + 1
        store = _get_default_store()
        prefix = f"commfuse/plan/{group_name}/{seq}"
        me = dist.get_rank()
        store.set(f"{prefix}/{me}", mine)
        keys = [f"{prefix}/{r}" for r in ranks]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            raise RuntimeError(
                f"commfuse: rank(s) {missing} did not reach the comm-buffer plan check of graph {graph_id} "
                f"(group {group_name}, check #{seq}) within {timeout_s}s: the ranks "
                f"are running different programs (e.g. a rank-dependent branch)") from e
        for r in ranks:
            theirs = store.get(f"{prefix}/{r}").decode()
            if _collectives(theirs) != _collectives(mine):
                raise RuntimeError(f"commfuse: ranks disagree on the comm-buffer plan of graph {graph_id} "
                                   f"(group {group_name}): {_first_difference(me, mine, r, theirs)}. The ranks "
                                   "compiled different programs (e.g. a rank-dependent branch or config)")


def _collectives(plan: str) -> dict:
    return {k: v for k, v in json.loads(plan).items() if k not in ("graph", "names")}


def _first_difference(me: int, mine: str, other: int, theirs: str) -> str:
    a, b = json.loads(mine), json.loads(theirs)
    if a["graph"] != b["graph"]:  # named with what differs in their collectives
        me, other = f"{me} (graph {a['graph']})", f"{other} (graph {b['graph']})"
    for x, y, nx, ny in zip(a["buffers"], b["buffers"], a["names"]["buffers"], b["names"]["buffers"]):
        if x != y:
            return f"first differing buffer {nx}: rank {me} has {x}, rank {other} has {y} ({ny})"
    if len(a["buffers"]) != len(b["buffers"]):
        return f"rank {me} has {len(a['buffers'])} comm buffers, rank {other} has {len(b['buffers'])}"
    fields = ("algorithm", "programs", "barriers")
    for x, y, nx, ny in zip(a["protocol"], b["protocol"], a["names"]["kernels"], b["names"]["kernels"]):
        if x != y:
            return (f"comm kernel {nx}: rank {me} runs {dict(zip(fields, x[1:]))}, "
                    f"rank {other} runs {dict(zip(fields, y[1:]))} ({ny})")
    if len(a["protocol"]) != len(b["protocol"]):
        return f"rank {me} runs {len(a['protocol'])} comm kernels, rank {other} runs {len(b['protocol'])}"
    return f"pools differ: rank {me} {a['pools']}, rank {other} {b['pools']}"
