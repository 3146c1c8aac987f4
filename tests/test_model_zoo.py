"""The model zoo: models nobody on the team wrote, built from configs with random weights (no
downloads), through commfuse. Inference: the outputs match eager. Training: the loss and every
parameter's gradient match eager. Either way each graph compiled (no whole-graph fallback: the
conftest makes a compile error raise) into generated Triton kernels, with no graph break.

Models are in eval mode (dropout off) so that both runs compute the same function. The HF models
use SDPA attention, the transformers default.
"""
from __future__ import annotations

import copy
import os
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from commfuse import config as commfuse_config
from tests.common import DEVICE, Dumps, compile_and_run, kernel_defs

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing may be downloaded

VOCAB, BATCH, SEQ = 100, 2, 8


class Case(NamedTuple):
    model: nn.Module
    inputs: dict                      # keyword arguments of model(...)
    outputs: Callable                 # model output -> tensors compared in inference
    loss: Callable                    # model output -> the scalar trained on


# --------------------------------------------------------------------------------------------- models
def _hf(model_cls: str, config_cls: str, loss_type=None, **config):
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, config_cls)(attn_implementation="sdpa", **config)
    model = getattr(transformers, model_cls)(cfg)
    assert model.config._attn_implementation == "sdpa"
    if loss_type:  # its class name names no loss: transformers would warn in forward (a graph break)
        model.loss_type = loss_type
    return model


def _tokens(*shape, low=0):
    return torch.randint(low, VOCAB, shape or (BATCH, SEQ))


def _logits_and_loss(out):
    return out.logits, out.loss


def _causal_lm(model):
    ids = _tokens()
    return Case(model, {"input_ids": ids, "labels": ids}, _logits_and_loss, lambda o: o.loss)


def gpt2():
    return _causal_lm(_hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=16,
                          n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                          loss_type="ForCausalLM"))


def llama():  # grouped-query attention: 4 query heads share 2 K/V heads
    return _causal_lm(_hf("LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0))


def qwen2():  # GQA, and biases on q/k/v
    return _causal_lm(_hf("Qwen2ForCausalLM", "Qwen2Config", vocab_size=VOCAB, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0))


def bert():  # masked LM over a padded batch: the padding mask reaches SDPA as attn_mask
    model = _hf("BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                pad_token_id=0)
    ids = _tokens(low=1)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 2:5] = ids[:, 2:5]
    inputs = {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
              "labels": labels}
    return Case(model, inputs, _logits_and_loss, lambda o: o.loss)


def t5():  # encoder-decoder: relative position bias, cross-attention, decoder inputs from labels
    model = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                num_layers=2, num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    inputs = {"input_ids": _tokens(), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
              "labels": _tokens(BATCH, 6)}
    return Case(model, inputs, _logits_and_loss, lambda o: o.loss)


def vit():
    model = _hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=8, num_channels=3,
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                num_labels=10)
    inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}
    return Case(model, inputs, _logits_and_loss, lambda o: o.loss)


def _torchvision(name):
    torchvision = pytest.importorskip("torchvision")
    model = getattr(torchvision.models, name)(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():  # running statistics of real activations: eval-mode BN then keeps them O(1)
        model.train()(x)
    labels = torch.arange(4) % 10
    return Case(model, {"x": x}, lambda o: (o,), lambda o: F.cross_entropy(o, labels.to(o.device)))


def resnet18():
    return _torchvision("resnet18")


def mobilenet_v3_small():
    return _torchvision("mobilenet_v3_small")


def transformer_encoder_layer():
    # (seq, batch, dim), the nn default: in inference, batch_first=True would take the fused
    # fast path, one aten op (test_transformer_encoder_layer_fast_path)
    model = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    inputs = {"src": torch.randn(SEQ, BATCH, 32), "src_mask": mask, "is_causal": True}
    probe = torch.randn(SEQ, BATCH, 32)  # not mean(o²): after the final LayerNorm it is ~1 whatever the weights
    return Case(model, inputs, lambda o: (o,), lambda o: (o * probe.to(o.device)).sum())


MODELS = [gpt2, llama, qwen2, bert, t5, vit, resnet18, mobilenet_v3_small, transformer_encoder_layer]


# --------------------------------------------------------------------------------------------- checks
def _run(model, inputs, tmp_path):
    """The model called with keyword inputs, compiled by commfuse; returns (output, Dumps)."""
    return compile_and_run(lambda kw: model(**kw), inputs, tmp_path=tmp_path)


def _build(make) -> tuple[Case, nn.Module]:
    torch.manual_seed(0)
    case = make()
    case.model.eval().to(DEVICE)
    inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
    return case._replace(inputs=inputs), copy.deepcopy(case.model)


def _close(got, want, what, floor=0.0, atol=1e-4, rtol=1e-3):
    """fp32 tolerance with atol relative to the tensor's largest value (gradients deep in a network
    can be 1e-8 small, where a fixed atol would accept anything), but not below `floor`."""
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor)
    torch.testing.assert_close(got, want, atol=atol * (scale or 1.0), rtol=rtol, msg=lambda m: f"{what}: {m}")


