"""Checkpoints of a run folder: atomic writes, the LATEST pointer, and the project's one reader of weights.

    <run>/checkpoints/step_000500/{model.safetensors, model_config.json, tokenizer.json, trainer_state.pt}
    <run>/checkpoints/LATEST   names the newest complete checkpoint folder

A checkpoint is written to a hidden temporary folder, flushed, renamed into place, and only then
does LATEST move, so a crash at any moment leaves the previous checkpoint usable. read_model() opens
a checkpoint, a run folder (its newest checkpoint) or a Hugging Face folder, never unpickling anything.
"""

import json
import os
import shutil
from dataclasses import asdict, dataclass, fields, replace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from config import CheckpointError, ConfigError, ModelConfig
from distributed import shard_as
from hf_format import check_weights, expected_shapes, is_hf_folder, load_hf_folder
from tokenizer import TOKENIZER_FILE as TOKENIZER

WEIGHTS, MODEL_CONFIG, TRAINER_STATE = "model.safetensors", "model_config.json", "trainer_state.pt"
HOW_TO_MAKE_ONE = "train one with: python gpu_training_optimized.py"


def _fsync_dir(path: str):
    if hasattr(os, "O_DIRECTORY"):  # directories cannot be opened for fsync on Windows
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_text_atomic(path: str, text: str):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def weights_state_dict(model: torch.nn.Module, state: dict | None = None) -> dict:
    """The model's tensors (or `state`, whole tensors of it) for safetensors: contiguous, on CPU, the tied head
    stored once (as the embedding)."""
    state = {k: v.detach().contiguous().cpu() for k, v in (state or model.state_dict()).items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(run_dir: str, step: int, state: dict, model_config: ModelConfig, tokenizer_path: str,
                    trainer_state: dict, keep: int) -> str:
    """Write checkpoint `step` atomically, point LATEST at it, keep the newest `keep`; return its folder."""
    root = os.path.join(run_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"step_{step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp_{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(tmp, MODEL_CONFIG), "w", encoding="utf-8") as f:
        json.dump(asdict(model_config), f, indent=2)
    shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER))
    torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
    for file in os.listdir(tmp):
        with open(os.path.join(tmp, file), "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):  # a re-run reaching the same step replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(os.path.join(root, "LATEST"), name + "\n")
    _prune(root, keep)
    return final


def _prune(root: str, keep: int):
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted writes."""
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.isdir(os.path.join(root, d)))
    for d in done[:-keep]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    for d in os.listdir(root):
        if d.startswith(".tmp_"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoint folders of a run, oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if d.startswith("step_") and os.path.isfile(os.path.join(root, d, WEIGHTS))]


def latest_checkpoint(run_dir: str) -> str | None:
    """The folder LATEST names, or None when the run has no checkpoint yet."""
    pointer = os.path.join(run_dir, "checkpoints", "LATEST")
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        path = os.path.join(run_dir, "checkpoints", f.read().strip())
    return path if os.path.isdir(path) else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder from a checkpoint folder, a run folder or its checkpoints/ folder."""
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        return path
    for run_dir in (path, os.path.dirname(os.path.normpath(path))):
        found = latest_checkpoint(run_dir)
        if found:
            return found
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}, {HOW_TO_MAKE_ONE}")
    raise CheckpointError(f"{path} holds no checkpoint (no {WEIGHTS} and no checkpoints/LATEST), {HOW_TO_MAKE_ONE}")


def load_model_config(ckpt: str) -> ModelConfig:
    """The ModelConfig saved beside the weights."""
    path = os.path.join(ckpt, MODEL_CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        known = {f.name for f in fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in values.items() if k in known})
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, the checkpoint is incomplete; {HOW_TO_MAKE_ONE}") from None
    except (json.JSONDecodeError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path} is not a valid model config ({e}), {HOW_TO_MAKE_ONE}") from None


def _read_weights(ckpt: str) -> dict:
    """Every tensor of a checkpoint's model.safetensors, on the CPU; CheckpointError naming the file otherwise."""
    path = os.path.join(ckpt, WEIGHTS)
    try:
        return load_file(path, device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, the checkpoint is incomplete; {HOW_TO_MAKE_ONE}") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}), use an earlier checkpoint or {HOW_TO_MAKE_ONE}") from None


def load_weights(ckpt: str, model: torch.nn.Module):
    """Load model.safetensors into `model` (shapes must match); the tied head follows the embedding."""
    path = os.path.join(ckpt, WEIGHTS)
    own = model.state_dict()
    state = {k: shard_as(v, own[k]) if k in own else v for k, v in _read_weights(ckpt).items()}  # FSDP2: our rows
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit the model: {str(e).splitlines()[-1].strip()}") from None
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise CheckpointError(f"{path} does not fit the model: missing {sorted(set(missing) - allowed)}, "
                              f"unexpected {sorted(unexpected)}")


@dataclass
class ModelFiles:
    """What read_model() found: the shape, the weights (CPU, our names, a tied head stored once), the tokenizer."""
    config: ModelConfig
    state: dict
    tokenizer_path: str | None
    path: str  # the checkpoint or Hugging Face folder read


def read_model(path: str, max_seq_len: int = 0) -> ModelFiles:
    """The model of a checkpoint folder, a run folder (its newest checkpoint) or a Hugging Face Qwen3/Llama
    folder, checked name by name and shape by shape; CheckpointError with one line for every failure.
    max_seq_len, when given, replaces the saved context length (it sizes the RoPE tables, no weight)."""
    if is_hf_folder(path):
        cfg, state, tokenizer = load_hf_folder(path, max_seq_len)
        return ModelFiles(cfg, state, tokenizer, path)
    ckpt = resolve_checkpoint(path)
    cfg = load_model_config(ckpt)
    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    state = _read_weights(ckpt)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_weights(state, expected_shapes(cfg), os.path.join(ckpt, WEIGHTS))
    tokenizer = os.path.join(ckpt, TOKENIZER)
    return ModelFiles(cfg, state, tokenizer if os.path.isfile(tokenizer) else None, ckpt)


def load_trainer_state(ckpt: str) -> dict:
    """Optimizer, schedule and RNG state, read onto the CPU without unpickling code."""
    path = os.path.join(ckpt, TRAINER_STATE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, the checkpoint is incomplete; resume from an earlier one") from None
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt ({str(e).splitlines()[0]}), resume from an earlier checkpoint") \
            from None
