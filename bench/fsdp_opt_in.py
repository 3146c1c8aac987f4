"""Which FSDP2 opt-ins put the parameter all-gathers and gradient reduce-scatters in the graphs a
backend compiles, and whether each matches eager (loss and gradients, 2 steps), on this torch.

    torchrun --standalone --nproc-per-node 2 bench/fsdp_opt_in.py [--backend commfuse|eager|inductor]

Variants, on a 2-block MLP (fully_shard per block and at the root):
- per_block: `block.compile(...)` on each block (FSDP2's hooks run eagerly around the graphs)
- per_block_ca: the same, the backward under compiled autograd
  (`torch._dynamo.compiled_autograd._enable(torch.compile(backend=...))`)
- traced_hooks: `torch._dynamo.config.skip_fsdp_hooks = False` (where this torch still has it),
  the whole model compiled, the backward under compiled autograd
Prints one line per variant: ok / mismatch / error, and the collectives in the backend's graphs
(commfuse only: from its summaries' comm_plans).
"""
import argparse
import collections
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.a, self.b = torch.nn.Linear(i, o), torch.nn.Linear(o, o)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Model(torch.nn.Module):  # a class of the user's: Dynamo compiles no graph for a bare nn.Sequential
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(8, 16), Block(16, 8)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def model(device):
    torch.manual_seed(0)
    m = Model().to(device)
    for block in m.blocks:
        fully_shard(block)
    return fully_shard(m)


def run(variant, backend, device):
    torch._dynamo.reset()
    eager, m = model(device), model(device)
    if variant == "traced_hooks":
        if not hasattr(torch._dynamo.config, "skip_fsdp_hooks"):
            return "unavailable (no torch._dynamo.config.skip_fsdp_hooks in this torch)"
        torch._dynamo.config.skip_fsdp_hooks = False
        step_model = torch.compile(m, backend=backend)
    else:
        for block in m.blocks:
            block.compile(backend=backend)
        step_model = m
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 8, device=device)
    try:
        for _ in range(2):
            loss = step_model(x).square().mean()
            if variant == "per_block":
                loss.backward()
            else:
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                    loss.backward()
            ref = eager(x).square().mean()
            ref.backward()
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
            for p, q in zip(m.parameters(), eager.parameters()):
                torch.testing.assert_close(getattr(p.grad, "_local_tensor", p.grad), q.grad._local_tensor,
                                           atol=1e-5, rtol=1e-5)
                p.grad = q.grad = None
        return "ok"
    except AssertionError as e:
        return "mismatch: " + str(e).splitlines()[0]
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        if hasattr(torch._dynamo.config, "skip_fsdp_hooks"):
            torch._dynamo.config.skip_fsdp_hooks = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="commfuse")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    import commfuse  # noqa: F401  (registers the backend; Triton's interpreter on CPU)
    from commfuse import backend as cf
    device = torch.device("cuda") if cuda else torch.device("cpu")
    for variant in ("per_block", "per_block_ca", "traced_hooks"):
        before = len(cf.summaries)
        result = run(variant, args.backend, device)
        plans = collections.Counter(p["collective"] for s in cf.summaries[before:] for p in s.get("comm_plans", []))
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__} {args.backend} {variant}: {result}; collectives in graphs: {dict(plans)}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
