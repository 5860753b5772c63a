"""trainer_state.pt's keys, written and read here alone: what a checkpoint keeps besides its weights, so that
a resumed run goes on exactly (optimizer, loss scaler, weight average, RNG, counters, the time budget's
clock), and the facts that a refused resume and the model card quote (the config, the data, the device, the
command).

TrainingState is what the steps change; it saves itself into a checkpoint and loads itself from one. Saved is
a checkpoint's trainer_state.pt read back, each key a field; recorded() is the model card's forgiving reading.
"""

import json
import math
from dataclasses import dataclass, field

import torch

from llm.base import distributed
from llm.base.averaging import WeightAverage
from llm.base.errors import CheckpointError, ConfigError
from llm.formats import checkpoint as ckpt_io
from llm.formats.lora import adapter_state

# for the model card
CORPUS_FACTS = ("train_tokens", "val_tokens", "train_documents", "val_documents", "has_masks")

# The time budget's figures a checkpoint keeps (schedule.StepTimer.state() gives them): seconds spent, the
# step's seconds, each overhead's seconds.
CLOCK_KEYS = ("spent_s", "step_s", "overhead_s")


@dataclass
class Saved:
    """A checkpoint's trainer_state.pt: its counters, the state a resume loads, and what its run recorded."""
    step: int
    tokens: int
    best_val: float
    optimizer: dict | None  # None: imported weights (export_hf.py --import), nothing to resume
    scaler: dict
    weight_average: dict | list | None
    rng_torch: torch.Tensor | None
    rng_cuda: torch.Tensor | None
    config: dict  # {section: {field: value}}: every value the run used
    data_fingerprint: str
    data_files: list | None  # [path, size, mtime] of each source file, to say what changed
    clock: dict  # the time budget's figures (RunClock.state())


def read(ckpt: str) -> Saved:
    """The checkpoint's trainer_state.pt, its config parsed (a damaged one refused in one line)."""
    return parse(ckpt_io.load_trainer_state(ckpt))


def parse(state: dict) -> Saved:
    """A trainer_state.pt's dict as Saved; keys a run of an earlier version did not write are left empty. A
    state without its counters (damaged, or written by hand) is refused in one line."""
    missing = [k for k in ("step", "tokens", "best_val_loss")
               if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"the checkpoint's trainer_state.pt lacks {', '.join(missing)}; it is "
                              "damaged, use an earlier checkpoint")
    return Saved(step=state["step"], tokens=state["tokens"], best_val=state["best_val_loss"],
                 optimizer=state.get("optimizer"), scaler=state.get("scaler") or {},
                 weight_average=state.get("weight_average"), rng_torch=state.get("rng_torch"),
                 rng_cuda=state.get("rng_cuda"), config=_config(state.get("config", "{}")),
                 data_fingerprint=state.get("data_fingerprint", ""), data_files=state.get("data_files"),
                 clock={k: state[k] for k in CLOCK_KEYS if k in state})


def _config(text) -> dict:
    try:
        values = json.loads(text)
    except (ValueError, TypeError, RecursionError) as e:
        raise CheckpointError(f"the checkpoint's trainer_state.pt holds a config that is not readable JSON "
                              f"({type(e).__name__}), use an earlier checkpoint") from None
    if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
        raise CheckpointError("the checkpoint's trainer_state.pt holds a config that is not "
                              "{section: {field: value}}, use an earlier checkpoint")
    return values


def imported(path: str) -> dict:
    """The trainer state of weights imported from elsewhere: step 0 and no optimizer, so a run starts from
    them (--init_from) rather than resuming them."""
    return {"step": 0, "tokens": 0, "best_val_loss": math.inf, "imported_from": path}


