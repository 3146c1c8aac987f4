"""Cross-rank check of comm-buffer plans, at the first call of each compiled graph.

Every rank publishes its plan under a per-group sequence number in the c10d store and reads the
others'. Plans are deterministic functions of the graph and config, so they must be equal; if a rank
compiled another graph (a rank-dependent branch) or another config, every rank raises an error that
names the graph and what differs. The graphs themselves may differ where the plans
agree: a rank-dependent constant (a vocabulary shard's offset) changes a graph, not its
collectives. A rank that never arrives (it took a branch with no collective) is reported after
`comm.plan_check_timeout_s`, instead of a hang in the pool rendezvous.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import weakref

import torch
import torch.distributed as dist

from commfuse import config

from .peers import PeerError, proc_gone, proc_id

# per c10d default store, so per init_process_group (a process that destroys its group and inits
# anew starts over): each group's check count, the plans every rank of a group checked, and whether
# this process announced itself there
_by_store: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PlansSplit(RuntimeError):
    """The ranks' first graphs with comm kernels hold the same collectives in the same order, but
    cut in different places: a graph break on some ranks only (a print or log under `if rank == 0`).
    Each graph plans its comm buffers alone, so the kernels would read the peers' other buffers:
    every rank lowers its graphs on the group again with c10d's collectives, which meet in order."""

    def __init__(self, message: str, group: str, found: bool = False):
        super().__init__(message)
        self.group, self.found = group, found  # found at this check (said once), or before


def _state(store) -> dict:
    return _by_store.setdefault(store, {"sequence": {}, "agreed": {}, "announced": False, "split": {}})


def split_groups() -> dict:
    """The groups whose ranks' plans split (PlansSplit), of this process group's life, each with
    why: their collectives run through c10d."""
    from torch.distributed.distributed_c10d import _get_default_store
    try:
        return _state(_get_default_store())["split"] if dist.is_available() and dist.is_initialized() else {}
    except (RuntimeError, ValueError):  # a group made without a default store: none is checked
        return {}

# what a rank's comm kernel does beside its peers' without changing what they exchange: its own
# input written by a producer fused in (program i writes the slice program i of every rank reads:
# the blocks and programs, still compared, say which)
_OWN = ("prologue",)

# what a comm kernel's fields (codegen/wrapper.py: note_comm_kernel) mean, and which options set
# them, for the error; the rest are its shape (blocks, elements)
_FIELDS = {
    "kernel": "kernel (c10d's collective, or commfuse's)",
    "collective": "collective",
    "reduce_op": "reduce op",
    "algorithm": "algorithm (comm.algorithm, comm.table, comm.*_max_bytes)",
    "group": "process group",
    "ranks": "ranks in the group",
    "pool": "pool",
    "offset": "offset in the pool",
    "reads": "how it reads its peers (comm.algorithm, comm.table)",
    "prologue": "input's producer fused in (fusion options; comm.algorithm one_shot_apart)",
    "programs": "programs (comm.max_programs, comm.block)",
    "barriers": "barriers",
    "xnumel": "elements (rows of a reduction) it walks",
    "rnumel": "row length",
    "elements": "elements of a c10d collective (a bucket of several, a sum of several)",
}


def _describe(buffers: list) -> list:
    """What the ranks must agree on for a comm buffer: its slice of the pool and its layout. Not its
    name: a rank that ran one more op before the collective numbers its buffers on from there. Not
    the view of a dense buffer either: its elements are in one order whatever its shape (an uneven
    DTensor shard padded to [2, 6, 8] on one rank, a matmul's [12, 8] on another)."""
    return [{"pool": b["pool"], "offset": b["offset"], "bytes": b["bytes"], "dtype": str(b["dtype"]),
             **({"layout": "dense"} if _dense(b["size"], b["stride"]) else
                {"size": list(b["size"]), "stride": list(b["stride"])})} for b in buffers]


