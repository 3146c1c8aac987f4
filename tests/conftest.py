"""Test set-up: Triton's interpreter when CUDA is absent (chosen before triton is imported),
compile errors raised rather than hidden behind the aten fallback, graph caches of this run's own,
GPU tests skipped on CPU, no TF32 in fp32 comparisons."""
import os
import tempfile

os.environ.setdefault("COMMFUSE_FALLBACK_ON_ERROR", "0")
# compiled graphs cached for this run only: a test that patches the compiler in a way the cache key
# cannot see must not meet an entry another run stored
os.environ.setdefault("COMMFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="commfuse_tests_"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["COMMFUSE_CACHE_DIR"], "inductor"))  # AOTAutograd's

import pytest  # noqa: E402
import torch  # noqa: E402

import commfuse  # noqa: E402,F401  (selects Triton's interpreter on CPU-only machines)


def pytest_configure(config):
    """Under xdist (-n), tests marked xdist_group run on one worker: a module whose checks share one
    spawn of ranks (dist_utils.SharedRanks, a module fixture) spawns it once, not once per worker.
    The workers read --dist before this runs: the controller tells them (pytest_configure_node), and
    they name each grouped test's group in its id as xdist's loadgroup does."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["commfuse_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", {}).get("commfuse_loadgroup"):
        for item in items:
            group = item.get_closest_marker("xdist_group")
            if group and "@" not in item.nodeid:
                _rename(item, f"{item.nodeid}@{group.args[0]}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _rename(item, nodeid: str) -> None:
    """Give `item` the node id xdist schedules it by. pytest 9.2 keeps a structured id (`_id`, whose
    string is the node id) where earlier versions kept the string (`_nodeid`): setting the old
    attribute there changed nothing, and every worker spawned the grouped modules' ranks again."""
    ident = getattr(item, "_id", None)
    if hasattr(ident, "parse"):
        item._id = type(ident).parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 compared at fp32 tolerance: no TF32 in eager's or our convolutions and matmuls on GPU
    (cuDNN allows it by default, and two layouts of one convolution pick different algorithms).
    cuDNN's flags through its context manager: OpInfo's test utilities forbid setting them."""
    if not torch.cuda.is_available():
        yield
        return
    cudnn, saved = torch.backends.cudnn, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        yield
    torch.backends.cuda.matmul.allow_tf32 = saved

