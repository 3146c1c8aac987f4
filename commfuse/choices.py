"""Every heuristic in one place: what fuses, in which order, how kernels are shaped, and which
algorithm each collective runs.

Policy is one object, `Choices`, installed on `V` for each compile: `config.choices` (an instance
of a subclass) replaces it, the way a user or a test changes one decision without forking the
compiler. Everything else asks `V.choices`.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed as dist

from . import compat, config, ir, memory, sizevars
from .collectives import ALGORITHMS, CommPlan, CommRequest, algorithm
from .dependencies import trace_body
from .runtime.plan_check import split_groups
from .runtime.symm import SIGNAL_PROGRAMS, group_of
from .sizevars import next_pow2
from .tuned_tables import lookup, measured_us, mm_row
from .virtualized import V

MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)
COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMM_REDUCE_OPS = ("sum", "avg", "max", "min")
MM_TEMPLATE_DTYPES = (torch.bfloat16, torch.float16)
MM_GROUP_MAX = 4  # few-row matmuls of one `a` in one launch (mm_group_member)
# a pointwise body past this many ops is stored, even with one user: each value inlined into it is
# a loader nested in its reader's, and a 750-op elementwise chain passed Python's recursion limit
MAX_INLINED_OPS = 128
CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
# aten's fused attention kernels read the mask (attn_bias: which argument) in rows that start at
# multiples of 16 elements; eager pads the mask so, and a mask we store is laid out so too
ATTENTION_BIAS_ARG = {torch.ops.aten._scaled_dot_product_efficient_attention.default: 3,
                      torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: 4,
                      torch.ops.aten._scaled_dot_product_cudnn_attention.default: 3,
                      torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default: 8}
ATTENTION_BIAS_ALIGN = 16
# Where the generated decode attention beat aten's SDPA at the cache's last position and its
# middle, for every batch measured (bench/decode_attention.py prints these entries): batches and
# cache lengths are inclusive ranges. Elsewhere (other GPUs, head dims, groups) aten's attention runs.
DECODE_ATTENTION_WINS: list = [
    # bench/results/decode_attention_h200_2df6b78.md: 1.01-2.27x aten up to 8192 keys; at 32768,
    # 0.88-0.93x with the whole cache valid
    {"gpu": "NVIDIA H200", "dtype": "torch.bfloat16", "head_dim": 128, "group": 4, "batch": (1, 8), "keys": (512, 8192)},
    # bench/results/decode_attention_d64_blocks_h200_3e2d11d.md: 1.29-1.84x up to 2048 keys; at 8192,
    # 0.99x at B=8 with the whole cache valid
    {"gpu": "NVIDIA H200", "dtype": "torch.bfloat16", "head_dim": 64, "group": 4, "batch": (1, 8), "keys": (512, 2048)},
    # bench/results/decode_attention_h100_e7b2d8f.md: 1.03-2.78x aten up to 8192 keys (head dim 128),
    # 1.29-1.89x up to 2048 (64); beyond, 0.93-0.99x with the whole cache valid
    {"gpu": "NVIDIA H100 80GB HBM3", "dtype": "torch.bfloat16", "head_dim": 128, "group": 4, "batch": (1, 8), "keys": (512, 8192)},
    {"gpu": "NVIDIA H100 80GB HBM3", "dtype": "torch.bfloat16", "head_dim": 64, "group": 4, "batch": (1, 8), "keys": (512, 2048)},
]
DEFAULT_SMS = 132  # H100 / H200
# matmul throughput assumed per SM, TFLOP/s: about half of an H100's dense peak (tensor cores for
# 16-bit, plain fp32 without TF32), so that the work a collective is said to hide behind is there
MATMUL_TFLOPS_PER_SM = {2: 3.5, 4: 0.25}
INTERPRETED_BLOCK = 1 << 16  # lanes of an interpreted reduction's program (interpreted_reduction_config)
INTERPRETED_MATH_FP32 = ("atan", "asin", "acos", "atan2", "erfc")  # see kernel_math_exact
POW_MULTIPLY_MAX = 32
SCATTER_INDICES_PER_ROW = 8
SMALL_TILED_REDUCTION = 1 << 17  # elements of a column reduction too small to be bandwidth-bound


@functools.cache
def _capability(index) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.cache
def sm_count(device=None) -> int:
    """SMs of a CUDA device; elsewhere (Triton's interpreter) those of the H100 / H200 we target."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def _pads_rows(device) -> bool:
    """`config.pad_rows`; None: on CUDA."""
    return config.pad_rows if config.pad_rows is not None else device.type == "cuda"


def _aligned_elements(itemsize: int) -> int:
    """Elements of this size in 16 bytes (cuBLAS's and vector loads' alignment)."""
    return 16 // math.gcd(16, itemsize)


def micro_pipeline_tp() -> bool:
    """torch's switch for async-TP (`torch._inductor.config._micro_pipeline_tp`), which turns ours on."""
    return bool(getattr(getattr(torch._inductor, "config", None), "_micro_pipeline_tp", False))


def group_size(group_name: str) -> int:
    return dist.get_world_size(group_of(group_name))


def group_size_or_0(group_name: str) -> int:
    """The group's size, 0 where this process cannot resolve it (the c10d op itself will say so)."""
    try:
        return group_size(group_name)
    except Exception:
        return 0


def single_host(group_name: str) -> bool:
    """torchrun places ranks node by node: a group is on one host when its ranks share a node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return len({r // local for r in dist.get_process_group_ranks(group_of(group_name))}) == 1


class Choices:
    # ------------------------------------------------------------------------- fusion
    def can_fuse(self, a, b) -> tuple[bool, str]:
        """Policy half of the fusion decision; the scheduler checks legality (shapes, indices, cycles)."""
        if a.is_extern() or b.is_extern():
            return False, "extern kernels do not fuse"
        if len(a.nodes) + len(b.nodes) > config.max_fusion_size:
            return False, f"group would exceed max_fusion_size={config.max_fusion_size}"
        if a.device != b.device:
            return False, "different devices"
        reads = (a.read_names | b.read_names) - a.write_names - b.write_names
        if self.read_bytes_exceeded(reads):
            return False, f"reads would exceed realize_acc_reads_size_threshold={config.realize_acc_reads_size_threshold}"
        shared = (a.read_names | a.write_names) & (b.read_names | b.write_names)
        if a.is_reduction() and b.is_reduction() and shared & (a.walked_transposed() ^ b.walked_transposed()):
            # a row reduction and a column sum's parts over the same data (parts x columns = rows):
            # the row kernel would walk its rows in tiles (LayerNorm backward over 32768 x 4096 on
            # H200: 810 us, Inductor 481); apart, the column sum may join it in mixed order
            # (mix_order.py). A norm of `x.transpose(1, 2)` shares no data walked both ways.
            return False, "a row reduction and a reduction over columns of the same data"
        return True, ""

    def keep_apart_for_memory(self, stored_anyway: bool) -> bool:
        """For a fusion into a reduction walking the value handed over transposed: a value other
        kernels read anyway saves one read by joining, and in that tiled kernel it can no longer be
        written over a dying input (on CPU, a GELU backward joining its bias-gradient sum raised an
        MLP step's peak above eager's). Keep them apart, unless in-place writes are off."""
        return stored_anyway and config.inplace_buffers

    def keep_apart_for_peak(self, held: int, peak_fused: int, peak: int) -> bool:
        """Keep two kernels apart where fusing them holds `held` bytes of outputs early and raises
        the estimated peak by over 1/16; outputs under 1 MiB (a split reduction's parts) never."""
        return config.reorder_for_peak_memory and held >= 1 << 20 and peak_fused > peak + peak // 16

    def score_fusion(self, a, b, shared_bytes: int, vertical: bool) -> tuple:
        """Higher first: vertical fusions (a pass over memory saved) before horizontal ones,
        then by bytes saved, then nodes that were close in program order."""
        return (vertical, shared_bytes, -abs(a.order - b.order))

    def should_realize(self, loops, users: int, output: bool = False) -> bool:
        """Store a pointwise value instead of inlining it into its users: when several users would
        each recompute it at too high a cost (many users, a long body, or many buffers read: a
        residual stream `h = h + f(h)` inlined layer after layer would have every consumer re-read
        the whole chain), or when it has accumulated too many reads, or when it is a graph output
        with other users: stored anyway, it is read rather than recomputed, so what it is computed
        from can die at its producer, which may then write over it (the logits under the
        log-softmax a forward saves for backward)."""
        if output and users > 1:
            return True
        trace = trace_body(loops)
        reads = {r.name for r in trace.reads}
        if users > 1 and (users > config.realize_users_threshold or len(reads) > config.realize_reads_threshold
                          or trace.op_count > config.realize_opcount_threshold):
            return True
        if trace.op_count > MAX_INLINED_OPS:  # (its one reader's kernel still fuses it: never stored)
            return True
        return len(reads) > config.realize_acc_reads_threshold or self.read_bytes_exceeded(reads)

    def realize_view_base(self, view, base) -> bool:
        """Storing a view of a value not stored yet (an extern's operand, say): store the value
        itself and pass a strided view of it, rather than a copy laid out as the view? When the view
        reads every element (reshape, permute, expand) and is a strided view of the value stored
        contiguously: no more bytes, and the value's other users (a graph output, the backward's
        saved copy) share the buffer instead of storing it a second time (softmax probabilities)."""
        return sizevars.hint(view.get_numel()) >= sizevars.hint(base.get_numel()) and \
            ir.is_strided_over_contiguous(view)

    def read_bytes_exceeded(self, reads) -> bool:
        """One value (or kernel) reading these buffers keeps them all alive until it runs, where
        eager would have freed each after its own op: bound what it holds. Buffers the graph does
        not own (inputs, comm buffers) are alive anyway and do not count."""
        limit = config.realize_acc_reads_size_threshold
        return limit is not None and memory.owned_bytes(reads) > limit

    def can_recompute(self, loops) -> bool:
        """May another kernel recompute this stored pointwise value instead of reading it? Cheap
        bodies only, and no data-dependent (gathered) reads."""
        trace = trace_body(loops)
        return not any(r.indirect for r in trace.reads) and \
            trace.op_count <= config.realize_opcount_threshold

    # ------------------------------------------------------------------------- memory
    def peak_memory_orders(self) -> tuple[str, ...]:
        """Topological orders tried besides the program order (commfuse/memory.py: ORDERS); the
        lowest estimated peak wins, the program order on ties."""
        return ("least_peak_first", "bfs", "dfs") if config.reorder_for_peak_memory else ()

    def inplace_buffers(self) -> bool:
        return config.inplace_buffers

    def extern_writes_slice(self, kernel, slice_layout) -> bool:
        """May an out-variant extern write its output straight into a slice of a cat buffer? When
        the slice has the strides the op would give its output anyway (then `out=` changes
        nothing), or, for a matmul, when its columns are contiguous (BLAS writes rows at a
        leading-dimension stride; slices of a dense cat never overlap)."""
        if not kernel.out_variant or kernel.multi_output or kernel.out_view is not None \
                or isinstance(kernel.layout, ir.CommLayout):
            return False
        if kernel.layout.has_strides(slice_layout.stride):
            return True
        return kernel.op.overloadpacket in MATMULS and sizevars.equal(slice_layout.stride[-1], 1)

    def cuda_graph_captures(self) -> int:
        """Captures in a row, each replayed fewer than `cuda_graph_paid_replays` times, of a graph
        in CUDA-graph mode before it runs without one: each follows moved parameters (reloaded
        weights; layers sharing compiled code, or FSDP2's, move every call)."""
        return 3

    def cuda_graph_paid_replays(self) -> int:
        """Replays (the capturing call's included) that pay for a capture (a warm run and a capture):
        a KV cache allocated anew per generated sequence is captured again at each, replayed per token."""
        return 8

    def cuda_graph_copy_limit(self, launches: int) -> int:
        """Bytes a replay copies (inputs into the graph's static copies, outputs out of its own)
        above which the graph is not worth replaying: a replay saves about 5 µs of host time per
        launch; a copy costs its bytes twice at about 1.5 TB/s. A training step's saved
        activations, returned by its forward and reaching its backward at new addresses, cost
        more than the launches they save."""
        return launches * (8 << 20)

    # ------------------------------------------------------------------------- overlap
    def matmul_us(self, flops: int, dtype: torch.dtype, device) -> float:
        """A conservative estimate of how long `flops` of matmuls take on `device`."""
        per_sm = MATMUL_TFLOPS_PER_SM.get(dtype.itemsize, MATMUL_TFLOPS_PER_SM[4])
        return flops / (per_sm * 1e6 * sm_count(device))

    def hidden_behind_compute(self, request: CommRequest, world: int, nbytes: int) -> str:
        """Why c10d should run a collective that a symmetric kernel runs faster alone, or "": c10d
        runs on its own stream, under the independent matmuls the overlap order puts beside it, while
        our kernel runs on the compute stream between them. Only where the table measured c10d at
        this size and that work takes at least as long (at a conservative throughput)."""
        if not (config.overlap_collectives and config.comm.hide_behind_compute and request.independent_flops):
            return ""
        c10d = measured_us(world, nbytes, request.device, request.collective).get("c10d")
        compute = self.matmul_us(request.independent_flops, request.dtype, request.device)
        if c10d is None or compute < c10d:
            return ""
        return (f"c10d, on its own stream, hides behind about {compute:.0f} µs of independent matmuls "
                f"({c10d:.0f} µs alone at {nbytes} bytes); a symmetric kernel would run between them")

    def overlap_within_peak(self, peak: int, memory_peak: int, program_peak: int) -> bool:
        """May a c10d collective be issued early and waited late (commfuse/overlap.py) in an order
        of estimated peak `peak`? Up to the peak of the program's own order (eager's: the overlap
        the program asked for is kept), or `config.overlap_peak_share` over the memory order's."""
        return peak <= max(program_peak, memory_peak + int(memory_peak * config.overlap_peak_share))

    # ------------------------------------------------------------------------- layout
    def conv_layout(self, gm) -> bool:
        """Run this graph's 2-D convolutions channels_last (their inputs, weights and outputs)?
        cudnn computes in NHWC: given NCHW tensors it transposes them around every conv (resnet18,
        H100, bf16, B=64: 764 of 2542 µs per inference step). `config.conv_channels_last` forces
        it; by default CUDA graphs. Static shapes only: AOTAutograd restrides the backward's
        saved activations to what the forward reports only then."""
        vals = [n.args[0].meta.get("val") for n in gm.graph.nodes if n.target in CONVOLUTIONS]
        vals = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() == 4]
        if not vals or config.conv_channels_last is False:
            return False
        static = all(isinstance(s, int) for v in vals for s in v.shape)
        return static and (config.conv_channels_last or vals[0].device.type == "cuda")

    def stored_order(self, loops) -> list | None:
        """The order of its dims (outermost first) a value is stored in; None: contiguous. In a
        channels_last graph (`conv_layout`), that of a 4-D dense buffer it reads, so that the
        BatchNorm, ReLU, residual and pooling kernels between convolutions keep their layout."""
        if not V.graph.channels_last or len(loops.get_size()) != 4:
            return None
        for r in trace_body(loops).reads:
            lay = V.graph.get_buffer(r.name).layout
            if len(lay.size) == 4 and lay.is_dense() and not lay.is_contiguous():
                return lay.stride_order()
        return None

    def pad_rows(self, layout):
        """A large row-major buffer whose rows are not 16-byte aligned gets its row stride rounded
        up (the same values, rows aligned): cuBLAS takes unaligned kernels for a matmul whose
        operand or output rows are not (GPT-2's 50257-wide logits, H100 bf16: 3.3 ms against
        0.45 for the aligned matmul), and a kernel cannot load such rows in 16-byte vectors.
        Rows of a few hundred elements and up only, so the padding wastes little."""
        size = layout.size
        if not _pads_rows(layout.device) or len(size) < 2 or not layout.is_contiguous() \
                or not all(sizevars.is_static(n) for n in size):
            return layout
        row, item = int(size[-1]), layout.dtype.itemsize
        if row < 256 or row * item % 16 == 0 or sizevars.hint(layout.numel()) * item < config.pad_rows_min_bytes:
            return layout
        return ir.row_padded(layout, _aligned_elements(item))

    def keep_padded_output(self, stored, meta: torch.Tensor) -> bool:
        """Return an output whose rows we padded as that padded view (`keep_padded_outputs`)
        rather than copy it into eager's contiguous strides."""
        keep = config.keep_padded_outputs
        if keep is None:
            keep = _pads_rows(stored.get_device())
        return keep and meta.is_contiguous() and ir.is_row_padded(stored.layout)

    def mm_pad_multiple(self, device, dtype, m, k, n, m_leading=False) -> int | None:
        """Elements (16 bytes' worth) to pad a matmul's K and N up to (and M, where it is the left
        operand's leading dimension), or None: when one is not a multiple and an operand or the
        output is large (`pad_rows`, `pad_rows_min_bytes`)."""
        if not _pads_rows(device) or not all(sizevars.is_static(x) for x in (m, k, n)):
            return None
        m, k, n, item = int(m), int(k), int(n), dtype.itemsize
        multiple = _aligned_elements(item)
        aligned = k % multiple == 0 and n % multiple == 0 and (not m_leading or m % multiple == 0)
        if aligned or max(m * k, k * n, m * n) * item < config.pad_rows_min_bytes:
            return None
        return multiple

    # ------------------------------------------------------------------------- kernel shape
    def reduction_split(self, xnumel: int, rnumel: int, columns: bool = False, device=None) -> int:
        """Into how many parts to split each output's reduction (a second kernel combines the
        parts): when its kernel would launch fewer programs than `split_reduction_programs` (None:
        2 per SM), enough parts to reach that many, while each program still reduces
        `split_reduction_min` elements for its block of outputs (64 for a `columns` reduction,
        which walks its input transposed). On H100, a bias gradient, the sum over 4096 rows of a
        (4096, 3072) bf16 tensor, took 100 µs in 48 programs, Inductor's split sum 8. The partials
        stay few: under 2 x target x block values."""
        kind = "looped_tiles" if columns else "persistent" if self.is_persistent(rnumel) else "looped"
        block = self.kernel_config(kind, xnumel, rnumel)["XBLOCK"]
        programs = -(-xnumel // block)
        target = config.split_reduction_programs or 2 * sm_count(device)
        if not 0 < programs < target:
            return 1
        most = max(1, block * rnumel // config.split_reduction_min)
        return min(next_pow2(-(-target // programs)), 1 << (most.bit_length() - 1))

    def mix_order_programs(self, rows: int, cols: int, device) -> int:
        """Programs of a row kernel that also sums its columns (mix_order.py); 0: keep the column
        sum apart. Each program strides over blocks of rows keeping a partial sum per column: the
        partials are programs x cols. Only for rows held whole in a block, many more rows than
        columns, and data past what a second read would find in L2 (as Inductor's thresholds)."""
        least = config.mix_order_min_elements
        if least is None or not self.is_persistent(cols) or rows < 2 * cols or rows * cols < least:
            return 0
        xblock = self.kernel_config("persistent", rows, cols)["XBLOCK"]
        return min(2 * sm_count(device), -(-rows // xblock))

    def kernel_math_exact(self, op: str, device, dtype) -> bool:
        """Does a kernel compute `op` to its dtype's precision? On a GPU libdevice does. Triton's
        interpreter has none: its atan, asin, acos, atan2 and erfc are fits accurate to fp32
        (fp64 atan off by 7e-8, relative), so fp64 ones run through aten there."""
        return device.type != "cpu" or dtype != torch.float64 or op not in INTERPRETED_MATH_FP32

    def scatter_as_pointwise(self, indices_per_row) -> bool:
        """A scatter of this many indices per row as a pointwise kernel, each element comparing
        its position with each index (topk's backward: k of them), rather than through aten:
        for a few, while the compares cost less than aten's copies of the whole input."""
        return sizevars.is_static(indices_per_row) and 0 < indices_per_row <= SCATTER_INDICES_PER_ROW

    def pow_by_multiplication(self, exponent, floating: bool) -> bool:
        """x ** n for a constant integral n as multiplications (by squaring; a reciprocal for
        n < 0) rather than exp2/log2 with special cases: GPT-2's GELU cubes its input, and that
        kernel took 60 µs on H100 against Inductor's 16. Floats for |n| < POW_MULTIPLY_MAX (the
        error grows with log n; Inductor's bound too), integers for every n >= 0, exactly
        (negative ones are errors in eager: aten runs them)."""
        if not isinstance(exponent, (int, float)) or not float(exponent).is_integer():
            return False
        return abs(exponent) < POW_MULTIPLY_MAX if floating else exponent >= 0

    def use_online_softmax(self, xnumel, rnumel) -> bool:
        """Softmax's row max and sum of exp in one pass (running max, rescaled sum), for rows that
        are looped. Not for rows held whole in one block: there the two-step form computes each exp
        once (measured on H200: online softmax there was 20% slower), nor where the reduction would
        be split: partial results would need both values."""
        if not config.online_softmax:
            return False
        if sizevars.is_static(rnumel) and self.is_persistent(int(rnumel)):
            return False
        if sizevars.is_static(xnumel) and sizevars.is_static(rnumel):
            return self.reduction_split(int(xnumel), int(rnumel)) == 1
        return True

    def is_persistent(self, rnumel, reads_peers: bool = False) -> bool:
        """Whole rows in one block: static and short enough. Longer rows for a kernel that reads its
        peers' buffers: a looped row would pull them over the link a second time."""
        limit = config.comm.persistent_reduction_max if reads_peers else config.persistent_reduction_max
        return rnumel is not None and rnumel <= limit

    def should_tile(self, rows: int, cols: int) -> bool:
        """Tile a transposing pointwise kernel when both sides are big enough to matter."""
        return rows >= 16 and cols >= 16 and -(-cols // 32) < 65536

    def kernel_config(self, kind: str, xnumel: int, rnumel: int, accumulators: int = 1, device=None) -> dict:
        """Blocks and warps of a kernel of this kind: pointwise, tiled, persistent or looped."""
        # accumulators: the values each lane of a looped reduction carries through its loop
        if device is not None and device.type == "cpu" and kind in ("persistent", "looped", "looped_tiles"):
            return self.interpreted_reduction_config(kind, xnumel, rnumel)
        if kind == "pointwise":
            block = min(config.max_block, next_pow2(max(xnumel, 1)))
            return {"XBLOCK": max(block, 16), "num_warps": 4 if block <= 512 else 8}
        if kind == "tiled":
            return {"XBLOCK": min(32, next_pow2(xnumel)), "RBLOCK": min(32, next_pow2(rnumel)), "num_warps": 4}
        if kind == "looped_tiles":  # a reduction that also walks a buffer transposed
            if xnumel * rnumel <= SMALL_TILED_REDUCTION:
                # latency-bound (a split reduction's second stage): more programs, each loading its
                # block at once. On H100, summing 512 partials of 64 columns took 9 µs in 1
                # program of 64 x 64 tiles, 3 µs in 8 programs of 8 x 512
                return {"XBLOCK": min(8, next_pow2(xnumel)), "RBLOCK": min(512, next_pow2(rnumel)), "num_warps": 4}
            # 32 values per lane and accumulator; smaller tiles where more accumulators would spill
            # (BatchNorm's Welford over 802816 x 64 bf16 on H100: 112 µs in 64 x 64 tiles, 60 in 32 x 32)
            block = 64 if accumulators <= 2 else 32
            return {"XBLOCK": min(block, next_pow2(xnumel)), "RBLOCK": block, "num_warps": 4}
        if kind == "persistent":
            rblock = next_pow2(max(rnumel, 1))
            xblock = max(1, min(next_pow2(xnumel), 4096 // max(rblock, 1)))
            warps = 4 if rblock * xblock <= 2048 else 8 if rblock * xblock <= 8192 else 16
            return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": warps}
        return {"XBLOCK": 1, "RBLOCK": 2048, "num_warps": 8}

    def interpreted_reduction_config(self, kind: str, xnumel: int, rnumel: int) -> dict:
        """A reduction's blocks under Triton's interpreter (CPU): each program and each op in it
        costs Python time (tens of µs to ms) whatever its block, and numpy then does the block's
        work at its own speed: few programs of up to INTERPRETED_BLOCK lanes. A std(0) of
        (8, 20000) in 625 programs of 32 x 32 lanes (a GPU's tiles) took minutes. The kind, and
        so the splits the GPU's shapes decide, stay as on a GPU: CPU runs test that code."""
        rblock = next_pow2(max(rnumel, 1))
        if kind != "persistent":  # a looped row keeps the GPU's RBLOCK; columns take their rows whole
            rblock = min(rblock, 2048 if kind == "looped" else INTERPRETED_BLOCK // 16)
        xblock = max(1, min(next_pow2(max(xnumel, 1)), INTERPRETED_BLOCK // rblock))
        return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": 4}

    def comm_max_programs(self) -> int:
        """Programs of one comm kernel: each owns a barrier slot of the signal pad."""
        return max(1, min(config.comm.max_programs, SIGNAL_PROGRAMS))

    def comm_launch(self, numel: int) -> dict:
        """Grid of a standalone all-reduce kernel. Small messages are latency: one step per
        program. Large ones are bandwidth over a long link: bigger steps keep more peer loads in
        flight."""
        cap = self.comm_max_programs()
        block = config.comm.block if numel <= cap * config.comm.block else config.comm.bulk_block
        nprog = max(1, min(cap, -(-numel // block)))
        return {"BLOCK": block, "NPROG": nprog, "num_warps": max(4, min(16, block // 256))}

    def comm_kernel_config(self, kind: str, xnumel: int, rnumel: int) -> dict:
        """A kernel that reads peers synchronizes program by program with the same program on
        every rank: at most `comm.max_programs` of them, so that all are resident at once, each
        striding over the blocks."""
        if kind == "pointwise":
            launch = self.comm_launch(xnumel)
            blocks = {"XBLOCK": launch["BLOCK"], "num_warps": launch["num_warps"]}
        else:
            blocks = self.kernel_config(kind, xnumel, rnumel)
            # few programs: each needs many loads in flight; long rows need more threads to hold them
            blocks["num_warps"] = max(config.comm.num_warps, min(16, blocks["XBLOCK"] * blocks["RBLOCK"] // 512))
        blocks["programs"] = max(1, min(self.comm_max_programs(), -(-xnumel // blocks["XBLOCK"])))
        return blocks

    # ------------------------------------------------------------------------- collectives
    def comm_exit_by_next_entry(self, nbytes: int) -> bool:
        """Does a comm buffer of `nbytes` stay live until the next comm kernel of its pool, so that
        the kernel reading it needs no closing barrier (memory.plan_comm_pools)? Up to
        `comm.double_buffer_max_bytes`: small ones, where a barrier's round trip (about 2 µs) is
        much of the kernel; a large one would double its pool's bytes for little."""
        return nbytes <= config.comm.double_buffer_max_bytes

    def comm_ineligible(self, request: CommRequest) -> str:
        """Why this collective cannot run over symmetric memory at all ("" when it can)."""
        cfg = config.comm
        if not cfg.enabled:
            return "comm lowering disabled by config"
        if cfg.groups is not None and request.group not in cfg.groups:
            return f"group {request.group} not in config.comm.groups"
        if request.group in split_groups():
            return f"{split_groups()[request.group]} (runtime/plan_check.py)"
        if request.reduce_op not in COMM_REDUCE_OPS and request.collective != "all_gather_into_tensor":
            return f"reduce op {request.reduce_op!r} (supported: {', '.join(COMM_REDUCE_OPS)})"
        if request.dtype not in COMM_DTYPES:
            return f"dtype {request.dtype} (supported: fp32, bf16, fp16)"
        if request.device.type not in ("cuda", "cpu"):
            return f"device {request.device}"
        if not all(sizevars.is_static(n) for n in request.size):  # (0, s0) too: the pool's slices are static
            return (f"symbolic size {list(request.size)}: a dynamic-shape graph; compile with dynamic=False (or "
                    "torch._dynamo.mark_static on the batch dim) to get the symmetric-memory kernels")
        try:
            if not single_host(request.group):
                return "group spans several hosts (no peer access)"
            if group_size(request.group) == 1:  # the barriers' peer lanes assume a peer
                return f"a group of one rank: no peers to read (c10d's {request.collective} is a copy)"
        except Exception as e:  # unknown group: c10d will report it properly
            return f"cannot resolve group {request.group}: {e}"
        return ""

    def async_tp(self, request: CommRequest) -> str:
        """Why an all-gather that feeds matmuls (a matmul that feeds a reduce-scatter) stays as it is,
        or "" to run it as async-TP's chunked op (passes/async_tp.py). `comm.async_tp` "on", or torch's
        `_inductor.config._micro_pipeline_tp` under "auto", chunks wherever symmetric memory can run it.
        "auto" does not chunk: on 4x H100 the op alone is faster (1.10-1.36x under a CUDA graph, at a
        Llama-8B layer's sequence-parallel sizes), but the sequence-parallel training steps it was
        measured in ran slower chunked, with CUDA graphs and without (docs/results.md)."""
        mode = "on" if config.comm.async_tp == "auto" and micro_pipeline_tp() else config.comm.async_tp
        if mode != "on":
            return f"comm.async_tp is {mode}" + (": not measured to win in a training step" if mode == "auto" else "")
        return self.comm_ineligible(request) or (f"reduce op {request.reduce_op}" if request.reduce_op not in ("", "sum", "avg") else "")

    def rewrites_collectives(self, group: str) -> bool:
        """Whether the FX rewrites may sum, merge or chunk this group's collectives: not once its
        ranks compiled different comm kernels for them (runtime/plan_check.py, `split_groups`), since
        each rank rewrites its own graph. Each rank then issues the program's own collectives."""
        return group not in split_groups()

    def bucket_member(self, request: CommRequest) -> bool:
        """Whether a collective may join a bucket (passes/bucketing.py): a small one, whose latency,
        not its bytes, sets its time. Not an all-reduce our kernels run: they fuse with its producer
        and consumers, which a packed buffer would keep apart, and cost no launch of c10d's."""
        if request.nbytes > config.comm.bucket_member_max_bytes or not self.rewrites_collectives(request.group):
            return False
        return request.collective != "all_reduce" or self.all_reduce_plan(request).algorithm.name == "c10d"

    def bucket_cap_bytes(self, kind: str, world: int) -> int:
        """The largest packed input of one bucket."""
        return config.comm.bucket_cap_bytes

    def all_reduce_plan(self, request: CommRequest) -> CommPlan:
        """The algorithm of one all-reduce, and why: c10d where symmetric memory cannot run it, the
        one `config.comm.algorithm` forces, else the tuned table's or the built-in thresholds'."""
        why = self.comm_ineligible(request)
        world = group_size(request.group) if not why else 0
        name, reason = ("c10d", why) if why else self._all_reduce_choice(request, world)
        return CommPlan("all_reduce", request.group, world, request.reduce_op, algorithm(name), reason,
                        request.inplace)

    def _all_reduce_choice(self, request: CommRequest, world: int) -> tuple[str, str]:
        forced = config.comm.algorithm
        if forced == "auto":
            name, reason = self.all_reduce_algorithm(world, request.nbytes, request.device)
            hidden = name != "c10d" and self.hidden_behind_compute(request, world, request.nbytes)
            return ("c10d", hidden) if hidden else (name, reason)
        name = "torch_one_shot" if forced == "torch" else forced
        why = algorithm(name).eligible(request)
        return ("one_shot", why) if why else (name, "forced by config.comm.algorithm")

    def all_reduce_algorithm(self, world: int, nbytes: int, device) -> tuple[str, str]:
        """From a tuned table that matches this host and covers the size, else built-in thresholds."""
        best = lookup(world, nbytes, device)
        if best is not None:
            algo, table = best
            return algo, f"{algo} is fastest at {nbytes} bytes in {table}"
        cfg = config.comm
        if nbytes <= cfg.one_shot_max_bytes.get(world, min(cfg.one_shot_max_bytes.values())):
            return "one_shot", "under the built-in one-shot threshold"
        if nbytes <= cfg.two_shot_max_bytes.get(world, 0):
            return "two_shot", "under the built-in two-shot threshold"
        return "c10d", f"{nbytes} bytes over the one-shot threshold and the two-shot threshold for {world} ranks"

    def gather_scatter_plan(self, request: CommRequest) -> CommPlan:
        """An all-gather (along dim 0) or a reduce-scatter (of dim 0): c10d where symmetric memory
        cannot run it or `config.comm.gather_scatter` says so; else the tuned table's choice for
        the gathered tensor's bytes where it measured this collective; else the symmetric kernel
        up to `comm.gather_scatter_max_bytes` per rank. That cap is a guess, not a measurement:
        each rank pulls the W shards over its links in one kernel, whose barriers cost a few µs
        (what NCCL's launch costs), while at large sizes NCCL's ring keeps every link busier."""
        why = self.comm_ineligible(request)
        size = request.size
        if not why and (not size or int(size[0]) == 0 or sizevars.product(size) == 0):
            why = "an empty or 0-d tensor"
        world = group_size(request.group) if not why else 0
        if not why and request.collective == "reduce_scatter_tensor" and int(size[0]) % world:
            why = f"dim 0 ({size[0]}) is not a multiple of the {world} ranks"
        symm = {"all_gather_into_tensor": "symm_all_gather", "reduce_scatter_tensor": "symm_reduce_scatter"}[request.collective]
        forced = config.comm.gather_scatter
        full = 0 if why else request.nbytes * (world if request.collective == "all_gather_into_tensor" else 1)
        if why:
            name, reason = "c10d", why
        elif forced != "auto":
            name, reason = (symm if forced == "symmetric" else "c10d"), "forced by config.comm.gather_scatter"
        elif (best := lookup(world, full, request.device, collective=request.collective)) is not None:
            name, reason = best[0], f"{best[0]} is fastest at {full} bytes in {best[1]}"
            if name != "c10d" and (hidden := self.hidden_behind_compute(request, world, full)):
                name, reason = "c10d", hidden
        elif full // world <= config.comm.gather_scatter_max_bytes:
            name, reason = symm, (f"{full // world} bytes per rank, under comm.gather_scatter_max_bytes (no table "
                                  "measured this collective here: a conservative cap)")
        else:
            name, reason = "c10d", (f"{full // world} bytes per rank, over comm.gather_scatter_max_bytes (no table "
                                    "measured this collective here)")
        return CommPlan(request.collective, request.group, world, request.reduce_op, algorithm(name), reason)

    def all_reduce_with_epilogue(self, world: int, rows: int, nbytes: int, device, current: str,
                                 prologue: bool, row_numel: int) -> tuple[str, str] | None:
        """The symmetric-memory algorithm for an all-reduce whose rows (of `row_numel` elements)
        feed a fused row reduction (a norm), from the table's fused measurements (`prologue`: its
        input's producer is pointwise, so one-shot can fuse it too); None keeps `current` (forced by
        config, not fused, or no such measurements: the choice for the all-reduce alone stands)."""
        if config.comm.algorithm != "auto" or not ALGORITHMS[current].fused or ALGORITHMS[current].collective != "all_reduce":
            return None
        best = lookup(world, nbytes, device, rows=rows, prologue=prologue)
        if best is None or best[0] not in ALGORITHMS or not ALGORITHMS[best[0]].fused:
            return None
        algo, table = best
        if ALGORITHMS[algo].gathers_shares and not self.is_persistent(row_numel, reads_peers=True):
            return None  # its rows would be looped, which two-shot cannot gather (codegen reads one-shot)
        return algo, f"{algo} is fastest with a fused row epilogue at {rows} rows x {nbytes // rows} bytes in {table}"

    def algorithm_without_shares(self, plan: CommPlan, why: str) -> tuple[str, str]:
        """The algorithm of a two-shot plan whose fused kernel cannot gather the shares: one-shot."""
        return "one_shot", f"two-shot cannot gather in its fused kernel ({why}); was: {plan.reason}"

    def comm_prologue(self, plan: CommPlan) -> bool:
        """Fuse an all-reduce input's pointwise producer into the comm kernel? For one-shot it
        usually saves a pass; with one row and a norm after it, it measured slower on 4x H200
        (1 x 4096: 10.4 µs fused against 7.9 apart; why was not found), so the tuned table picks
        `one_shot_apart` there. Two-shot reduces each share before the kernel's body runs, so its
        input must be written by an earlier kernel."""
        return plan.algorithm.prologue

    # ------------------------------------------------------------------------- attention
    def use_decode_attention(self, device, dtype, b: int, hq: int, hkv: int, s: int, d: int) -> bool:
        """Our split-KV kernel (codegen/decode_attention.py) for one query token over a cache of
        `s` keys, instead of aten's SDPA: `config.decode_attention` if set, else where the measured
        table (DECODE_ATTENTION_WINS) has this GPU and shape."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16) or device.type not in ("cuda", "cpu") \
                or d > 256 or hq % hkv:
            return False
        if config.decode_attention is not None:
            return config.decode_attention
        return device.type == "cuda" and any(
            w["gpu"] == torch.cuda.get_device_name(device) and w["dtype"] == str(dtype) and w["head_dim"] == d
            and w["group"] == hq // hkv and w["batch"][0] <= b <= w["batch"][1] and w["keys"][0] <= s <= w["keys"][1]
            for w in DECODE_ATTENTION_WINS)

    def decode_attention_config(self, device, b: int, hkv: int, group: int, s: int, d: int) -> dict:
        """Blocks of the decode kernel: about two programs per SM, each split at least 256 keys
        long (fewer, longer splits when B x Hkv alone fills the GPU; the kernel divides the keys
        up to the mask's last kept one among them); the query heads of a group padded to 16 rows,
        tl.dot's least; the mask scanned 2048 keys a step. Heads of 64 or less take 128 keys a
        step over 3 stages: on H200, 52.9 -> 41.8 µs at B=8 and 8192 keys, 41.5 -> 34.2 at B=1
        and 32768 (a sweep of blocks, programs per SM and stages; 128 wide heads gained <2%)."""
        block_n = 128 if d <= 64 else 64 if d <= 128 else 32
        return {"BLOCK_N": block_n, "GBLOCK": max(16, next_pow2(group)), "DBLOCK": max(16, next_pow2(d)),
                "SPLITS": key_splits(device, b * hkv, s, block_n), "SCAN": min(2048, next_pow2(s)),
                "F32": device.type != "cuda",  # interpreted: fp32 dots
                "num_warps": 4, "num_stages": 3 if d <= 64 else 2}

    # ------------------------------------------------------------------------- launches
    def dependent_launch(self, device) -> bool:
        """Launch generated kernels as programmatic dependents of the kernel before them (Hopper
        and later; `config.dependent_launch`)? Each waits at its top for that kernel and its writes
        (triton_helpers.after_predecessor), so its launch and its programs' start overlap that
        kernel's tail: a decode step is a chain of short kernels (Llama-3.2-1B's on one H100: 1251
        -> 1202 µs). Prefetching a matmul's first weight tiles into L2 before the wait measured
        slower (1268 µs; 1581 for 16 steps). Comm kernels launch as before."""
        return bool(config.dependent_launch) and device.type == "cuda" and torch.version.hip is None \
            and _capability(device.index)[0] >= 9 and compat.triton_has_dependent_launch()

    # ------------------------------------------------------------------------- matmuls
    def use_mm_template(self, a, b, siblings: int = 0) -> bool:
        """Our Triton kernel for `a @ b` (codegen/matmul.py) instead of aten's mm: few rows and
        static sizes, where the weight streams once from memory. On H200 it reached 3.3–3.7 TB/s
        against cuBLAS's 3.0–3.5 at 1–16 rows, and a fused activation costs it nothing (a
        341-configuration sweep, docs/results.md); at 32 rows they tie. bf16/fp16 only: fp32 would
        need tl.dot's slow IEEE mode to match aten (whose fp32 mm does not use TF32). Where this
        GPU's table has cuBLAS faster at the shape, cuBLAS, unless `siblings` other matmuls read
        the same `a`: one launch for them all, with their epilogues (q's rotary embedding), beats
        a lone matmul's edge (H200, 1B decode: q by cuBLAS left its group and its rotary apart)."""
        if not config.mm_template or a.get_dtype() not in MM_TEMPLATE_DTYPES or b.get_dtype() != a.get_dtype():
            return False
        if a.get_device().type not in ("cuda", "cpu"):  # the CPU runs Triton's interpreter
            return False
        (m, k), (_, n) = a.get_size(), b.get_size()
        if not all(sizevars.is_static(s) for s in (m, k, n)):
            return False
        if not (1 <= int(m) <= config.mm_template_max_rows and int(k) >= 16 and int(n) >= 16):
            return False
        row = mm_row(a.get_device(), int(m), int(k), int(n))  # this GPU's measured table: cuBLAS where it won
        return row is None or row["us"] <= row["cublas_us"] or (siblings > 0 and self.mm_group_member(1))

    def mm_group_member(self, members: int) -> bool:
        """May a few-row matmul join a group of `members` that load the same `a` (one launch over
        all their column blocks)? Up to MM_GROUP_MAX (a decode layer's q, k, v are three), unless
        `config.mm_group` is off."""
        return config.mm_group and members < MM_GROUP_MAX

    def mm_epilogue(self, members: int, shape: tuple, width: int) -> bool:
        """Does a pointwise consumer of `members` of a matmul group of `shape` (M, N, K, device)
        join it as its epilogue? Yes (unless `config.mm_group` is off): its launch goes, and the
        members only it reads are never stored (SiLU(gate) * up; the rotary embedding of q, and of k
        stored into the KV cache beside v; a lone matmul's bias or residual add). One that needs
        tiles `width` columns wide (a rotary embedding: a head) joins even where this GPU's table
        measured narrower ones for the group, which then takes the widened heuristic's blocks
        (`mm_template_config`): on H100 the 1B decode's q/k/v measured 8.0 µs in 32-column tiles
        and 8.3 in 64, where the two kernels the epilogue saves took 3 µs a layer."""
        return config.mm_group and members >= 1

    def mm_template_config(self, m: int, n: int, k: int, device=None, dots: int = 1, width: int = 16) -> dict:
        """Blocks of the few-row matmul streaming `n` weight columns in all: the fastest measured on
        this GPU at this K and N (tables/mm, bench/mm_sweep.py), else one program per 64 columns,
        and K split over several (partial sums added atomically) when the columns alone leave SMs
        idle. Thresholds from the H200 sweep (132 SMs): 7168 columns run best unsplit with 256-deep
        steps, 4096 split in 4. A program of `dots` weights' tiles (an epilogue's members) streams
        what one matmul's would, so each tile is 1/dots as wide: gate and up of 3584 columns each
        took 21.1 µs a launch in 64-column tiles, one matmul of 7168 takes 16.9 (H200). Tiles are
        at least `width` columns (an epilogue's rotary embedding: a whole head), K split the more."""
        cfg = self._mm_config(m, n, k, device, width)
        bm, bn, bk = cfg["BLOCK_M"], max(width, cfg["BLOCK_N"] // dots), cfg["BLOCK_K"]
        while bk > 64 and (bm + dots * bn) * bk > (bm + cfg["BLOCK_N"]) * cfg["BLOCK_K"]:
            bk //= 2  # (tiles kept 16 wide take more shared memory a step)
        return {**cfg, "BLOCK_N": bn, "BLOCK_K": bk}

    def _mm_config(self, m: int, n: int, k: int, device, width: int) -> dict:
        row = mm_row(device, m, k, n)
        if row is not None and row["config"]["BLOCK_N"] >= width:
            return {"BLOCK_M": max(16, next_pow2(m)), **row["config"]}
        block_n = max(64, width)
        programs = -(-n // block_n)
        split, block_k = 1, 256
        if programs < 96:
            block_k = 128
            while programs * split < 192 and split < 8 and k >= 4 * split * 64:
                split *= 2
        while block_k > 16 and k < block_k * split:
            block_k //= 2
        return {"BLOCK_M": max(16, next_pow2(m)), "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
                "num_warps": 4, "num_stages": 4 if split == 1 else 3}


def key_splits(device, rows: int, keys: int, block_n: int, per_sm: int = 2) -> int:
    """Splits of `keys` for the decode kernel's `rows` (B x Hkv) programs: `per_sm` programs per SM,
    each split at least 256 keys and a whole number of `block_n` blocks, at most 64."""
    splits = max(1, min(-(-per_sm * sm_count(device) // rows), 64, -(-keys // 256)))
    chunk = -(-(-(-keys // splits)) // block_n) * block_n
    return -(-keys // chunk)


def current() -> Choices:
    """`config.choices`, or the default policy."""
    chosen = config.choices or Choices()
    if not isinstance(chosen, Choices):
        raise TypeError(f"commfuse: config.choices must be an instance of commfuse.choices.Choices "
                        f"(or a subclass), not {type(chosen).__name__}")
    return chosen


def install(choices: Choices | None = None):
    """`with install(): ...` puts `config.choices` (or the default policy) on `V`."""
    return V.set_choices(choices if choices is not None else current())
