"""How the training step computes on this machine: the loss's logits whole or in chunks of rows (whatever fits
beside the rest of the step), and causal attention through SDPA or written out as matmuls (faster on a CPU for
short rows, compiled or under bf16). The trainer builds the model with both; startup.py's fit check estimates
with the chunks."""

import torch

from config import Config
from llm.base.fit import estimate
from llm.base.sizing import MEMORY_FRACTION, Machine, gpu_target, training_bytes_estimate

# per logit of a whole training loss: bf16 logits, fp32 log-softmax, its fp32 and bf16 gradients
LOGIT_BYTES = 12
CPU_LOGITS_BYTES = 2**30  # off CUDA, the whole logits may take this much
GEMM_ROWS = 128  # loss chunks in whole GEMM tiles: another count makes Inductor pad (and time) every chunk
# Measured on a 2-core CPU, forward and backward: written out, attention is 2x faster at 128-256 positions
# compiled, and eager under bf16 2.5x at 104, even at 256 and slower at 512; eager in fp32 the kernel wins.
MATMUL_ATTENTION_ROWS = 256


def loss_chunk_rows(cfg: Config, machine: Machine) -> int:
    """Rows per chunk of the training loss, 0 for the logits whole: whole while they fit beside the rest of
    the step in MEMORY_FRACTION of the GPU (CPU_LOGITS_BYTES off CUDA), else as many rows as fill a quarter of
    that room, in whole GEMM tiles. Chunks recompute the head's matmul in backward: about 1/3 more head FLOPs.
    """
    m, t = cfg.model, cfg.train
    rows, per_row = t.micro_batch_size * m.max_seq_len, m.vocab_size * LOGIT_BYTES
    room = CPU_LOGITS_BYTES if machine.kind != "cuda" else \
        MEMORY_FRACTION * machine.memory - (training_bytes_estimate(cfg) - _logit_bytes(cfg))
    if rows * per_row <= room:
        return 0
    return max(GEMM_ROWS, int(room / 4 / per_row) // GEMM_ROWS * GEMM_ROWS)


def matmul_attention(cfg: Config, machine: Machine, amp_dtype=None, row: int = 0) -> bool:
    """Whether causal attention runs written out as matmuls and a softmax (llm/base/attention.py): on a
    CPU, in a compiled step or under bf16 autocast (amp_dtype), for rows of up to MATMUL_ATTENTION_ROWS tokens
    (row: a micro-batch row's, the context where 0), where the CPU's flash kernel is slower."""
    faster = cfg.train.compile != "off" or amp_dtype == torch.bfloat16
    return machine.kind == "cpu" and faster and (row or cfg.model.max_seq_len) <= MATMUL_ATTENTION_ROWS


def _logit_bytes(cfg: Config) -> int:
    return next(b for name, b, _ in estimate(cfg, gpu_target(cfg)).terms if name == "loss")
