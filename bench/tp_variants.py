"""The variants bench/model_tp.py and the scripts beside it compare: their names and
torch.compile's arguments for each."""
from __future__ import annotations

import torch

ASYNC_TP = "inductor async-TP"  # Inductor with _micro_pipeline_tp: sequence-parallel training only
UNHIDDEN = "commfuse unhidden"  # comm.hide_behind_compute off: every collective by the table alone
UNCHUNKED = "commfuse no async-TP"  # comm.async_tp off: every all-gather / reduce-scatter apart from its matmuls
UNCHUNKED_GRAPHED = "commfuse cuda_graphs no async-TP"
CHUNKED_GRAPHED = "commfuse cuda_graphs async-TP"  # comm.async_tp on: chunked where the plan allows, replayed
SINGLE_BUFFERED = "commfuse single-buffered"  # comm.double_buffer_max_bytes 0: every comm kernel closes with a barrier
SERIAL = "commfuse serial launch"  # dependent_launch off: every kernel starts after the one before has finished
# Dynamo's guards on the module tree (each DTensor parameter's spec, its hooks) skipped: host time per call
LEAN_GRAPHED = "commfuse cuda_graphs no module guards"
LEAN_REDUCE_OVERHEAD = "inductor reduce-overhead no module guards"
VARIANTS = ("eager", "inductor", "inductor reduce-overhead", ASYNC_TP, "commfuse", "commfuse cuda_graphs", UNHIDDEN,
            UNCHUNKED, UNCHUNKED_GRAPHED, CHUNKED_GRAPHED, SINGLE_BUFFERED, SERIAL, LEAN_GRAPHED, LEAN_REDUCE_OVERHEAD)
SELF_GRAPHED = ("inductor reduce-overhead", "commfuse cuda_graphs", UNCHUNKED_GRAPHED, CHUNKED_GRAPHED, LEAN_GRAPHED,
                LEAN_REDUCE_OVERHEAD)
WORKLOADS = ("decode", "train", "sp", "fsdp")
OPT_IN = (UNHIDDEN, UNCHUNKED, UNCHUNKED_GRAPHED, CHUNKED_GRAPHED, SINGLE_BUFFERED, SERIAL, LEAN_GRAPHED,
          LEAN_REDUCE_OVERHEAD)  # A/B variants, not run by default


def compile_options(name) -> dict | None:
    """torch.compile's arguments for a variant; None for eager."""
    skip = torch.compiler.skip_guard_on_all_nn_modules_unsafe  # (unsafe where a parameter is swapped for another)
    return {"eager": None,
            "inductor": dict(dynamic=False),
            "inductor reduce-overhead": dict(mode="reduce-overhead", dynamic=False),
            ASYNC_TP: dict(dynamic=False, options={"_micro_pipeline_tp": True}),
            "commfuse": dict(backend="commfuse", dynamic=False),
            "commfuse cuda_graphs": dict(backend="commfuse", dynamic=False, options={"cuda_graphs": True}),
            UNHIDDEN: dict(backend="commfuse", dynamic=False, options={"comm.hide_behind_compute": False}),
            UNCHUNKED: dict(backend="commfuse", dynamic=False, options={"comm.async_tp": "off"}),
            UNCHUNKED_GRAPHED: dict(backend="commfuse", dynamic=False, options={"cuda_graphs": True, "comm.async_tp": "off"}),
            CHUNKED_GRAPHED: dict(backend="commfuse", dynamic=False, options={"cuda_graphs": True, "comm.async_tp": "on"}),
            SINGLE_BUFFERED: dict(backend="commfuse", dynamic=False, options={"comm.double_buffer_max_bytes": 0}),
            SERIAL: dict(backend="commfuse", dynamic=False, options={"dependent_launch": False}),
            LEAN_GRAPHED: dict(backend="commfuse", dynamic=False, options={"cuda_graphs": True, "guard_filter_fn": skip}),
            # (torch.compile takes a mode or options: reduce-overhead's CUDA graphs as an option)
            LEAN_REDUCE_OVERHEAD: dict(dynamic=False, options={"triton.cudagraphs": True, "guard_filter_fn": skip})}[name]


def compiled(model, name):
    kw = compile_options(name)
    return model if kw is None else torch.compile(model, **kw)
