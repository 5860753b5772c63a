"""The Plan: what settle() (startup.py) decided for a training run, read by the runner and the trainer's loop;
and StepSettings, how its step runs, decided with it (step_settings), before any model exists. Its own module,
so that the planner and the runner it probes with both read one type."""

from dataclasses import dataclass

import torch

from config import Config
from llm.base.attention import written_out_is_faster
from llm.base.device import machine, pick_precision, uses_cuda_graphs
from llm.base.distributed import Ranks
from llm.base.errors import ConfigError
from llm.base.sizing import loss_chunk_rows
from llm.data.token_cache import PreparedData
from llm.formats.lora import base_dtype
from llm.formats.trainer_state import Saved
from llm.train.fine_tuning import grpo_row
from llm.train.preference import OBJECTIVES as PREFERENCE_OBJECTIVES
from modern_llm import Execution


@dataclass(frozen=True)
class StepSettings:
    """How a run's step runs on its device: decided once, from the final config, by step_settings; the runner
    builds the step to them and no module changes them after (a compiler failure makes the runner eager; the
    model's execution settings stay, being valid for both)."""
    amp_dtype: torch.dtype | None  # autocast's dtype; None: fp32
    eager: bool  # the model runs uncompiled: the one test of eager or compiled, which every setting asks
    cudagraphs: bool  # the compile mode captures CUDA graphs
    lora_base: str  # how a LoRA run holds its frozen base: fp32, bf16, int8 or nf4 ("" without adapters)
    execution: Execution  # the model's: loss chunks, written-out attention, the stream's dtype, ragged rows


def step_settings(cfg: Config, device: torch.device, row: int = 0, torchrun: bool = False) -> StepSettings:
    """The StepSettings of cfg's run on `device`, whose micro-batch rows are row tokens long (the context
    where 0), under torchrun or not; what cannot run so is refused here, before a model exists."""
    t = cfg.train
    amp_dtype = pick_precision(t.precision, device)
    if t.data_parallel == "fsdp" and amp_dtype == torch.float16 and torchrun:
        raise ConfigError("--data_parallel fsdp needs bf16 or fp32, not fp16 with loss scaling: pass "
                          "--precision fp32, or use --data_parallel ddp on a GPU without bf16")
    eager = t.compile == "off"
    return StepSettings(amp_dtype=amp_dtype, eager=eager, cudagraphs=uses_cuda_graphs(t.compile, device),
                        lora_base=base_dtype(t, amp_dtype) if t.lora_rank else "",
                        execution=execution(cfg, device, amp_dtype, eager, row))


def execution(cfg: Config, device: torch.device, amp_dtype, eager: bool, row: int) -> Execution:
    """The model's execution settings for this run's step, whose micro-batch rows are row tokens long (the
    context where 0)."""
    where = machine(device)
    # A bf16 residual stream saves a GPU's bandwidth; on a CPU it saves no time and learned a little less.
    stream = torch.bfloat16 if device.type == "cuda" and amp_dtype == torch.bfloat16 else None
    # Eager preference and GRPO steps put each reply's branch on a row of its own; preference runs the head at
    # the replies only, where GRPO's rows are mostly replies (the head's rows varying, a CPU's heap grew by a
    # tenth on the GRPO bench, with no time saved).
    ragged = eager and cfg.train.objective in (*PREFERENCE_OBJECTIVES, "grpo")
    labelled_rows = eager and cfg.train.objective in PREFERENCE_OBJECTIVES
    written_out = written_out_is_faster(where.kind, not eager, amp_dtype, row or cfg.model.max_seq_len)
    return Execution(loss_chunk_rows(cfg, where), written_out, stream, ragged, labelled_rows)


@dataclass(frozen=True)
class Plan:
    """settle()'s result, which nothing changes after: the run's final config (its run length included), how
    its step runs, the processes and device it runs on, the data it reads, and what it starts from."""
    cfg: Config
    settings: StepSettings
    ranks: Ranks
    device: torch.device
    ckpt: str | None  # the checkpoint --resume continues, or None for a new run
    saved: Saved | None  # its trainer state
    init_state: dict | None  # --init_from's weights, for a new run
    data: PreparedData
    batches: object  # the training split's loader: Batches, or a GRPO run's PromptSplit
    val_batches: object
    lora_meta: dict | None  # a LoRA run's adapter_config.json: its settings and base
    # a dpo run's --init_from weights' identity (lora.fingerprint): what its reference is stored under
    init_fingerprint: str = ""
    rewards: tuple | None = None  # a GRPO run's reward functions and their weights (rewards.load_all)

    @property
    def row(self) -> int:
        """A micro-batch row's tokens: the context, or a GRPO run's longest prompt and reply (grpo_row)."""
        return run_row(self.cfg, self.data)

    @property
    def tokens_per_step(self) -> int:
        """The tokens one optimizer step reads, over every rank."""
        t = self.cfg.train
        return t.micro_batch_size * self.row * t.grad_accum_steps * self.ranks.world_size


def run_row(cfg: Config, data) -> int:
    """A micro-batch row's tokens in cfg's run on data: the context, or a GRPO run's longest prompt and reply
    (grpo_row)."""
    return grpo_row(cfg, data.longest) if cfg.train.objective == "grpo" else cfg.model.max_seq_len
