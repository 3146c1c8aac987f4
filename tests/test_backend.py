"""The backend as users meet it: options, config, environment, errors, fallbacks, randomness."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import commfuse
from commfuse import config
from tests.common import DEVICE, compile_and_run, kernel_defs


def test_config_patch_is_context_manager_and_decorator():
    before = config.max_fusion_size
    with config.patch(max_fusion_size=3):
        assert config.max_fusion_size == 3
    assert config.max_fusion_size == before

    @config.patch({"debug": True})
    def inside():
        return config.debug
    assert inside() is True and config.debug is False


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown commfuse option"):
        config.patch(no_such_option=1)
    fn = torch.compile(lambda x: x + 1, backend="commfuse", options={"no_such_option": 1})
    with pytest.raises(Exception, match="no_such_option"):
        fn(torch.ones(3, device=DEVICE))
    fn = torch.compile(lambda x: x + 1, backend="commfuse", options={"cuda_graph": True})  # a typo
    with pytest.raises(Exception, match="'cuda_graph': did you mean 'cuda_graphs'"):
        fn(torch.ones(3, device=DEVICE))


def test_inductors_option_names_compile_as_a_program_for_inductor_passes_them(caplog):
    """`triton.cudagraphs` is our `cuda_graphs`; Inductor's tuning options mean nothing here and
    are dropped with a warning (they raised "unknown commfuse option")."""
    from commfuse.backend import _from_inductor
    assert _from_inductor({"triton.cudagraphs": True, "max_fusion_size": 4}) == {"cuda_graphs": True, "max_fusion_size": 4}
    with caplog.at_level("WARNING", logger="commfuse"):
        assert _from_inductor({"max_autotune": True, "epilogue_fusion": False}) == {}
    assert "['epilogue_fusion', 'max_autotune']" in caplog.text
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + 1, backend="commfuse", options={"max_autotune": True, "shape_padding": True})
    torch.testing.assert_close(fn(torch.ones(3, device=DEVICE)), torch.full((3,), 2.0, device=DEVICE))


@pytest.mark.parametrize("option, value, error", [
    ("max_fusion_size", "lots", "max_fusion_size='lots': expected int"),
    ("cuda_graphs", 1, "cuda_graphs=1: expected bool"),
    ("max_block", 100, "max_block=100: must be a power of 2"),
    ("comm.algorithm", "bogus", "comm.algorithm='bogus': must be one of"),
    ("max_fusion_size", 0, "max_fusion_size=0: must be above 0"),
    ("fallback_ops", ["aten.not_an_op"], "'aten.not_an_op' names no op"),
    ("comm.one_shot_max_bytes", {"2": 1 << 20}, "keys must be ints"),  # no world size is "2": silently unused
])
def test_a_bad_option_value_is_a_clear_error(option, value, error):
    """Refused when set, naming the option: not taken, or failing later in a kernel."""
    with pytest.raises((TypeError, ValueError), match=error):
        config.patch({option: value})
    fn = torch.compile(lambda x: x + 1, backend="commfuse", options={option: value})
    with pytest.raises(Exception, match=option):
        fn(torch.ones(3, device=DEVICE))
    with config.patch({option: config.get(option)}):  # the defaults pass the same check
        pass


def test_compile_options_change_the_generated_code(tmp_path):
    fn = lambda x: ((x + 1) * 2).exp()  # noqa: E731
    x = torch.randn(64, device=DEVICE)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="commfuse",
                        options={"max_fusion_size": 1, "dump_dir": str(tmp_path)})(x)
    torch.testing.assert_close(out, fn(x))
    code = next(tmp_path.glob("rank0/*/output_code.py")).read_text()
    assert len(kernel_defs(code)) == 1  # pointwise chains inline into one loop body anyway
    fn2 = lambda x: (x.sum(-1), (x * 2).amax(-1))  # noqa: E731
    x2 = torch.randn(8, 16, device=DEVICE)
    _, dumps1 = compile_and_run(fn2, x2, tmp_path=tmp_path / "a", max_fusion_size=1)
    _, dumps2 = compile_and_run(fn2, x2, tmp_path=tmp_path / "b")
    assert len(dumps1.only()[0]["kernels"]) == 2
    assert len(dumps2.only()[0]["kernels"]) == 1


def test_environment_overrides():
    code = "import commfuse; print(commfuse.config.max_fusion_size, commfuse.config.dump_dir)"
    env = dict(os.environ, COMMFUSE_MAX_FUSION_SIZE="7", COMMFUSE_DUMP_DIR="/tmp/x")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "/tmp/x"]


def test_out_of_bounds_index_raises():
    fn = torch.compile(lambda w, i: F.embedding(i, w) * 2, backend="commfuse")
    w = torch.randn(10, 4, device=DEVICE)
    torch.testing.assert_close(fn(w, torch.tensor([1, -1], device=DEVICE)), F.embedding(torch.tensor([1, 9]), w.cpu()).to(DEVICE) * 2)
    if DEVICE == "cuda":
        pytest.skip("a device-side assert poisons the CUDA context; checked on CPU")
    with pytest.raises(Exception, match="index out of bounds"):
        fn(w, torch.tensor([1, 12]))


def test_random_ops_are_deterministic_under_a_seed():
    fn = torch.compile(lambda x: F.dropout(x, 0.5, training=True) + torch.rand_like(x), backend="commfuse")
    x = torch.ones(256, device=DEVICE)
    torch.manual_seed(123)
    a = fn(x)
    torch.manual_seed(123)
    b = fn(x)
    torch.testing.assert_close(a, b)
    kept = (a >= 2).float().mean().item()  # dropout keeps ~half, scaled by 2
    assert 0.3 < kept < 0.7


def test_compile_failure_falls_back_to_aten(monkeypatch, caplog):
    import commfuse.scheduler as sched

    def broken(*a, **k):
        raise RuntimeError("simulated compiler bug")
    monkeypatch.setattr(sched.Scheduler, "__init__", broken)
    fn = lambda x: x * 3 + 1  # noqa: E731
    x = torch.randn(5, device=DEVICE)
    with config.patch(fallback_on_error=True):
        out = torch.compile(fn, backend="commfuse")(x)
    torch.testing.assert_close(out, fn(x))
    assert "simulated compiler bug" in caplog.text and "runs through aten" in caplog.text
    torch._dynamo.reset()
    with config.patch(fallback_on_error=False), pytest.raises(Exception, match="simulated compiler bug"):
        torch.compile(fn, backend="commfuse")(x)


def test_backend_registered_by_entry_point():
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("commfuse") is not None


def test_inference_mode_and_no_grad():
    fn = torch.compile(lambda x: F.gelu(x) * x.sum(), backend="commfuse")
    x = torch.randn(6, 7, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), F.gelu(x) * x.sum())
    torch._dynamo.reset()
    with torch.inference_mode():
        torch.testing.assert_close(fn(x), F.gelu(x) * x.sum())



def test_output_laid_over_a_buffer_is_updated_in_place_under_autograd():
    """`x + lin(x)` is written in place over the matmul's output and returned in the caller's
    shape: that output was an autograd view of the matmul's buffer, so `y.mul_(2)` raised ("Output
    0 of CompiledFunction is a view and is being modified inplace") and FSDP2 warned that each
    compiled block returned a view."""
    lin = torch.nn.Linear(8, 8, device=DEVICE)
    fn = torch.compile(lambda x: x + lin(x), backend="commfuse")
    grads = []
    for f in (fn, lambda x: x + lin(x)):
        x = torch.arange(48.0, device=DEVICE).view(2, 3, 8).div(10).requires_grad_()
        y = f(x)
        assert not y._is_view()
        y.mul_(2)
        y.square().sum().backward()
        grads.append((y.detach(), x.grad, lin.weight.grad))
        lin.weight.grad = None
    torch.testing.assert_close(*grads)


def _written_through_a_transpose(x):
    y = x * 2
    y.t()[0].mul_(3)  # functionalized: y and y.t() are views of a select_scatter shaped as y.t()
    return y, y.t()


def test_outputs_viewing_one_value_alias_as_in_eager():
    """Outputs that are views of one computed value (`h[0]` and `h.view(-1)`; `h` and `h.t()`;
    unbind's parts; a value written in place through a view of it) share its storage as eager's
    do: a write through one shows in the others, with eager's strides and offsets."""
    fns = [lambda x: ((h := x * 2)[0], h.view(-1)), lambda x: ((h := x + 1), h.t()), lambda x: (x - 1).unbind(0),
           _written_through_a_transpose]
    for fn in fns:
        torch._dynamo.reset()
        x = torch.randn(3, 4, device=DEVICE)
        got, want = torch.compile(fn, backend="commfuse")(x), fn(x)
        assert [(g.shape, g.stride(), g.storage_offset()) for g in got] == \
            [(w.shape, w.stride(), w.storage_offset()) for w in want]
        for outs in (got, want):
            outs[0].add_(100)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("train", [False, True])
def test_twin_random_draws_stay_two(train):
    """Two draws of the same kind from the same arguments are two draws: common-subexpression
    elimination (AOTAutograd's partitioner for training, commfuse's for inference) merged those
    its list of random ops misses, and `randn_like(x) - randn_like(x)` was all zeros."""
    draws = {
        "randn_like": lambda x: torch.randn_like(x) - torch.randn_like(x),
        "randint_like": lambda x: (torch.randint_like(x, 100) - torch.randint_like(x, 100)).float(),
        "uniform_": lambda x: torch.empty_like(x).uniform_() - torch.empty_like(x).uniform_(),
        "normal_": lambda x: torch.empty_like(x).normal_() - torch.empty_like(x).normal_(),
        "exponential_": lambda x: torch.empty_like(x).exponential_() - torch.empty_like(x).exponential_(),
    }
    x = torch.randn(32, 32, device=DEVICE, requires_grad=train)
    for name, draw in draws.items():
        torch._dynamo.reset()
        fn = torch.compile(lambda x: draw(x) * x, backend="commfuse")
        with torch.set_grad_enabled(train):
            out = fn(x)
        assert (out != 0).float().mean() > 0.9, name
        if train:
            out.sum().backward()



def test_compiled_autograd_with_a_saved_python_scalar():
    """Compiled autograd hands `loss / accum`'s saved int to the backward graph as a wrapped-number
    tensor (in a loop over micro-batches), and AOTAutograd runs a graph's first call under a
    dispatch mode (its custom-op aliasing check), which turned that tensor into an int where
    Triton's interpreter copied it."""
    lin = torch.nn.Linear(4, 3, device=DEVICE)
    xs, ys, accum = [torch.randn(2, 4, device=DEVICE)], [torch.tensor([0, 2], device=DEVICE)], 1

    def step(xs, ys):
        for x, y in zip(xs, ys):
            (F.cross_entropy(lin(x), y) / accum).backward()
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend="commfuse")(xs, ys)
    grad, lin.weight.grad = lin.weight.grad, None
    step(xs, ys)
    torch.testing.assert_close(grad, lin.weight.grad)


