"""Hugging Face models that no test of ours is written for (not in tests/test_model_zoo.py),
through commfuse on CPU (Triton interpreter), as a new user would run them.

    python bench/heldout_hf.py --results bench/results/heldout_hf_cpu.json   # all, 2 worker processes
    python bench/heldout_hf.py --one NAME      # one model in this process (what each worker runs)
    python bench/heldout_hf.py --only A,B      # a subset
    python bench/heldout_hf.py --device cuda --jobs 8 [--backend inductor]   # on a GPU (or Inductor there)

Tiny random configs, eval mode (train mode with dropout 0 where eager's backward asks for it), fp32. Per model: inference, forward + backward (the loss, or the
main output against a fixed random tensor; every parameter gradient), and a call at other sizes
(Dynamo's symbolic-size recompile), each against eager; graph breaks and per-graph fallbacks.
Compile errors raise (COMMFUSE_FALLBACK_ON_ERROR=0). Each model runs in its own process with a
timeout; the logs go to a temporary folder.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VOCAB, B, S = 100, 2, 8
PAD = False  # set for the "+pad" variants

# --------------------------------------------------------------------------------------------- models


def _tok(*shape, low=3):
    import torch
    return torch.randint(low, VOCAB, shape or (B, S))


def _padmask():
    import torch
    m = torch.ones(B, S, dtype=torch.long)
    m[1, -3:] = 0
    return m


def _mlm_labels(ids):
    import torch
    lab = torch.full_like(ids, -100)
    lab[:, 2:5] = ids[:, 2:5]
    return lab


def _causal(**cfg):
    import torch
    ids = _tok()
    if PAD:  # left padding: row 1 starts with 3 pad tokens
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, :3] = 0
        return dict(cfg=cfg, inputs={"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                                     "labels": ids.masked_fill(mask == 0, -100)}, main="logits", loss="loss")
    return dict(cfg=cfg, inputs={"input_ids": ids, "labels": ids}, main="logits", loss="loss")


def _mlm(pad_id=0, **cfg):
    ids, mask = _tok(), _padmask()
    ids = ids.masked_fill(mask == 0, pad_id)
    return dict(cfg=cfg, inputs={"input_ids": ids, "attention_mask": mask, "labels": _mlm_labels(ids)},
                main="logits", loss="loss")


def _seq2seq(**over):
    """A BART-like encoder-decoder's tiny config over a padded batch."""
    cfg = {**dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None),
           **over}
    ids, mask = _tok(), _padmask()
    return dict(cfg=cfg, inputs={"input_ids": ids.masked_fill(mask == 0, cfg["pad_token_id"]), "attention_mask": mask,
                                 "labels": _tok(B, 6)}, main="logits", loss="loss")


def _image(n=16):
    import torch
    return torch.randn(B, 3, n, n)


