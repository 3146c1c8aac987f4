"""CUDA-graph mode keeps what the graph writes visible to the caller: module buffers updated in
place (a KV cache, a counter) are used at their own address, other inputs are copied in and, when
written, back; outputs held across calls keep their values."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.passes.host_scalars import scalars_to_device
from commfuse.passes.reinplace import reinplace_input_updates
from commfuse.runtime.cudagraphs import CudaGraphed, InputRoles, copy_out, input_roles, on_input, static_aliases

aten = torch.ops.aten


class Counter(torch.nn.Module):
    def __init__(self, device="cpu"):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("cache", torch.zeros(8, 4))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, y, pos):
        self.cache.index_copy_(0, pos, self.proj(y))
        self.count.add_(1)
        return self.cache.sum(0) * self.count


def test_input_roles_of_a_module_with_updated_buffers():
    """The bookkeeping, on CPU: parameters and buffers are static, the two buffers the forward
    updates are mutated, nothing is symbolic."""
    roles, names = [], []

    def fw(gm, example_inputs):
        reinplace_input_updates(gm)
        roles.append(input_roles(gm, "inference"))
        names.extend(tuple(p.meta["val"].shape) for p in gm.graph.find_nodes(op="placeholder"))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, keep_inference_input_mutations=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Counter(), backend=backend)(torch.randn(1, 4), torch.tensor([2]))
    (r,) = roles
    shapes = dict(enumerate(names))
    assert {shapes[i] for i in r.static} == {(4, 4), (8, 4), ()}, (r, shapes)
    assert {shapes[i] for i in r.mutated} == {(8, 4), ()}, (r, shapes)
    assert r.mutated <= r.static and not r.dynamic
    assert {shapes[i] for i in r.copy_in(len(shapes))} == {(1, 4), (1,)}
    assert r.copy_back() == []


def test_outputs_are_copied_in_their_own_strides():
    """A replay's outputs reach the caller as copies with the strides the graph reported (a padded
    logits matrix that the backward reads by them), not made contiguous as `clone` would."""
    padded = torch.randn(4, 8)[:, :7]
    copy = copy_out(padded)
    assert copy.stride() == (8, 1) and torch.equal(copy, padded)
    assert padded.clone().stride() == (7, 1)  # what a clone would have given
    expanded = torch.randn(1, 7).expand(3, 7)
    assert torch.equal(copy_out(expanded), expanded)


def test_outputs_on_static_inputs_are_taken_on_this_calls_input():
    """An output that is a static input (a weight the forward saves for its backward) or a view
    of one is rebuilt on the tensor of the current call: the same address may hold another
    layer's weight now, in a storage the caller frees and gathers again (FSDP2)."""
    weight, x = torch.randn(4, 6), torch.randn(3, 4)
    outputs = [weight, weight.t(), x @ weight]
    assert static_aliases(outputs, [weight, x], static={0}) == {0: 0, 1: 0}
    assert static_aliases(outputs, [weight, x], static=set()) == {}
    current = torch.randn(4, 6)  # this call's weight
    assert on_input(outputs[0], weight, current) is current
    view = on_input(outputs[1], weight, current)
    assert view.untyped_storage().data_ptr() == current.untyped_storage().data_ptr()
    assert view.stride() == (1, 6) and torch.equal(view, current.t())
    # inputs that are views into a flat buffer (FSDP2's gathered parameters), at other offsets
    flat, other = torch.randn(40), torch.randn(50)
    captured, now = flat[8:32].view(4, 6), other[20:44].view(4, 6)
    row = captured[2]
    assert torch.equal(on_input(row, captured, now), now[2])


class _FakeCapture:
    """Stands in for a CUDA graph on CPU: records captures, replays nothing."""
    def replay(self):
        pass


def test_a_graph_whose_parameters_keep_moving_stops_capturing(monkeypatch, caplog):
    """Each call brings a weight at a new address (one compiled code run by several layers):
    captured again up to the limit, then run plainly, with a warning."""
    captures, calls = [], []

    def capture(self, args):
        captures.append(len(calls))
        self.graph, self.inputs, self.outputs = _FakeCapture(), list(args), []
        self.static_ptrs = [(0, args[0].data_ptr())]
        self.copy_in, self.copy_back, self.aliases, self.cloned = [], [], {}, set()
        self.captured_signature, self.out_bytes = None, 0
        return True
    monkeypatch.setattr(CudaGraphed, "_capture", capture)
    graphed = CudaGraphed(lambda args: calls.append(1) or [], "g", InputRoles(frozenset({0}), frozenset(), False),
                          max_captures=2, copy_limit=1 << 30, paid_replays=8)
    weights = [torch.randn(4) for _ in range(6)]  # all alive: six addresses
    with caplog.at_level("WARNING", logger="commfuse"):
        for w in weights:
            graphed([w])
    assert captures == [1, 1]  # the 2nd and 3rd calls captured (the 1st runs plainly, as a warm-up)
    assert len(calls) == 1 + 3, "the 1st call, and every call after the limit, run plainly"
    assert "runs without a CUDA graph" in caplog.text
    graphed([weights[-1]])
    assert len(calls) == 5 and captures == [1, 1]