def _mlp(width=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 4)).to(DEVICE)


def _backward_summaries():
    from commfuse.compiled import summaries
    return [s for s in summaries if "_backward_" in s["graph_id"]]


@pytest.mark.parametrize("graph_cache", [True, False])
def test_backward_twice_with_retain_graph(graph_cache):
    """`loss.backward(retain_graph=True)` then `loss.backward()`: the gradients add up as in eager.
    Where AOTAutograd's cache keeps the backward with its forward (compiled before its first call),
    it donates the saved activations, which our backward writes over in place, and AOTAutograd
    refused a kept graph: now the first call decides, as AOTAutograd does for a backward compiled
    then (Inductor's case), and a kept graph's writes go to copies."""
    x = torch.randn(64, 8, device=DEVICE)
    grads = []
    for compiled in (False, True):
        model = _mlp()
        fn = torch.compile(model, backend="commfuse", options={"graph_cache": graph_cache}) if compiled else model
        loss = fn(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(*grads)
    if graph_cache:  # the backward wrote over saved activations it got donated: the copies mattered
        assert _backward_summaries()[-1]["overwritten_inputs"]


def test_two_losses_from_a_shared_trunk_and_a_gan_loop():
    """Two losses from one compiled trunk, each backward keeping the graph for the next; and a GAN's
    step, whose discriminator loss keeps the generator's graph for the generator's loss."""
    x = torch.randn(16, 8, device=DEVICE)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        trunk, head_a, head_b = _mlp(), torch.nn.Linear(4, 1).to(DEVICE), torch.nn.Linear(4, 3).to(DEVICE)

        def losses(x):
            h = trunk(x)
            return head_a(h).square().mean(), head_b(h).tanh().sum()
        fn = torch.compile(losses, backend="commfuse") if compiled else losses
        for _ in range(2):
            a, b = fn(x)
            a.backward(retain_graph=True)
            b.backward(retain_graph=True)
        gen, disc = _mlp(), torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).to(DEVICE)
        g_opt, d_opt = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
        g, d = (torch.compile(gen, backend="commfuse"), torch.compile(disc, backend="commfuse")) if compiled else (gen, disc)
        real = torch.randn(16, 4, device=DEVICE)
        for step in range(3):
            fake = g(x + step)
            d_opt.zero_grad()
            d_loss = F.softplus(-d(real)).mean() + F.softplus(d(fake)).mean()
            d_loss.backward(retain_graph=True)  # keeps the generator's graph for g_loss
            d_opt.step()
            g_opt.zero_grad()
            F.softplus(-d(fake)).mean().backward()
            g_opt.step()
        results.append([p.grad for p in trunk.parameters()] + [head_a.weight.grad, head_b.weight.grad]
                       + [p.detach() for p in (*gen.parameters(), *disc.parameters())])
    torch.testing.assert_close(*results)


