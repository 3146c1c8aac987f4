"""Can a Triton kernel beat cuBLAS on decode-sized bf16 matmuls, and by how much once SiLU is fused
into its epilogue? A single-GPU diagnostic, not a test.

    python tools/skinny_mm_probe.py --out DIR         # one GPU; writes DIR/skinny_mm.md and .json
    TRITON_INTERPRET=1 python tools/skinny_mm_probe.py --check-cpu   # values on tiny shapes, CPU

out = act(A[M, K] @ B[K, N]). Each program streams a [K / SPLIT_K, BLOCK_N] slab of B; with
SPLIT_K > 1 partial sums are atomically added to an fp32 workspace, and the last program to arrive
on an N block (a counter per block) applies the activation and zeroes workspace and counter for
the next call. DOT=False swaps tl.dot for FMAs (tried for M <= 8). Timing cycles over three copies
of B so that the 58.7 MB weight comes from HBM, not from the 50 MB L2."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import cycle, product
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

if "--check-cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton's @jit runs, so before any import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = [(8, 4096, 7168), (8, 7168, 4096), (1, 4096, 7168), (1, 7168, 4096), (16, 4096, 7168),
          (32, 7168, 4096)]


@triton.jit
def _epilogue(o_ptrs, x, mask, ACT: tl.constexpr):
    if ACT == 1:
        x = x * tl.sigmoid(x)
    tl.store(o_ptrs, x.to(o_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def skinny_mm(a, b, out, ws, lock, M, N, K, stride_am, stride_bk, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT_K: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # this program's share of K
    rk = pid_k * k_len + tl.arange(0, BLOCK_K)
    a_ptrs = a + rm[:, None] * stride_am + rk[None, :]
    b_ptrs = b + rk[:, None] * stride_bk + rn[None, :]
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN:
            at = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
            bt = tl.load(b_ptrs)
        else:
            at = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
            bt = tl.load(b_ptrs, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        if DOT:
            acc = tl.dot(at, bt, acc)
        else:
            acc += at.to(tl.float32)[:, :, None] * bt.to(tl.float32)[None, :, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if not DOT:
        acc = tl.sum(acc, axis=1)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    o_ptrs = out + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        _epilogue(o_ptrs, acc, mask, ACT)
    else:
        w_ptrs = ws + rm[:, None] * N + rn[None, :]
        tl.atomic_add(w_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums before the (release) count
        arrived = tl.atomic_add(lock + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # last one in: all partial sums are in ws
            tl.debug_barrier()
            total = tl.atomic_add(w_ptrs, tl.zeros_like(acc), mask=mask)  # read it at L2
            total = tl.where(mask, total, 0.0)  # masked lanes return garbage
            tl.store(w_ptrs, tl.zeros_like(acc), mask=mask)  # and zero it for the next call
            _epilogue(o_ptrs, total, mask, ACT)
            tl.atomic_xchg(lock + pid_n, 0)


def block_m(cfg, M):
    return max(16, triton.next_power_of_2(M)) if cfg["dot"] else triton.next_power_of_2(M)


def kernel_args(cfg, M, N, K, act):
    """Everything but the five pointers, and the grid."""
    bn, bk, sk = cfg["bn"], cfg["bk"], cfg["sk"]
    consts = dict(BLOCK_M=block_m(cfg, M), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, ACT=act,
                  DOT=cfg["dot"], EVEN=N % bn == 0 and K % (bk * sk) == 0,
                  num_warps=cfg["warps"], num_stages=cfg["stages"])
    return (M, N, K, K, N, N), consts, (triton.cdiv(N, bn), sk)


def make_launch(a, bs, out, cfg, act):
    M, K = a.shape
    N = bs[0].shape[1]
    ws = torch.zeros(M, N, device=a.device, dtype=torch.float32)  # the kernel leaves it zeroed
    lock = torch.zeros(triton.cdiv(N, cfg["bn"]), device=a.device, dtype=torch.int32)
    ints, consts, grid = kernel_args(cfg, M, N, K, act)
    nxt = cycle(bs).__next__  # the copies of B in turn, each baked into the captured graph
    return lambda: skinny_mm[grid](a, nxt(), out, ws, lock, *ints, **consts)


def check(a, b, cfg, act, calls=2):
    """Values of `calls` successive launches (the second shows the workspace was reset)."""
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
    launch = make_launch(a, [b], out, cfg, act)
    ref = a.float() @ b.float()
    ref = F.silu(ref) if act else ref
    for _ in range(calls):
        out.fill_(float("nan"))
        launch()
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def cfg_name(c):
    return f"{'dot' if c['dot'] else 'fma'} BN{c['bn']} BK{c['bk']} SK{c['sk']} w{c['warps']} s{c['stages']}"


def smem_ok(c, M, smem):
    return not c["dot"] or c["stages"] * (block_m(c, M) * c["bk"] + c["bk"] * c["bn"]) * 2 <= smem


def tile_grid(M, N, K, sms, smem):
    """Stage 1: tile shapes and split-K at 4 warps, 3 stages, pruned by CTA count, K steps,
    shared memory (tl.dot) and registers (FMA accumulator)."""
    out = []
    for dot, bn, bk, sk in product((True, False) if M <= 8 else (True,), (32, 64, 128),
                                   (32, 64, 128, 256), (1, 2, 4, 8)):
        c = dict(dot=dot, bn=bn, bk=bk, sk=sk, warps=4, stages=3)
        if sms // 2 <= triton.cdiv(N, bn) * sk <= 8 * sms and K // sk >= 2 * bk and smem_ok(c, M, smem) \
                and (bk >= 64 if dot else block_m(c, M) * bk * bn <= 64 * 32 * 4):
            out.append(c)
    return out


def _warm(job):
    """In a worker: compile one kernel into Triton's disk cache (dtypes stand in for tensors)."""
    cfg, (M, K, N), act = job
    try:
        ints, consts, _ = kernel_args(cfg, M, N, K, act)
        skinny_mm.warmup(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.int32,
                         *ints, grid=(1,), **consts)
    except Exception:  # noqa: BLE001 (reported when the main process compiles it again)
        pass