def _dense(size, stride) -> bool:
    """Row-major and gap-free (dims of one element aside, whatever their stride)."""
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _protocol(protocol: list, group_name: str) -> list:
    """The comm kernels as the ranks of `group_name` must agree on them: names without their
    schedule step (`cf_allreduce_pw_sum_3`: the ops fused, not where they fall), and other groups
    unnamed (a 2-D mesh's sub-groups are named differently on different ranks, rightly)."""
    return [dict({k: v for k, v in p.items() if k not in _OWN}, kernel=_wire(p["kernel"]),
                 collectives=[dict(c, group=c["group"] if c["group"] == group_name else "another group")
                              for c in p["collectives"]])
            for p in protocol]


def _wire(kernel: str) -> str:
    """A kernel's name as far as its peers care: a c10d collective's op, or that it is ours (which
    ops it fuses is this rank's business: a bias added on one rank only, before the all-reduce)."""
    return re.sub(r"_\d+$", "", kernel) if kernel.startswith("c10d_") else "commfuse"


def announce() -> None:
    """Tell the peers once where this process is, at its first compile: a peer waiting at a plan
    check for a rank that exits without reaching one (its branch had no collective) sees it gone at
    once, not after the timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _get_default_store
    try:
        store = _get_default_store()
        if not _state(store)["announced"]:
            store.set(f"commfuse/proc/{dist.get_rank()}", proc_id())
            # an object (choices) by its type, not its address
            options = {k: re.sub(r" at 0x[0-9a-f]+", "", repr(v)) for k, v in config.snapshot().items() if k not in config.WITHOUT_EFFECT_ON_CODE}
            store.set(f"commfuse/options/{dist.get_rank()}", json.dumps(options))
            _state(store)["options"] = options
    except (RuntimeError, ValueError):  # no default store (a group made without one): the checks set it
        return
    _state(store)["announced"] = True


def _note_eager_frames() -> None:
    """Dynamo's warning that this rank hit its recompile limit on a frame (an MoE's rank-local token
    counts), which it then runs eagerly: its c10d collectives cannot meet the comm kernels its peers
    still run there. Kept in the store for a peer's wait that gives up (`eager_frames`)."""
    def note(record) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("torch._dynamo hit config.") and len(args) >= 3:  # (limit, value, frame)
            with contextlib.suppress(Exception):  # (no process group now)
                from torch.distributed.distributed_c10d import _get_default_store
                what = f"runs {args[2]} eagerly since it hit torch._dynamo.config.{args[0]} ({args[1]}) there"
                _get_default_store().set(f"commfuse/eager/{dist.get_rank()}", what)
        return True
    logging.getLogger("torch._dynamo.convert_frame").addFilter(note)


_note_eager_frames()


def eager_frames(ranks: list) -> str:
    """What a wait that gave up adds for the peers among `ranks` (global) that run a frame eagerly."""
    from torch.distributed.distributed_c10d import _get_default_store
    try:
        store = _get_default_store()
        notes = [f"rank {r} {store.get(f'commfuse/eager/{r}').decode()}" for r in ranks
                 if store.check([f"commfuse/eager/{r}"])]
    except Exception:  # no store, or it is gone
        return ""
    return "".join(f". {n}" for n in notes) + (
        ": collectives in it go through c10d, which cannot meet this rank's comm kernels. Raise that limit, "
        "mark the sizes that vary dynamic (torch._dynamo.mark_dynamic), or set comm.enabled=False" if notes else "")


def _options_differ(store, ranks: list) -> str:
    """What a timeout's message adds where a missing rank announced other options than this one's
    (a collective that one rank's config sends to c10d has no plan there to check)."""
    mine, notes = _state(store).get("options") or {}, []
    for r in ranks:
        theirs = json.loads(store.get(f"commfuse/options/{r}")) if store.check([f"commfuse/options/{r}"]) else mine
        diff = [f"{k} = {theirs.get(k)} there, {mine.get(k)} here" for k in sorted({*mine, *theirs})
                if mine.get(k) != theirs.get(k)]
        notes += [f"rank {r}'s commfuse options differ from this rank's: {'; '.join(diff)}"] if diff else []
    return "".join(f". {n}" for n in notes) + (" (an option set on some ranks only)" if notes else "")