def _dynamo_graphs(call) -> int:
    """Graphs Dynamo itself makes of `call` (no commfuse: its "eager" backend)."""
    count = 0

    def backend(gm, example_inputs):
        nonlocal count
        count += 1
        return gm.forward
    torch._dynamo.reset()
    torch.compile(call, backend=backend)()
    return count


def _assert_compiled(dumps, kinds: list[str], call=None):
    """Each graph compiled into generated kernels, none run op by op through aten; and as many
    graphs as `kinds`, or where `call` is given, as many as Dynamo itself breaks the model into
    (a graph break in the model's library under some version is Dynamo's, not ours)."""
    graphs = dumps.graphs()
    counters = dict(torch._dynamo.utils.counters["graph_break"])
    found = sorted(os.path.basename(g).split("_")[1] for g in graphs)
    if found != kinds and call is not None:
        n = _dynamo_graphs(call)  # each of Dynamo's graphs once per kind (forward and backward)
        assert n > 1 and found == sorted(kinds * n), (graphs, counters, n)
    else:
        assert found == kinds, (graphs, counters)
    for g in graphs:
        summary = dumps.summary(g)
        assert summary.get("compiled", True), summary
        assert summary["kernels"] and kernel_defs(dumps.code(g)), f"{g}: no generated kernel"


@pytest.mark.parametrize("make", MODELS, ids=lambda f: f.__name__)
def test_inference(make, tmp_path):
    case, ref = _build(make)
    with torch.no_grad():
        out, dumps = _run(case.model, case.inputs, tmp_path)
        want = ref(**case.inputs)
    for i, (g, w) in enumerate(zip(case.outputs(out), case.outputs(want), strict=True)):
        _close(g, w, f"output {i}")
    with torch.no_grad():
        _assert_compiled(dumps, ["inference"], lambda: ref(**case.inputs))


@pytest.mark.parametrize("make", MODELS, ids=lambda f: f.__name__)
def test_training(make, tmp_path):
    case, ref = _build(make)
    out, dumps = _run(case.model, case.inputs, tmp_path)
    loss = case.loss(out)
    loss.backward()
    ref_loss = case.loss(ref(**case.inputs))
    ref_loss.backward()
    _close(loss, ref_loss, "loss")
    grads = {name: p.grad for name, p in ref.named_parameters()}
    # A gradient that is zero in exact arithmetic (the key bias: softmax ignores a constant added
    # to every score) is rounding noise of the terms that cancel, whose size is the model's, not its own.
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values() if g is not None)
    for name, p in case.model.named_parameters():
        assert (p.grad is None) == (grads[name] is None), name
        if p.grad is not None:
            _close(p.grad, grads[name], name, floor)
    _assert_compiled(dumps, ["backward", "forward"], lambda: case.loss(ref(**case.inputs)))


def test_transformer_encoder_layer_fast_path(tmp_path):
    """batch_first in inference: PyTorch's fused encoder layer, one aten op that runs as an extern
    (there is nothing left to generate a kernel for); its value must still be eager's."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True).eval().to(DEVICE)
    x = torch.randn(BATCH, SEQ, 32, device=DEVICE)
    with torch.no_grad():
        out, dumps = compile_and_run(model, x, tmp_path=tmp_path)
        _close(out, model(x), "output")
    summary, _ = dumps.only()
    assert summary["fallback_ops"] == ["aten._transformer_encoder_layer_fwd.default"], summary["fallback_ops"]


def test_greedy_decode_static_kv_cache(tmp_path):
    """A few tokens of greedy generation by HF `generate` over a static KV cache (updated in place
    by index_copy_), the model's forward compiled: the same tokens and logits as eager, from two
    graphs (prefill, and one decode step reused for every token), each compiled."""
    case, _ = _build(llama)
    model, prompt = case.model, case.inputs["input_ids"]
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", output_logits=True,
              return_dict_in_generate=True)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model.generate(prompt, **kw)
        with commfuse_config.patch(dump_dir=str(tmp_path)):
            model.forward = torch.compile(model.forward, backend="commfuse")
            got = model.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for i, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        _close(g, w, f"logits of token {i}")
    _assert_compiled(Dumps(tmp_path), ["inference", "inference"])


def test_gpt2_with_padded_rows(tmp_path):
    """GPT-2 with GPU layouts on CPU: a 1001-word vocabulary and width 34, unaligned, so the head,
    qkv and MLP matmuls run on padded operands and the logits sit in padded rows (`pad_rows`, on
    for CUDA); the qkv split reads them through as_strided. Loss and every gradient as eager's."""
    torch.manual_seed(0)
    model = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=1001, n_positions=16, n_embd=34, n_layer=2,
                n_head=2, n_inner=300, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM").eval().to(DEVICE)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 1001, (2, 8), device=DEVICE)
    with commfuse_config.patch(pad_rows=True, pad_rows_min_bytes=0):
        out, dumps = _run(model, {"input_ids": ids, "labels": ids}, tmp_path)
        out.loss.backward()
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    _close(out.logits, want.logits, "logits")
    _close(out.loss, want.loss, "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, name, 1e-3 * max(g.grad.abs().max().item() for g in ref.parameters()))
    forward = dumps.code(dumps.graphs()[0])
    assert "(16, 1004), (1004, 1)" in forward, forward  # the head's output rows, padded
