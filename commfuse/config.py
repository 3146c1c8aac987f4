"""commfuse options.

Every option is a module attribute with a default, overridable by the environment
(`COMMFUSE_<NAME>`, upper case, read at import), by `config.patch(...)` (a context
manager and decorator), or per compile through `torch.compile(..., options={...})`.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import sys
from typing import Any, Callable

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
dependent_launch = True       # on Hopper and later, generated kernels launch as programmatic dependents
                              # of the kernel before them: each waits at its top for that one to finish,
                              # so its launch and start-up overlap that one's tail

# Attention.
sdpa_gqa = True               # K/V repeated for grouped-query attention reach SDPA unrepeated,
                              # with enable_gqa=True (no copies of K/V: attention.py)
decode_attention: bool | None = None  # one-token SDPA over a cache by our split-KV kernel: True
                              # always, False never, None where choices' measured table says it wins

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
mm_group = True               # those that read the same left operand run as one kernel, with a
                              # pointwise consumer of one or more of them as its epilogue (mm_group.py)

# Memory.
reorder_for_peak_memory = True  # memory-aware kernel orders (lowest estimated peak), no fusion raising it
overlap_collectives = True      # c10d collectives issued as early as their inputs allow, waited at first use
overlap_peak_share = 0.10       # ... unless that raises the estimated peak by more than this share
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
    algorithm = "auto"             # auto | torch | a registered all-reduce algorithm (collectives.py)
    # one-shot all-reduce up to this many bytes per world size (larger: c10d)
    one_shot_max_bytes = {2: 1 << 20, 4: 512 << 10, 8: 256 << 10}
    # built-in thresholds when no tuned table matches: two-shot up to this many bytes
    two_shot_max_bytes = {2: 0, 4: 8 << 20, 8: 8 << 20}
    # all-gather / reduce-scatter: auto (the table's choice, else the cap below) | symmetric | c10d
    gather_scatter = "auto"
    # without a table that measured them: the symmetric-memory kernels up to this many bytes per
    # rank's shard (larger: c10d); a conservative guess, not a measurement
    gather_scatter_max_bytes = 1 << 20
    hide_behind_compute = True     # c10d (own stream) where independent matmuls outlast it, not a faster kernel
    # all-gather -> matmul and matmul -> reduce-scatter chunked per rank, transfers overlapping the
    # matmuls (passes/async_tp.py): auto (Choices.async_tp) | on | off
    async_tp = "auto"
    async_tp_graphs = True         # ... each op's launches replayed as a CUDA graph per call's addresses
                                   # (runtime/async_tp.py; read when the op runs)
    table: str | None = None       # a `commfuse.tune` JSON table (None: the shipped one for this host)
    groups: list | None = None     # only these group names (None: all)
    sum_before_all_reduce = True   # all_reduce(a) + all_reduce(b) as all_reduce(a + b) (comm_sums.py)
    bucketing = True               # merge small collectives of one group and dtype (passes/bucketing.py)
    bucket_member_max_bytes = 1 << 20  # a collective up to this size may join a bucket
    bucket_cap_bytes = 32 << 20    # the packed input of one bucket at most
    double_buffer_max_bytes = 4 << 20  # comm buffers up to this size take turns between two pool
                                   # slices, so a kernel reading one needs no closing barrier (the
                                   # next comm kernel's opening one covers it); 0: off
    block = 1024                   # elements per program step of the comm kernels
    bulk_block = 4096              # ... once a message needs several steps per program
    max_programs = 128             # programs of a comm kernel (each owns a barrier slot)
    num_warps = 8                  # warps of a fused all-reduce kernel that reduces rows
    persistent_reduction_max = 8192  # rows a kernel reading peers reduces in one block
    # how long the first call waits for every rank's plan (None: the process group's timeout where
    # the program gave it one, init_process_group(timeout=...), else 60 s: plan_check.peer_wait_s)
    plan_check_timeout_s: float | None = None
    # how long a comm kernel waits at a barrier for a live peer before it fails (None: as above); a
    # peer that exits ends the wait at once. The clock runs only while a peer is missing, in graphs
    # whose first call's plan check passed: a rank late by host work of its own (rank 0 alone
    # logging, evaluating, saving) must arrive within it
    barrier_timeout_s: float | None = None


_SECTIONS = {"comm": comm}


_KINDS = ((bool, (bool,)), (int, (int,)), (float, (int, float)), (str, (str, os.PathLike)),
          (list, (list, tuple, set)), (dict, (dict,)))
_SPELLED = {bool: "bool (1/0, true/false, yes/no, on/off)", list: "a list (comma-separated or JSON)",
            dict: "a JSON object"}

# What an option's type allows but its meaning does not: (what it must be, the test, the options).
# A dict's values are tested. Every option is also checked against its type.
_RULES = (
    ("above 0", lambda v: v > 0, ("max_fusion_size", "persistent_reduction_max", "split_reduction_programs",
                                  "split_reduction_min", "comm.max_programs", "comm.persistent_reduction_max",
                                  "comm.bucket_member_max_bytes", "comm.bucket_cap_bytes",
                                  "comm.plan_check_timeout_s", "comm.barrier_timeout_s")),
    ("0 or more", lambda v: v >= 0, ("realize_users_threshold", "realize_reads_threshold", "realize_opcount_threshold",
                                     "realize_acc_reads_threshold", "realize_acc_reads_size_threshold",
                                     "mm_template_max_rows", "pad_rows_min_bytes", "mix_order_min_elements",
                                     "compile_workers", "overlap_peak_share", "comm.one_shot_max_bytes", "comm.two_shot_max_bytes",
                                     "comm.gather_scatter_max_bytes", "comm.double_buffer_max_bytes")),
    ("a power of 2", lambda v: v > 0 and v & (v - 1) == 0, ("max_block", "comm.block", "comm.bulk_block",
                                                             "comm.num_warps")),  # tl.arange sizes, warps
    ("at most 1024", lambda v: v <= 1024, ("comm.max_programs",)),  # barrier slots
)
# the values an enumerated option may take; comm.algorithm's are the algorithm registry's, from the
# time it has loaded (collectives.py, during `import commfuse`: `one_of`)
_ONE_OF: dict[str, Callable[[], set]] = {"comm.gather_scatter": lambda: {"auto", "symmetric", "c10d"},
                                         "comm.async_tp": lambda: {"auto", "on", "off"}}
# COMMFUSE_ variables of the project's own that are not options (tests, examples, benchmarks)
# options that leave the generated code as it is: out of the graph cache's key and the ranks' comparison
WITHOUT_EFFECT_ON_CODE = ("debug", "dump_dir", "graph_cache", "cache_dir", "compile_workers")
_NOT_OPTIONS = ("COMMFUSE_TEST_", "COMMFUSE_EXAMPLE_", "COMMFUSE_BENCH_", "COMMFUSE_OPINFO_")


def one_of(name: str, values: Callable[[], set]) -> None:
    """Option `name` takes one of `values()`, a registry's names; its environment value, read before, is checked now."""
    _ONE_OF[name] = values
    if os.environ.get(var := _variable(name)):
        parse(name, os.environ[var], var)