def gbps(M, K, N, us):
    return (K * N * 2 + M * K * 2 + M * N * 2) / (us * 1e-6) / 1e9


def run_cfgs(shape, cfgs, act, a, bs, pool, sweep):
    """Compile (in parallel), check, then time each config; [(us, cfg)] of those that passed."""
    from commfuse.tune import cuda_graph_time_us
    if pool is not None:
        list(pool.map(_warm, [(c, shape, act) for c in cfgs], chunksize=1))
    out = torch.empty(shape[0], shape[2], device="cuda", dtype=torch.bfloat16)
    done = []
    for c in cfgs:
        rec = dict(shape=list(shape), act=act, config=cfg_name(c))
        try:
            check(a, bs[0], c, act)
            rec["us"] = us = cuda_graph_time_us(make_launch(a, bs, out, c, act))
            rec["gbps"] = gbps(*shape, us)
            done.append((us, c))
        except AssertionError as e:
            rec["error"] = "wrong values: " + str(e).strip().splitlines()[0]
            print(f"  {shape} act={act} {cfg_name(c)}: WRONG VALUES, skipped", flush=True)
        except Exception as e:  # noqa: BLE001 (compile failure, out of resources)
            rec["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        sweep.append(rec)
    return sorted(done, key=lambda t: t[0])


def probe(shape, pool, sms, smem, sweep):
    from commfuse.tune import cuda_graph_time_us
    M, K, N = shape
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    bs = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(3)]
    best = run_cfgs(shape, tile_grid(M, N, K, sms, smem), 0, a, bs, pool, sweep)
    # Stage 2: warps x stages around the three best tile shapes.
    more = [dict(c, warps=w, stages=s) for _, c in best[:3] for w in (4, 8) for s in (3, 4, 5)]
    more = [c for c in more if (c["warps"], c["stages"]) != (4, 3) and smem_ok(c, M, smem)]
    best = sorted(best + run_cfgs(shape, more, 0, a, bs, pool, sweep), key=lambda t: t[0])
    # SiLU fused: the three best no-activation configs.
    best_silu = run_cfgs(shape, [c for _, c in best[:3]], 1, a, bs, pool, sweep)
    # Time the winners again beside cuBLAS, so that the reported numbers are not the minimum
    # over many noisy samples.
    o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    nxt = cycle(bs).__next__
    row = dict(M=M, K=K, N=N, cublas=cuda_graph_time_us(lambda: torch.mm(a, nxt(), out=o)),
               cublas_silu=cuda_graph_time_us(lambda: F.silu(torch.mm(a, nxt(), out=o))))
    for key, res, act in (("triton", best, 0), ("triton_silu", best_silu, 1)):
        row[key + "_cfg"] = cfg_name(res[0][1]) if res else "-"
        row[key] = cuda_graph_time_us(make_launch(a, bs, o, res[0][1], act)) if res else float("nan")
    for key in ("cublas", "cublas_silu", "triton", "triton_silu"):
        row[key + "_gbps"] = gbps(M, K, N, row[key])
    row["ratio"] = row["cublas"] / row["triton"]
    row["ratio_silu"] = row["cublas_silu"] / row["triton_silu"]
    return row


