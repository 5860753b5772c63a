"""The start report: the lines a training run prints before its first step (device, model, batch and run
length, a LoRA run's parameters and memory by part, optimizer, folder)."""

from dataclasses import replace

import torch

from config import LORA_TARGETS
from llm.base.sizing import activation_bytes, flops_per_token
from llm.reports.monitor import device_report


def start_report(cfg, device: torch.device, model, opt, *, precision: str, ranks, row: int,
                 tokens_per_step: int, compile_fallback: bool = False) -> str:
    """The lines printed before the first step: device, model, batch and run length, optimizer, folder. row: a
    micro-batch row's tokens (Plan.row); compile_fallback: a compile failure would become an eager run (else
    it stops the run)."""
    t = cfg.train
    n, n_body = model.num_parameters(), model.num_parameters(exclude_embeddings=True)
    length = " or ".join(([f"{t.max_steps} steps"] if t.max_steps else [])
                         + ([f"{t.max_minutes:g} minutes"] if t.max_minutes else []))
    return "\n".join([
        f"device: {device_report(device)} | precision: {precision} | compile: {t.compile}"
        f"{' (eager if compiling fails)' if compile_fallback and t.compile != 'off' else ''} | "
        f"world size: {ranks.world_size}" + (f" ({t.data_parallel})" if ranks.enabled else ""),
        f"model: {n / 1e6:.2f}M parameters ({n_body / 1e6:.2f}M without embeddings), "
        f"{flops_per_token(cfg.model) / 1e6:.1f} MFLOP per token",
        f"batch: {t.micro_batch_size} x {row} tokens x {t.grad_accum_steps} accumulation x "
        f"{ranks.world_size} ranks = {tokens_per_step:,} tokens per step, {length}",
        *([trainable_report(cfg, model, row)] if t.lora_rank else []),
        opt.describe(),
        f"run folder: {t.run_dir}",
    ])


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, a quantized one's (int8 values and scales) included."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, name)) for name in names)
    return t.nbytes


def trainable_report(cfg, model, row: int) -> str:
    """A LoRA run's parameters and memory by part: the trained adapters with their gradients and optimizer
    state (16 bytes each), the frozen base as it is held, and the activations of rows of `row` tokens
    (sizing.py's estimate)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    n_frozen = sum(p.numel() for p in frozen)
    t = cfg.train
    return (f"lora: rank {t.lora_rank}, alpha {t.lora_alpha or 2 * t.lora_rank:g} on "
            f"{' '.join(t.lora_targets or LORA_TARGETS)}: {trained / 1e6:.2f}M trainable parameters "
            f"({trained / (trained + n_frozen):.2%}), {n_frozen / 1e6:.2f}M frozen\n"
            f"memory: frozen base {sum(stored_bytes(p) for p in frozen) / 2**20:,.1f} MiB, adapters "
            f"with gradients and optimizer state {16 * trained / 2**20:,.1f} MiB, activations about "
            f"{activation_bytes(replace(cfg, model=replace(cfg.model, max_seq_len=row))) / 2**20:,.0f} MiB a "
            "micro-batch")
