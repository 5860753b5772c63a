"""Continuing a run, or starting one from trained weights: which checkpoint --resume means, the settings it
carries, the checks that it fits this run (and that a new run's folder holds none), loading it into the model
and optimizer, and a LoRA run's base.

    --resume            the run folder's newest complete checkpoint (LATEST, or a scan if LATEST is lost)
    --resume FOLDER     that checkpoint (a run folder: its newest), for example into a new --run_dir
    --init_from FOLDER  a checkpoint, run or Hugging Face folder's (or a GGUF file's) weights, shape and
                        tokenizer; a new optimizer
    --init_from hf:ORG/NAME  the same from the Hugging Face Hub (hf_hub.py)
"""

import os
from dataclasses import asdict, fields, replace

from config import AUTO, Config
from llm.base import atomic
from llm.base.errors import CheckpointError, ConfigError
from llm.formats import checkpoint as ckpt_io
from llm.formats import lora
from llm.formats import trainer_state
from llm.formats.gguf_reader import is_gguf
from llm.formats.hf_format import is_hf_folder
from llm.formats.hf_hub import is_hub_name
from llm.formats.loading import ModelFiles, read_model


def resume_point(cfg: Config) -> tuple[str | None, trainer_state.Saved | None, list[str]]:
    """The checkpoint to resume, its trainer state (read once) and report lines; (None, None, []) for a new
    run. Refuses a missing checkpoint, imported weights, and an earlier checkpoint of a run that went on."""
    t, notes = cfg.train, []
    if not t.resume:
        return None, None, notes
    if t.resume == "latest":
        ckpt, problem = ckpt_io.latest_checkpoint(t.run_dir), ckpt_io.latest_problem(t.run_dir)
        if ckpt is None:
            raise ConfigError(f"--resume: {t.run_dir} has no complete checkpoint"
                              + (f" ({problem})" if problem else " yet") + ", start without --resume")
        if problem:
            notes.append(f"note: {problem}; resuming from {ckpt}, the newest complete checkpoint")
    else:
        ckpt = _resumable(t.resume)
        later = [c for c in ckpt_io.list_checkpoints(t.run_dir) if ckpt_io.checkpoint_step(c) >
                 ckpt_io.checkpoint_step(ckpt) and not os.path.samefile(c, ckpt)]
        if later:
            raise ConfigError(f"--resume {t.resume}: {t.run_dir} holds later checkpoints "
                              f"({os.path.basename(later[-1])}) of a run that went on past it; resume into a "
                              f"new folder: --run_dir NEW --resume {ckpt}")
    state = _trainer_state(ckpt, t.run_dir)
    if state.optimizer is None:
        raise ConfigError(f"{ckpt} holds imported weights only, start a new run with --init_from {ckpt}")
    return ckpt, state, notes


def _resumable(path: str) -> str:
    """The checkpoint --resume FOLDER names: a run folder's newest, or a step_N folder itself; a Hugging Face
    folder or a copied checkpoint renamed otherwise holds no step to continue from, so it is refused."""
    hf = is_hf_folder(path) or is_hub_name(path) or is_gguf(path)
    ckpt = path if hf else ckpt_io.resolve_checkpoint(path)
    if hf or not ckpt_io.STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(ckpt))):
        what = ("a GGUF file" if is_gguf(path) else "a Hugging Face model") if hf else \
            "a checkpoint folder not named step_N"
        raise ConfigError(f"--resume takes a run folder or a step_N checkpoint folder in one, and {path} is "
                          f"{what}; to start a new run from its weights, pass --init_from {path}")
    return ckpt


def _trainer_state(ckpt: str, run_dir: str) -> trainer_state.Saved:
    """trainer_state.pt, with a hint naming the checkpoint before it when this one is damaged."""
    try:
        return trainer_state.read(ckpt)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_earlier_hint(ckpt, run_dir)}") from None


def _earlier_hint(ckpt: str, run_dir: str) -> str:
    step = ckpt_io.checkpoint_step(ckpt)
    earlier = [c for c in ckpt_io.list_checkpoints(run_dir) if ckpt_io.checkpoint_step(c) < step]
    return f"; resume from the one before with --resume {earlier[-1]}" if earlier else ""


def carry_settings(cfg: Config, state: trainer_state.Saved) -> tuple[Config, list[str]]:
    """cfg with its automatic fields set to the values the checkpoint's run used, so a run resumes as it was
    sized wherever it resumes (values given now stay), and a report line."""
    saved, sections, taken = state.config, {}, []
    for section in ("model", "train"):
        ours, theirs = getattr(cfg, section), saved.get(section, {})
        values = {k: theirs[k] for k in ours.automatic() if theirs.get(k, AUTO) != AUTO
                  and not (k == "max_steps" and cfg.train.epochs)}  # --epochs sets the run's length anew
        if section == "train" and ours.optimizer == "auto" and theirs.get("optimizer") in ("muon", "adamw"):
            values["optimizer"] = theirs["optimizer"]  # the optimizer whose state the checkpoint holds
        sections[section] = replace(ours, **values)
        taken += [f"{k}={v}" for k, v in values.items()]
    return replace(cfg, **sections), ([f"automatic: {', '.join(taken)} (as the checkpoint's run)"]
                                      if taken else [])


def check_run_folder(t, resuming: bool):
    """A folder this process can write to, and, for a new run, one that holds no checkpoint folder, complete
    or not, LATEST or not: a new run never writes over another's checkpoints."""
    atomic.writable_folder(t.run_dir, "--run_dir")
    atomic.lock_folder(t.run_dir, "--run_dir")  # until this process ends: a second trainer here is refused
    if ckpt_io.holds_checkpoints(t.run_dir) and not resuming:
        raise ConfigError(f"{t.run_dir} already holds checkpoints, pass --resume to continue it "
                          "or --run_dir NEW_FOLDER for a new run")