def test_a_graph_that_cannot_be_captured_runs_as_compiled(monkeypatch, caplog):
    """A capture that fails (an op that synchronizes, say) costs the graph, not the call: it runs
    without a CUDA graph from then on, with a warning that says why."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    def refused(*a, **k):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    for name, value in (("Stream", Stream), ("current_stream", Stream), ("CUDAGraph", object),
                        ("stream", lambda s: contextlib.nullcontext()), ("graph", refused)):
        monkeypatch.setattr(torch.cuda, name, value)
    calls = []
    graphed = CudaGraphed(lambda args: calls.append(list(args)) or [args[0] + 1], "g",
                          InputRoles(frozenset(), frozenset(), False), max_captures=2, copy_limit=1 << 30, paid_replays=8)
    with caplog.at_level("WARNING", logger="commfuse"):
        outs = [graphed([torch.full((2,), float(i))])[0] for i in range(3)]
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert len(calls) == 4, "the 1st call, the warm run before the capture, then each call plainly"
    assert "cannot be captured in a CUDA graph (RuntimeError: CUDA error: operation not permitted" in caplog.text


def test_a_graph_is_captured_again_when_a_symmetric_pool_moves(monkeypatch):
    """Another graph's first call needed a larger pool: the comm buffers this graph captured were
    freed, so its next call captures again at the new addresses."""
    from commfuse.runtime.symm import shared_pools
    captures = []

    def capture(self, args):
        captures.append(self.calls)
        self.pools_replaced = shared_pools.replaced
        self.graph, self.inputs, self.outputs, self.static_ptrs = _FakeCapture(), list(args), [], []
        self.copy_in, self.copy_back, self.aliases, self.cloned = [], [], {}, set()
        self.captured_signature, self.out_bytes = None, 0
        return True
    monkeypatch.setattr(CudaGraphed, "_capture", capture)
    graphed = CudaGraphed(lambda args: [], "g", InputRoles(frozenset(), frozenset(), False), max_captures=2,
                          copy_limit=1 << 30, paid_replays=8)
    x = torch.randn(4)
    for _ in range(3):
        graphed([x])
    monkeypatch.setattr(shared_pools, "replaced", shared_pools.replaced + 1)
    for _ in range(2):
        graphed([x])
    assert captures == [2, 4]


@pytest.mark.parametrize("marked_static", [False, True])
def test_a_cache_allocated_per_sequence_is_captured_in_place_once_per_sequence(monkeypatch, caplog, marked_static):
    """transformers' generate() allocates a new StaticCache for each sequence and the decode step
    writes it: a graph input that moves once per sequence and stays put for its tokens. Marked
    static (the prefill ran eagerly) or not (a compiled prefill allocated it), it is captured in
    place, never copied in or back, captured again at each sequence, and the graph keeps being
    replayed: captures that served a sequence's tokens do not count towards the limit."""
    captures, calls = [], []

    def capture(self, args):
        self._plan(args)
        captures.append((self.calls, self.copy_in, self.copy_back, [p for _, p in self.static_ptrs]))
        self.graph, self.outputs, self.aliases, self.cloned, self.out_bytes = _FakeCapture(), [], {}, set(), 0
        return True
    monkeypatch.setattr(CudaGraphed, "_capture", capture)
    roles = InputRoles(frozenset({0, 1} if marked_static else {0}), frozenset({1}), False)
    graphed = CudaGraphed(lambda args: calls.append(1) or [], "g", roles, max_captures=2, copy_limit=1 << 30,
                          paid_replays=8)
    weight, tokens = torch.randn(4), 10
    caches = [torch.zeros(8) for _ in range(5)]  # all alive: five addresses
    with caplog.at_level("WARNING", logger="commfuse"):
        for cache in caches:
            for _ in range(tokens):
                graphed([weight, cache, torch.randn(1)])  # (token ids: a new tensor each call)
    # the 1st call runs plainly; a written input is kept in place once seen twice at one address
    assert [c[0] for c in captures] == [2] + [tokens * k + 1 for k in range(1, 5)], captures
    assert all(c[1] == [2] and c[2] == [] for c in captures), "the cache is neither copied in nor back"
    assert [c[3] for c in captures] == [[weight.data_ptr(), c.data_ptr()] for c in caches]
    assert len(calls) == 1 and "runs without a CUDA graph" not in caplog.text


