"""Tests of the training step's execution settings: the loss chunked only where memory needs it (sizing.py),
attention written out only where that is faster (plan.py)."""

from dataclasses import replace

import pytest
import torch

from config import preset_tiny
from llm.base import attention, sizing
from llm.base.sizing import Machine
from llm.train import plan

CPU = Machine("cpu", "cpu, 2 threads")
GIB = 2**30


@pytest.mark.parametrize("preset,memory_gib,chunked", [
    ("large", 80, False),  # an H100: 12,288 rows x 32k logits fit beside the rest of the step
    ("large", 16, True),  # a 16 GB card: they would not
    ("tiny", 0, False),  # a CPU: tiny's logits are 200 MB
    ("small", 0, True),  # a CPU: small's 16k rows x 32k are 6 GB
])
def test_the_loss_is_chunked_only_when_memory_needs_it_in_whole_gemm_tiles(preset, memory_gib, chunked):
    """Chunking recomputes the head's matmul in backward; it ran on every GPU preset, in chunks of 2,097 rows,
    which Inductor pads (and times) on every chunk. Now: whole logits when they fit, else multiples of 128."""
    from config import PRESETS
    cfg = PRESETS[preset]()
    micro = {"large": 32, "small": 16}.get(preset, cfg.train.micro_batch_size)  # the micro-batches presets once had
    cfg.train = replace(cfg.train, micro_batch_size=micro, grad_accum_steps=0)
    machine = Machine("cuda", "GPU", memory_gib * GIB) if memory_gib else CPU
    rows = sizing.loss_chunk_rows(cfg, machine)
    whole = cfg.train.micro_batch_size * cfg.model.max_seq_len
    assert (rows > 0) == chunked
    if chunked:
        assert rows % 128 == 0 and 128 <= rows < whole
        room = sizing.CPU_LOGITS_BYTES if not memory_gib else \
            0.8 * memory_gib * GIB - (sizing.training_bytes_estimate(cfg) - whole * cfg.model.vocab_size * 6)
        assert rows * cfg.model.vocab_size * sizing.LOGIT_BYTES <= max(room, 128 * cfg.model.vocab_size * 12)


@pytest.mark.parametrize("device,compile_mode,amp,seq_len,row,written", [
    ("cpu", "default", None, 256, 0, True),  # the default CPU run: twice as fast as the CPU's flash kernel
    ("cpu", "default", None, 512, 0, False),  # slower than the kernel from 512 positions
    ("cpu", "off", None, 256, 0, False),  # eager in fp32, the kernel is faster
    ("cpu", "off", torch.bfloat16, 256, 0, True),  # eager under bf16, the kernel is slower
    ("cpu", "off", torch.bfloat16, 512, 128, True),  # a GRPO run's rows of prompt and reply, not the context
    ("cpu", "off", torch.bfloat16, 512, 0, False),
    ("cuda", "default", torch.bfloat16, 256, 0, False),  # GPUs keep SDPA's flash and cuDNN kernels
])
def test_attention_is_written_out_only_on_a_cpu_for_short_rows_compiled_or_in_bf16(device, compile_mode, amp,
                                                                                   seq_len, row, written):
    cfg = preset_tiny()
    cfg = replace(cfg, model=replace(cfg.model, max_seq_len=seq_len), train=replace(cfg.train, compile=compile_mode))
    eager = compile_mode == "off"
    assert attention.written_out_is_faster(device, not eager, amp, row or seq_len) is written
    if device == "cpu":  # the run's execution settings carry it, for the micro-batch's rows or the context
        assert plan.execution(cfg, torch.device("cpu"), amp, eager, row).matmul_softmax is written
