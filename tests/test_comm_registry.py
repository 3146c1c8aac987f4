"""An all-reduce algorithm is one registry entry plus its kernel, chosen by a policy subclass.

The toy algorithm here copies the input into an ordinary buffer and runs c10d's all-reduce on it:
nothing of the compiler changes, only the registry and the `Choices` installed through config.
"""
import glob
import json

import pytest
import torch
from torch.testing import FileCheck

from tests.dist_utils import WORLD, device, run_ranks


def _with_toy_algorithm(rank, world, dump_dir):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from commfuse import config
    from commfuse.choices import Choices
    from commfuse.collectives import ALGORITHMS, CommAlgorithm, algorithm, register_algorithm

    def c10d_call(plan, src, out):
        return (f"{out} = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce("
                f"{src}, {plan.reduce_op!r}, {plan.group!r}))")
    register_algorithm(CommAlgorithm("copy_then_c10d", symmetric=False, call=c10d_call))

    class ToyChoices(Choices):
        def all_reduce_algorithm(self, world, nbytes, device):
            return "copy_then_c10d", "the test's policy"

    def step(x, res):
        return torch.relu(funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + res)
    torch.manual_seed(rank)
    x = torch.randn(4, 16, device=device())
    res = torch.randn(4, 16, device=device())
    try:
        with config.patch(choices=ToyChoices(), dump_dir=dump_dir):
            got = torch.compile(step, backend="commfuse", dynamic=False)(x, res)
    finally:
        del ALGORITHMS["copy_then_c10d"]
    torch.testing.assert_close(got, step(x, res))
    assert algorithm("one_shot").fused  # the built-ins are untouched
    return True


def test_a_registered_algorithm_chosen_by_a_policy_subclass(tmp_path):
    run_ranks(_with_toy_algorithm, WORLD, args=(str(tmp_path),))
    for rank in range(WORLD):
        (path,) = glob.glob(f"{tmp_path}/rank{rank}/*/summary.json")
        s = json.load(open(path))
        (plan,) = s["comm_plans"]
        assert plan["algorithm"] == "copy_then_c10d" and plan["reason"] == "the test's policy", plan
        assert plan["buffer"] and plan["result"] and not s["comm_buffers"]  # nothing in the symmetric pool
        assert s["extern_calls"] == ["copy_then_c10d all_reduce"], s["extern_calls"]
        code = open(path.replace("summary.json", "output_code.py")).read()
        body = code.split("def call")[1]
        # the producer (x * 2) writes the buffer, the call reduces it, the consumer's kernel reads it
        src, out = plan["buffer"], plan["result"]
        FileCheck().check(f"{src} = empty_strided").check(f", {src}, ").check(
            f"{out} = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce({src}, 'sum',").check(
            f"), {out}, ").check_not("symm").run(body)


def test_an_unknown_algorithm_is_a_clear_error():
    from commfuse.collectives import algorithm
    with pytest.raises(ValueError, match="unknown comm algorithm 'three_shot'; registered: one_shot"):
        algorithm("three_shot")
