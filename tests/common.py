"""Shared test helpers: compile with dumps on, read back the generated code and summary."""
from __future__ import annotations

import glob
import json
import os

import torch
from torch.testing import FileCheck

from commfuse import config

# Tests run on the GPU where there is one (compiled Triton), else on CPU (Triton's interpreter).
DEVICE = os.environ.get("COMMFUSE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
ALLOC = "empty_strided_cuda" if DEVICE == "cuda" else "empty_strided"  # what the wrapper allocates with there


class Dumps:
    """The per-graph dump folders written while compiling and running `fn`."""

    def __init__(self, root):
        self.root = str(root)

    def graphs(self, rank: int = 0) -> list[str]:
        return sorted(glob.glob(os.path.join(self.root, f"rank{rank}", "*")))

    def summary(self, graph: str) -> dict:
        with open(os.path.join(graph, "summary.json")) as f:
            return json.load(f)

    def code(self, graph: str) -> str:
        with open(os.path.join(graph, "output_code.py")) as f:
            return f.read()

    def only(self) -> tuple[dict, str]:
        graphs = self.graphs()
        assert len(graphs) == 1, graphs
        return self.summary(graphs[0]), self.code(graphs[0])


def compile_and_run(fn, *args, tmp_path, dynamic=False, **patch):
    """Run `fn` compiled by commfuse with dumps under tmp_path; returns (result, Dumps)."""
    torch._dynamo.reset()
    with config.patch(dump_dir=str(tmp_path), **patch):
        out = torch.compile(fn, backend="commfuse", dynamic=dynamic)(*args)
    return out, Dumps(tmp_path)


def kernel_defs(code: str) -> list[str]:
    return [line for line in code.splitlines() if line.startswith("def cf_")]


# torch's FileCheck misplaces a check_regex that follows another check (it resumes from the wrong
# position): find names with `re`, then check them as literal strings.


def count(code: str, text: str, n: int) -> None:
    """`text` occurs exactly `n` times in `code` (FileCheck: a failure prints the code)."""
    FileCheck().check_count(text, n, exactly=True).run(code)


def check_peer_sum(code: str, buf: str, world: int, kernel: str = "def cf_") -> None:
    """After `kernel`'s definition, one line sums the loads of `buf`'s copy on every rank, in rank
    order: the all-reduce reads each peer's buffer, none missing. A kernel that layers share names
    its parameters after its first launch's buffers: the launch passing `buf`'s copies says which."""
    local = buf
    name = kernel[len("def "):-1] if kernel.endswith("(") else None
    if name is not None and f"{buf}_peer0" not in code.split(kernel, 1)[1].split(")", 1)[0]:
        params = code.split(kernel, 1)[1].split(")", 1)[0].split(", ")
        launch = next(line for line in code.splitlines()
                      if line.strip().startswith(f"{name}_launch") and f"comm['peers_{buf}'][0]" in line)
        args = launch.split("), ", 1)[1].split(", ")  # after the grid
        local = params[args.index(f"comm['peers_{buf}'][0]")].removesuffix("_peer0")
    check = FileCheck().check(kernel).check(f"tl.load({local}_peer0 + (")
    for r in range(1, world):
        check = check.check_same(f"tl.load({local}_peer{r} + (")
    check.run(code)


def check_reduced_in_place(code: str, buf: str, kernel: str) -> None:
    """The graph's one in-place all-reduce: the wrapper takes comm buffer `buf` from the pool, and
    `kernel`, launched right after the result is aliased to `buf`, reads the peers' copies of
    `buf` and writes over it: no copy out."""
    FileCheck().check(f"{buf} = comm['{buf}']").check(f" = {buf}  # reduced in place").check_next(
        f"{kernel}_launch").check_same(f"comm['peers_{buf}'][0]").run(code)
    count(code, "# reduced in place", 1)
