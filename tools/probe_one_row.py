"""Diagnostic: AR + residual + RMSNorm with a pointwise producer at 1 and 2 rows (torchrun, GPUs),
one-shot with the producer fused, under variants of the generated kernel: the index broadcast by
`+ tl.zeros` (as generated) or `tl.broadcast_to`, 4 / 16 warps instead of 8; and two-shot.

    torchrun --standalone --nproc-per-node 4 tools/probe_one_row.py

Results: bench/results/probe_one_row_4xh200.txt. The one-row cost of the fused producer is not the
index form; the tuned table keeps that producer apart instead."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401  (registers the backend)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from codegen import triton as tk  # noqa: E402
from commfuse import choices  # noqa: E402
from commfuse.tune import ar_norm_step, cuda_graph_time_us  # noqa: E402

GENERATED_INDEX, GENERATED_BLOCKS = tk.TritonKernel.index_str, choices.comm_kernel_blocks


def broadcast_index_str(self, index):
    index = self.simplify_index(index)
    text = tk.texpr(index.subs({tk.XSYM: tk.XNAME, tk.RSYM: tk.RNAME}))
    want = {tk.XSYM, tk.RSYM} if self.in_loop() else {tk.XSYM}
    if want <= index.free_symbols or not index.free_symbols & want:
        return GENERATED_INDEX(self, index)
    return f"tl.broadcast_to({text}, {self.shape()})"


VARIANTS = {  # name: (index_str, num_warps or None, algorithm)
    "zeros": (GENERATED_INDEX, None, "one_shot"),
    "broadcast": (broadcast_index_str, None, "one_shot"),
    "w4": (GENERATED_INDEX, 4, "one_shot"),
    "w16": (GENERATED_INDEX, 16, "one_shot"),
    "two_shot": (GENERATED_INDEX, None, "two_shot"),
}


def time_variant(step, index_str, warps, algorithm, x, res) -> float:
    """Compile under the patched code generator and time at once: Dynamo reuses a compiled graph
    for a later torch.compile with equal options, so each variant gets a fresh cache."""
    tk.TritonKernel.index_str = index_str
    choices.comm_kernel_blocks = GENERATED_BLOCKS if warps is None else \
        (lambda *a: {**GENERATED_BLOCKS(*a), "num_warps": warps})
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda x, r: step(x * 1.0, r), backend="commfuse", dynamic=False,
                           options={"comm.algorithm": algorithm})
        return cuda_graph_time_us(lambda: fn(x, res))
    finally:
        tk.TritonKernel.index_str, choices.comm_kernel_blocks = GENERATED_INDEX, GENERATED_BLOCKS


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    for hidden in (4096, 8192):
        step = ar_norm_step(dist.group.WORLD, torch.randn(hidden, dtype=torch.bfloat16, device=dev))
        for rows in (1, 2):
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
            res = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
            times = {name: time_variant(step, *v, x, res) for name, v in VARIANTS.items()}
            if dist.get_rank() == 0:
                print(f"H={hidden} rows={rows}: " + "  ".join(f"{k} {t:.1f}" for k, t in times.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
