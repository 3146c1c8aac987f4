"""Each collective is decided once, into a `CommPlan`: its group, its algorithm and why.

Lowering asks policy (`V.choices.all_reduce_plan`, `V.choices.gather_scatter_plan`) while it still
places the input, so that the producer of a symmetric-memory algorithm writes straight into the pool. An all-reduce whose rows
feed a norm is asked once more before fusion, from the fused measurements (the scheduler's
`choose_comm_algorithms`); nothing decides it after that. Codegen renders the plan, the wrapper
places its buffer, and the dumps print it (`summary.json`: `comm_plans`).

Algorithms are a registry: a new one is one `register_algorithm` call here (or in the user's code)
plus its kernel, and a `Choices` subclass that picks it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from commfuse import config, sizevars
from commfuse.codegen import comm as comm_codegen


@dataclasses.dataclass(frozen=True)
class CommRequest:
    """What policy sees of one collective: its kind, group and message."""
    collective: str
    reduce_op: str
    group: str
    dtype: torch.dtype
    device: torch.device
    size: tuple                   # ints, or sympy expressions in a dynamic-shape graph
    inplace: bool = False
    independent_flops: int = 0    # matmul work the overlap order can run while it is in flight

    @property
    def numel(self):
        return sizevars.product(self.size)

    @property
    def nbytes(self) -> int:
        return int(self.numel) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class CommAlgorithm:
    """How an algorithm lowers and renders. Fused algorithms become a loop body that reads the
    peers' copies (`ops.peer_reduce`; an all-gather's `ops.peer_load`), which codegen/triton.py
    renders inside the fused kernel of its consumers; the others become a `CommKernel` that the
    wrapper launches (`kernel`: standalone Triton source, also what `commfuse.tune` times) or calls
    (`call`: one line of the wrapper)."""
    name: str
    collective: str = "all_reduce"  # the `_c10d_functional` op it implements ("" : any, as c10d)
    symmetric: bool = True        # the input lives in the group's symmetric pool (peers read it)
    fused: bool = False           # consumers fuse into its loop body (not when it runs in place)
    prologue: bool = False        # ... and so does the input's pointwise producer
    gathers_shares: bool = False  # fused two-shot: each rank reduces a share of every block first
    kernel: Callable | None = None  # kernel(name, world, reduce_op, dtype, inplace) -> Triton source
    call: Callable | None = None    # call(plan, src, out) -> a wrapper statement
    eligible: Callable = lambda request: ""  # why it cannot run `request` ("" when it can)


@dataclasses.dataclass(eq=False)
class CommPlan:
    """One collective of the graph, decided. `buffer` is its input in the symmetric pool (None when
    it is not symmetric); `result` the buffer that holds its value; `copy_in` says that the input
    was copied into the pool (the value was not ours to place: a graph input, say)."""
    collective: str
    group: str
    world: int
    reduce_op: str
    algorithm: CommAlgorithm
    reason: str = ""
    inplace: bool = False
    buffer: str | None = None
    result: str | None = None
    copy_in: bool = False

    def record(self) -> dict:
        """For summary.json and the dumps."""
        return {"collective": self.collective, "group": self.group, "world": self.world,
                "reduce_op": self.reduce_op, "algorithm": self.algorithm.name, "reason": self.reason,
                "inplace": self.inplace, "buffer": self.buffer, "result": self.result,
                "copy_in": self.copy_in}


ALGORITHMS: dict[str, CommAlgorithm] = {}


def register_algorithm(algorithm: CommAlgorithm) -> CommAlgorithm:
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def algorithm(name: str) -> CommAlgorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"commfuse: unknown comm algorithm {name!r}; registered: "
                         f"{', '.join(ALGORITHMS)} (commfuse/collectives.py: register_algorithm)") from None


# ------------------------------------------------------------------------------- built-in
def _cuda_sum(request: CommRequest) -> str:
    return "" if request.device.type == "cuda" and request.reduce_op == "sum" else "torch's kernel needs CUDA and sum"


def _torch_one_shot(plan: CommPlan, src: str, out: str) -> str:
    return f"{out} = torch.ops.symm_mem.one_shot_all_reduce({src}, {plan.reduce_op!r}, {plan.group!r})"


register_algorithm(CommAlgorithm("one_shot", fused=True, prologue=True, kernel=comm_codegen.one_shot_all_reduce))
# one-shot with its input's producer in a kernel of its own (choices.py: all_reduce_with_epilogue)
register_algorithm(CommAlgorithm("one_shot_apart", fused=True, kernel=comm_codegen.one_shot_all_reduce))
register_algorithm(CommAlgorithm("two_shot", fused=True, gathers_shares=True, kernel=comm_codegen.two_shot_all_reduce))
register_algorithm(CommAlgorithm("torch_one_shot", call=_torch_one_shot, eligible=_cuda_sum))
# the aten collective, asynchronous, waited on where the graph waits (an extern, not a comm buffer)
register_algorithm(CommAlgorithm("c10d", collective="", symmetric=False))
# all-gather along dim 0: output element i is peer (i // shard)'s element i % shard, loaded in the
# kernel of its consumers; reduce-scatter: output element i combines every peer's element
# rank * shard + i. Each rank pulls from every peer between the fused kernel's barriers.
register_algorithm(CommAlgorithm("symm_all_gather", collective="all_gather_into_tensor", fused=True))
register_algorithm(CommAlgorithm("symm_reduce_scatter", collective="reduce_scatter_tensor", fused=True))
# async-TP (passes/async_tp.py): the collective and its matmuls as one op of runtime/async_tp.py,
# chunk by chunk over a workspace of its own
register_algorithm(CommAlgorithm("async_tp", collective="", symmetric=False))
# what config.comm.algorithm may be: "auto" (policy's choice), "torch" (torch_one_shot), or it forces an all-reduce's
config.one_of("comm.algorithm", lambda: {"auto", "torch"} | {n for n, a in ALGORITHMS.items() if a.collective in ("all_reduce", "")})