def fmt(r):
    cells = [r["M"], r["K"], r["N"]] + [f"{r[k]:.1f} ({r[k + '_gbps']:.0f})" for k in ("cublas", "cublas_silu")]
    cells += [f"{r['triton']:.1f} ({r['triton_gbps']:.0f})", r["triton_cfg"]]
    cells += [f"{r['triton_silu']:.1f} ({r['triton_silu_gbps']:.0f})", r["triton_silu_cfg"]]
    return "| " + " | ".join(map(str, cells + [f"{r['ratio']:.2f}", f"{r['ratio_silu']:.2f}"])) + " |"


def check_cpu():
    torch.manual_seed(0)
    # (M, K, N, tl.dot, BLOCK_N, BLOCK_K, SPLIT_K): tails of N (64 | 96 no) and of K (80),
    # an empty last split (48 over 4 x 16), BLOCK_M = 32 (M = 17), and the FMA variant.
    cases = [(3, 64, 96, 1, 32, 16, 1), (3, 64, 96, 1, 64, 32, 2), (3, 80, 96, 1, 32, 32, 2),
             (1, 48, 96, 1, 32, 16, 4), (17, 64, 96, 1, 32, 16, 2), (3, 64, 96, 0, 32, 16, 1),
             (3, 80, 96, 0, 64, 16, 2), (1, 64, 96, 0, 32, 32, 2)]
    for M, K, N, dot, bn, bk, sk in cases:
        c = dict(dot=bool(dot), bn=bn, bk=bk, sk=sk, warps=4, stages=3)
        # The interpreter's tl.dot multiplies bf16 as raw uint16 bits (triton 3.9), so A and B
        # are fp16 for the tl.dot cases here; out stays bf16. On the GPU everything is bf16.
        dt = torch.float16 if c["dot"] else torch.bfloat16
        a = torch.randn(M, K, dtype=dt)
        b = (torch.randn(K, N) * K ** -0.5).to(dt)
        for act in (0, 1):
            check(a, b, c, act)
            print(f"ok M={M} K={K} N={N} act={act} {cfg_name(c)}")
    print("check-cpu passed")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for skinny_mm.md and skinny_mm.json")
    p.add_argument("--check-cpu", action="store_true", help="interpreter value checks, no timing")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile workers")
    args = p.parse_args()
    if args.check_cpu:
        return check_cpu()
    import torch.distributed as dist
    if not dist.is_initialized():  # cuda_graph_time_us calls dist.barrier()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    smem = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    # Compiling dominates the sweep: worker processes fill Triton's disk cache ahead of timing.
    pool = ProcessPoolExecutor(args.jobs, get_context("spawn")) if args.jobs > 1 else None
    t0, sweep, rows = time.time(), [], []
    head = ["| M | K | N | cuBLAS µs (GB/s) | cuBLAS+silu µs (GB/s) | Triton µs (GB/s) | config "
            "| Triton silu µs (GB/s) | config | cuBLAS/Triton | cuBLAS+silu/Triton silu |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}")
    print("\n".join(head), flush=True)
    for shape in SHAPES:
        rows.append(probe(shape, pool, sms, smem, sweep))
        print(fmt(rows[-1]), flush=True)
    if pool is not None:
        pool.shutdown()
    print(f"sweep: {len(sweep)} kernels in {time.time() - t0:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "skinny_mm.md"), "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; µs per call under "
                    "CUDA graphs, B cycled over 3 copies; GB/s = (KN + MK + MN) * 2 B / time\n\n")
            f.write("\n".join(head + [fmt(r) for r in rows]) + "\n")
        with open(os.path.join(args.out, "skinny_mm.json"), "w") as f:
            json.dump(dict(rows=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
