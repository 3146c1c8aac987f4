"""Dumps as a user compares them: byte-identical from process to process (set orders and object
addresses vary with PYTHONHASHSEED and the allocator; per-run facts live in timing.json), and
`python -m commfuse.diff` telling which ranks compiled something else, in the plan's words."""
import filecmp
import json
import os
import subprocess
import sys

import torch

from tests.dist_utils import skip_unless_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _program(rank, world, diverge=False):
    """A training step over 2 ranks: a gather (its backward an indexed accumulate, whose IR prints
    an index list), a matmul into an all-reduce, a residual and an RMSNorm; checked against eager.
    With `diverge`, rank 1 takes another branch: its all-reduce covers half the columns."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from tests.dist_utils import device
    torch.manual_seed(0)
    dev = device()  # NCCL ranks on GPUs, gloo on CPU
    emb, w = torch.randn(10, 16, device=dev, requires_grad=True), torch.randn(16, 32, device=dev, requires_grad=True)
    norm_w = torch.randn(32, device=dev, requires_grad=True)
    idx, res = torch.tensor([1, 3, 3, 7, 0, 9, 2, 2], device=dev), torch.randn(8, 32, device=dev)

    def step(idx, res):
        h = torch.relu(emb[idx]) @ w
        if diverge and rank == 1:
            y = funcol.all_reduce(h[:, :16], "sum", dist.group.WORLD).repeat(1, 2) + res
        else:
            y = funcol.all_reduce(h, "sum", dist.group.WORLD) + res
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w).sum()
    try:
        loss = torch.compile(step, backend="commfuse")(idx, res)
        loss.backward()
    except Exception as e:  # the divergent ranks: the plan check at the first call stops them
        assert diverge and "ranks disagree on the comm-buffer plan" in str(e), e
        return str(e)
    grads = [p.grad.clone() for p in (emb, w, norm_w)]
    for p in (emb, w, norm_w):
        p.grad = None
    want = step(idx, res)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    for g, p in zip(grads, (emb, w, norm_w)):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-4)
    return None


def dump_program(dump_dir, seed: int, diverge=False):
    """_program on 2 ranks in a fresh process with its own hash seed, dump folder and caches."""
    skip_unless_ranks(2)
    code = f"from tests.dist_utils import run_ranks; from tests.test_dumps import _program; run_ranks(_program, 2, args=({diverge},))"
    env = dict(os.environ, PYTHONHASHSEED=str(seed), COMMFUSE_DUMP_DIR=str(dump_dir),
               COMMFUSE_CACHE_DIR=f"{dump_dir}_cache", TORCHINDUCTOR_CACHE_DIR=f"{dump_dir}_cache/inductor")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=600)


def rank_diff(dump_dir, *args):
    """`python -m commfuse.diff` as a script runs it: (exit status, its report)."""
    run = subprocess.run([sys.executable, "-m", "commfuse.diff", str(dump_dir), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr


def _differ(a, b) -> list:
    """The files that differ between two dump trees, or exist in one only."""
    cmp, out = filecmp.dircmp(a, b), []
    out += [os.path.join(a, n) for n in cmp.left_only + cmp.right_only + cmp.funny_files]
    out += [os.path.join(a, n) for n in cmp.common_files if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)]
    for sub in cmp.common_dirs:
        out += _differ(os.path.join(a, sub), os.path.join(b, sub))
    return out


def test_two_processes_dump_byte_identical_files(tmp_path):
    for seed in (1, 2):
        dump_program(tmp_path / f"run{seed}", seed)
    differ = _differ(tmp_path / "run1", tmp_path / "run2")
    assert differ and all(p.endswith("timing.json") for p in differ), differ  # compile seconds differ
    graphs = sorted(os.listdir(tmp_path / "run1" / "rank0"))
    assert [g.split("_")[1] for g in graphs] == ["forward", "backward"], graphs
    for g in graphs:
        folder = tmp_path / "run1" / "rank0" / g
        assert sorted(os.listdir(folder)) == ["fx_graph.txt", "ir_post_fusion.txt", "ir_pre_fusion.txt",
                                              "output_code.py", "summary.json", "timing.json"]
        assert "compile_seconds" in json.loads((folder / "timing.json").read_text())
        assert "compile_seconds" not in json.loads((folder / "summary.json").read_text())
    summary = json.loads((tmp_path / "run1" / "rank0" / graphs[0] / "summary.json").read_text())
    assert [p["collective"] for p in summary["comm_plans"]] == ["all_reduce"]
    # identical ranks: the rank diff passes them
    status, report = rank_diff(tmp_path / "run1")
    assert status == 0 and "ranks agree: 2 ranks, 2 graph(s)" in report, report
    assert "g000_forward:\n  rank 1: same graph, same 1 plan(s), same code" in report, report


def test_rank_diff_finds_a_rank_that_took_another_branch(tmp_path):
    dump_program(tmp_path / "run", 1, diverge=True)
    status, report = rank_diff(tmp_path / "run")
    assert status == 1 and "ranks differ" in report, report
    # in the plan's words: the collective, its buffer, the bytes of its slice of the pool
    forward = report.split("g000_forward:")[1].split("g001")[0]
    assert "plans differ: collective #0 (all_reduce sum over group 0) differs in copy_in, bytes" in forward, report
    assert "at pool_0 [0, +1024)" in forward and "at pool_0 [0, +512)" in forward, report
    assert "graph differs, first at line" in forward and "code differs" in forward, report


def test_rank_diff_usage_errors(tmp_path):
    assert rank_diff(tmp_path)[0] == 2  # no rank folders
    (tmp_path / "rank0").mkdir()
    status, report = rank_diff(tmp_path)
    assert status == 2 and "need two or more" in report
    assert rank_diff(tmp_path, "--no-such-flag")[0] == 2


def test_an_unwritable_dump_dir_warns_and_compiles(tmp_path, caplog):
    """A dump_dir that cannot be created (under a file) costs the dumps, said once with the option
    to fix, not the compile (it raised a raw NotADirectoryError from the backend)."""
    from commfuse import config
    from tests.common import DEVICE
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    x = torch.arange(4.0, device=DEVICE)
    torch._dynamo.reset()
    with config.patch(dump_dir=str(blocker / "dumps"), fallback_on_error=False), caplog.at_level("WARNING", "commfuse"):
        out = torch.compile(lambda x: x * 2 + 1, backend="commfuse")(x)
        torch.compile(lambda x: x - 1, backend="commfuse")(x)
    assert torch.equal(out, x * 2 + 1)
    warnings = [r.getMessage() for r in caplog.records if "cannot write dumps" in r.getMessage()]
    assert len(warnings) == 1 and "dump_dir=" in warnings[0], warnings