@pytest.mark.parametrize("size,out_bytes,replayed", [(64, 0, 7), (4096, 0, 2), (64, 1 << 20, 2)])
def test_a_graph_whose_copies_cost_more_than_its_launches_stops_replaying(monkeypatch, caplog, size, out_bytes,
                                                                          replayed):
    """An activation at a new address each call is copied into the graph's static copy, and the
    outputs out of the graph's. Where those copies are above the limit at 3 replays in a row (a
    backward's saved activations; a forward's, returned), the graph runs plainly from then on;
    small inputs (token ids) keep being copied and replayed."""
    calls, replays = [], []

    def capture(self, args):
        self.graph, self.inputs, self.outputs = _FakeCapture(), [a.clone() for a in args], []
        self.static_ptrs, self.copy_in, self.copy_back, self.aliases, self.cloned = [], [0], [], {}, set()
        self.captured_signature, self.out_bytes = None, out_bytes
        self.graph.replay = lambda: replays.append(1)
        return True
    monkeypatch.setattr(CudaGraphed, "_capture", capture)
    graphed = CudaGraphed(lambda args: calls.append(1) or [], "g", InputRoles(frozenset(), frozenset(), False),
                          max_captures=3, copy_limit=1024 * 4, paid_replays=8)
    with caplog.at_level("WARNING", logger="commfuse"):
        for _ in range(8):
            graphed([torch.randn(size)])  # a new tensor each call
    assert len(replays) == replayed and len(calls) == 8 - replayed
    assert ("runs without a CUDA graph" in caplog.text) == (replayed < 7)


def test_host_scalars_are_made_on_the_device_that_reads_them():
    """A lifted 0-dim CPU constant copied into a device tensor (HF T5's `ids[..., 0] = start_id`)
    and a CPU scalar in a `where` become constants on the reading op's device: no host-to-device
    copy for a CUDA graph to refuse, nothing left for aten. ('meta' stands for the GPU here.)"""
    start = torch.tensor(5)
    def f(x, ids):
        first = aten.copy.default(aten.select.int(ids, 1, 0), aten.lift_fresh_copy.default(start))
        return aten.where.self(x > 0, x, aten.scalar_tensor.default(-1.5, device="cpu")), first
    x, ids = torch.randn(4, 4, device="meta"), torch.ones(4, 3, device="meta", dtype=torch.int64)
    gm = make_fx(f)(x, ids)
    assert scalars_to_device(gm) == 2
    made = {n.args[0]: n.kwargs for n in gm.graph.find_nodes(op="call_function", target=aten.scalar_tensor.default)}
    assert made == {5: {"dtype": torch.int64, "device": torch.device("meta")},
                    -1.5: {"dtype": torch.float32, "device": torch.device("meta")}}
    assert not gm.graph.find_nodes(op="get_attr") and not [
        n for n in gm.graph.nodes if getattr(n.meta.get("val"), "device", None) == torch.device("cpu")]
    out = gm(x, ids)
    assert [(t.shape, t.dtype) for t in out] == [((4, 4), torch.float32), ((4,), torch.int64)]


@pytest.mark.gpu
def test_hf_t5_is_captured_and_matches_eager():
    """T5's decoder input is its labels shifted right, the first column set from a lifted CPU
    constant: the compiled graph keeps no host-to-device copy, so a CUDA graph captures it."""
    pytest.importorskip("transformers")
    from bench.models import MODELS
    torch.manual_seed(0)
    spec = MODELS["t5"](True, "cuda")
    model = spec.model.cuda().eval()
    compiled = torch.compile(model, backend="commfuse", options={"cuda_graphs": True})
    with torch.no_grad():
        want = spec.outputs(model(**spec.inputs(model)))
        for _ in range(3):
            for got, ref in zip(spec.outputs(compiled(**spec.inputs(model))), want):
                torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