def spec(name):
    import torch
    enc = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=32)
    dec = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "DistilBertForMaskedLM":
        return "DistilBertConfig", _mlm(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                        max_position_embeddings=32, pad_token_id=0)
    if name == "RobertaForMaskedLM":
        return "RobertaConfig", _mlm(pad_id=1, **enc, pad_token_id=1)
    if name == "AlbertForMaskedLM":
        return "AlbertConfig", _mlm(**enc, embedding_size=16, pad_token_id=0)
    if name == "ElectraForPreTraining":
        s = _mlm(**enc, embedding_size=16, pad_token_id=0)
        s["inputs"]["labels"] = torch.randint(0, 2, (B, S))
        return "ElectraConfig", s
    if name == "BartForConditionalGeneration":
        ids, mask = _tok(), _padmask()
        return "BartConfig", dict(cfg=dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                           encoder_attention_heads=2, decoder_attention_heads=2,
                                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                                           pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                           decoder_start_token_id=2, forced_eos_token_id=None),
                                  inputs={"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask,
                                          "labels": _tok(B, 6)}, main="logits", loss="loss")
    if name == "MistralForCausalLM":
        return "MistralConfig", _causal(**dec, sliding_window=4)
    if name == "Gemma2ForCausalLM":
        return "Gemma2Config", _causal(**dec, head_dim=8, sliding_window=4)
    if name == "PhiForCausalLM":
        return "PhiConfig", _causal(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=32,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "GPTNeoXForCausalLM":
        return "GPTNeoXConfig", _causal(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "OPTForCausalLM":
        return "OPTConfig", _causal(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                    pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if name == "BloomForCausalLM":
        return "BloomConfig", _causal(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "FalconForCausalLM":
        return "FalconConfig", _causal(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "MixtralForCausalLM":
        return "MixtralConfig", _causal(**dec, num_local_experts=4, num_experts_per_tok=2)
    if name == "WhisperForConditionalGeneration":
        return "WhisperConfig", dict(cfg=dict(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2,
                                              decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                                              encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                              max_target_positions=16, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, decoder_start_token_id=1,
                                              suppress_tokens=None, begin_suppress_tokens=None),
                                     inputs={"input_features": torch.randn(B, 16, 32), "labels": _tok(B, 6)},
                                     main="logits", loss="loss")
    if name == "CLIPModel":
        ids = _tok()
        ids[:, -1] = 2  # eos
        return "CLIPConfig", dict(cfg=dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=2, num_attention_heads=2,
                                                            max_position_embeddings=16, eos_token_id=2),
                                           vision_config=dict(image_size=16, patch_size=8, hidden_size=32,
                                                              intermediate_size=64, num_hidden_layers=2,
                                                              num_attention_heads=2),
                                           projection_dim=16),
                                  inputs={"input_ids": ids, "pixel_values": torch.randn(B, 3, 16, 16),
                                          "return_loss": True},
                                  main="logits_per_image", loss="loss")
    if name == "Swinv2Model":
        return "Swinv2Config", dict(cfg=dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                             num_heads=[2, 2], window_size=4),
                                    inputs={"pixel_values": torch.randn(B, 3, 32, 32)},
                                    main="last_hidden_state", loss=None)
    if name == "ConvNextModel":
        return "ConvNextConfig", dict(cfg=dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32),
                                      inputs={"pixel_values": torch.randn(B, 3, 32, 32)},
                                      main="last_hidden_state", loss=None)
    if name == "DeiTForImageClassification":
        return "DeiTConfig", dict(cfg=dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64, num_labels=10),
                                  inputs={"pixel_values": torch.randn(B, 3, 16, 16),
                                          "labels": torch.randint(0, 10, (B,))},
                                  main="logits", loss="loss")
    if name == "SegformerForSemanticSegmentation":
        return "SegformerConfig", dict(cfg=dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                                hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                                num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                                decoder_hidden_size=32, num_labels=3, image_size=32),
                                       inputs={"pixel_values": torch.randn(B, 3, 32, 32),
                                               "labels": torch.randint(0, 3, (B, 32, 32))},
                                       main="logits", loss="loss")
    if name in ("Wav2Vec2Model", "HubertModel"):  # the same speech encoder's config
        return name.replace("Model", "Config"), dict(
            cfg=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                     num_conv_pos_embedding_groups=2, vocab_size=VOCAB),
            inputs={"input_values": torch.randn(B, 400)}, main="last_hidden_state", loss=None)
    if name == "Qwen3ForCausalLM": return "Qwen3Config", _causal(**dec, head_dim=8)
    if name == "Qwen3MoeForCausalLM":
        return "Qwen3MoeConfig", _causal(**dec, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, decoder_sparse_step=1)
    if name == "Gemma3ForCausalLM": return "Gemma3TextConfig", _causal(**dec, head_dim=8, sliding_window=4)
    if name == "Phi3ForCausalLM": return "Phi3Config", _causal(**dec)
    if name == "StableLmForCausalLM": return "StableLmConfig", _causal(**dec)
    if name == "Olmo2ForCausalLM": return "Olmo2Config", _causal(**dec)
    if name == "CohereForCausalLM": return "CohereConfig", _causal(**dec)
    if name == "Starcoder2ForCausalLM": return "Starcoder2Config", _causal(**dec, sliding_window=4)
    if name == "GPTJForCausalLM":
        return "GPTJConfig", _causal(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "CodeGenForCausalLM":
        return "CodeGenConfig", _causal(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                                       n_ctx=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "GPTNeoForCausalLM":
        return "GPTNeoConfig", _causal(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                      attention_types=[[["global", "local"], 1]], window_size=4,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "MambaForCausalLM":
        return "MambaConfig", _causal(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                     conv_kernel=4, use_mambapy=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "Mamba2ForCausalLM":
        return "Mamba2Config", _causal(vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=1,
                                      num_hidden_layers=2, expand=2, chunk_size=4, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    if name == "ModernBertForMaskedLM":
        return "ModernBertConfig", _mlm(**enc, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0)
    if name == "DebertaV2ForMaskedLM":
        return "DebertaV2Config", _mlm(**enc, pad_token_id=0, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                      position_buckets=8, max_relative_positions=16)
    if name == "XLNetLMHeadModel":
        ids = _tok()
        return "XLNetConfig", dict(cfg=dict(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2, d_inner=64, pad_token_id=0),
                                   inputs={"input_ids": ids, "labels": ids}, main="logits", loss="loss")
    if name == "PegasusForConditionalGeneration": return "PegasusConfig", _seq2seq()
    if name == "MarianMTModel": return "MarianConfig", _seq2seq(decoder_start_token_id=1, decoder_vocab_size=VOCAB)
    if name == "MBartForConditionalGeneration": return "MBartConfig", _seq2seq()
    if name == "Dinov2Model":
        return "Dinov2Config", dict(cfg=dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, mlp_ratio=2),
                                    inputs={"pixel_values": _image()}, main="last_hidden_state", loss=None)
    if name == "BeitForImageClassification":
        return "BeitConfig", dict(cfg=dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64, num_labels=10,
                                           use_relative_position_bias=True, use_mean_pooling=True),
                                  inputs={"pixel_values": _image(), "labels": torch.randint(0, 10, (B,))},
                                  main="logits", loss="loss")
    if name == "MobileViTForImageClassification":
        return "MobileViTConfig", dict(cfg=dict(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                                neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2,
                                                num_labels=10),
                                       inputs={"pixel_values": _image(32), "labels": torch.randint(0, 10, (B,))},
                                       main="logits", loss="loss")
    if name == "RegNetForImageClassification":
        return "RegNetConfig", dict(cfg=dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                                             num_labels=10),
                                    inputs={"pixel_values": _image(32), "labels": torch.randint(0, 10, (B,))},
                                    main="logits", loss="loss")
    if name == "ResNetForImageClassification":
        return "ResNetConfig", dict(cfg=dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                             layer_type="bottleneck", num_labels=10),
                                    inputs={"pixel_values": _image(32), "labels": torch.randint(0, 10, (B,))},
                                    main="logits", loss="loss")
    if name == "SiglipModel":
        return "SiglipConfig", dict(cfg=dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=2, num_attention_heads=2,
                                                              max_position_embeddings=16),
                                             vision_config=dict(image_size=16, patch_size=8, hidden_size=32,
                                                                intermediate_size=64, num_hidden_layers=2,
                                                                num_attention_heads=2)),
                                    inputs={"input_ids": _tok(), "pixel_values": _image(), "return_loss": True},
                                    main="logits_per_image", loss="loss")

    # ------------------------------------------- architectures whose ops no model above exercises
    if name == "LongT5ForConditionalGeneration":
        ids, mask = _tok(), _padmask()
        return "LongT5Config", dict(cfg=dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                             num_decoder_layers=2, num_heads=4, local_radius=2, global_block_size=4,
                                             encoder_attention_type="transient-global",
                                             relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                             decoder_start_token_id=0),
                                    inputs={"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                                            "labels": _tok(B, 6)}, main="logits", loss="loss")
    if name == "BigBirdForMaskedLM":
        return "BigBirdConfig", _mlm(**{**enc, "max_position_embeddings": 64}, attention_type="original_full",
                                     pad_token_id=0)
    if name == "BigBirdForMaskedLM_blocksparse":
        s_ = 2 * S  # block sparse needs seq > (5 + 2 * num_random_blocks) * block_size = 14
        ids = torch.randint(3, VOCAB, (B, s_))
        lab = torch.full_like(ids, -100)
        lab[:, 2:5] = ids[:, 2:5]
        return "BigBirdConfig", dict(cfg={**enc, "max_position_embeddings": 64, "attention_type": "block_sparse",
                                          "block_size": 2, "num_random_blocks": 1, "pad_token_id": 0},
                                     inputs={"input_ids": ids, "labels": lab}, main="logits", loss="loss",
                                     cls="BigBirdForMaskedLM")
    if name == "FunnelForMaskedLM":
        return "FunnelConfig", _mlm(vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=2,
                                    d_head=16, d_inner=64, pad_token_id=0)
    if name == "LEDForConditionalGeneration":
        s = _seq2seq(max_encoder_position_embeddings=64, max_decoder_position_embeddings=32, attention_window=4)
        s["cfg"].pop("max_position_embeddings")
        g = torch.zeros(B, S, dtype=torch.long)
        g[:, 0] = 1
        s["inputs"]["global_attention_mask"] = g
        return "LEDConfig", s
    if name == "PerceiverForMaskedLM":
        sp = _mlm(vocab_size=VOCAB, num_latents=8, d_latents=32, d_model=32, num_blocks=1,
                  num_self_attends_per_block=2, num_self_attention_heads=2,
                  num_cross_attention_heads=2, max_position_embeddings=32)
        sp["inputs"].pop("labels")  # the decoder emits max_position_embeddings positions
        sp["loss"] = None
        return "PerceiverConfig", sp
    if name == "YolosForObjectDetection":  # (no labels: the Hungarian matcher needs scipy)
        n = 2 * S
        return "YolosConfig", dict(cfg=dict(image_size=[16, 16], patch_size=8, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, num_detection_tokens=4,
                                            num_labels=3),
                                   inputs={"pixel_values": torch.randn(B, 3, n, n)}, main="logits", loss=None)
    if name == "DetrForObjectDetection":
        n = 4 * S
        return "DetrConfig", dict(cfg=dict(use_timm_backbone=False, use_pretrained_backbone=False,
                                           backbone_config=dict(model_type="resnet", embedding_size=8,
                                                                hidden_sizes=[8, 16], depths=[1, 1],
                                                                layer_type="basic", out_features=["stage2"]),
                                           d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                           num_queries=5, num_labels=3),
                                  inputs={"pixel_values": torch.randn(B, 3, n, n)}, main="logits", loss=None)
    if name == "SamModel":
        return "SamConfig", dict(cfg=dict(vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                             image_size=64, patch_size=16, output_channels=16,
                                                             window_size=2, global_attn_indexes=[1], mlp_dim=64,
                                                             num_pos_feats=8),
                                          prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=16,
                                                                     mask_input_channels=4),
                                          mask_decoder_config=dict(hidden_size=16, num_hidden_layers=1,
                                                                   num_attention_heads=2, mlp_dim=32,
                                                                   iou_head_hidden_dim=16)),
                                 inputs={"pixel_values": torch.randn(B, 3, 64, 64),
                                         "input_points": torch.rand(B, 1, 1, 2) * 64},
                                 main="pred_masks", loss=None)
    if name == "Wav2Vec2ConformerModel":
        return "Wav2Vec2ConformerConfig", dict(
            cfg=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                     num_conv_pos_embedding_groups=2, vocab_size=VOCAB, position_embeddings_type="relative",
                     conv_depthwise_kernel_size=3),
            inputs={"input_values": torch.randn(B, 50 * S)}, main="last_hidden_state", loss=None)
    if name == "Speech2TextForConditionalGeneration":
        t = 4 * S
        m = torch.ones(B, t, dtype=torch.long)
        m[1, -5:] = 0
        return "Speech2TextConfig", dict(cfg=dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                                  encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=16,
                                                  input_channels=1, num_conv_layers=2, conv_channels=32,
                                                  conv_kernel_sizes=[5, 5], max_source_positions=64,
                                                  max_target_positions=32, pad_token_id=1, bos_token_id=0,
                                                  eos_token_id=2, decoder_start_token_id=2),
                                         inputs={"input_features": torch.randn(B, t, 16), "attention_mask": m,
                                                 "labels": _tok(B, 6)}, main="logits", loss="loss")
    if name == "BlipForConditionalGeneration":
        return "BlipConfig", dict(cfg=dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=2, num_attention_heads=2,
                                                            max_position_embeddings=32, bos_token_id=1,
                                                            pad_token_id=0, sep_token_id=2, eos_token_id=2),
                                           vision_config=dict(image_size=16, patch_size=8, hidden_size=32,
                                                              intermediate_size=64, num_hidden_layers=2,
                                                              num_attention_heads=2),
                                           projection_dim=16),
                                  inputs={"pixel_values": _image(), "input_ids": _tok(), "labels": _tok()},
                                  main="logits", loss="loss")
    if name == "ConvBertForMaskedLM":
        return "ConvBertConfig", _mlm(**enc, embedding_size=32, head_ratio=2, conv_kernel_size=3, num_groups=1,
                                      pad_token_id=0)
    if name == "ReformerModelWithLMHead":  # backward needs train mode (dropouts 0); train mode needs S == 8
        ids = _tok(B, 8)
        return "ReformerConfig", dict(cfg=dict(vocab_size=VOCAB, hidden_size=32, attention_head_size=8,
                                               num_attention_heads=2, attn_layers=["local", "lsh"],
                                               feed_forward_size=64, axial_pos_embds=True, axial_pos_shape=[2, 4],
                                               axial_pos_embds_dim=[16, 16], local_attn_chunk_length=4,
                                               lsh_attn_chunk_length=4, num_buckets=2, num_hashes=1,
                                               max_position_embeddings=32, is_decoder=True, hash_seed=0,
                                               pad_token_id=0, eos_token_id=2, hidden_dropout_prob=0.0,
                                               local_attention_probs_dropout_prob=0.0,
                                               lsh_attention_probs_dropout_prob=0.0, axial_pos_embds_dim_dropout=0.0),
                                      inputs={"input_ids": ids, "labels": ids}, main="logits", loss="loss",
                                      train=True)
    if name == "PatchTSTForPrediction":
        return "PatchTSTConfig", dict(cfg=dict(num_input_channels=3, context_length=32, patch_length=8,
                                               patch_stride=8, prediction_length=8, d_model=32,
                                               num_attention_heads=2, num_hidden_layers=2, ffn_dim=64,
                                               scaling="std"),
                                      inputs={"past_values": torch.randn(B, 32, 3),
                                              "future_values": torch.randn(B, 8, 3)},
                                      main="prediction_outputs", loss="loss")
    if name == "TimeSeriesTransformerForPrediction":
        return "TimeSeriesTransformerConfig", dict(
            cfg=dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1, d_model=16,
                     encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                     encoder_ffn_dim=32, decoder_ffn_dim=32, input_size=1),
            inputs={"past_values": torch.randn(B, 10).abs() + 0.5, "past_time_features": torch.randn(B, 10, 1),
                    "past_observed_mask": torch.ones(B, 10), "future_values": torch.randn(B, 4).abs() + 0.5,
                    "future_time_features": torch.randn(B, 4, 1)},
            main="encoder_last_hidden_state", loss="loss")
    if name == "FNetForMaskedLM":
        ids = _tok()
        return "FNetConfig", dict(cfg=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                           max_position_embeddings=32, use_tpu_fourier_optimizations=False,
                                           pad_token_id=0),
                                  inputs={"input_ids": ids, "labels": _mlm_labels(ids)}, main="logits", loss="loss")
    if name == "RwkvForCausalLM":
        sp = _causal(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                     intermediate_size=64, context_length=32, bos_token_id=0, eos_token_id=0)
        sp["inputs"]["use_cache"] = False  # (eager's backward fails on the cached state's in-place update)
        return "RwkvConfig", sp
    if name == "RecurrentGemmaForCausalLM":  # RG-LRU recurrence (a custom autograd.Function) + local attention
        return "RecurrentGemmaConfig", _causal(**dec, block_types=["recurrent", "attention"], attention_window_size=4)

    # ------------------------------------------- MoE routers, MLA, hybrid attention/SSM, short convs, chunked attention
    if name == "Qwen2ForCausalLM": return "Qwen2Config", _causal(**dec)
    if name == "Glm4ForCausalLM": return "Glm4Config", _causal(**dec, head_dim=8)
    if name == "SmolLM3ForCausalLM": return "SmolLM3Config", _causal(**dec, no_rope_layer_interval=2)
    if name == "Cohere2ForCausalLM":
        return "Cohere2Config", _causal(**dec, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    if name == "Exaone4ForCausalLM": return "Exaone4Config", _causal(**dec, sliding_window=4, sliding_window_pattern=2)
    if name == "Qwen2MoeForCausalLM":
        return "Qwen2MoeConfig", _causal(**dec, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32)
    if name == "OlmoeForCausalLM": return "OlmoeConfig", _causal(**dec, num_experts=4, num_experts_per_tok=2)
    if name == "GraniteMoeForCausalLM":
        return "GraniteMoeConfig", _causal(**dec, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                                          logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.1)
    if name == "DbrxForCausalLM":
        return "DbrxConfig", _causal(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=32,
                                     attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4),  # (no default)
                                     ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "GptOssForCausalLM":  # attention sinks, clamped SwiGLU experts
        return "GptOssConfig", _causal(**dec, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    if name == "DeepseekV3ForCausalLM":  # multi-head latent attention, grouped top-k router, shared expert
        return "DeepseekV3Config", _causal(**{**dec, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
                                          qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                                          num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                          moe_intermediate_size=32, n_shared_experts=1)
    if name == "Llama4ForCausalLM":  # chunked attention, NoPE layers, sigmoid top-1 router
        return "Llama4TextConfig", _causal(**dec, head_dim=8, num_local_experts=4, intermediate_size_mlp=64,
                                          attention_chunk_size=4, no_rope_layer_interval=2)
    if name == "Lfm2ForCausalLM":  # a gated short conv layer, then attention
        return "Lfm2Config", _causal(**dec, full_attn_idxs=[1], block_auto_adjust_ff_dim=False)
    if name == "FalconMambaForCausalLM":
        return "FalconMambaConfig", _causal(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                           expand=2, conv_kernel=4, use_mambapy=False, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=0)
    if name == "JambaForCausalLM":  # mamba layer, then attention + MoE
        return "JambaConfig", _causal(**dec, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                     expert_layer_offset=1, num_experts=4, mamba_d_state=8, use_mamba_kernels=False)
    if name == "BambaForCausalLM":  # mamba2 layer, then attention
        return "BambaConfig", _causal(**dec, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8,
                                     mamba_chunk_size=4)
    if name == "Zamba2ForCausalLM":  # mamba2 layer, then a shared attention block + mamba2
        return "Zamba2Config", _causal(**dec, layers_block_type=["mamba", "hybrid"], n_mamba_heads=4,
                                      mamba_d_state=8, chunk_size=4, adapter_rank=8, use_mamba_kernels=False)
    raise KeyError(name)


MODELS = ["DistilBertForMaskedLM", "RobertaForMaskedLM", "AlbertForMaskedLM", "ElectraForPreTraining",
          "BartForConditionalGeneration", "MistralForCausalLM", "Gemma2ForCausalLM", "PhiForCausalLM",
          "GPTNeoXForCausalLM", "OPTForCausalLM", "BloomForCausalLM", "FalconForCausalLM", "MixtralForCausalLM",
          "WhisperForConditionalGeneration", "CLIPModel", "Swinv2Model", "ConvNextModel",
          "DeiTForImageClassification", "SegformerForSemanticSegmentation", "Wav2Vec2Model"]
MODELS += ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "StableLmForCausalLM",
           "Olmo2ForCausalLM", "CohereForCausalLM", "Starcoder2ForCausalLM", "GPTJForCausalLM", "GPTNeoForCausalLM",
           "CodeGenForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM", "ModernBertForMaskedLM",
           "DebertaV2ForMaskedLM", "XLNetLMHeadModel", "PegasusForConditionalGeneration", "MarianMTModel",
           "MBartForConditionalGeneration", "Dinov2Model", "BeitForImageClassification",
           "MobileViTForImageClassification", "RegNetForImageClassification", "ResNetForImageClassification",
           "HubertModel", "SiglipModel"]
MODELS += [m + "+pad" for m in MODELS if m.endswith("ForCausalLM")]  # causal LMs over a left-padded batch
MODELS += ["LongT5ForConditionalGeneration", "BigBirdForMaskedLM", "BigBirdForMaskedLM_blocksparse", "FunnelForMaskedLM",
          "LEDForConditionalGeneration", "PerceiverForMaskedLM", "YolosForObjectDetection", "DetrForObjectDetection",
          "SamModel", "Wav2Vec2ConformerModel", "Speech2TextForConditionalGeneration", "BlipForConditionalGeneration",
          "ConvBertForMaskedLM", "ReformerModelWithLMHead", "PatchTSTForPrediction",
          "TimeSeriesTransformerForPrediction", "FNetForMaskedLM", "RwkvForCausalLM", "RecurrentGemmaForCausalLM"]
NEW_LMS = ["Qwen2ForCausalLM", "Glm4ForCausalLM", "SmolLM3ForCausalLM", "Cohere2ForCausalLM", "Exaone4ForCausalLM",
           "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM", "DbrxForCausalLM", "GptOssForCausalLM",
           "DeepseekV3ForCausalLM", "Llama4ForCausalLM", "Lfm2ForCausalLM", "FalconMambaForCausalLM",
           "JambaForCausalLM", "BambaForCausalLM", "Zamba2ForCausalLM"]
MODELS += NEW_LMS + [m + "+pad" for m in NEW_LMS]

# --------------------------------------------------------------------------------------------- one model


def _tb_tail(e, n=12):
    lines = traceback.format_exception(e)
    text = "".join(lines).rstrip().splitlines()
    # commfuse frames in the traceback, innermost last
    cf_frames = [ln.strip() for ln in text if 'File "' in ln and REPO + "/" in ln and "/.scratch/" not in ln]
    return {"type": type(e).__name__, "msg": str(e)[:2000], "tail": text[-n:], "commfuse_frames": cf_frames[-6:]}


def _close(got, want):
    import torch
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    try:
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-4)
        return None
    except AssertionError:
        err = (got - want).abs()
        nan = bool(torch.isnan(got).any()) and not bool(torch.isnan(want).any())
        return f"max abs err {err.nan_to_num(float('inf')).max().item():.3g} (ref max {want.abs().max().item():.3g})" + \
            (" NaN in compiled" if nan else "")


def _to(x, device):
    """`x` (a tensor, or a dict / list of them) on `device`."""
    import torch
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def run_one(name, device="cpu", backend="commfuse"):
    os.environ["COMMFUSE_FALLBACK_ON_ERROR"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("COMMFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="cf_sweep_"))
    import copy
    import torch
    import commfuse  # noqa: F401
    import commfuse.backend as cfb
    import transformers
    torch.set_num_threads(1)
    global PAD, B, S
    res = {"model": name, "transformers": transformers.__version__, "device": device, "backend": backend}
    if name.endswith("+pad"):
        PAD, name = True, name[:-4]
    if not hasattr(transformers, name.split("_")[0]):
        if name == "Gemma2ForCausalLM" and hasattr(transformers, "GemmaForCausalLM"):
            name = "GemmaForCausalLM"
        else:
            res["result"] = "skipped (class missing)"
            return res
    torch.manual_seed(0)
    cfg_cls, s = spec(name)
    cfg_kwargs = s["cfg"]
    try:
        cfg = getattr(transformers, cfg_cls)(attn_implementation="sdpa", **cfg_kwargs)
        model = getattr(transformers, s.get("cls", name))(cfg)
        res["attn"] = model.config._attn_implementation
    except (ValueError, ImportError) as e:
        res["sdpa_error"] = str(e)[:300]
        cfg = getattr(transformers, cfg_cls)(**cfg_kwargs)
        model = getattr(transformers, s.get("cls", name))(cfg)
        res["attn"] = getattr(model.config, "_attn_implementation", None)
    model.to(device)
    model.train() if s.get("train") else model.eval()
    res["mode"] = "train" if s.get("train") else "eval"
    ref = copy.deepcopy(model)
    inputs = _to(s["inputs"], device)
    main, loss_key = s["main"], s["loss"]
    try:
        with torch.no_grad():
            out_ref = ref(**inputs)
    except Exception as e:
        res["result"] = "setup error (eager fails)"
        res["error"] = _tb_tail(e)
        return res
    probe = torch.randn(getattr(out_ref, main).shape, generator=torch.Generator().manual_seed(1)).to(device)

    def loss_of(out):
        if loss_key:
            return getattr(out, loss_key)
        return (getattr(out, main) * probe).sum()

    counters = torch._dynamo.utils.counters
    res["phases"] = {}
    for phase in ("inference", "training"):
        ph = res["phases"][phase] = {}
        torch._dynamo.reset()
        counters.clear()
        cfb.summaries.clear()
        m = copy.deepcopy(model)  # fresh grads
        r = copy.deepcopy(ref)
        t0 = time.time()
        try:
            compiled = torch.compile(m, backend=backend)
            if phase == "inference":
                with torch.no_grad():
                    out = compiled(**inputs)
                    want = r(**inputs)
                ph["mismatch"] = {k: v for k, v in {main: _close(getattr(out, main), getattr(want, main))}.items() if v}
            else:
                out = compiled(**inputs)
                loss = loss_of(out)
                loss.backward()
                want = r(**inputs)
                wloss = loss_of(want)
                wloss.backward()
                mm = {}
                if (e := _close(getattr(out, main), getattr(want, main))):
                    mm[main] = e
                if (e := _close(loss, wloss)):
                    mm["loss"] = e
                refp = dict(r.named_parameters())
                for pn, p in m.named_parameters():
                    q = refp[pn]
                    if q.grad is None and p.grad is not None and not p.grad.any():
                        continue  # no gradient in eager, zeros through AOTAutograd (aot_eager's too)
                    if (p.grad is None) != (q.grad is None):
                        mm[pn + ".grad"] = f"grad None: compiled {p.grad is None} eager {q.grad is None}"
                    elif p.grad is not None and (e := _close(p.grad, q.grad)):
                        mm[pn + ".grad"] = e
                ph["mismatch"] = mm
            ph["status"] = "mismatch" if ph["mismatch"] else "ok"
        except Exception as e:
            ph["status"] = "error"
            ph["error"] = _tb_tail(e)
        ph["seconds"] = round(time.time() - t0, 1)
        ph["graph_breaks"] = {k: v for k, v in counters["graph_break"].items()}
        ph["graphs"] = [{"id": g.get("graph_id"), "compiled": g.get("compiled"),
                         "kernels": len(g.get("kernels", []) or []),
                         "fallback_reasons": g.get("fallback_reasons") or None,
                         "fallback_reason": g.get("fallback_reason")} for g in cfb.summaries]
    # a new user's second call at another batch size / sequence length: Dynamo recompiles with
    # dynamic (symbolic) sizes ("automatic dynamic shapes"); outputs vs eager, inference
    ph = res["phases"]["reshape"] = {}
    torch._dynamo.reset()
    counters.clear()
    cfb.summaries.clear()
    B, S = 3, 12
    torch.manual_seed(0)
    inputs2 = _to(spec(name)[1]["inputs"], device)
    B, S = 2, 8
    t0 = time.time()
    try:
        m = copy.deepcopy(model)
        compiled = torch.compile(m, backend=backend)
        with torch.no_grad():
            compiled(**inputs)
            out = compiled(**inputs2)
            want = copy.deepcopy(ref)(**inputs2)
        e = _close(getattr(out, main), getattr(want, main))
        ph["mismatch"] = {main: e} if e else {}
        ph["status"] = "mismatch" if e else "ok"
    except Exception as e:
        ph["status"] = "error"
        ph["error"] = _tb_tail(e)
    ph["seconds"] = round(time.time() - t0, 1)
    ph["graph_breaks"] = {k: v for k, v in counters["graph_break"].items()}
    ph["recompiles"] = {k: v for k, v in counters["recompiles"].items()} if "recompiles" in counters else {}
    ph["graphs"] = [{"id": g.get("graph_id"), "compiled": g.get("compiled"),
                     "kernels": len(g.get("kernels", []) or []),
                     "fallback_reasons": g.get("fallback_reasons") or None,
                     "fallback_reason": g.get("fallback_reason")} for g in cfb.summaries]
    st = [p["status"] for p in res["phases"].values()]
    res["result"] = "error" if "error" in st else "mismatch" if "mismatch" in st else "ok"
    return res


# --------------------------------------------------------------------------------------------- driver


def worker(name, timeout, outdir, device="cpu", backend="commfuse"):
    out = os.path.join(outdir, f"{name}.json")
    log = os.path.join(outdir, f"{name}.log")
    env = dict(os.environ, COMMFUSE_FALLBACK_ON_ERROR="0", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
               OMP_NUM_THREADS="1", COMMFUSE_CACHE_DIR=tempfile.mkdtemp(prefix="cf_sweep_"))
    t0 = time.time()
    with open(log, "w") as f:
        try:
            p = subprocess.run([sys.executable, __file__, "--one", name, "--out", out, "--device", device,
                                "--backend", backend], stdout=f,
                               stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    dt = round(time.time() - t0, 1)
    if rc == "timeout":
        res = {"model": name, "result": "timeout"}
    elif os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
    else:
        with open(log) as f:
            tail = f.read().splitlines()[-15:]
        res = {"model": name, "result": f"crash rc={rc}", "tail": tail}
    res["wall"] = dt
    print(f"[{dt:7.1f}s] {name}: {res['result']}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--out")
    ap.add_argument("--only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--results", help="write the results as JSON here")
    ap.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    ap.add_argument("--backend", default="commfuse", help="commfuse, or a peer (inductor) on the same models")
    a = ap.parse_args()
    if a.one:
        res = run_one(a.one, a.device, a.backend)
        text = json.dumps(res, indent=1, default=str)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)
        print(text)
        return
    names = a.only.split(",") if a.only else MODELS
    outdir = os.environ.get("SWEEP_OUT") or tempfile.mkdtemp(prefix="heldout_hf_")
    os.makedirs(outdir, exist_ok=True)
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda n: worker(n, a.timeout, outdir, a.device, a.backend), names))
    if a.results:
        with open(a.results, "w") as f:
            json.dump(results, f, indent=1, default=str)
    sys.exit(0 if all(r["result"] == "ok" for r in results) else 1)


if __name__ == "__main__":
    main()
