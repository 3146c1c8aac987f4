"""Compiling a graph's kernels ahead of its first call (commfuse/runtime/precompile.py).

`_launches` must list exactly what `call` launches; kernels compiled from it by the worker pool for
an sm_90 target (no GPU needed: Triton's wheel brings ptxas) must be what the JIT then looks up;
a failing or crashing worker must only cost the ahead-of-time compile.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from commfuse import config
from commfuse.runtime import loader, precompile
from commfuse.runtime.launch import Site
from tests.common import DEVICE, compile_and_run
from tests.dist_utils import WORLD, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _static(a, w, x):  # the mm template (silu prologue, split-K), a reduction, a 2-pass softmax
    return F.silu(a * 2) @ w, x.softmax(-1), (x * 3).sum(0)


def _dynamic(x, y):
    return (x.exp() + y).amax(-1), x * 2


CASES = {
    "static": (_static, lambda: (torch.randn(3, 512, dtype=torch.bfloat16, device=DEVICE),
                                 torch.randn(512, 64, dtype=torch.bfloat16, device=DEVICE),
                                 torch.randn(33, 300, device=DEVICE)), False),
    "dynamic": (_dynamic, lambda: (torch.randn(6, 40, device=DEVICE), torch.randn(40, device=DEVICE)), True),
}


def _generated(case, tmp_path):
    fn, make_args, dynamic = CASES[case]
    args = make_args()
    compile_and_run(fn, *args, tmp_path=tmp_path / "dumps", dynamic=dynamic)
    graphs = sorted((tmp_path / "dumps" / "rank0").iterdir())
    assert len(graphs) == 1, graphs
    return (graphs[0] / "output_code.py").read_text(), args


def _record_launches() -> tuple[list, list]:
    """Stands in for the pool: each freshly loaded module's `_launches`, and the launches its calls
    then make (its kernels replaced by recorders; tensors as their dtypes)."""
    listed, launched = [], []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launched.append((self.name, tuple(x.dtype if isinstance(x, torch.Tensor) else x for x in a), kw))
            return launch

    def record(module):
        if loader.interpreting():  # nothing is compiled ahead of time in the interpreter
            assert start(module) is None
        for kernel, args, kwargs in module._launches:
            listed.append((kernel.__name__, args, kwargs))
        for site in [v for v in vars(module).values() if isinstance(v, Site)]:
            site.kernel = Recorder(site.kernel.__name__)

    start, precompile.start = precompile.start, record
    return listed, launched


@pytest.mark.parametrize("case", sorted(CASES))
def test_launches_list_what_call_launches(tmp_path, case, monkeypatch):
    """Every launch the first call makes is listed in `_launches`, with the same arguments, in order."""
    monkeypatch.setattr(precompile, "start", precompile.start)  # restored after the test
    listed, launched = _record_launches()
    fn, make_args, dynamic = CASES[case]
    compile_and_run(fn, *make_args(), tmp_path=tmp_path, dynamic=dynamic)
    assert launched == listed and listed
    if case == "static":  # the matmul template, with its split-K scratch, is among them
        assert any(name.startswith("cf_mm_") and kw["SPLIT_K"] > 1 for name, _, kw in listed), listed
    if case == "dynamic":  # sizes: the example's, which the call then passed
        assert any(40 in args for _, args, _ in listed), listed


def _comm_launches(rank, world, algorithm, epilogue):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx
    from commfuse import config
    from commfuse.backend import compile_graph
    listed, launched = _record_launches()
    from tests.dist_utils import device
    x, w = torch.randn(4, 64, device=device()), torch.randn(64, 32, device=device())
    def fused(x, w):
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD) * 2

    def in_place(x, w):  # its own kernel, in place (as tests/test_comm.py builds it)
        y = x @ w
        c10d.all_reduce_(y, "sum", dist.group.WORLD.group_name)
        return (c10d.wait_tensor(y) + 1,)

    c10d = torch.ops._c10d_functional
    with config.patch({"comm.algorithm": algorithm}):  # kernels that take the rank and the signal pads
        if epilogue:
            torch.compile(fused, backend="commfuse", dynamic=False)(x, w)
        else:
            compile_graph(make_fx(in_place)(x, w), [x, w])([x, w])
    # the recorders stand in for the comm kernels, whose barriers would keep a rank from leaving
    # first: a rank gone before a peer's call starts fails that call ("rank 1 exited")
    dist.barrier()
    return launched == listed, [name for name, _, _ in listed]


@pytest.mark.parametrize("algorithm,epilogue", [("one_shot", True), ("two_shot", True), ("one_shot", False)])
def test_comm_kernel_launches_are_listed(algorithm, epilogue):
    for same, names in run_ranks(_comm_launches, WORLD, args=(algorithm, epilogue)):
        assert same and any("all_reduce" in n or "allreduce" in n for n in names), names


AOT_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"  # compiled Triton, as on a GPU
sys.path.insert(0, ROOT)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class SM90:  # what a launch asks Triton's driver, answered for an H100 on a machine without one
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

@triton.jit
def _probe(x):
    triton.language.store(x, 1)
try:
    triton.compile(triton.compiler.ASTSource(_probe, {"x": "*i32"}), target=GPUTarget("cuda", 90, 32))
except Exception as e:
    print(json.dumps({"skip": f"triton {triton.__version__} cannot compile for sm_90 here: {type(e).__name__}: {e}"}))
    sys.exit(0)
driver.set_active(SM90())

from commfuse import config
from commfuse.runtime import loader, precompile
module, _ = loader.load_module(open(sys.argv[1]).read(), {})
if len(sys.argv) > 2:  # as after Inductor: this process read its ptxas's version, then another ptxas is set
    from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version
    real, version = get_ptxas(90).path, get_ptxas_version(90)
    with open(sys.argv[2], "w") as f:  # the same ptxas, announcing another build of its release
        f.write(f"#!{sys.executable}\nimport os, sys\nif sys.argv[1:] == ['--version']:\n"
                f"    print({version!r} + 'another build')\nelse:\n    os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n")
    os.chmod(sys.argv[2], 0o755)
    os.environ["TRITON_PTXAS_PATH"] = os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = sys.argv[2]
with config.patch(compile_workers=2):
    pending = precompile.start(module)
pending.wait()
errors = [f.result() for f in pending.futures]

from triton.compiler import compiler
def not_cached(*args, **kwargs):
    raise AssertionError("the launch compiled its kernel")
compiler.ASTSource.make_ir = not_cached  # a cache miss compiles from the AST: fail it
found = []
for kernel, args, kwargs in module._launches:  # as a launch looks them up: real (16-byte aligned) tensors
    real = [torch.empty(64, dtype=a) if isinstance(a, torch.dtype) else a for a in args]
    compiled = kernel.warmup(*real, grid=(1,), **kwargs)
    found.append([kernel.__name__, compiled.metadata.target.arch, compiled.metadata.num_warps, kwargs["num_warps"]])
print(json.dumps({"jobs": len(pending.futures), "errors": errors, "found": found, "triton": triton.__version__}))
""".replace("ROOT", repr(ROOT))