def check_plans_agree(graph_id: str, pools: dict, buffers: list, groups: dict, protocol: list = (),
                      program: list = (), timeout_s: float | None = None, at_break: bool | None = None) -> None:
    """`groups`: the process group of each group checked (its pools', or its c10d collectives'). `protocol`: each comm
    kernel's and c10d collective's record in the wrapper's order (its collectives, algorithm, grid,
    barriers); ranks that differ there (another reduce op, algorithm, grid or prologue, another
    order of collectives) would combine different things, or wait at barriers and collectives the
    others never reach. `program`: the collectives the program itself issues (fx_rewrite.
    program_collectives). `at_break`: whether Dynamo ended this graph at a graph break (None: not
    known). Where the programs issue the same collectives (or cut apart), the plans may still differ
    by what each rank compiled alone (a consumer fused on one rank only, a sum or bucket of
    collectives, an option set on one rank): the group then runs c10d's, as issued (PlansSplit).
    Programs that differ are an error."""
    from torch.distributed.distributed_c10d import _get_default_store  # c10d internals: only when checking
    for group_name in sorted(groups):  # (a group without a pool: its c10d collectives, which a rewrite changed)
        # the ranks of a group compare that group's pools: a sub-group's name differs between the
        # ranks of WORLD ({0, 1} and {2, 3} of a 2-D mesh), rightly
        own = {k: [g, n] for k, (g, _d, n) in pools.items() if g == group_name}
        bufs = [b for b in buffers if b["pool"] in own]
        # the kernels with a collective on it: another group's are its own ranks' business (on a
        # 2-D mesh a tp all-reduce's size may differ between dp peers, each sequence its own length)
        kernels = [p for p in protocol if any(c["group"] == group_name for c in p["collectives"])]
        mine = json.dumps({"graph": graph_id.split("_", 1)[1], "pools": own,
                           "protocol": _protocol(kernels, group_name), "buffers": _describe(bufs),
                           "program": [c for c in program if c[2] == group_name], "break": at_break,
                           "names": {"buffers": [b["name"] for b in bufs], "protocol": [p["kernel"] for p in kernels]}})
        if group_name in split_groups():  # found at an earlier check on every rank: no meeting
            raise PlansSplit(f"commfuse: graph {graph_id}: the ranks of group {group_name} cut their graphs apart",
                             group_name)
        agreed = _state(_get_default_store())["agreed"].setdefault(group_name, set())
        wire, me = _collectives(mine), dist.get_rank()
        if wire in agreed:  # every rank of the group checked this plan already: a graph compiled
            continue  # again on this rank alone (its last batch shorter) runs it as the peers do
        try:
            plans = meet(groups[group_name], f"the comm-buffer plan check of graph {graph_id}", mine, timeout_s, "plan")
        except PeerError as late:
            if not late.late or not any(_part_of(_sequence(mine), _sequence(w)) for w in agreed):
                raise
            raise PeerError(
                f"{late}. This graph holds part of the collectives of a graph the ranks of group {group_name} "
                "agreed on earlier: it was cut apart on this rank after the first calls, and the peers still run "
                "it whole (a graph break on some ranks at some steps only, such as a log under `if rank == 0 "
                "and step % 100 == 0`). Move that code out of the compiled function, or make it the same on "
                "every rank", late.ranks) from None
        other = next((r for r, theirs in plans.items() if _collectives(theirs) != wire), None)
        if other is None:
            agreed.add(wire)
            continue
        programs = [json.loads(p)["program"] for p in plans.values()]
        if _cut_apart([json.loads(p) for p in plans.values()]):
            split_groups()[group_name] = f"the ranks of group {group_name} cut their graphs in different places"
            counts = ", ".join(f"{len(p)} on rank {r}" for r, p in zip(plans, programs))
            raise PlansSplit(
                f"commfuse: the ranks of group {group_name} cut their graphs in different places (collectives in "
                f"graph {graph_id} and its peers': {counts}; the fewer are the first of the most, in order): a graph break "
                "on some ranks only, such as a print or log under `if rank == 0`. Their collectives on this "
                "group run through c10d from now on, which meets in order whatever the graphs; move the "
                "rank-dependent code out of the compiled function to keep commfuse's comm kernels", group_name, True)
        if all(p == programs[0] for p in programs):
            why = (f"the ranks of group {group_name} compiled different comm kernels for the same collectives: "
                   f"{_first_difference(me, mine, other, plans[other])}{_options_differ(_get_default_store(), [other])}")
            split_groups()[group_name] = why
            raise PlansSplit(
                f"commfuse: graph {graph_id}: {why}. Code that differs between the ranks around a "
                "collective (a value only one rank logs or reduces further), or an option set on some ranks only. "
                "Their collectives on this group run through c10d from now on, as the program issues them; make "
                "that code the same on every rank to keep commfuse's comm kernels", group_name, True)
        for r, theirs in plans.items():
            if _collectives(theirs) != wire:
                raise RuntimeError(f"commfuse: ranks disagree on the comm-buffer plan of graph {graph_id} "
                                   f"(group {group_name}): {_first_difference(me, mine, r, theirs)}. The ranks "
                                   "compiled different programs: a rank-dependent branch, or a config (options=, "
                                   "config.patch, COMMFUSE_* environment) or comm.table set on some ranks only; "
                                   "the ranks' dumps (dump_dir) show both, and `python -m commfuse.diff DUMP_DIR` "
                                   "compares them")


