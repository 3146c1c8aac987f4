"""CUDA-graph mode keeps what the graph writes visible to the caller: module buffers updated in
place (a KV cache, a counter) are used at their own address, other inputs are copied in and, when
written, back; outputs held across calls keep their values."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from commfuse.reinplace import reinplace_input_updates
from commfuse.runtime.cudagraphs import copy_out, input_roles


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
