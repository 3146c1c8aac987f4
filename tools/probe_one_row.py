"""Probe: AR + residual + RMSNorm, one-shot with a pointwise prologue, at 1 and 2 rows (4 ranks),
with the index broadcast by tl.zeros (as generated) or tl.broadcast_to, and with 4/8/16 warps."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa
import torch
import torch.distributed as dist
from commfuse.tune import ar_norm_step, cuda_graph_time_us
from codegen import triton as tk
from commfuse import choices

orig_index_str, orig_blocks = tk.TritonKernel.index_str, choices.comm_kernel_blocks


def bcast_index_str(self, index):
    index = self.simplify_index(index)
    text = tk.texpr(index.subs({tk.XSYM: tk.XNAME, tk.RSYM: tk.RNAME}))
    want = {tk.XSYM, tk.RSYM} if self.in_loop() else {tk.XSYM}
    if not want <= index.free_symbols:
        if index.free_symbols & want:
            return f"tl.broadcast_to({text}, {self.shape()})"
        return f"({text}) + tl.zeros({self.shape()}, tl.int32)"
    return text


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    for hidden in (4096, 8192):
        step = ar_norm_step(dist.group.WORLD, torch.randn(hidden, dtype=torch.bfloat16, device=dev))
        for rows in (1, 2):
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
            res = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
            out = []
            for variant in ("zeros", "broadcast", "w4", "w16", "bcast_two_shot"):
                tk.TritonKernel.index_str = bcast_index_str if variant.startswith("b") else orig_index_str
                warps = {"w4": 4, "w16": 16}.get(variant)
                choices.comm_kernel_blocks = (lambda *a, w=warps: {**orig_blocks(*a), "num_warps": w}) if warps else orig_blocks
                import codegen.triton as ct
                ct.choices.comm_kernel_blocks = choices.comm_kernel_blocks
                algo = "two_shot" if "two_shot" in variant else "one_shot"
                torch._dynamo.reset()
                fn = torch.compile(lambda x, r: step(x * 1.0, r), backend="commfuse", dynamic=False,
                                   options={"comm.algorithm": algo})
                fn(x, res)
                out.append(f"{variant} {cuda_graph_time_us(lambda: fn(x, res)):.1f}")
            if dist.get_rank() == 0:
                print(f"H={hidden} rows={rows}: " + "  ".join(out), flush=True)
    dist.destroy_process_group()


main()
