"""Seconds per call of reductions under Triton's interpreter (CPU), after a warm-up call that
compiles: `python bench/interpreter_reductions.py std0 var1`. Results: bench/results/cpu_interpreter_reductions.md."""
import sys
import time

import torch

import commfuse

OPS = {"std0": lambda x: x.std(0), "var1": lambda x: x.var(1)}

if __name__ == "__main__":
    commfuse.config.graph_cache = False
    x = torch.randn(8, 20000)
    for name in sys.argv[1:] or list(OPS):
        fn = torch.compile(OPS[name], backend="commfuse")
        start = time.perf_counter()
        fn(x)
        first = time.perf_counter() - start
        start = time.perf_counter()
        torch.testing.assert_close(fn(x), OPS[name](x), rtol=1e-4, atol=1e-4)
        print(f"{name} (8, 20000): first call {first:.2f} s (compiles), next {time.perf_counter() - start:.2f} s", flush=True)