def _variable(name: str) -> str:
    return f"COMMFUSE_{name.replace('.', '_').upper()}"


def _kind(name: str) -> tuple[type | None, bool]:
    """(the type of an option's values, whether None is one): its annotation's, else its default's."""
    obj, attr = _owner(name)
    hint, default = str(getattr(obj, "__annotations__", {}).get(attr, "")), _DEFAULTS.get(name, getattr(obj, attr))
    words = hint.replace("|", " ").split()
    kind = next((t for t, _ in _KINDS if t.__name__ in words), None) or \
        next((t for t, _ in _KINDS if isinstance(default, t)), None)
    return kind, default is None or "None" in words


def _parse(text: str, kind: type | None, nullable: bool) -> Any:
    if nullable and text.strip().lower() == "none":
        return None
    if kind is bool:
        for value, words in ((True, ("1", "true", "yes", "on")), (False, ("0", "false", "no", "off"))):
            if text.strip().lower() in words:
                return value
        raise ValueError
    if kind is list and not text.lstrip().startswith("["):
        return [v.strip() for v in text.split(",") if v.strip()]  # COMMFUSE_FALLBACK_OPS=aten.sort,aten.topk
    if kind in (list, dict):
        import json
        parsed = json.loads(text)  # a dict's keys are world sizes (not one: _check names it)
        return {int(k) if k.strip().isdigit() else k: v for k, v in parsed.items()} \
            if kind is dict and isinstance(parsed, dict) else parsed
    if kind in (int, float, str):
        return kind(text)
    raise ValueError


