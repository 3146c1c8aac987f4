"""A persistent on-disk cache of compiled graphs.

A hit skips lowering, scheduling and code generation: the generated module's source is read back
and loaded (Triton keeps its own kernel cache). The key is a digest of everything the generated
code depends on, written out by `describe`: the aten graph (its code, every node's value: shapes,
strides, dtypes, devices, aliasing), the example inputs, symbolic-shape facts, the whole config,
the distributed context, the device, the library versions, commfuse's own files, and any commfuse
function replaced at run time. A graph that depends on something the key cannot describe (a
config value or a constant that is not plain data) is compiled every time and never stored.

Tensor constants are never stored: an entry names the graph attribute each comes from, and a hit
takes them from the live graph. Entries are written atomically; one that cannot be read, or whose
description differs from the one it is looked up with, is a miss.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import pickle
import platform
import re
import sys
import types
import uuid

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import choices, config
from .runtime.plan_check import split_groups

log = logging.getLogger("commfuse")
FORMAT = 1


class Uncacheable(Exception):
    """The graph depends on something the key cannot describe: compile it, store nothing."""


@dataclasses.dataclass
class Generated:
    """What `backend._compile` needs from lowering, scheduling and code generation."""
    graph_id: str
    source: str
    constants: dict                 # name -> value, as the loader installs them
    summary: dict                   # without the per-call fields (graph id, timing, cache)
    device_types: set               # of every buffer (CUDA-graph mode needs {"cuda"})
    computed_device_types: set      # of the kernels' outputs (Triton's interpreter for "cpu")
    pre_fusion: str
    post_fusion: str                # "" when dumps were off
    messages: list = dataclasses.field(default_factory=list)  # (level, text) logged while compiling


@contextlib.contextmanager
def recording_messages():
    """The commfuse log records of a compile (a lowering's warning), which a hit logs again."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append((record.levelno, record.getMessage()))
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


# ------------------------------------------------------------------------------------ the key
def describe(gm: torch.fx.GraphModule, example_inputs, kind: str, donated, saved=()) -> str:
    """Everything the generated code depends on, as text (its digest is the key). Raises
    Uncacheable where a part cannot be written out faithfully."""
    storages, inputs = {}, {}  # storage -> index, for aliasing among nodes, among inputs
    parts = {
        "format": FORMAT,
        "kind": kind,
        "donated": sorted(donated),
        "saved": list(saved),
        "code": [gm.code] + [f"{name}:\n{m.code}" for name, m in gm.named_modules()
                             if m is not gm and isinstance(m, torch.fx.GraphModule)],
        "nodes": [[n.name, n.op, plain_value(n.meta.get("val"), storages)] for n in gm.graph.nodes],
        "attributes": _attributes(gm),
        "program": [gm.meta.get(k) for k in ("commfuse_program", "commfuse_checked", "commfuse_break")],  # (the plan check's)
        "inputs": [plain_value(x, inputs, strict=True) for x in example_inputs],
        "shape_env": _shape_env(example_inputs),
        **context([n.meta.get("val") for n in gm.graph.nodes]),
    }
    return json.dumps(parts, sort_keys=True)


def context(values) -> dict:
    """What generated code depends on besides its graph: the config, the distributed context, the
    devices of `values` (tensors anywhere in them), the library versions, commfuse's own code."""
    return {
        "config": _config(),
        "distributed": _distributed(),
        "device": _device(values),
        "versions": _versions(),
        "default_dtype": str(torch.get_default_dtype()),
        # lowerings choose by it (atomic adds for index_put only where order may vary)
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "commfuse_files": files_digest(),
        "replaced_functions": replaced_functions(),
    }


def digest(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def plain_value(v, storages: dict, strict: bool = False):
    """A node's value or an example input, as plain data: tensors by metadata (never by their
    data), with the storage each shares among the others (aliasing), symbolic sizes by their
    expression and hint."""
    if isinstance(v, torch.Tensor):
        try:
            storage = storages.setdefault(StorageWeakRef(v.untyped_storage()), len(storages))
        except Exception:
            storage = None
        return ["tensor", type(v).__name__, str(v.dtype), str(v.device), str(v.layout),
                [plain_value(s, storages) for s in v.shape], [plain_value(s, storages) for s in v.stride()],
                plain_value(v.storage_offset(), storages), storage, v.requires_grad, v.is_conj(), v.is_neg()]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = v.node.hint if v.node.has_hint() else None
        return [type(v).__name__, str(v.node.expr), repr(hint)]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [plain_value(x, storages, strict) for x in v]]
    if isinstance(v, dict):
        return ["dict", [[repr(k), plain_value(x, storages, strict)] for k, x in v.items()]]
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type(v).__name__, str(v)]
    mesh = mesh_description(v)
    if mesh is not None:
        return mesh
    if strict:
        raise Uncacheable(f"an example input is a {type(v).__qualname__}")
    return [type(v).__module__, type(v).__qualname__, _ADDRESS.sub("", repr(v))]