def check_same_shape(cfg: Config, ckpt: str):
    """Refuse to resume into a model of another shape, naming the fields that differ."""
    saved = asdict(ckpt_io.load_model_config(ckpt))
    ours = asdict(cfg.model)
    differ = [f"{k}: checkpoint {saved[k]} vs config {ours[k]}" for k in ours
              if k != "gradient_checkpointing" and saved.get(k) != ours[k]]
    if differ:
        raise ConfigError(f"cannot resume {ckpt}: the model shape differs ({'; '.join(differ)}), "
                          "use the run's own settings or a new --run_dir")


def check_same_data(cfg: Config, state: trainer_state.Saved, data):
    """Refuse to resume on other data: its tokenizer and tokens would not be the checkpoint's. Says what
    changed: the data settings, or the source files added, removed or changed since."""
    saved = state.data_fingerprint
    if not saved or saved == data.fingerprint:
        return
    theirs = state.config.get("data", {})
    differ = [f"{f.name}: checkpoint {theirs[f.name]!r} vs now {getattr(cfg.data, f.name)!r}"
              for f in fields(cfg.data) if f.name != "cache_dir" and f.name in theirs
              and theirs[f.name] != getattr(cfg.data, f.name)]
    if not differ and state.data_files is not None:
        differ = _file_changes({f[0]: list(f) for f in state.data_files}, {f[0]: list(f) for f in data.files})
    what = "; ".join(differ) if differ else "the checkpoint read a token cache of an earlier format"
    raise ConfigError(f"cannot resume on other data ({what}): the tokens would not be the checkpoint's; "
                      "resume with the run's data, or train on the new data with --init_from CHECKPOINT")


def _file_changes(before: dict, now: dict) -> list[str]:
    """The source files added, removed and changed (size or modification time), a few of each named."""
    def few(paths):
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    kinds = {"added": sorted(set(now) - set(before)), "removed": sorted(set(before) - set(now)),
             "changed": sorted(p for p in set(now) & set(before) if now[p] != before[p])}
    return [f"{kind} {few(paths)}" for kind, paths in kinds.items() if paths] or \
        ["the same files, read into other parts (another --max_tokens or mixture)"]


def load_into(state: trainer_state.TrainingState, ckpt: str | None,
              saved: trainer_state.Saved | None, run_dir: str):
    """Set state, in place, as the checkpoint --resume continues left it (a new run's stays at step 0); a
    damaged checkpoint's line names the one before it."""
    if ckpt is not None:
        try:
            state.load(ckpt, saved)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{_earlier_hint(ckpt, run_dir)}") from None


def apply_init_from(cfg: Config) -> tuple[Config, ModelFiles]:
    """--init_from: cfg with the model shape and tokenizer of a checkpoint, run or Hugging Face folder, and
    what was read there (its weights too)."""
    found = read_model(cfg.train.init_from, cfg.model.max_seq_len)  # this run's context, when set
    if not found.tokenizer_path:
        raise ConfigError(f"--init_from {cfg.train.init_from} has no tokenizer.json, import it with "
                          "export_hf.py --tokenizer")
    # tokenized as the model was
    data = replace(cfg.data, tokenizer=cfg.data.tokenizer or found.tokenizer_path)
    return replace(with_shape(cfg, found.config), data=data), found


def with_shape(cfg: Config, shape) -> Config:
    """cfg with the model shape of --init_from: only the weights' shape is taken; context length (when set)
    and memory settings stay this run's."""
    return replace(cfg, model=replace(shape, max_seq_len=cfg.model.max_seq_len or shape.max_seq_len,
                                      gradient_checkpointing=cfg.model.gradient_checkpointing))


def lora_start(cfg: Config, ckpt: str | None, init: ModelFiles | None) -> dict | None:
    """A LoRA run's adapter_config.json (its settings, its base and the base's fingerprint), None for a run of
    whole weights. LoRA needs a base (--init_from); a resume needs the base its checkpoint was trained on, and
    a checkpoint of adapters cannot continue as a run of whole weights or the other way round."""
    t = cfg.train
    saved = lora.read_meta(ckpt) if ckpt else None
    if ckpt and bool(saved) != bool(t.lora_rank):
        settings = f"--lora_rank {saved['rank']} --init_from BASE" if saved else "no --lora_rank"
        raise ConfigError(f"{ckpt} was trained {'with' if saved else 'without'} LoRA adapters; resume with "
                          f"the run's settings ({settings}), or start a new run from it with --init_from")
    if not t.lora_rank:
        return None
    if init is None:
        raise ConfigError("--lora_rank trains adapters on a model: pass --init_from with it (a "
                          "checkpoint, run or Hugging Face folder)")
    if t.precision == "fp8" or t.data_parallel == "fsdp":
        raise ConfigError("--lora_rank works with bf16, fp16 or fp32 and DDP: drop --precision fp8 and "
                          "--data_parallel fsdp")
    meta = lora.meta_of(t, init.path)
    if saved:
        lora.check_base(saved, init.path, ckpt, "--init_from")
        changed = [f"--lora_{k} {' '.join(saved[k]) if k == 'targets' else saved[k]}"
                   for k in ("rank", "alpha", "dropout", "targets") if saved[k] != meta[k]]
        if saved.get("base_format", meta["base_format"]) != meta["base_format"]:  # recorded since nf4 came
            # adapters fitted to another rounding of the base
            changed.append(f"--lora_base {saved['base_format']}")
        if changed:
            raise ConfigError(f"{ckpt} was trained with other LoRA settings; resume with {' '.join(changed)}")
    return meta