def recorded(ckpt: str) -> dict:
    """What the checkpoint's run recorded for the model card, each fact left out where missing or not of its
    type (a hand-edited or damaged file never stops an export); tensors' bytes are not read."""
    try:
        state = ckpt_io.load_trainer_state(ckpt, True)
    except (CheckpointError, OSError, ValueError, RuntimeError):
        return {}
    state = state if isinstance(state, dict) else {}
    facts = {k: state.get(k) for k in ("tokens", "world_size")}
    facts = {k: v for k, v in facts.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    spent = state.get("spent_s")
    if isinstance(spent, (int, float)) and not isinstance(spent, bool) and math.isfinite(spent):
        facts["spent_s"] = float(spent)
    facts |= {k: state[k] for k in ("device", "precision", "command", "imported_from")
              if isinstance(state.get(k), str)}
    # a path in it is never followed
    facts["corpus"] = state["corpus"] if isinstance(state.get("corpus"), dict) else {}
    return facts


@dataclass(frozen=True)
class Record:
    """What a session's checkpoints record of it besides the state: for the model card, and a LoRA run's
    adapters."""
    command: str  # how the session was started, as a user would type it
    device: str
    precision: str
    lora_meta: dict | None  # a LoRA run's adapter_config.json: its checkpoints hold the adapters alone


@dataclass
class TrainingState:
    """What the steps change: the model, its optimizer, loss scaler and weight average, the RNG, and the
    counters. save() writes it into a checkpoint and load() restores it from one, so that N steps, a save, a
    resume and N more equal 2N steps."""
    model: torch.nn.Module  # uncompiled and unwrapped
    opt: object
    scaler: object  # torch.amp.GradScaler under fp16, else None
    average: WeightAverage
    step: int = 0
    tokens: int = 0
    best_val: float = math.inf
    clock: dict = field(default_factory=dict)  # a resumed run's time budget figures, for its RunClock

    def advance(self, tokens: int):
        """One optimizer step done, over this many tokens (every rank's)."""
        self.step, self.tokens = self.step + 1, self.tokens + tokens

    def load(self, ckpt: str, saved: Saved):
        """The checkpoint's weights, optimizer, loss scaler, weight average, RNG and counters."""
        ckpt_io.load_weights(ckpt, self.model)  # read on the CPU, then copied into the device's parameters
        try:
            # the rates and settings given now win over the checkpoint's
            self.opt.load_state_dict(saved.optimizer)
        except ValueError as e:  # its state has other parts: trained with another --optimizer
            theirs = saved.config.get("train", {}).get("optimizer", "another optimizer")
            raise ConfigError(f"{ckpt} was trained with --optimizer {theirs} ({e}); resume with --optimizer "
                              f"{theirs}, or start a new run from its weights with --init_from") from None
        if self.scaler and saved.scaler:
            self.scaler.load_state_dict(saved.scaler)
        self.average.load_state_dict(saved.weight_average)
        torch.set_rng_state(saved.rng_torch)
        if saved.rng_cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved.rng_cuda)
        self.step, self.tokens, self.best_val, self.clock = (saved.step, saved.tokens,
                                                             saved.best_val, saved.clock)

    def save(self, cfg, ranks, data, record: "Record", clock: dict, val_loss: float | None) -> str | None:
        """Write a checkpoint at self.step (rank 0; DDP keeps every rank's weights identical, FSDP2 shards are
        gathered to it), refusing NaN or Inf; its path, None on other ranks. Every rank calls it. clock: the
        time budget's figures (RunClock.state()); val_loss: the evaluation at this step, if there was one."""
        weights = distributed.full_state(self.model.state_dict(), keep=ranks.is_main)
        opt_state = distributed.full_state(self.opt.state_dict(), keep=ranks.is_main)
        average = self.average.state_dict(keep=ranks.is_main)  # every rank: a gather under FSDP2
        if not ranks.is_main:
            return None
        state = (adapter_state(self.model) if record.lora_meta
                 else ckpt_io.weights_state_dict(self.model, weights))
        bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
        if bad:
            raise FloatingPointError(f"weights {bad[:3]} hold NaN or Inf; the checkpoint was not written")
        trainer_state = {
            "step": self.step, "tokens": self.tokens, "best_val_loss": self.best_val, "optimizer": opt_state,
            "weight_average": average, "scaler": self.scaler.state_dict() if self.scaler else {},
            "data_fingerprint": data.fingerprint,
            "data_files": [list(f) for f in data.files],  # to say what changed, if a resume is refused
            "corpus": {k: v for k, v in data.meta.items() if k in CORPUS_FACTS},
            "world_size": ranks.world_size, "rng_torch": torch.get_rng_state(),
            # CUDA's: dropout's
            "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "config": json.dumps(cfg.to_dict()), "command": record.command, "device": record.device,
            "precision": record.precision, **{k: clock[k] for k in CLOCK_KEYS}}
        return ckpt_io.save_checkpoint(cfg.train.run_dir, self.step, state, model_config=cfg.model,
                                       tokenizer_path=data.tokenizer_path, trainer_state=trainer_state,
                                       keep=cfg.train.keep_checkpoints, val_loss=val_loss,
                                       lora_meta=record.lora_meta)
