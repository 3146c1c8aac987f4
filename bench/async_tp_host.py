"""Host µs per call of async-TP's ops (commfuse/runtime/async_tp.py) and of each primitive they are
made of (the failure check, a barrier, copies, a side stream's fork and join, a matmul), launched
back to back, at a Llama-3-8B layer's sequence-parallel sizes (B=2, S=1024, H=4096); beside the
c10d collectives; then rank 0's cProfile of each op. GPUs only.

    torchrun --standalone --nproc-per-node 2 bench/async_tp_host.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401  (registers the ops)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from commfuse.runtime import async_tp as A  # noqa: E402
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
world, g = dist.get_world_size(), dist.group.WORLD.group_name
b, h, n, S = 2, 4096, 4096 // world, 1024
rows = b * S // world
shard = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
w = (torch.randn(n, h, device=dev, dtype=torch.bfloat16) / 64).t()
a = torch.randn(b * S, n, device=dev, dtype=torch.bfloat16)
wo = (torch.randn(h, n, device=dev, dtype=torch.bfloat16) / 64).t()
ops = torch.ops.commfuse_comm
pool = A._workspace(g, dev, world * rows * h * 2 * 2, None)
mine = pool.view(0, (rows, h), (h, 1), torch.bfloat16)
theirs = [v.view(rows, h) for v in pool.peer_views(0, rows * h, torch.bfloat16)]
gathered = torch.empty(world * rows, h, device=dev, dtype=torch.bfloat16)
chunks = gathered.view(world, rows, h)
out = torch.empty(world, rows, n, device=dev, dtype=torch.bfloat16)
side = A._side_stream(dev); cur = torch.cuda.current_stream(dev)
ev = torch.cuda.Event()
peer = 1 - rank
what = lambda: ("x", "y")
def side_copy():
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        chunks[peer].copy_(theirs[peer])
    cur.wait_stream(side)
def stream_ctx():
    with torch.cuda.stream(side):
        pass
raw_ag = getattr(A.all_gather_mm, "_init_fn", None)
raw_rs = getattr(A.mm_reduce_scatter, "_init_fn", None)
cases = {
    "empty loop": lambda: None,
    "pool.failure": lambda: pool.failure(what, True),
    "_workspace": lambda: A._workspace(g, dev, rows * h * 2, None),
    "barrier": lambda: A._barrier(pool, g),
    "local copy_ into pool": lambda: mine.copy_(shard),
    "peer copy_ (current stream)": lambda: chunks[peer].copy_(theirs[peer]),
    "peer copy_ on side stream, with waits": side_copy,
    "side.wait_stream(cur)": lambda: side.wait_stream(cur),
    "with torch.cuda.stream(side): pass": stream_ctx,
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "event record+wait": lambda: (ev.record(side), cur.wait_event(ev)),
    "mm out=": lambda: torch.mm(chunks[0], w, out=out[0]),
    "mm": lambda: torch.mm(chunks[0], w),
    "new_empty": lambda: shard.new_empty((world, rows, n)),
    "op all_gather_mm [w]": lambda: ops.all_gather_mm(shard, [w], g, world, None),
    "op all_gather_mm [w,w,w]": lambda: ops.all_gather_mm(shard, [w, w, w], g, world, None),
    "op mm_reduce_scatter": lambda: ops.mm_reduce_scatter([a], [wo], "sum", g, world, None),
    "c10d AG": lambda: torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(shard, world, g)),
    "c10d RS": lambda: torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(a, "sum", world, g)),
}
if raw_ag is not None:
    cases["raw fn all_gather_mm [w]"] = lambda: raw_ag(shard, [w], g, world, None)
    cases["raw fn mm_reduce_scatter"] = lambda: raw_rs([a], [wo], "sum", g, world, None)
def host(fn, n):
    for _ in range(3): fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t) / n * 1e6, (t2 - t) / n * 1e6
lines = []
for name, fn in cases.items():
    for n in (20, 200):
        hu, tot = host(fn, n)
        lines.append(f"{name:45s} n={n:4d} host {hu:8.1f} us/call  incl. sync {tot:8.1f} us/call")
if rank == 0:
    print("\n".join(lines), flush=True)
# cProfile of the ops, 50 calls each
import cProfile, io, pstats  # noqa: E402,E401
for name in ("op all_gather_mm [w,w,w]", "op mm_reduce_scatter"):
    torch.cuda.synchronize(); dist.barrier()
    p = cProfile.Profile(); p.enable()
    for _ in range(50): cases[name]()
    p.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(25)
    if rank == 0:
        print("== cProfile", name); print("\n".join(l[:170] for l in s.getvalue().splitlines()[4:40]), flush=True)
dist.barrier(); dist.destroy_process_group()