def meet(group, what: str, value: str = "", timeout_s: float | None = None, kind: str = "pool") -> dict:
    """The ranks of `group` meet through the c10d store (a plan check, a step of a symmetric pool's
    creation): each posts `value` and gets every rank's, {global rank: value}. A rank gone ends the
    wait at once, one missing past `timeout_s` is named (a c10d barrier would wait out the group's
    timeout, then fail naming no rank). Meetings of a `kind` are numbered per group, in call order."""
    from torch.distributed.distributed_c10d import _get_default_store
    store, name = _get_default_store(), group.group_name
    count = _state(store)["sequence"].setdefault(kind, {})
    seq = count[name] = count.get(name, 0) + 1
    prefix, ranks = f"commfuse/{kind}/{name}/{seq}", dist.get_process_group_ranks(group)
    announce()  # where the peers find this process, to see it gone
    store.set(f"{prefix}/{dist.get_rank()}", value)
    _wait(store, prefix, ranks, peer_wait_s(config.comm.plan_check_timeout_s if timeout_s is None else timeout_s, group),
          f"{what} (group {name}, {kind} #{seq})")
    return {r: store.get(f"{prefix}/{r}").decode() for r in ranks}


# c10d's default timeouts (30 min; NCCL's 10): a program that kept them said nothing of how long its
# ranks may be apart, and that long a stuck peer would go unnamed
_C10D_DEFAULTS = (dist.default_pg_timeout, getattr(getattr(dist, "constants", None), "default_pg_nccl_timeout", None))
PEER_WAIT_DEFAULT_S = 60.0


def peer_wait_s(seconds: float | None, group, device=None) -> float:
    """How long a rank waits for a live peer (comm.plan_check_timeout_s, comm.barrier_timeout_s):
    `seconds`; None: the group's timeout where the program gave one (init_process_group or
    new_group with timeout=, for a rank's long work alone: evaluation, checkpoints), else 60 s."""
    if seconds is not None:
        return seconds
    for kind in [torch.device(device).type] if device is not None else ["cuda", "cpu"]:
        try:  # c10d keeps a group's timeout in its backend's options (a backend per device type)
            timeout = group._get_backend(torch.device(kind)).options._timeout
        except (AttributeError, RuntimeError):
            continue
        return PEER_WAIT_DEFAULT_S if timeout in _C10D_DEFAULTS else timeout.total_seconds()
    return PEER_WAIT_DEFAULT_S