def test_layers_sharing_compiled_code_train_like_eager():
    """Identical layers compiled one by one share Dynamo's compiled code, each with its own
    weights: the weight each forward saves is its own layer's, and gradients match eager."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())  # noqa: E731
                                         for _ in range(5)]).cuda()
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    for layer in model:
        layer.compile(backend="commfuse", options={"cuda_graphs": True})
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
            p.grad = q.grad = None


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["zero_grad", "accumulate", "two_forwards"])
def test_a_training_loop_replays_with_lent_activations_like_eager(loop):
    """A whole model's forward and backward as graphs: the forward lends its saved activations,
    the backward reads them in place; gradients match eager whether they are set to None each
    step, accumulated into, or two forwards run before their backwards (the first's activations
    still held at the second: copied, never overwritten)."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),  # noqa: E731
                                       torch.nn.LayerNorm(64)).cuda()
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="commfuse", options={"cuda_graphs": True})
    for step in range(6):
        xs = [torch.randn(16, 64, device="cuda") for _ in range(2 if loop == "two_forwards" else 1)]
        losses = [compiled(x).square().mean() for x in xs]
        for loss in reversed(losses):
            loss.backward()
        for x in xs:
            ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):  # (a stale activation: errors of 1e-3 and up)
            torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=1e-3)
            if loop != "accumulate":
                p.grad = q.grad = None


@pytest.mark.gpu
def test_a_step_the_caller_captures_whole_replays_like_eager():
    """torchtitan's trainer (its default on NVIDIA) runs one step, then captures the whole forward
    and backward of the compiled model in its own CUDA graph, on its own stream and pool, and
    replays it with each batch copied into the captured input; gradients accumulate in place."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),  # noqa: E731
                                       torch.nn.LayerNorm(64)).cuda()
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="commfuse")

    def step(x):
        loss = compiled(x).square().mean()
        loss.backward()
        return loss.detach()
    static, stream, graph = torch.randn(16, 64, device="cuda"), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    for i in range(5):
        x = torch.randn(16, 64, device="cuda")
        model.zero_grad(set_to_none=False)  # (the captured step accumulates into these tensors)
        ref.zero_grad()
        if i == 0:  # the warm step, on the capture's stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                loss = step(x)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            if i == 1:
                static.copy_(x)
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    captured = step(static)
            static.copy_(x)
            graph.replay()
            loss = captured
        want = ref(x).square().mean()
        want.backward()
        torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=1e-3)


@pytest.mark.gpu
def test_replays_update_module_buffers_and_keep_outputs():
    torch.manual_seed(0)
    model, ref = Counter().cuda(), Counter().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="commfuse", options={"cuda_graphs": True})
    held = []
    with torch.no_grad():
        for step in range(6):
            y, pos = torch.randn(1, 4, device="cuda"), torch.tensor([step % 8], device="cuda")
            out, want = compiled(y, pos), ref(y, pos)
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(model.cache, ref.cache)
            assert model.count.item() == ref.count.item() == step + 1
            held.append((out, want.clone()))
    for out, want in held:  # not rewritten by later replays
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
def test_replays_write_back_a_mutated_argument():
    """An argument that is not a module buffer and that the graph writes: copied back after each
    replay, whichever tensor the caller passes."""
    def step(x, y):
        x.mul_(2).add_(y)
        return x.sum()
    compiled = torch.compile(step, backend="commfuse", options={"cuda_graphs": True})
    for _ in range(4):
        x, y = torch.randn(16, device="cuda"), torch.randn(16, device="cuda")
        x_ref = x.clone()
        want = step(x_ref, y)
        torch.testing.assert_close(compiled(x, y), want)
        torch.testing.assert_close(x, x_ref)


@pytest.mark.gpu
def test_replays_draw_new_random_numbers():
    """Random tensors are drawn in the kernels from a seed aten draws in the captured graph: each
    replay draws anew (a dropout mask repeated every step would train silently wrong)."""
    x = torch.ones(64, 256, device="cuda")
    compiled = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5, True) + torch.rand_like(x),
                             backend="commfuse", options={"cuda_graphs": True})
    outs = [compiled(x).clone() for _ in range(6)]
    for i, out in enumerate(outs):
        assert 0.45 < (out >= 1).float().mean() < 0.55  # dropout kept about half
        assert all(not torch.equal(out, other) for other in outs[i + 1:])


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["forward", "generate"])
def test_hf_generate_keeps_its_graph_over_a_new_cache_per_call(how, caplog):
    """transformers' generate() with a static cache allocates a new cache at each call, which the
    decode step writes (marked static where generate() compiles the step, a compiled prefill's
    output where the forward is compiled): each call's logits are eager's, and the graph is captured
    again for each call's cache rather than given up after a few calls (11 decode steps a call: more
    replays than `Choices.cuda_graph_paid_replays`, so a capture pays for itself)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                                   eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(1, 128, (2, 5), device="cuda")

    def generate(**kw):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kw)
        return torch.stack(out.logits)
    want = generate(disable_compile=True)
    if how == "forward":
        model.forward, kw = torch.compile(model.forward, backend="commfuse", mode="reduce-overhead"), {"disable_compile": True}
    else:
        kw = {"compile_config": transformers.CompileConfig(backend="commfuse", mode="reduce-overhead")}
    with caplog.at_level("INFO", logger="commfuse"):
        for _ in range(6):
            torch.testing.assert_close(generate(**kw), want, atol=1e-3, rtol=1e-3)
    assert "runs without a CUDA graph" not in caplog.text
    assert caplog.text.count("in a CUDA graph") >= 5  # the decode step's graph, captured for each new cache