def mesh_description(v):
    """A DeviceMesh (DTensor graphs take it as an input since torch 2.13, opaque, or fake while
    tracing) by what it is: its device type, ranks, dimension names and process groups."""
    from torch.distributed.device_mesh import DeviceMesh
    v = getattr(v, "real_obj", v)  # a FakeScriptObject wraps the real object
    if not isinstance(v, DeviceMesh):
        return None
    groups = [v.get_group(d).group_name for d in range(v.ndim)]
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # the mesh's ranks are a real tensor
        ranks = v.mesh.tolist()
    return ["DeviceMesh", v.device_type, ranks, list(v.mesh_dim_names or ()), groups]


def _attributes(gm) -> list:
    """The graph's attributes: tensor constants by metadata (their values are read from the live
    graph at every load), anything else by type."""
    out = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = _fetch(gm, node.target)
        out.append([node.target, plain_value(value, {}) if isinstance(value, torch.Tensor)
                    else [type(value).__module__, type(value).__qualname__]])
    return out


def _shape_env(example_inputs):
    env = None
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None:
        env = ctx.fake_mode.shape_env
    for x in example_inputs:
        if env is None and getattr(x, "fake_mode", None) is not None:
            env = x.fake_mode.shape_env
    if env is None or not env.var_to_range:
        return None

    def items(d):
        return sorted([str(k), str(v)] for k, v in d.items())
    # torch 2.13 renamed the hints (`var_to_val` is deprecated there and warns on every read)
    hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    return {"ranges": items(env.var_to_range), "hints": items(hints),
            "replacements": items(env.replacements), "guards": [str(g.expr) for g in env.guards],
            "runtime_asserts": sorted(str(a.expr) for asserts in env.deferred_runtime_asserts.values()
                                      for a in asserts)}


def _config() -> dict:
    out = {}
    for name, value in config.snapshot().items():
        if name not in config.WITHOUT_EFFECT_ON_CODE:
            out[name] = _plain(value, name)
    out["_micro_pipeline_tp"] = choices.micro_pipeline_tp()  # turns async-TP on (Choices.async_tp)
    if config.comm.table:
        try:
            with open(config.comm.table, "rb") as f:
                out["comm.table contents"] = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            raise Uncacheable(f"comm.table {config.comm.table} unreadable: {e}") from e
    return out


def _plain(v, name: str):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_plain(x, name) for x in v]]
    if isinstance(v, (set, frozenset)):
        return ["set", sorted(json.dumps(_plain(x, name)) for x in v)]
    if isinstance(v, dict):
        return ["dict", sorted([repr(k), _plain(x, name)] for k, x in v.items())]
    raise Uncacheable(f"config option {name} is a {type(v).__qualname__}")


