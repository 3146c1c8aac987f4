"""Where the few-row matmul template's time goes (one GPU): the decode MLP's matmuls compiled with
the template and with aten's mm, each timed under CUDA graphs, then one profiled step of each.

    python bench/mm_profile.py --out DIR      # DIR/mm_profile.txt, DIR/dump (generated code)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from commfuse.runtime.timing import cuda_graph_time_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    B, H, Fs = 8, 4096, 7168
    torch.manual_seed(0)
    w_up = torch.randn(H, Fs, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w_down = torch.randn(Fs, H, device="cuda", dtype=torch.bfloat16) / Fs ** 0.5
    x = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
    h = x @ w_up
    cases = {"mlp": (lambda x: F.silu(x @ w_up) @ w_down, x), "up": (lambda x: x @ w_up, x),
             "silu+down": (lambda h: F.silu(h) @ w_down, h), "down": (lambda h: h @ w_down, h)}
    lines = []
    for variant, opts in (("template", {}), ("aten mm", {"mm_template": False})):
        for name, (fn, arg) in cases.items():
            torch._dynamo.reset()
            dump = os.path.join(args.out, "dump", f"{variant.replace(' ', '_')}_{name.replace('+', '_')}")
            compiled = torch.compile(fn, backend="commfuse", options=dict(opts, dump_dir=dump))
            torch.testing.assert_close(compiled(arg).float(), fn(arg).float(), atol=3e-2, rtol=3e-2)
            lines.append(f"{variant:9s} {name:10s} {cuda_graph_time_us(lambda: compiled(arg)):7.1f} µs")
            print(lines[-1], flush=True)
            if name == "mlp":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        compiled(arg)
                    torch.cuda.synchronize()
                lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    with open(os.path.join(args.out, "mm_profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