def _doubling_graph(monkeypatch, reads=None):
    """CudaGraphed over `2 * x`, its capture faked on CPU: a replay writes the static output from
    the static input (or from `reads()`, the caller's tensor, where the capture reads it in place),
    as a CUDA graph's kernels would. `captured`: (call, inputs copied in) of each capture."""
    def capture(self, args):
        self._drop()
        self._plan(args)
        self.captured.append((self.calls, list(self.copy_in)))
        out, inputs = torch.empty(4), self.inputs
        self.graph, self.outputs, self.captured_signature = _FakeCapture(), [out], None
        self.graph.replay = lambda: torch.mul(inputs[0] if inputs[0] is not None else self.reads(), 2, out=out)
        self._lend()
        return True
    monkeypatch.setattr(CudaGraphed, "_capture", capture)
    graphed = CudaGraphed(lambda args: [args[0] * 2], "g", InputRoles(frozenset(), frozenset(), False),
                          max_captures=2, copy_limit=1 << 30, paid_replays=8)
    graphed.captured, graphed.reads = [], reads
    return graphed


def test_outputs_are_lent_until_one_is_held_past_the_next_call(monkeypatch, caplog):
    """A replay returns its output over the graph's own memory (no copy) while nothing holds the
    last one at the next call (a forward's saved activations, freed by its backward). One held
    there would be overwritten by the replay: that call runs without the graph, the held value is
    kept, and the graph is captured again with the output copied out; the limit on captures is not
    spent on it."""
    graphed = _doubling_graph(monkeypatch)
    xs = [torch.full((4,), float(i)) for i in range(8)]
    with caplog.at_level("WARNING", logger="commfuse"):
        graphed([xs[0]])                     # the warm-up runs plainly
        (y,) = graphed([xs[1]])              # captured: lent
        static = graphed.outputs[0]
        assert torch.equal(y, xs[1] * 2) and y.data_ptr() == static.data_ptr()
        del y
        (kept,) = graphed([xs[2]])           # replayed, lent again, and held across the next call
        assert kept.data_ptr() == static.data_ptr()
        (y,) = graphed([xs[3]])              # would overwrite `kept`: runs plainly
        assert torch.equal(y, xs[3] * 2) and y.data_ptr() != static.data_ptr()
        assert torch.equal(kept, xs[2] * 2), "a held output was overwritten"
        for x in xs[4:]:
            (y,) = graphed([x])              # captured again, the output copied out
            assert torch.equal(y, x * 2) and y.data_ptr() != graphed.outputs[0].data_ptr()
    assert torch.equal(kept, xs[2] * 2)
    assert [c[0] for c in graphed.captured] == [2, 5] and graphed.copied == {0}
    assert "runs without a CUDA graph" not in caplog.text


def test_a_graph_reads_another_graphs_lent_output_in_place(monkeypatch):
    """A backward's saved activations are its forward's lent outputs: captured at the forward's
    addresses, they are not copied in; an input that is not lent is."""
    current = []
    forward, backward = _doubling_graph(monkeypatch), _doubling_graph(monkeypatch, reads=lambda: current[0])
    for i in range(4):
        (saved,) = forward([torch.full((4,), float(i))])
        current[:] = [saved]
        (grad,) = backward([saved])
        assert torch.equal(grad, torch.full((4,), 4.0 * i))
        del saved, grad
        current.clear()
    assert backward.captured == [(2, [])], "captured once, the lent activation in place"
    other = _doubling_graph(monkeypatch)
    for i in range(2):
        other([torch.full((4,), float(i))])
    assert other.captured == [(2, [0])]