def _distributed():
    """The process groups a plan may depend on: their names, ranks and backends; this rank."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.distributed_c10d._world
    groups = []
    for pg, name in world.pg_names.items():
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = None
        groups.append([name, sorted(world.pg_group_ranks.get(pg, {}).items()), backend])
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "groups": sorted(groups),
            "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE"), "split": sorted(split_groups())}


def _device(values) -> dict:
    from .runtime.loader import interpreting
    cuda = torch.cuda.is_available()
    devices = set()
    for v in torch.utils._pytree.tree_leaves(values):
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            devices.add(v.device.index or 0)
    props = []
    for i in sorted(devices):
        p = torch.cuda.get_device_properties(i)
        props.append([i, p.name, [p.major, p.minor], p.multi_processor_count, p.total_memory])
    return {"cuda_available": cuda, "triton_interpret": interpreting(), "machine": platform.machine(),
            "cuda": props}


def _versions() -> dict:
    import sympy
    import triton
    out = {"python": sys.version, "torch": torch.__version__, "torch_git": torch.version.git_version,
           "cuda": torch.version.cuda, "hip": torch.version.hip, "triton": triton.__version__,
           "sympy": sympy.__version__}
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].__version__
    return out


def _package_dirs() -> list[str]:
    """commfuse's folders: this package, and lowering/ and codegen/ wherever they are installed
    (found, not imported: the package imports the compiler, which imports this module)."""
    subpackages = [importlib.util.find_spec(f"{__package__}.{name}") for name in ("lowering", "codegen")]
    return sorted({os.path.dirname(os.path.abspath(__file__)),
                   *(os.path.abspath(s.submodule_search_locations[0]) for s in subpackages)})


@functools.lru_cache(None)
def files_digest() -> str:
    """commfuse's own files (the compiler, its tables): editing any is a new key. Read once per
    process, which is the code it runs (a file edited after it is imported is not)."""
    h = hashlib.sha256()
    for top in _package_dirs():
        for root, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".json")):
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        h.update(f"{os.path.relpath(path, top)}\0".encode() + f.read() + b"\0")
    return h.hexdigest()


def replaced_functions() -> list[str]:
    """Functions in commfuse's namespaces (modules, their classes, their dict registries such as
    the lowering table) whose code lies outside commfuse and the libraries it uses: a patch made at
    run time (a test's monkeypatch, a lowering registered by a script), which the file digest
    cannot see. Each is keyed by the whole file it was written in (a change there is a new key), or
    by its own code where it has no file (made by exec: a dataclass's methods, a notebook cell).
    commfuse's own functions in a registry or under another name are keyed, in one digest, by which
    each is (name, closure): one moved to another's place (sin's lowering set to cos's) is a new key."""
    from .lowering import load_all
    load_all()  # the lowering table complete, whether or not this process has lowered a graph
    trusted = _trusted_dirs()
    out, placed = [], []
    registries = set()
    for modname, mod in sorted(sys.modules.items()):
        if not (modname == "commfuse" or modname.startswith("commfuse.")) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            found = [(attr, value)]
            if isinstance(value, type) and value.__module__ == modname:
                found += [((attr, ".{}", k), v) for k, v in vars(value).items()]
            elif isinstance(value, dict) and id(value) not in registries:  # under the first module holding it
                registries.add(id(value))
                for k, v in list(value.items()):
                    found.append(((attr, "[{}]", k), v))
                    if dataclasses.is_dataclass(v):  # a registry entry's functions (a comm algorithm's kernel)
                        found += [((attr, "[{}]." + f.name, k), getattr(v, f.name)) for f in dataclasses.fields(v)]
            for where, obj in found:
                code = _code_of(obj)
                if code is None:
                    continue
                path = code.co_filename
                if path.startswith("<"):
                    out.append(f"{modname}.{_where(where)}: {_code_digest(code)}")
                elif not _is_trusted(path, trusted):
                    out.append(f"{modname}.{_where(where)}: {path}:{code.co_firstlineno}:{_file_digest(path)}")
                elif (ident := _identity(obj)).startswith("commfuse.") and ident.partition("[")[0].rpartition(".")[2] \
                        != (where if isinstance(where, str) else where[2] if where[1] == ".{}" else None):
                    placed.append(f"{modname}.{_where(where)}: {ident}")  # in a registry, or renamed
    return out + [f"commfuse functions: {digest(chr(10).join(placed))}"]


def _identity(obj, deep: bool = True) -> str:
    """Which function `obj` is, as text the same in every process: its qualified name and, `deep`,
    the plain values of its closure, defaults and partial arguments (an op, a name), others by name."""
    if type(obj) not in _FUNCTIONS:
        plain = (int, float, bool, type(None), torch._ops.OpOverload, torch._ops.OpOverloadPacket)
        return obj if isinstance(obj, str) else repr(obj) if isinstance(obj, plain) else type(obj).__qualname__
    if type(obj) is not types.FunctionType:
        return f"{_identity(obj.func)}{[_identity(a, False) for a in obj.args]}" if type(obj) is functools.partial \
            else _identity(obj.__func__, deep)
    values = [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    for cell in obj.__closure__ or () if deep else ():  # not deeper: a recursive function holds itself
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            values.append(None)
    return f"{obj.__module__}.{obj.__qualname__}{[_identity(v, False) for v in values] if deep else ''}"


_FUNCTIONS = (types.FunctionType, types.MethodType, staticmethod, classmethod, functools.partial)


def _code_of(obj):
    while type(obj) in _FUNCTIONS:  # exact types: no attribute lookups on anything else
        if type(obj) is types.FunctionType:
            return obj.__code__
        obj = obj.func if type(obj) is functools.partial else obj.__func__
    return None


def _where(where) -> str:
    return where if isinstance(where, str) else where[0] + where[1].format(where[2])


@functools.lru_cache(None)
def _is_trusted(path: str, trusted: tuple) -> bool:
    return os.path.abspath(path).startswith(trusted)


@functools.lru_cache(None)
def _code_digest(code) -> str:
    return hashlib.sha256(_code_text(code).encode()).hexdigest()


def _code_text(code) -> str:
    """A code object as text that does not depend on the process (marshal's output may)."""
    consts = [_code_text(c) if isinstance(c, types.CodeType) else
              repr(sorted(map(repr, c))) if isinstance(c, frozenset) else repr(c) for c in code.co_consts]
    return repr((code.co_name, code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars))


def _file_digest(path: str) -> str:
    try:
        st = os.stat(path)
        return _read_digest(path, st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise Uncacheable(f"{path}, which replaces a commfuse function, cannot be read: {e}") from e


@functools.lru_cache(None)
def _read_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.lru_cache(None)
def _trusted_dirs() -> tuple:
    import sysconfig
    import sympy
    import triton
    paths = sysconfig.get_paths()
    dirs = _package_dirs() + [os.path.dirname(m.__file__) for m in (torch, triton, sympy)] + \
        [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


# ------------------------------------------------------------------------------------ entries
def cache_dir() -> str:
    from .runtime.loader import persistent_cache_dir
    base = persistent_cache_dir()
    if base is None:  # said in a warning there
        raise Uncacheable("the cache folder cannot be written")
    path = os.path.join(base, "graphs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _path(key: str) -> str:
    return os.path.join(cache_dir(), f"{key}.pkl")


def pass_over(key: str, why: str) -> None:
    """Graph `key`'s copy in AOTAutograd's cache, which has no graph to lower again or rerun through
    aten, is passed over from now on (its ranks cut their graphs apart, runtime/plan_check.PlansSplit;
    its first run failed): a start that finds it compiles afresh, from the FX graph."""
    try:
        with open(_path(key) + ".passed_over", "w") as f:
            f.write(why)
    except (OSError, Uncacheable):  # the cache folder's warning said so
        pass


def passed_over(key: str) -> str | None:
    try:
        with open(_path(key) + ".passed_over") as f:
            return f.read()
    except (OSError, Uncacheable):
        return None


def store(key: str, description: str, gm: torch.fx.GraphModule, gen: Generated) -> str | None:
    """Write an entry; None when written, else why not (the graph's constants, pickling, the disk)."""
    try:
        constants = {name: constant_ref(gm, name, value) for name, value in gen.constants.items()}
        entry = {"format": FORMAT, "key": key, "description": description,
                 "generated": dataclasses.replace(gen, constants=constants)}
        data = pickle.dumps(entry, protocol=4)
        path = _path(key)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return None
    except Uncacheable as e:
        why = str(e)
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
    log.debug("commfuse: graph %s not cached: %s", gen.graph_id, why)
    return why


def lookup(key: str, description: str, gm: torch.fx.GraphModule, graph_id: str,
           need_ir: bool = False) -> Generated | None:
    """The entry for `key`, made ready for this graph: its graph id, its constants from `gm`.
    None on a miss, including an entry that cannot be read or used."""
    try:
        path = _path(key)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if entry.get("format") != FORMAT or entry.get("key") != key or entry.get("description") != description:
            raise ValueError("the entry was written for another key")
        gen = entry["generated"]
        if need_ir and not gen.post_fusion:
            log.debug("commfuse: cache entry %s has no IR for the dumps: compiling again", key)
            return None
        return loaded(gen, graph_id, gm)
    except Exception as e:
        log.debug("commfuse: cache entry %s unusable (%s: %s): compiling", key, type(e).__name__, e)
        return None


def loaded(gen: Generated, graph_id: str, gm) -> Generated:
    """A stored entry made ready for a graph of this process: its id, its constants found again
    (from `gm`, or stored by value where there is none)."""
    return dataclasses.replace(gen, graph_id=graph_id, source=gen.source.replace(gen.graph_id, graph_id),
                               constants={name: constant(gm, ref) for name, ref in gen.constants.items()},
                               messages=[(lv, m.replace(gen.graph_id, graph_id)) for lv, m in gen.messages])


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def constant_ref(gm, name: str, value):
    """How a hit finds a constant again: a tensor, or a higher-order op's subgraph (flex_attention's
    score_mod), as the graph attribute holding it (the key has the subgraph's code; a tensor's value
    is never stored), or by value without a graph (AOTAutograd's cache keeps none); plain data
    (flex_attention's kernel options) by value; anything else by import path."""
    if isinstance(value, (torch.Tensor, torch.fx.GraphModule)):
        if gm is None and isinstance(value, torch.fx.GraphModule):
            return ("module", value)  # pickles as its code
        if gm is None:  # on the CPU, outside fake mode: a CUDA tensor pickles only so
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                return ("value", (value.detach().cpu(), str(value.device)))
        for node in gm.graph.find_nodes(op="get_attr"):
            if _fetch(gm, node.target) is value:
                return ("attr", node.target)
        raise Uncacheable(f"constant {name} is no attribute of the graph")
    if _is_plain(value):
        return ("plain", value)
    ref = _reference(value)
    if not (_resolve(ref) is value or isinstance(value, slice) and _resolve(ref) == value):
        raise Uncacheable(f"constant {name} ({value!r}) is not found again by {ref}")
    return ("ref", ref)


def _is_plain(v) -> bool:
    if isinstance(v, dict):
        return all(type(k) is str and _is_plain(x) for k, x in v.items())
    return v is None or type(v) in (bool, int, float, str) or type(v) in (list, tuple) and all(map(_is_plain, v))


def _reference(obj) -> tuple:
    if isinstance(obj, torch._ops.OpOverload):
        return ("op", obj.namespace, obj._opname, obj._overloadname)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        ns, name = obj._qualified_op_name.split("::")
        return ("packet", ns, name)
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return ("hop", obj.name())
    if isinstance(obj, slice) and all(x is None or type(x) is int for x in (obj.start, obj.stop, obj.step)):
        return ("slice", obj.start, obj.stop, obj.step)
    if obj is Ellipsis:
        return ("ellipsis",)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        return ("python", module, qualname)
    raise Uncacheable(f"a constant of type {type(obj).__qualname__}")


def _resolve(ref: tuple):
    kind = ref[0]
    if kind == "op":
        return getattr(getattr(getattr(torch.ops, ref[1]), ref[2]), ref[3])
    if kind == "packet":
        return getattr(getattr(torch.ops, ref[1]), ref[2])
    if kind == "hop":
        return getattr(torch.ops.higher_order, ref[1])
    if kind == "slice":
        return slice(*ref[1:])
    if kind == "ellipsis":
        return Ellipsis
    if kind == "python":
        obj = importlib.import_module(ref[1])
        for part in ref[2].split("."):
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"unknown constant reference {ref}")


def constant(gm, ref: tuple):
    kind, what = ref
    if kind == "value":
        return what[0].to(what[1])
    if kind in ("module", "plain"):
        return what
    if kind == "attr":
        value = _fetch(gm, what)
        if not isinstance(value, (torch.Tensor, torch.fx.GraphModule)):
            raise ValueError(f"graph attribute {what} is no tensor or subgraph")
        return value
    return _resolve(what)