@pytest.mark.parametrize("graph_cache", [True, False])
def test_retain_graph_after_a_donating_backward_is_refused_as_by_aotautograd(graph_cache):
    """A backward whose first call did not keep the graph donated its saved tensors: a later kept
    graph is refused, with AOTAutograd's own error (as under Inductor), not run over values the
    first call wrote over."""
    fn = torch.compile(_mlp(), backend="commfuse", options={"graph_cache": graph_cache})
    x = torch.randn(64, 8, device=DEVICE)
    fn(x).sum().backward()
    with pytest.raises(RuntimeError, match="non-empty donated buffers which requires create_graph=False "
                                           "and retain_graph=False"):
        fn(x).sum().backward(retain_graph=True)


def test_generated_code_calls_each_aten_overload_as_itself():
    """The generated modules' `aten` (runtime.support.Ops) binds each overload to a faster callable
    of the same operator: a matmul's Python binding, else the overload's own C++ function."""
    from commfuse.runtime.support import Ops
    aten = Ops(torch.ops.aten)
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    out = torch.empty(3, 5)
    assert aten.mm.out(a, b, out=out) is out and torch.equal(out, a @ b) and aten.mm.out is torch.mm
    torch.testing.assert_close(aten.addmm.out(c, a, b, beta=0.5, alpha=2.0, out=torch.empty(3, 5)), 0.5 * c + 2 * (a @ b))
    assert aten.sum.dim_IntList is torch.ops.aten.sum.dim_IntList._op
    assert torch.equal(aten.sum.dim_IntList(a, [1], True), a.sum(1, keepdim=True))
