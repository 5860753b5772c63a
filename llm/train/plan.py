"""The Plan: what settle() (startup.py) decided for a training run, read by the runner and the trainer's loop.
Its own module, so that the planner and the runner it probes with both read one type."""

from dataclasses import dataclass

import torch

from config import Config
from llm.base.distributed import Ranks
from llm.data.token_cache import PreparedData
from llm.formats.trainer_state import Saved
from llm.train.fine_tuning import grpo_row


@dataclass(frozen=True)
class Plan:
    """settle()'s result, which nothing changes after: the run's final config (its run length included), the
    processes and device it runs on, the data it reads, and what it starts from."""
    cfg: Config
    ranks: Ranks
    device: torch.device
    ckpt: str | None  # the checkpoint --resume continues, or None for a new run
    saved: Saved | None  # its trainer state
    init_state: dict | None  # --init_from's weights, for a new run
    data: PreparedData
    batches: object  # the training split's loader: Batches, or a GRPO run's PromptSplit
    val_batches: object
    lora_meta: dict | None  # a LoRA run's adapter_config.json: its settings and base
    init_path: str = ""  # the --init_from checkpoint, folder or file read (a preference run's reference)
    rewards: tuple | None = None  # a GRPO run's reward functions and their weights (rewards.load_all)

    @property
    def row(self) -> int:
        """A micro-batch row's tokens: the context, or a GRPO run's longest prompt and reply (grpo_row)."""
        return grpo_row(self.cfg, self.data.longest) if self.cfg.train.objective == "grpo" else \
            self.cfg.model.max_seq_len

    @property
    def tokens_per_step(self) -> int:
        """The tokens one optimizer step reads, over every rank."""
        t = self.cfg.train
        return t.micro_batch_size * self.row * t.grad_accum_steps * self.ranks.world_size
