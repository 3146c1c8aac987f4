"""Options as users set them: environment values that do not parse or make no sense, misspelled
variables, enumerated and bounded options, and a cache folder that cannot be written."""
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

from commfuse import config
from tests.common import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _import_commfuse(code: str = "", **env) -> subprocess.CompletedProcess:
    """`import commfuse` in a fresh process whose COMMFUSE_ variables are `env` alone."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMMFUSE_")}
    return subprocess.run([sys.executable, "-c", f"import commfuse; from commfuse import config; {code}"],
                          env={**clean, **env}, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("var, value, expected", [
    ("COMMFUSE_MAX_FUSION_SIZE", "lots", "expected int"),  # was: invalid literal for int()
    ("COMMFUSE_COMM_ONE_SHOT_MAX_BYTES", "{2: 1024}", "expected a JSON object"),  # was: JSONDecodeError
    ("COMMFUSE_SPLIT_REDUCTION_PROGRAMS", "1.5", "expected int or None"),
    ("COMMFUSE_DEBUG", "maybe", "expected bool"),  # was: silently False
    ("COMMFUSE_COMM_ALGORITHM", "bogus", "must be one of"),
    ("COMMFUSE_MAX_FUSION_SIZE", "-5", "must be above 0"),
])
def test_a_malformed_environment_value_names_the_variable(var, value, expected):
    out = _import_commfuse(**{var: value})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {var}={value!r}: ") and expected in last, out.stderr


def test_environment_values_of_each_type():
    """A float option takes `1.5` (its default is None: the annotation gives the type), `none`
    unsets an optional one, `0` is an int where the option is one, and an empty value is unset."""
    out = _import_commfuse("print(repr((config.comm.barrier_timeout_s, config.compile_workers, config.pad_rows, "
                           "config.comm.groups, config.comm.algorithm, config.dump_dir, config.comm.plan_check_timeout_s)))",
                           COMMFUSE_COMM_BARRIER_TIMEOUT_S="1.5", COMMFUSE_COMPILE_WORKERS="0",
                           COMMFUSE_PAD_ROWS="none", COMMFUSE_COMM_GROUPS="tp,dp", COMMFUSE_COMM_ALGORITHM="two_shot",
                           COMMFUSE_DUMP_DIR="", COMMFUSE_COMM_PLAN_CHECK_TIMEOUT_S="2.5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1.5, 0, None, ['tp', 'dp'], 'two_shot', None, 2.5)"  # (both timeouts in seconds)


def test_a_misspelled_variable_is_a_warning_naming_the_closest_option():
    out = _import_commfuse(COMMFUSE_MAX_FUSON_SIZE="8", COMMFUSE_COMM_ALGORTHM="c10d", COMMFUSE_TEST_DEVICE="cpu",
                           COMMFUSE_EXAMPLE_BACKEND="eager", COMMFUSE_BENCH_STEPS="3", COMMFUSE_OPINFO_SAMPLES="2")
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "is not a commfuse option" in line]
    assert len(warned) == 2, out.stderr
    assert "COMMFUSE_COMM_ALGORTHM is not a commfuse option; did you mean COMMFUSE_COMM_ALGORITHM?" in warned[0]
    assert "COMMFUSE_MAX_FUSON_SIZE is not a commfuse option; did you mean COMMFUSE_MAX_FUSION_SIZE?" in warned[1]


def test_every_commfuse_variable_the_project_names_is_an_option_or_spared():
    """The variables the project's code reads (tests, examples, benchmarks) must not draw the typo
    warning. Test modules are left out: they may misspell a name on purpose."""
    options = {f"COMMFUSE_{n.replace('.', '_').upper()}" for n in config.snapshot()}
    named = set()
    for path in ROOT.rglob("*"):
        if path.suffix in (".py", ".sh", ".toml", ".yml", ".yaml", ".cfg") and ".git" not in path.parts \
                and not path.name.startswith("test_"):
            named |= set(re.findall(r"\bCOMMFUSE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="ignore")))
    assert {"COMMFUSE_CACHE_DIR", "COMMFUSE_TEST_DEVICE"} <= named  # the walk found the variables read
    strays = sorted(v for v in named - options if not v.startswith(config._NOT_OPTIONS))
    assert not strays, strays


@pytest.mark.parametrize("option, value, error", [
    ("comm.algorithm", "bogus", "must be one of"),
    ("max_fusion_size", 0, "must be above 0"),
    ("max_fusion_size", -5, "must be above 0"),
    ("realize_users_threshold", -1, "must be 0 or more"),
    ("comm.max_programs", 2048, "must be at most 1024"),
    ("comm.num_warps", 6, "must be a power of 2"),
    ("comm.barrier_timeout_s", 0, "must be above 0"),
    ("comm.one_shot_max_bytes", {2: -1}, "must be 0 or more"),
    ("overlap_peak_share", -0.5, "must be 0 or more"),
    ("overlap_peak_share", float("nan"), "must be 0 or more"),
    ("comm.barrier_timeout_s", "soon", "expected float or None"),
    ("comm.groups", [0], "expected group names"),  # an int never matches a group's name
    ("comm.table", "/no/such/table.json", "[Errno 2] No such file"),  # refused when set, not at a compile
    ("choices", 5, "expected an instance of commfuse.choices.Choices"),
])
def test_values_out_of_range_are_refused(option, value, error):
    with pytest.raises((TypeError, ValueError), match=re.escape(f"{option}={value!r}: {error}")):
        config.patch({option: value})


def test_an_options_type_is_its_default_whatever_a_program_assigned(monkeypatch):
    monkeypatch.setattr(config, "max_fusion_size", "x")  # then a check: "expected int", not "above 0"
    with pytest.raises(TypeError, match="max_fusion_size='x': expected int"):
        config.patch(max_fusion_size="x")


def test_a_table_keyed_by_other_than_world_sizes_says_so():
    with pytest.raises(ValueError, match="its keys must be ints, world sizes"):
        config.parse("comm.one_shot_max_bytes", '{"two": 5}')
    assert config.parse("comm.one_shot_max_bytes", '{"2": 5}') == {2: 5}


def test_an_unknown_mode_is_an_error_as_in_inductor():
    with pytest.raises(Exception, match="unknown mode='fast'"):
        torch.compile(lambda x: x * 2, backend="commfuse", mode="fast")(torch.ones(4))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda x: x * 2, backend="commfuse", mode="max-autotune")(torch.ones(4)),
                               torch.full((4,), 2.0))


def test_a_choices_class_is_refused_as_such_not_as_an_unknown_option():
    from commfuse.choices import Choices
    with pytest.raises(Exception, match="choices=MyChoices\\(\\), not the class"):
        torch.compile(lambda x: x * 2, backend="commfuse", options={"choices": Choices})(torch.ones(4))


def test_every_registered_algorithm_may_be_forced():
    from commfuse.collectives import ALGORITHMS, CommAlgorithm, register_algorithm
    register_algorithm(CommAlgorithm("test_config_algorithm", symmetric=False))
    try:
        for name in ("auto", "torch", *(n for n, a in ALGORITHMS.items() if a.collective in ("all_reduce", ""))):
            with config.patch({"comm.algorithm": name}), config.patch({"comm.barrier_timeout_s": 1.5}):
                pass
        with pytest.raises(ValueError, match="must be one of"):  # an all-gather's is not an all-reduce's
            config.patch({"comm.algorithm": "symm_all_gather"}).__enter__()
    finally:
        del ALGORITHMS["test_config_algorithm"]


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_an_unwritable_cache_folder_turns_the_caches_off_with_one_warning(tmp_path, where):
    """A folder under a regular file, or a file itself (root writes into a read-only folder, so
    its mode would prove nothing): every graph still compiles, from a folder of its own, with one
    warning naming the folder. Its generated modules failed to load, and each graph ran through
    aten, with a hint about fallback_ops."""
    (tmp_path / "file").write_text("")
    folder = str(tmp_path / "file" / "sub" if where == "under_a_file" else tmp_path / "file")
    from commfuse.compiled import summaries
    seen = len(summaries)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(DEVICE)
    x = torch.randn(5, 8, device=DEVICE)
    with config.patch(cache_dir=folder, fallback_on_error=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # after a reset: compiled again, no second warning
            torch._dynamo.reset()
            model.zero_grad()
            out = torch.compile(model, backend="commfuse")(x)
            out.square().sum().backward()
            grads = [p.grad for p in model.parameters()]
            with torch.no_grad():
                inference = torch.compile(lambda x: (x + 1).sin(), backend="commfuse")(x)
    model.zero_grad()
    expected = model(x)
    expected.square().sum().backward()
    torch.testing.assert_close((out, grads), (expected, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(inference, (x + 1).sin())
    warned = [str(w.message) for w in caught if "cannot write the cache folder" in str(w.message)]
    assert len(warned) == 1 and folder in warned[0], [str(w.message) for w in caught]
    graphs = summaries[seen:]
    assert len(graphs) == 6 and all(s["compiled"] and not s["cache_hit"] for s in graphs), graphs
    assert {s.get("cache_skipped") for s in graphs} == {"the cache folder cannot be written"}
    assert not os.path.isdir(folder)