# A value a compile would misread is refused, naming the option: the type of its values, and the
# rules above.
def _check(name: str, value: Any) -> None:
    kind, nullable = _kind(name)
    if name == "choices" and value is not None and (isinstance(value, type) or not hasattr(value, "use_mm_template")):
        raise TypeError(f"commfuse option choices={value!r}: expected an instance of commfuse.choices.Choices "
                        "(or of a subclass: choices=MyChoices(), not the class)")
    if value is None and nullable or kind is None:  # None, or an option of no type (choices)
        return
    accepted = dict(_KINDS).get(kind, ())
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"commfuse option {name}={value!r}: expected {_SPELLED.get(kind, kind.__name__)}"
                        f"{' or None' if nullable else ''} (docs/config.md)")
    if isinstance(value, dict) and not all(type(k) is int for k in value):  # ("2" would never match a world size)
        raise TypeError(f"commfuse option {name}={value!r}: its keys must be ints, world sizes (docs/config.md)")
    numbers = list(value.values()) if isinstance(value, dict) else [value]
    for what, ok, names in _RULES:
        if name in names and not all(type(v) in (int, float) and ok(v) for v in numbers):
            raise ValueError(f"commfuse option {name}={value!r}: must be {what}"
                             f"{' (each value)' if isinstance(value, dict) else ''} (docs/config.md)")
    if name in _ONE_OF and value not in (allowed := _ONE_OF[name]()):
        raise ValueError(f"commfuse option {name}={value!r}: must be one of {sorted(allowed)}")
    if name == "comm.groups" and not all(isinstance(g, str) for g in value):
        raise TypeError(f"commfuse option comm.groups={value!r}: expected group names, strings ('0' is the default "
                        "group's; `group.group_name` gives another's)")
    if name == "comm.table":
        import json
        try:
            with open(value) as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ValueError(f"commfuse option comm.table={value!r}: {e} (a table is what `python -m commfuse.tune` "
                             "writes)") from None
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
    out = {k: v for k, v in vars(mod).items()  # (choices: even when set to a class, to be refused)
           if not k.startswith("_") and (k == "choices" or not callable(v) and not isinstance(v, (type(sys), type)))
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


def parse(name: str, text: str, source: str | None = None) -> Any:
    """Option `name`'s value from text (an environment variable's, a command line's), checked; an
    error names `source` (the variable), the text and what was expected."""
    source = source or name
    kind, nullable = _kind(name)
    try:
        value = _parse(text, kind, nullable)
    except ValueError:
        expected = _SPELLED.get(kind, getattr(kind, "__name__", None))
        raise ValueError(f"{source}={text!r}: expected {expected}{' or None' if nullable else ''} "
                         f"(commfuse option {name}, docs/config.md)" if expected else
                         f"{source}: commfuse option {name} cannot be set from text (docs/config.md)") from None
    try:
        _check(name, value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}={text!r}: {e}") from None
    return value


def _load_env() -> None:
    """Options from `COMMFUSE_<NAME>` (empty: not set). A value that does not parse or check is an
    error naming the variable; a COMMFUSE_ variable that names no option, a warning."""
    names = {_variable(name): name for name in _options()}
    for var, name in names.items():
        if os.environ.get(var):
            _set(name, parse(name, os.environ[var], var))
    for var in sorted(os.environ):
        if var.startswith("COMMFUSE_") and var not in names and not var.startswith(_NOT_OPTIONS):
            import difflib
            import warnings
            close = difflib.get_close_matches(var[9:], [n[9:] for n in names], n=1)
            warnings.warn(f"{var} is not a commfuse option{f'; did you mean COMMFUSE_{close[0]}?' if close else ''}"
                          " (docs/config.md)", stacklevel=2)


def snapshot() -> dict[str, Any]:
    return dict(_options())


def check_names(names) -> None:
    """A ValueError naming the options commfuse does not have, each with its nearest known name."""
    known = sorted(_options())
    unknown = sorted(set(names) - set(known))
    if unknown:
        near = [f"{u!r}: did you mean {m[0]!r}?" for u in unknown if (m := difflib.get_close_matches(u, known, n=1))]
        raise ValueError(f"unknown commfuse option(s) {unknown}" + (f" ({'; '.join(near)})" if near else "") +
                         f"; see docs/config.md. Known: {known}")


class _Patch(contextlib.ContextDecorator):
    def __init__(self, changes: dict[str, Any]):
        check_names(changes)
        for k, v in changes.items():
            _check(k, v)
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


_DEFAULTS = _options()  # the types of options without an annotation, whatever a program assigns later
_load_env()
