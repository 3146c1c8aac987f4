"""Inference graphs take their DTensor parameters and buffers as local shards (dtensor_params.py):
which inputs are rewritten, and that results and in-place buffer updates stay those of eager."""
import pytest
import torch
import torch.nn as nn

from tests.dist_utils import SharedRanks, device

pytestmark = pytest.mark.xdist_group("dtensor_params")  # one worker: its checks share a spawn


class _Model(nn.Module):
    """Column- then row-parallel linears; a sharded DTensor buffer counted up in place each call;
    optionally the first weight returned as it is."""

    def __init__(self, return_weight=False):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.return_weight = return_weight

    def forward(self, x):
        self.count.add_(1)
        y = self.b(torch.relu(self.a(x))) + self.count.to_local().sum()
        return (y, self.a.weight) if self.return_weight else y


def _build(return_weight=False):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(device().type, (torch.distributed.get_world_size(),))
    torch.manual_seed(0)
    model = _Model(return_weight).to(device())
    parallelize_module(model, mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    model.register_buffer("count", distribute_tensor(torch.zeros(4, device=device()), mesh, [Shard(0)]))
    return model


def _run(rank, world, grad, return_weight=False):
    from commfuse import backend
    rewrite, compile_graph, seen, static = backend.local_shard_inputs, backend.compile_graph, [], []

    def recorded(gm, example_inputs):  # what the rewrite makes of Dynamo's graph
        after, shards = rewrite(gm, example_inputs)
        seen.append(([type(x).__name__ for x in example_inputs], [type(x).__name__ for x in after], shards))
        return after, shards

    def roles(gm, example_inputs, kind):  # the inputs `cuda_graphs` mode would not copy per call
        static.append(sorted(backend.input_roles(gm, kind).static))
        return compile_graph(gm, example_inputs, kind)

    compiled, eager = _build(return_weight), _build(return_weight)
    x = torch.randn(3, 16, device=device())
    backend.local_shard_inputs, backend.compile_graph = recorded, roles
    try:
        with torch.set_grad_enabled(grad):
            fn = torch.compile(compiled, backend="commfuse", dynamic=False)
            outs = [(fn(x), eager(x)) for _ in range(3)]
    finally:
        backend.local_shard_inputs, backend.compile_graph = rewrite, compile_graph
    diffs = []
    for got, want in outs:
        got, want = (got, want) if return_weight else ((got,), (want,))
        diffs.append(max((g.full_tensor() if hasattr(g, "full_tensor") else g).sub(
            w.full_tensor() if hasattr(w, "full_tensor") else w).abs().max().item() for g, w in zip(got, want)))
    returned_is_param = return_weight and outs[0][0][1] is compiled.a.weight
    return seen, diffs, compiled.count.full_tensor().tolist(), returned_is_param, static


def _uneven(rank, world):
    """A column-parallel linear whose 15 outputs split 8 / 7, gathered back (`output_layouts=Replicate()`):
    DTensor pads the short shard on one rank only, so the all-gather's buffer is the matmul's [12, 8]
    on one rank and the padded [2, 6, 8] on the other: one dense layout, which the ranks' plans agree on."""
    from torch.distributed.tensor import Replicate, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh(device().type, (world,))
    torch.manual_seed(0)
    model, ref = nn.Linear(8, 15).to(device()), nn.Linear(8, 15).to(device())
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, ColwiseParallel(output_layouts=Replicate()))
    x = torch.randn(2, 6, 8, device=device())
    got, want = torch.compile(model, backend="commfuse")(x), ref(x)
    got.square().sum().backward()
    want.square().sum().backward()
    return max((got - want).abs().max().item(),
               (model.weight.grad.full_tensor() - ref.weight.grad).abs().max().item())


# the four cases in one spawn
SHARED = SharedRanks([(_run, (False,)), (_run, (True,)), (_run, (False, True)), (_uneven, ())], 2)


def test_inference_takes_dtensor_parameters_and_buffers_as_shards():
    for seen, diffs, count, _, static in SHARED.result(_run, False):
        (before, after, shards), = seen
        # the four weights and biases and the buffer: DTensors to Dynamo, local tensors to AOTAutograd
        assert before.count("DTensor") == 5 and after.count("DTensor") == 0 and len(shards) == 5, seen
        assert static == [shards], static  # still parameters and buffers to AOTAutograd
        assert max(diffs) < 1e-5, diffs
        assert count == [3.0] * 4  # the buffer's in-place update reached the module's DTensor


def test_training_keeps_dtensor_parameters():
    for seen, diffs, count, _, _ in SHARED.result(_run, True):
        (before, after, shards), = seen
        assert shards == [] and after == before, seen  # a shard would cut the weights off their gradients
        assert max(diffs) < 1e-5 and count == [3.0] * 4, (diffs, count)


def test_a_returned_parameter_stays_the_callers_object():
    for seen, diffs, count, returned_is_param, _ in SHARED.result(_run, False, True):
        assert len(seen) == 1 and len(seen[0][2]) == 5, seen  # Dynamo returns the parameter itself
        assert returned_is_param and max(diffs) < 1e-5 and count == [3.0] * 4


def test_an_uneven_shard_gathered_back_compiles_on_every_rank():
    assert max(SHARED.result(_uneven)) < 1e-4
