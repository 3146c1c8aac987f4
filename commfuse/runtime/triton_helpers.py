"""Triton device functions the generated kernels call.

Written in core `tl` operations, so the same code runs compiled on a GPU and under Triton's
interpreter on a CPU; a few are libdevice's on a GPU (at the end).
"""
import triton
import triton.language as tl

from .interpret import interpreting


# NEGATE: a float is negated as x * -1.0 where x may be +0.0: the Triton of torch 2.11's wheels
# (3.6) compiles -x as 0 - x, which is +0.0 there, where eager's -x is -0.0.
@triton.jit
def max_nan(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def min_nan(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def prod_combine(a, b):
    return a * b


@triton.jit
def argmax_combine(va, ia, vb, ib):
    take_a = (va > vb) | ((va != va) & (vb == vb)) | ((va == vb) & (ia < ib)) | ((va != va) & (vb != vb) & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@triton.jit
def argmin_combine(va, ia, vb, ib):
    take_a = (va < vb) | ((va != va) & (vb == vb)) | ((va == vb) & (ia < ib)) | ((va != va) & (vb != vb) & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


# Online softmax: sum(exp(x - max(x))) in one pass. Per lane, a running max m and the sum s of
# exp(x - m) over the values seen, rescaled whenever m grows. -inf values add nothing (a row of
# only -inf sums to 0); equal maxima (also both -inf) need no rescaling; NaN propagates.
@triton.jit
def exp_shifted(v, m):
    return tl.where(v == float("-inf"), 0.0, tl.exp(v - m))


@triton.jit
def online_softmax_rescale(s, m, m_new):
    """s, a sum of exp(x - m), as a sum of exp(x - m_new) (m_new >= m)."""
    return s * tl.where(m == m_new, 1.0, tl.exp(m - m_new))


@triton.jit
def online_softmax_update(m, s, v):
    m_new = max_nan(m, v)
    return m_new, online_softmax_rescale(s, m, m_new) + exp_shifted(v, m_new)


# Welford: the sum of squared deviations from the mean (M2) in one pass. Per lane a running mean,
# M2 and count; lanes and parts are combined by Chan's formula. Two passes (the mean, then the
# deviations) would read a looped row twice.
@triton.jit
def welford_update(mean, m2, count, v, valid):
    count_new = tl.where(valid, count + 1.0, count)
    delta = v - mean
    mean_new = tl.where(valid, mean + delta / tl.maximum(count_new, 1.0), mean)
    return mean_new, tl.where(valid, m2 + delta * (v - mean_new), m2), count_new


@triton.jit
def welford_combine(mean_a, m2_a, count_a, mean_b, m2_b, count_b):
    count = count_a + count_b
    delta = mean_b - mean_a
    frac_b = count_b / tl.maximum(count, 1.0)  # counts are whole: 0 where both are empty, without a 0 / 0
    return mean_a + delta * frac_b, m2_a + m2_b + delta * delta * count_a * frac_b, count


@triton.jit
def div_floor(a, b):
    """Python floor division of integers (Triton's `//` truncates)."""
    q = a // b
    return tl.where((q * b != a) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def div_floor_float(a, b):
    """Python's float floor division, from the exact remainder: floor(a / b) floors a rounded
    quotient (3.0 // 0.3 gave 10, for 9)."""
    mod = a % b
    q = (a - mod) / b
    q = tl.where((mod != 0) & ((b < 0) != (mod < 0)), q - 1.0, q)
    f = tl.floor(q)
    f = tl.where(q - f > 0.5, f + 1.0, f)  # q is a whole number; its division may fall just under it
    f = tl.where(q == 0, (a / b) * 0.0, f)  # |a| < |b|: zero, signed as a / b
    return tl.where(b == 0, a / b, f)


@triton.jit
def remainder(a, b):  # Python's %, of integers or floats (Triton's % truncates, as C's fmod)
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def round_half_even(x):
    f = tl.floor(x)
    d = x - f  # exact, where floor(x + 0.5) rounded x + 0.5 first (8388609 became 8388610)
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0
    r = tl.where((d > 0.5) | ((d == 0.5) & ~even), f + 1.0, f)
    return tl.where(r == 0, x * 0.0, r)  # -0.5 rounds to -0.0


@triton.jit
def tanh(x):  # -expm1(-2|x|) / (2 + expm1(-2|x|)): 1 - e^-2|x| would cancel digits for small |x|
    e = expm1(-2.0 * tl.abs(x))
    return tl.where(negative(x), e / (2.0 + e), -e / (2.0 + e))


@triton.jit
def expm1(x):  # Kahan: (u - 1) x / log(u) cancels the rounding of u = e^x, where u - 1 loses digits (|x| < 1)
    u = tl.exp(x)
    return tl.where(tl.abs(x) < 1.0, tl.where(u == 1.0, x, (u - 1.0) * (x / tl.log(u))), u - 1.0)


@triton.jit
def log1p(x):
    u = 1.0 + x
    # log(u) * x / (u - 1) corrects the rounding of 1 + x (Goldberg); none where u - 1 is x (inf: not inf / inf)
    return tl.where(u == 1.0, x, tl.log(u) * tl.where(u - 1.0 == x, 1.0, x / (u - 1.0)))


@triton.jit
def atan(x):
    # Cephes-style: reduce to [0, tan(pi/8)] then a polynomial
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = (a > 0.4142135623730950) & (~big)
    y0 = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = tl.where(big, -1.0 / tl.where(big, a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    zz = z * z
    p = (((8.05374449538e-2 * zz - 1.38776856032e-1) * zz + 1.99777106478e-1) * zz
         - 3.33329491539e-1) * zz * z + z
    r = y0 + p
    return tl.where(negative(x), r * -1.0, r)  # atan(-0.0) is -0.0 (see NEGATE)


@triton.jit
def atan2(y, x):
    pi, inf = 3.141592653589793, float("inf")
    both_inf = (tl.abs(x) == inf) & (tl.abs(y) == inf)  # not atan(inf / inf)
    base = tl.where(both_inf, tl.where((y > 0) == (x > 0), pi / 4, -pi / 4), atan(y / tl.where(x == 0, 1.0, x)))
    r = tl.where(x > 0, base, tl.where(negative(y), base - pi, base + pi))
    r = tl.where(x == 0, tl.where(y > 0, pi / 2, tl.where(y < 0, -pi / 2, 0.0)), r)
    return tl.where((x == 0) & (y == 0), tl.where(negative(x), tl.where(negative(y), -pi, pi), y), r)


@triton.jit
def asin(x):
    return atan2(x, tl.sqrt((1.0 - x) * (1.0 + x)))


@triton.jit
def acos(x):
    return atan2(tl.sqrt((1.0 - x) * (1.0 + x)), x)


@triton.jit
def sinh(x):  # expm1 below |x| = 1 (e^x - e^-x cancels); above, e^(|x|/2) squared (e^|x| overflows first)
    e, h = expm1(x), tl.exp(0.5 * tl.abs(x))
    big = (0.5 * h) * h - (0.5 / h) / h
    return tl.where(tl.abs(x) < 1.0, 0.5 * (e + e / (e + 1.0)), tl.where(x < 0, -big, big))


@triton.jit
def cosh(x):  # e^(|x|/2) squared: e^|x| would overflow where cosh does not
    h = tl.exp(0.5 * tl.abs(x))
    return (0.5 * h) * h + (0.5 / h) / h


@triton.jit
def asinh(x):  # log1p(a + a² / (1 + sqrt(1 + a²))): log(a + sqrt(a² + 1)) loses digits for small a
    a = tl.abs(x)
    r = tl.where(a > 1e9, tl.log(a) + 0.6931471805599453, log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a))))
    return tl.where(negative(x), r * -1.0, r)


@triton.jit
def acosh(x):  # log1p(t + sqrt(t (t + 2))) with t = x - 1: x² - 1 cancels near 1
    t = x - 1.0
    r = tl.where(x > 1e9, tl.log(x) + 0.6931471805599453, log1p(t + tl.sqrt(t * (t + 2.0))))
    return tl.where(x < 1.0, float("nan"), r)  # (t (t + 2) overflows to inf for x below -1e19)


@triton.jit
def atanh(x):
    r = 0.5 * log1p(2.0 * tl.abs(x) / (1.0 - tl.abs(x)))  # log((1 + x) / (1 - x)) cancels digits for small |x|
    return tl.where(negative(x), r * -1.0, r)


@triton.jit
def erfc(x):  # exp(-x²) times a Chebyshev fit (Numerical Recipes' erfcc): relative error < 1.2e-7
    x = tl.where(tl.abs(x) > 10.5, tl.where(x > 0, 10.5, -10.5), x)  # erfc(10.5) rounds to 0 in fp32; no inf - inf
    t = 1.0 / (1.0 + 0.5 * tl.abs(x))
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    h = tl.floor(x * 256.0) / 256.0  # exp(-x²) as exp(-h²) exp(-(x - h)(x + h)): h² is exact
    r = t * tl.exp(-h * h) * tl.exp(-(x - h) * (x + h) + p)
    return tl.where(x >= 0, r, 2.0 - r)


@triton.jit
def signbit(x):  # -0.0 too; fp16 / bf16 values are held as fp32
    if x.dtype == tl.float64:
        return x.to(tl.int64, bitcast=True) < 0
    return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def negative(x):  # x < 0, or -0.0: signbit for the helpers here, where a NaN's sign does not matter.
    # Through fp32, whose conversion keeps the sign: under Triton 3.6, signbit's branch on x.dtype,
    # called from another helper, compiled its fp32 bitcast for an fp64 x
    return x.to(tl.float32).to(tl.int32, bitcast=True) < 0


@triton.jit
def pow_float(a, b):
    """a ** b with C's special cases: negative bases (-0.0 and -inf too) with integral exponents,
    zeros, ones, infinite exponents."""
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = tl.floor(b) == b
    odd = tl.abs(b - 2.0 * tl.floor(b * 0.5)) == 1.0  # (an infinite b is even)
    neg = negative(a)
    r = tl.where(neg & odd, mag * -1.0, mag)
    r = tl.where(neg & ~b_int & (a != 0) & (a != float("-inf")), float("nan"), r)
    r = tl.where(b == 0, 1.0, r)
    return tl.where((a == 1) | ((a == -1) & (tl.abs(b) == float("inf"))), 1.0, r)


@triton.jit
def hypot(a, b):  # scaled by the larger: a² + b² overflows (1e20) or underflows (1e-25) in fp32
    x, y = tl.abs(a), tl.abs(b)
    big, small = tl.where(x > y, x, y), tl.where(x > y, y, x)
    q = small / tl.where(big == 0, 1.0, big)
    r = tl.where((a != a) | (b != b), float("nan"), big * tl.sqrt(1.0 + q * q))
    return tl.where((x == float("inf")) | (y == float("inf")), float("inf"), r)  # inf beside nan too


# On a GPU, CUDA's libdevice (within an ulp or two, fp32 and fp64) replaces the portable forms
# above, which Triton's interpreter needs for want of libdevice: they are accurate to fp32 only
# (Choices.kernel_math_exact sends fp64 ones to aten there).
# (Called here, not aliased: libdevice's functions resolve to the device's library only where a
# kernel calls them.)
if not interpreting():
    from triton.language.extra import libdevice

    @triton.jit
    def atan(x):  # noqa: F811
        return libdevice.atan(x)

    @triton.jit
    def atan2(y, x):  # noqa: F811
        return libdevice.atan2(y, x)

    @triton.jit
    def asin(x):  # noqa: F811
        return libdevice.asin(x)

    @triton.jit
    def acos(x):  # noqa: F811
        return libdevice.acos(x)

    @triton.jit
    def erfc(x):  # noqa: F811
        return libdevice.erfc(x)

    @triton.jit
    def sinh(x):  # noqa: F811  (the forms above square tl.exp's approximate e^(|x|/2): 9 ulps off)
        return libdevice.sinh(x)

    @triton.jit
    def cosh(x):  # noqa: F811
        return libdevice.cosh(x)

    @triton.jit
    def hypot(a, b):  # noqa: F811
        return libdevice.hypot(a, b)

    @triton.jit
    def pow_float(a, b):  # noqa: F811  (exp2(b log2|a|) is 2 ulps off at 3 ** 3)
        return libdevice.pow(a, b)


# Programmatic dependent launch (choices.dependent_launch): a kernel launched with `launch_pdl`
# may start before the kernel ahead of it in its stream has finished; it touches memory only after
# `after_predecessor`, which waits for that kernel and its writes, then lets the next one launch
# (after the wait, not before: no chain of kernels started early holding the SMs).
if interpreting():  # one program at a time, in launch order
    @triton.jit
    def after_predecessor():
        pass
else:
    @triton.jit
    def after_predecessor():
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# A comm kernel's barrier wait, bounded (codegen/comm.py: barrier_lines). Only a poll that finds a
# peer missing calls this: the first starts the clock (so the wait costs nothing where no peer is
# missing). Past the timeout in this rank's header (runtime/peers.py; comm.barrier_timeout_s), or
# once a peer waited for is gone (its exit handler's state; on a CPU also its pid), or once an
# earlier barrier of this rank gave up, the wait gives up: after one more poll (a peer that
# signalled, then exited, has not failed) it records why in the header and returns -1, and the
# kernel leaves its barriers without waiting. The device never hangs and never traps (a trap
# loses the CUDA context and cannot say which rank); the host reads the record and raises.
# Every branch here is taken by all of the program's threads together: the values it tests (the
# clock, the own and the peers' headers) are reduced over the program first. A warp that left the
# loop before the others would pair its reductions' barriers with theirs: wrong values, or a hang.
BARRIER_GRACE_NS = tl.constexpr(100_000)  # ns


@triton.jit
def barrier_deadline(deadline, header, peer_header, waiting):
    missing = waiting >= 0
    now = clock_ns(waiting)
    timeout = tl.load(header).to(tl.int64) * 1000000
    if deadline == 0:
        deadline = now + timeout
    # The peers' headers are remote reads (a microsecond each over NVLink): a barrier looks at them
    # only once it has waited BARRIER_GRACE_NS, so an ordinary wait polls as fast as it can.
    if now - (deadline - timeout) > BARRIER_GRACE_NS:
        state = tl.load(peer_header + 3, missing, other=0, volatile=True)
        pids = tl.load(peer_header + 1, missing, other=0, volatile=True)
        gone = (tl.max(state, 0) != 0) | peer_pids_gone(pids, tl.load(peer_header + 2, missing, other=0, volatile=True))
        failed = tl.max(tl.load(header + 4 + 0 * waiting, volatile=True), 0) != 0  # an earlier barrier gave up
        if gone | failed | (now > deadline):
            if deadline == 1:
                tl.atomic_cas(header + 4, 0, tl.where(gone, 2, 1))
                bit = tl.full(waiting.shape, 1, tl.int32) << tl.minimum(tl.maximum(waiting, 0), 30)
                tl.atomic_or(header + 5, tl.sum(tl.where(missing & (waiting < 31), bit, 0)))  # ranks 0-30
                deadline = tl.full([], -1, tl.int64)
            else:
                deadline = tl.full([], 1, tl.int64)  # one more poll, then give up
    return deadline


if interpreting():
    def clock_ns(lanes):
        import time
        time.sleep(0.0005)  # only while waiting: leave the CPU to the peer being waited for
        return tl.full([], time.monotonic_ns(), tl.int64)

    def peer_pids_gone(pids, namespaces):
        from .peers import any_pid_gone
        return tl.full([], any_pid_gone(pids.handle.data.ravel(), namespaces.handle.data.ravel()), tl.int1)
else:
    @triton.jit
    def clock_ns(lanes):  # each thread reads its own clock; their max is the program's
        return tl.max(tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lanes], dtype=tl.int64,
                                                is_pure=False, pack=1), 0)

    @triton.jit
    def peer_pids_gone(pids, namespaces):  # a GPU cannot see processes: the exit handlers' state only
        return tl.zeros([], tl.int1)