@pytest.mark.parametrize("case,ptxas_changed", [*((c, False) for c in sorted(CASES)), ("static", True)])
def test_kernels_compiled_ahead_are_found_by_the_launch(tmp_path, case, ptxas_changed):
    """The pool compiles the kernels for sm_90 into Triton's cache; the JIT's lookup at each launch
    then loads them instead of compiling. Also where TRITON_PTXAS_PATH changed after this process's
    Triton read its ptxas's version (which it keeps, and hashes): the workers hash that one too."""
    code, _ = _generated(case, tmp_path)
    path = tmp_path / "output_code.py"
    path.write_text(code)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), COMMFUSE_CACHE_DIR=str(tmp_path / "cf"))
    script = tmp_path / "aot.py"  # @triton.jit needs its source in a file
    script.write_text(AOT_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(path), *([str(tmp_path / "ptxas")] * ptxas_changed)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["jobs"] == len(out["found"]) > 0 and out["errors"] == [None] * out["jobs"], out
    assert all(arch == 90 and warps == want for _, arch, warps, want in out["found"]), out


def test_worker_runs_the_kernels_without_torch(tmp_path):
    """A worker runs a generated module's kernel part only: starting one costs no torch import."""
    code, _ = _generated("static", tmp_path)
    path = tmp_path / "output_code.py"
    path.write_text(code)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import compile_worker as w; "
             "k = w.kernels(sys.argv[2], 'probe'); "
             "print(sorted(n for n in k if n.startswith('cf_')), 'torch' in sys.modules)")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", probe, os.path.dirname(precompile.compile_worker.__file__), str(path)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    names, torch_imported = run.stdout.rsplit(" ", 1)
    assert torch_imported.strip() == "False" and "cf_mm_" in names, run.stdout


class _Crash:
    def __reduce__(self):  # unpickled by the worker: it dies
        return (os._exit, (3,))


def test_a_failing_or_crashing_worker_costs_only_its_kernel(tmp_path, caplog):
    pool = precompile.Pool(1)
    try:
        missing = (str(tmp_path / "missing.py"), "commfuse_generated_missing", None, {"env": {}, "ptxas_version": None},
                   ("k", {}, {}, {}, {}))
        crash = pool.submit(_Crash())
        failed = pool.submit(missing)  # a new worker replaces the dead one
        assert crash.result(timeout=600).startswith("compile worker: EOFError"), crash.result()
        assert failed.result(timeout=600).startswith("k: FileNotFoundError"), failed.result()
        with caplog.at_level("DEBUG", logger="commfuse.runtime.precompile"):
            precompile.Pending([crash, failed]).wait()  # logged, not raised
        assert sum("compile at their launch" in r.message for r in caplog.records) == 2
    finally:
        pool.close()
    assert not pool.procs


def test_workers_start_when_the_pool_is_made(monkeypatch):
    """The backend makes the pool at its entry (`warm`), and each worker starts at once: its
    interpreter's start and imports overlap tracing and lowering, not the first graph's kernels."""
    monkeypatch.setattr(precompile, "interpreting", lambda: False)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precompile, "_pool", None)
    with config.patch(compile_workers=2):
        precompile.warm()
        pool = precompile._pool
        precompile.warm()  # one pool for every graph
        assert precompile._pool is pool and pool.n == 2
    try:
        deadline = time.time() + 120
        while len(pool.procs) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert len(pool.procs) == 2 and all(p.poll() is None for p in pool.procs), pool.procs
    finally:
        pool.close()
    assert not pool.procs
