"""commfuse options.

Every option is a module attribute with a default, overridable by the environment
(`COMMFUSE_<NAME>`, upper case, read at import), by `config.patch(...)` (a context
manager and decorator), or per compile through `torch.compile(..., options={...})`.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

# Debugging and dumps. (debug, dump_dir and the cache options are left out of the graph cache's key:
# they must not change the generated code. Every other option is in it.)
debug = False                 # log each compiled graph's summary
dump_dir: str | None = None   # write per-rank dumps under this folder (COMMFUSE_DUMP_DIR)
fallback_on_error = True      # a graph we fail to compile runs through aten instead of raising;
                              # a lowering that fails costs only its op (run through aten)
fallback_ops: list = []       # aten ops run as they are, neither decomposed nor lowered, by name:
                              # an overload ("aten.native_layer_norm.default") or all overloads
                              # ("aten.native_layer_norm"); an escape hatch, and how tests reach
                              # the fallback of ops we normally lower

# Policy.
choices = None                # a commfuse.choices.Choices (subclass) instance that makes every
                              # heuristic decision; None: the default Choices()

# Caches.
cache_dir: str | None = None  # generated modules and the graph cache live under this folder
                              # (COMMFUSE_CACHE_DIR; None: <tmp>/commfuse_<uid>)
graph_cache = True            # keep compiled graphs on disk (cache_dir/graphs): a graph compiled
                              # before, with the same config, versions and commfuse files, is loaded
                              # without lowering, scheduling or code generation (graph_cache.py)

# Execution.
cuda_graphs = False           # capture each compiled graph in a CUDA graph after warm-up, replay it
                              # (also `mode="reduce-overhead"`)
compile_workers: int | None = None  # processes that compile a graph's Triton kernels before its first
                                   # call, for all graphs (CUDA only); 0: each compiles at its first
                                   # launch; None: this host's CPUs / its ranks (LOCAL_WORLD_SIZE)

# Attention.
sdpa_gqa = True               # K/V repeated for grouped-query attention reach SDPA unrepeated,
                              # with enable_gqa=True (no copies of K/V: attention.py)

# Fusion.
max_fusion_size = 64          # cap on the number of IR nodes in one fused kernel
realize_users_threshold = 4   # a value with more users than this is stored, not recomputed by each
realize_reads_threshold = 4   # ... or with several users and more buffer reads than this
realize_opcount_threshold = 30  # ... or whose body has more ops than this
realize_acc_reads_threshold = 8         # realize a pointwise value that inlines more buffer reads
realize_acc_reads_size_threshold: int | None = None  # ... or reads more bytes than this; no fusion
                                                     # reads more either (None: off)

# Matmuls.
mm_template = True            # few-row matmuls (decode) by our own Triton kernel, with the left
                              # operand's pointwise producer fused into it, instead of aten's mm
mm_template_max_rows = 16     # ... up to this many rows (beyond, cuBLAS is as fast: bench/results)

# Memory.
reorder_for_peak_memory = True  # memory-aware kernel orders (lowest estimated peak), no fusion raising it
inplace_buffers = True          # a kernel may write its output over an input it is last to read
rematerialize = True              # a kernel recomputes pointwise values of other kernels where
                                  # that reads fewer bytes than loading them (min-cut, remat.py)
loop_ordering_after_fusion = True  # permute a pointwise group's loops so it fuses with a group
                                   # that walks a shared buffer in another order (read it once)

# Layout.
conv_channels_last: bool | None = None  # a graph with 2-D convolutions runs them channels_last and
                                        # stores the values between them in their inputs' layout
                                        # (cudnn transposes NCHW tensors around each conv); None:
                                        # for CUDA graphs of static shapes (choices.conv_layout)

pad_rows: bool | None = None       # large buffers whose rows are not 16-byte aligned get a padded
                                   # row stride (cuBLAS and vector loads want aligned rows); None:
                                   # on CUDA
pad_rows_min_bytes = 1 << 20       # ... buffers of at least this many bytes
keep_padded_outputs: bool | None = None  # an output stored with padded rows (GPT-2's logits) is
                                         # returned as that padded view, not copied into eager's
                                         # strides; None: where rows are padded

# Reductions.
persistent_reduction_max = 8192   # rows up to this length are reduced in one block (one read of the row)
split_reduction_programs: int | None = None  # a reduction launching fewer programs is split (None: 2 per SM)
split_reduction_min = 8192        # ... into parts of at least this many elements per program
online_softmax = True             # softmax's max and sum of exp in one pass over a looped row
mix_order_min_elements: int | None = 1 << 22  # a column sum over rows that a row kernel reads anyway (a norm's
                                  # weight gradient) joins that kernel from this many elements
                                  # (mix_order.py; None: never)

# Code generation.
triton_interpret: bool | None = None  # None: Triton's interpreter exactly when CUDA is absent (set at import)
max_block = 1024                       # largest pointwise block
emulate_precision_casts = False        # round bf16/fp16 values after every op, as eager does
                                       # (off: fp32 between the ops of a kernel; stores and the
                                       # program's own casts round either way)
use_block_ptr = False                  # N-D block pointers for affine div/mod indices


class comm:
    """Collectives (`config.patch({"comm.enabled": False})`, env `COMMFUSE_COMM_ENABLED=0`)."""
    enabled = True                 # lower eligible all-reduces to symmetric-memory kernels
    algorithm = "auto"             # auto | one_shot | one_shot_apart | two_shot | torch | c10d
    # one-shot all-reduce up to this many bytes per world size (larger: c10d)
    one_shot_max_bytes = {2: 1 << 20, 4: 512 << 10, 8: 256 << 10}
    # built-in thresholds when no tuned table matches: two-shot up to this many bytes
    two_shot_max_bytes = {2: 0, 4: 8 << 20, 8: 8 << 20}
    table: str | None = None       # a `commfuse.tune` JSON table (None: the shipped one for this host)
    groups: list | None = None     # only these group names (None: all)
    sum_before_all_reduce = True   # all_reduce(a) + all_reduce(b) as all_reduce(a + b) (comm_sums.py)
    block = 1024                   # elements per program step of the comm kernels
    bulk_block = 4096              # ... once a message needs several steps per program
    max_programs = 128             # programs of a comm kernel (each owns a barrier slot)
    num_warps = 8                  # warps of a fused all-reduce kernel that reduces rows
    persistent_reduction_max = 8192  # rows a kernel reading peers reduces in one block
    plan_check_timeout_s = 60      # how long the first call waits for every rank's plan
    # how long a comm kernel waits at a barrier for a live peer before it fails (None: the group's
    # timeout); a peer that exits ends the wait at once. The clock runs only while a peer is
    # missing, in graphs whose first call's plan check passed: a rank late by host work of its own
    # (rank 0 alone logging, evaluating, saving) must arrive within it
    barrier_timeout_s: float | None = 60.0


_SECTIONS = {"comm": comm}


def _coerce(value: str, default: Any) -> Any:
    if isinstance(default, list) and not value.lstrip().startswith("["):
        return [v.strip() for v in value.split(",") if v.strip()]  # COMMFUSE_FALLBACK_OPS=aten.sort,aten.topk
    if isinstance(default, (dict, list)):
        import json
        parsed = json.loads(value)
        return {int(k): v for k, v in parsed.items()} if isinstance(parsed, dict) else parsed
    if isinstance(default, bool) or default is None and value.lower() in ("0", "1", "true", "false"):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    return value


_POWERS_OF_TWO = ("max_block", "comm.block", "comm.bulk_block")  # block sizes of tl.arange
_KINDS = ((bool, (bool,)), (int, (int,)), (float, (int, float)), (str, (str, os.PathLike)),
          (list, (list, tuple, set)), (dict, (dict,)))


# A value a compile would misread is refused, naming the option: the type of its default (or of its
# annotation where the default is None), and the few options with a narrower range.
def _check(name: str, value: Any, default: Any) -> None:
    obj, attr = _owner(name)
    hint = str(getattr(obj, "__annotations__", {}).get(attr, ""))
    if value is None and (default is None or "None" in hint):
        return
    for t, accepted in _KINDS:
        if isinstance(default, t) if default is not None else t.__name__ in hint:
            if not isinstance(value, accepted) or (t is not bool and isinstance(value, bool)):
                raise TypeError(f"commfuse option {name}={value!r}: expected {t.__name__}"
                                f"{' or None' if 'None' in hint else ''} (docs/config.md)")
            break
    if name in _POWERS_OF_TWO and not (value > 0 and value & (value - 1) == 0):
        raise ValueError(f"commfuse option {name}={value!r}: a block size must be a power of 2")
    if name == "fallback_ops":
        for op in value:
            if not _is_aten_op(op):
                raise ValueError(f"commfuse option fallback_ops: {op!r} names no op; write an overload "
                                 "('aten.native_layer_norm.default') or all of an op's ('aten.native_layer_norm')")


def _is_aten_op(name: Any) -> bool:
    import torch
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) not in (2, 3) or not hasattr(torch.ops, parts[0]):
        return False
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    return packet is not None and (len(parts) == 2 or parts[2] in packet.overloads())


def _options() -> dict[str, Any]:
    """Every option by name; options of a section are named `section.option`."""
    mod = sys.modules[__name__]
    out = {k: v for k, v in vars(mod).items()
           if not k.startswith("_") and not callable(v) and not isinstance(v, (type(sys), type))
           and k not in ("annotations",)}
    for sec_name, sec in _SECTIONS.items():
        out.update({f"{sec_name}.{k}": v for k, v in vars(sec).items() if not k.startswith("_")})
    return out


def _owner(name: str):
    if "." in name:
        sec, name = name.split(".", 1)
        return _SECTIONS[sec], name
    return sys.modules[__name__], name


def _set(name: str, value: Any) -> None:
    obj, attr = _owner(name)
    setattr(obj, attr, value)


def get(name: str) -> Any:
    obj, attr = _owner(name)
    return getattr(obj, attr)


def _load_env() -> None:
    for name, default in _options().items():
        env = os.environ.get(f"COMMFUSE_{name.replace('.', '_').upper()}")
        if env is not None:
            value = _coerce(env, default)
            _check(name, value, default)
            _set(name, value)


def snapshot() -> dict[str, Any]:
    return dict(_options())


class _Patch(contextlib.ContextDecorator):
    def __init__(self, changes: dict[str, Any]):
        known = _options()
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"unknown commfuse option(s) {unknown}; known: {sorted(known)}")
        for k, v in changes.items():
            _check(k, v, known[k])
        self.changes = changes
        self.saved: list[dict[str, Any]] = []

    def __enter__(self):
        self.saved.append({k: get(k) for k in self.changes})
        for k, v in self.changes.items():
            _set(k, v)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.pop().items():
            _set(k, v)
        return False


def patch(changes: dict[str, Any] | None = None, **kwargs: Any) -> _Patch:
    """`with config.patch(max_fusion_size=8): ...` or `@config.patch({"debug": True})`."""
    return _Patch({**(changes or {}), **kwargs})


_load_env()
