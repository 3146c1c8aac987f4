"""Which compiled graph, and which of its outputs, differs from eager: a backend that runs each graph
Dynamo hands over both compiled by commfuse and as its FX module (the same inputs, cloned), and
prints each floating output's largest difference. For a model of bench/heldout_hf.py whose end
result differs, this names the first graph and output that do.

    python bench/graph_diff.py CodeGenForCausalLM --pad --device cuda [--reshape]

--reshape: call once at the bench's sizes, then at others (B=3, S=12), as its recompile phase
does; the second call's graphs are Dynamo's symbolic-size ones.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heldout_hf as H  # noqa: E402


def checking_backend(backend):
    """A backend compiling with `backend` that compares each call of each graph with its FX module."""
    import torch
    count = iter(range(1, 1 << 30))

    def compile_fn(gm, example_inputs):
        compiled, reference, graph = backend(gm, example_inputs), copy.deepcopy(gm), next(count)

        def run(*args):
            want = reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            got = compiled(*args)
            for i, (g, w) in enumerate(zip(got, want)):
                if isinstance(g, torch.Tensor) and g.is_floating_point():
                    d = (g.float() - w.float()).abs().nan_to_num(float("inf")).max().item() if g.numel() else 0.0
                    print(f"graph {graph} output {i} {tuple(g.shape)} {g.dtype}: max abs diff {d:.4g}", flush=True)
            return got
        return run
    return compile_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model name of bench/heldout_hf.py")
    ap.add_argument("--pad", action="store_true", help="its left-padded variant")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reshape", action="store_true", help="a second call at other sizes")
    a = ap.parse_args()
    os.environ.setdefault("COMMFUSE_FALLBACK_ON_ERROR", "0")
    import torch
    import transformers
    import commfuse  # noqa: F401  (registers the backend where it is not installed)
    H.PAD = a.pad
    torch.manual_seed(0)
    cfg_cls, s = H.spec(a.model)
    model = getattr(transformers, a.model)(getattr(transformers, cfg_cls)(**s["cfg"])).to(a.device).eval()
    calls = [H._to(s["inputs"], a.device)]
    if a.reshape:
        H.B, H.S = 3, 12
        torch.manual_seed(0)
        calls.append(H._to(H.spec(a.model)[1]["inputs"], a.device))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=checking_backend(torch._dynamo.lookup_backend("commfuse")))
    with torch.no_grad():
        for inputs in calls:
            out, want = compiled(**inputs), reference(**inputs)
    print("last call's logits: max abs diff", (out.logits - want.logits).abs().max().item())


if __name__ == "__main__":
    main()
