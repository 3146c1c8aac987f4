"""Memory planning shared by ordinary and comm buffers."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Interval:
    name: str
    nbytes: int
    start: int   # first step the buffer is live (its producer)
    end: int     # last step it is read


def pack_intervals(items: list[Interval], align: int) -> tuple[dict[str, int], int]:
    """Offsets for buffers so that two never live at the same time may share bytes.

    Largest first, each into the lowest gap that fits among the buffers already placed whose
    live ranges overlap it (best fit on address order). Deterministic: the same items give the
    same plan on every rank. Returns ({name: offset}, total bytes)."""
    def up(n):
        return -(-n // align) * align
    placed: list[tuple[int, int, Interval]] = []
    offsets = {}
    for it in sorted(items, key=lambda i: (-i.nbytes, i.start, i.name)):
        size = up(max(it.nbytes, 1))
        busy = sorted((o, o + up(p.nbytes)) for o, _, p in placed if p.start <= it.end and it.start <= p.end)
        best, cursor, best_gap = None, 0, None
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offset = best if best is not None else cursor
        placed.append((offset, size, it))
        offsets[it.name] = offset
    total = max((o + s for o, s, _ in placed), default=0)
    return offsets, total
