"""Per-rank dumps: COMMFUSE_DUMP_DIR/rank<R>/<graph-id>/ with the FX graph, the IR before
and after fusion, the generated module and a JSON summary, all byte-identical from run to run of
the same program (the rank diff, `commfuse.diff`, compares them); what belongs to one run (compile
time, cache) goes to timing.json beside them."""
from __future__ import annotations

import json
import logging
import os
import sys

from . import config

RUN_KEYS = ("compile_seconds", "cache_hit", "cache", "cache_key", "cache_skipped")  # timing.json's
_unwritable: set = set()  # dump folders already warned about


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def write(graph_id: str, files: dict[str, str], summary: dict) -> str | None:
    """The graph's dump folder, written; None without `dump_dir`, or where it cannot be written
    (a warning once: the compile goes on, undumped)."""
    if not config.dump_dir:
        return None
    path = os.path.join(config.dump_dir, f"rank{rank()}", graph_id)
    run = {k: summary[k] for k in RUN_KEYS if k in summary}
    files = {**files, **{name: json.dumps(value, indent=1, default=str) for name, value in (
        ("summary.json", {k: v for k, v in summary.items() if k not in run}), ("timing.json", run))}}
    try:
        os.makedirs(path, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(text)
    except OSError as e:
        if config.dump_dir not in _unwritable:
            _unwritable.add(config.dump_dir)
            logging.getLogger("commfuse").warning(
                "commfuse: cannot write dumps under dump_dir=%r (COMMFUSE_DUMP_DIR): %s; compiling without "
                "them. Point it at a folder this process may create and write.", config.dump_dir, e)
        return None
    return path


# ---- torch's logging: TORCH_LOGS and the structured trace (TORCH_TRACE, read by tlparse)
_artifacts: dict = {}  # artifact loggers of ours under torch's artifact names
SLOW_COMPILE_S = 10    # a graph compiling longer says so on rank 0, whatever TORCH_LOGS says


def register_torch_logging() -> None:
    """`TORCH_LOGS="+commfuse"` (our log), `output_code`, `ir_pre_fusion` and `ir_post_fusion` (ours
    beside Inductor's), as if commfuse were in torch's registry when torch read TORCH_LOGS."""
    from torch._logging import _internal as tl
    log = logging.getLogger("commfuse")
    if not tl.log_registry.is_log("commfuse"):
        tl.register_log("commfuse", "commfuse")
    # TORCH_LOGS naming commfuse: torch imports us as a module while reading it, then gives the log
    # its handler; naming only artifacts (output_code), it read it before we were here
    named = {n.strip().lstrip("+-").split(".")[0] for n in os.environ.get("TORCH_LOGS", "").split(",")}
    if os.environ.get("TORCH_LOGS") and "commfuse" not in named and not any(map(tl._is_torch_handler, log.handlers)):
        tl._setup_handlers(logging.StreamHandler, log)  # what torch's _init_logs gives its own
    for name in ("output_code", "ir_pre_fusion", "ir_post_fusion"):
        _artifacts[name] = tl.getArtifactLogger(__name__, name)


def ir_wanted() -> bool:
    """Whether to print the IR (it costs as much as a cache hit): for dumps, logs or a trace."""
    return bool(config.dump_dir or os.environ.get("TORCH_TRACE")) or any(
        _artifacts[n].isEnabledFor(logging.DEBUG) for n in ("ir_pre_fusion", "ir_post_fusion") if n in _artifacts)


def publish(graph_id: str, source: str, pre_fusion: str, post_fusion: str, summary: dict) -> None:
    """The generated module, the IR before and after fusion and the comm plans to torch's logging:
    TORCH_LOGS artifacts, and structured-trace artifacts (per rank and compile: tlparse)."""
    from torch._logging._internal import trace_structured_artifact
    texts = {"output_code": source, "ir_pre_fusion": pre_fusion, "ir_post_fusion": post_fusion}
    for name, text in texts.items():
        if text and name in _artifacts:
            _artifacts[name].debug("commfuse %s of graph %s, rank %d:\n%s", name, graph_id, rank(), text)
    plans = {k: summary.get(k) for k in ("comm_plans", "comm_buffers", "comm_pools", "collective_order",
                                          "c10d_overlap", "kernels", "extern_calls")}
    for name, text in [*texts.items(), ("comm_plans", json.dumps(plans, indent=1, default=str))]:
        if text:
            trace_structured_artifact(f"commfuse_{graph_id}_{name}", "json" if name == "comm_plans" else "string",
                                      lambda text=text: text)


def progress(graph_id: str, summary: dict, nodes: int | None, seconds: dict, cache: str | None) -> None:
    """One INFO line per graph (TORCH_LOGS=commfuse): its size, where the time went, the cache.
    A compile longer than SLOW_COMPILE_S prints it on rank 0 in any case."""
    log = logging.getLogger("commfuse")
    total = summary.get("compile_seconds", 0.0)
    comm = sum(1 for k in summary.get("kernels", ()) if k.get("collective"))
    line = (f"commfuse: graph {graph_id}: {f'{nodes} aten nodes -> ' if nodes is not None else ''}"
            f"{len(summary.get('kernels', ()))} kernels ({comm} comm), {len(summary.get('extern_calls', ()))} extern "
            f"calls; {total:.2f} s" + "".join(f", {k} {v:.2f}" for k, v in seconds.items())
            + (f"; loaded from the {cache} cache" if cache else "; cache miss"))
    if log.isEnabledFor(logging.INFO):
        log.info("%s", line)
    elif total > SLOW_COMPILE_S and rank() == 0:
        print(line, file=sys.stderr, flush=True)