def _wait(store, prefix: str, ranks: list, timeout_s: float, what: str) -> None:
    """Every rank's key under `prefix`, in `timeout_s`; a rank whose process is gone (on this host)
    or a store gone (it lived in a rank that exited) ends the wait at once."""
    end, keys, pause = time.monotonic() + timeout_s, [f"{prefix}/{r}" for r in ranks], 0.001
    while True:  # polled with check(), not wait(): a wait that times out logs a c10d warning each time
        try:
            if store.check(keys):
                return
            missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            gone = [r for r in missing if store.check([f"commfuse/proc/{r}"])
                    and proc_gone(store.get(f"commfuse/proc/{r}").decode())]
        except Exception as lost:  # the store's host (rank 0, or the launcher) is gone
            raise PeerError(f"commfuse: the c10d store is gone while waiting at {what} ({lost}): the rank "
                            "or launcher that hosted it exited", [0]) from lost
        if gone:
            raise PeerError(f"commfuse: rank(s) {gone} exited before reaching {what}", gone)
        if time.monotonic() > end:
            raise PeerError(
                f"commfuse: rank(s) {missing} did not reach {what} within {timeout_s}s (comm.plan_check_timeout_s): "
                "the ranks are running different programs (e.g. a rank-dependent branch), a rank runs these "
                "collectives through c10d (its graph has dynamic sizes there: mark_dynamic, or automatic dynamic "
                "shapes after other sizes on that rank only; Dynamo skipped the frame there; another backend), "
                f"or a rank hangs{_options_differ(store, missing)}{eager_frames(missing)}", missing, late=True)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _sequence(plan: str) -> list:
    """A plan's collectives in order, as what they do (not where their buffers are)."""
    return [[c["collective"], c["reduce_op"], c["group"]] for p in json.loads(plan)["protocol"] for c in p["collectives"]]


def _cut_apart(plans: list) -> bool:
    """Whether the ranks' programs issue different numbers of collectives, each the start of the
    longest, and each shorter one's graph ended at a graph break (or may have). A rank whose graph
    ended where its frame returns issued fewer collectives: a program of its own."""
    longest = max((p["program"] for p in plans), key=len)
    return any(len(p["program"]) < len(longest) for p in plans) and all(
        p["program"] == longest[:len(p["program"])] and (len(p["program"]) == len(longest) or p.get("break") is not False)
        for p in plans)


def _part_of(part: list, whole: list) -> bool:
    """Whether `part` is a run of consecutive collectives of `whole`, and shorter."""
    return 0 < len(part) < len(whole) and any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def _collectives(plan: str) -> str:
    """What the ranks must agree on in a plan (not the graph's name or its buffers' names), canonical."""
    return json.dumps({k: v for k, v in json.loads(plan).items() if k not in ("graph", "names", "break")}, sort_keys=True)


def _first_difference(me: int, mine: str, other: int, theirs: str) -> str:
    a, b = json.loads(mine), json.loads(theirs)
    graphs = f"rank {me} compiled graph {a['graph']}, rank {other} {b['graph']}; " if a["graph"] != b["graph"] else ""
    return graphs + _difference(me, a, other, b)


def _difference(me: int, a: dict, other: int, b: dict) -> str:
    for part, label, fields in (("buffers", "comm buffer", dict), ("protocol", "comm kernel", _fields)):
        for i, (x, y) in enumerate(zip(a[part], b[part])):
            if x != y:
                x, y = fields(x), fields(y)
                diff = "; ".join(f"{f}: {x.get(f)!r} on rank {me}, {y.get(f)!r} on rank {other}"
                                 for f in dict.fromkeys([*x, *y]) if x.get(f) != y.get(f))
                return (f"{label} #{i} ({a['names'][part][i]} on rank {me}, {b['names'][part][i]} on rank {other}) "
                        f"differs in {diff}")
        if len(a[part]) != len(b[part]):
            return f"rank {me} has {len(a[part])} {label}s, rank {other} has {len(b[part])}"
    if a.get("program") != b.get("program"):  # (op, reduce op, group, elements, dtype) as the program issues them
        return f"the program's collectives differ: {a.get('program')} on rank {me}, {b.get('program')} on rank {other}"
    return f"pools differ: rank {me} {a['pools']}, rank {other} {b['pools']}"


def _fields(kernel: dict) -> dict:
    """A comm kernel's record, flat and labelled for the error: {"reduce op": "sum", ...}."""
    out = {}
    for key, value in kernel.items():
        if key != "collectives":
            out[_FIELDS.get(key, key)] = value
            continue
        for j, c in enumerate(value):
            of = f" of collective #{j}" if len(value) > 1 else ""
            out.update({f"{_FIELDS[f]}{of}": v for f, v in c.items()})
    return out
