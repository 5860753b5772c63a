"""Tests of sizing.py: the memory estimate beside the peaks measured on an H200, the peak table a budget is
planned with, and the FLOPs a token that MFU and the budget divide by."""

from dataclasses import replace

import pytest

from config import Config, preset_tiny
from llm.base import sizing
from llm.base.sizing import Machine
from llm.train.autofill import fill_automatic

GIB = 2**30


@pytest.mark.parametrize("preset,micro,measured_gib", [("small", 64, 33.40), ("large", 128, 42.70)])
def test_the_memory_estimate_matches_the_peak_measured_on_an_h200(preset, micro, measured_gib):
    """Peak memory of the compiled bf16 step on an NVIDIA H200 (torch 2.11, 2026-11-27, docs/gpu_report.md):
    the estimate that sizes the micro-batch must stay within 10% of it."""
    from config import PRESETS
    cfg = PRESETS[preset]()
    cfg.train = replace(cfg.train, micro_batch_size=micro)
    assert sizing.training_bytes_estimate(cfg) / GIB == pytest.approx(measured_gib, rel=0.10)


def test_an_unknown_gpu_is_planned_at_a_stated_peak():
    cfg, notes = fill_automatic(Config(), Machine("cuda", "Some Future GPU", 48 * GIB), corpus_bytes=None)
    assert sizing.gpu_peak_flops("Some Future GPU") is None
    assert f"{sizing.FALLBACK_TFLOPS:g} TFLOP/s (assumed: Some Future GPU is not in the peak table)" in "\n".join(notes)
    assert sizing.gpu_peak_flops("NVIDIA H100 PCIe") == 756e12 and sizing.gpu_peak_flops("NVIDIA H200") == 989.4e12


@pytest.mark.parametrize("tied", [True, False])
def test_the_flops_a_token_count_every_matmul_of_the_built_model(tied):
    """MFU and the budget's tokens/s divide by one count (sizing.flops_per_token, the model file keeps none
    since two copies of the formula could drift): 6 FLOPs per weight of every nn.Linear the built model runs,
    the head included and the embedding lookup not, plus PaLM's 12 * layers * heads * head_dim * context for
    attention."""
    import torch
    from modern_llm import Transformer
    model_cfg = replace(preset_tiny().model, tie_word_embeddings=tied)
    model = Transformer(model_cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    m = model_cfg
    attention = 12 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * m.max_seq_len
    assert sizing.flops_per_token(model_cfg) == 6 * linear + attention
