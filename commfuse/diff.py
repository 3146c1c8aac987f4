"""Compare every rank's dumps: `python -m commfuse.diff DUMP_DIR`.

Per graph (graphs pair by their place in compile order: `g003_backward`), each rank against rank 0:
the same graph, the same comm plans, the same generated code. A difference is told in the plan's
words (which collective, which buffer, which pool offset), or as the first differing line of the
graph and of the kernel around it. Graphs that differ only in constants (a vocabulary shard's
offset) compile the same plans and are reported, but pass, as the ranks' plan check passes them;
`--strict` fails them too, and code that differs only in constants (the rank number). Exit status: 0 the ranks agree, 1 they differ, 2 usage error.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

PLAN_KEYS = ("collective", "reduce_op", "group", "world", "algorithm", "inplace", "copy_in")
PLACE_KEYS = ("pool", "offset", "bytes")
_NUMBER = re.compile(r"\d+(\.\d+)?(e-?\d+)?")  # names' counters too (as_strided_34): FX numbers them per process


def _shape(text: str) -> str:
    """A graph, or generated code, with its constants out, its shapes (FX's quoted annotations) kept."""
    return "\"".join(part if i % 2 else _NUMBER.sub("#", part) for i, part in enumerate(text.split('"')))


def load(dump_dir: str) -> dict:
    """{rank: {graph key: (graph id, {file: text}, summary)}}."""
    ranks = {}
    for name in os.listdir(dump_dir):
        if re.fullmatch(r"rank\d+", name) and os.path.isdir(os.path.join(dump_dir, name)):
            graphs = ranks[int(name[4:])] = {}
            for gid in sorted(os.listdir(os.path.join(dump_dir, name))):
                folder = os.path.join(dump_dir, name, gid)
                files = {f: open(os.path.join(folder, f)).read() for f in ("fx_graph.txt", "output_code.py")
                         if os.path.exists(os.path.join(folder, f))}
                path = os.path.join(folder, "summary.json")
                summary = json.load(open(path)) if os.path.exists(path) else {}
                graphs["_".join(gid.split("_")[:2])] = (gid, files, summary)
    return dict(sorted(ranks.items()))


def first_difference(a: str, b: str, comments: bool = True) -> tuple | None:
    """(line number in a, line of a, line of b) where two texts first differ, or None; without
    `comments`, lines that are comments alone (FX's source locations) are not compared."""
    la, lb = ([(i + 1, t) for i, t in enumerate(x.splitlines()) if comments or not t.strip().startswith("#")]
              for x in (a, b))
    ops = difflib.SequenceMatcher(None, [t for _, t in la], [t for _, t in lb], autojunk=False).get_opcodes()
    for tag, i, _, j, _ in ops:
        if tag != "equal":
            return (la[i][0] if i < len(la) else len(la) + 1, la[i][1] if i < len(la) else "(end)",
                    lb[j][1] if j < len(lb) else "(end)", lb[j][0] if j < len(lb) else 0)
    return None


def _source(fx: str, line: int) -> str:
    """The user's source line FX noted above a graph line (`# File: ...`), if any."""
    for text in reversed(fx.splitlines()[:line - 1]):
        if "# File: " in text:
            return " (from " + text.split("# File: ", 1)[1].strip() + ")"
        if not text.strip():
            break
    return ""


def _plan(p: dict, places: dict) -> str:
    where = places.get(p.get("buffer"))
    at = f"buffer {p['buffer']} at {where['pool']} [{where['offset']}, +{where['bytes']})" if where else \
        f"buffer {p.get('buffer')} (no comm buffer: {p.get('reason')})"
    return f"{p['collective']} {p['algorithm']}, {at}"


def plan_difference(a: dict, b: dict, rank: int) -> str | None:
    """The first difference of two summaries' comm plans, in the plan's words."""
    pa, pb = a.get("comm_plans", []), b.get("comm_plans", [])
    placed_a, placed_b = ({x["name"]: x for x in s.get("comm_buffers", [])} for s in (a, b))
    for i, (x, y) in enumerate(zip(pa, pb)):
        what = f"collective #{i} ({x['collective']} {x['reduce_op']} over group {x['group']})".replace("  ", " ")
        fields = [k for k in PLAN_KEYS if x.get(k) != y.get(k)]
        wx, wy = placed_a.get(x.get("buffer"), {}), placed_b.get(y.get("buffer"), {})
        fields += [k for k in PLACE_KEYS if wx.get(k) != wy.get(k)]
        if fields:
            return (f"{what} differs in {', '.join(fields)}: rank 0: {_plan(x, placed_a)}; "
                    f"rank {rank}: {_plan(y, placed_b)}"
                    + (f" (why: rank 0 {x['reason']!r}, rank {rank} {y['reason']!r})" if "algorithm" in fields else ""))
    if len(pa) != len(pb):
        extra, who = (pa, 0) if len(pa) > len(pb) else (pb, rank)
        p = extra[min(len(pa), len(pb))]
        return (f"rank 0 has {len(pa)} collectives, rank {rank} {len(pb)}: the first extra one, on rank {who}, "
                f"is {p['collective']} {p['reduce_op']} over group {p['group']}")
    return None


def _kernel_at(code: str, line: int) -> str:
    """The kernel, the wrapper's `call`, or the module-level name a line of generated code is in."""
    for text in reversed(code.splitlines()[:line]):
        if re.match(r"(def |async def )?\w+ ?[(=]", text):
            return re.sub(r"^(async )?def ", "", text).split("(")[0].split(" =")[0]
    return "the module's header"


def compare(ranks: dict, strict: bool = False) -> tuple[list, bool]:
    """(report lines, whether the ranks differ)."""
    lines, differ = [], False
    base, keys = ranks[min(ranks)], sorted({k for graphs in ranks.values() for k in graphs})
    for key in keys:
        lines.append(f"{key}:")
        for rank, graphs in ranks.items():
            if rank == min(ranks):
                continue
            if key not in graphs or key not in base:
                lines.append(f"  rank {rank}: {'no such graph' if key not in graphs else 'a graph rank 0 did not compile'}")
                differ = True
                continue
            (gid_a, fa, sa), (gid_b, fb, sb) = base[key], graphs[key]
            out, constants_only = [], True  # where the graph differs, it differs in constants only
            fx_a, fx_b = fa.get("fx_graph.txt", ""), fb.get("fx_graph.txt", "")
            graph = first_difference(fx_a, fx_b, comments=False)
            if graph:
                constants_only = _shape(fx_a) == _shape(fx_b)
                out.append(f"graph differs{' in constants only' if constants_only else ''}, first at line {graph[0]}:\n"
                           f"      rank 0: {graph[1].strip()}{_source(fx_a, graph[0])}\n"
                           f"      rank {rank}: {graph[2].strip()}{_source(fx_b, graph[3])}")
            plans = plan_difference(sa, sb, rank)
            if plans:
                out.append(f"plans differ: {plans}")
            code_a, code_b = (c.get("output_code.py", "").replace(g, "<graph>") for c, g in ((fa, gid_a), (fb, gid_b)))
            code = first_difference(code_a, code_b)
            rank_only = code is not None and not graph and _shape(code_a) == _shape(code_b)  # the rank, a comm kernel's argument
            if code and (strict or not rank_only):
                out.append(f"code differs{' in constants only' if _shape(code_a) == _shape(code_b) else ''}, first in "
                           f"{_kernel_at(code_a, code[0])} (line {code[0]}):\n"
                           f"      rank 0: {code[1].strip()}\n      rank {rank}: {code[2].strip()}")
            if sa.get("compiled", True) != sb.get("compiled", True):
                out.append(f"compiled by commfuse on rank 0: {sa.get('compiled', True)}, on rank {rank}: {sb.get('compiled', True)}")
            # code that differs where the graphs do not is a disagreement; where they differ in
            # constants, the code follows them
            differ |= bool(out) and (strict or plans is not None or not constants_only or (code and not graph))
            same = f"same graph, same {len(sa.get('comm_plans', []))} plan(s), same code" + (" up to the rank" if rank_only else "")
            lines += [f"  rank {rank}: " + o for o in out] or [f"  rank {rank}: {same}"]
    return lines, differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commfuse.diff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_dir", help="the COMMFUSE_DUMP_DIR of a run (holds rank0/, rank1/, ...)")
    ap.add_argument("--strict", action="store_true", help="graphs that differ in constants only differ too")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    ranks = load(args.dump_dir) if os.path.isdir(args.dump_dir) else {}
    if len(ranks) < 2:
        print(f"commfuse.diff: {args.dump_dir} holds {len(ranks)} rank folder(s) (rank0/, rank1/, ...); "
              "need two or more: run with COMMFUSE_DUMP_DIR set on every rank", file=sys.stderr)
        return 2
    lines, differ = compare(ranks, args.strict)
    print("\n".join(lines))
    graphs = len({k for g in ranks.values() for k in g})
    print(f"{'ranks differ' if differ else 'ranks agree'}: {len(ranks)} ranks, {graphs} graph(s)")
    return int(differ)


if __name__ == "__main__":
    sys.exit(main())
