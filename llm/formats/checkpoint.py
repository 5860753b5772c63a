"""Checkpoints of a run folder: atomic writes, the LATEST pointer, and the project's one reader of weights.

    <run>/checkpoints/step_000500/{model.safetensors, model_config.json, tokenizer.json, trainer_state.pt,
                                   manifest.json}
    <run>/checkpoints/LATEST   names the newest complete checkpoint folder; BEST the one of lowest val loss

A checkpoint is written to a hidden temporary folder, its manifest last, flushed, renamed into place,
and only then does LATEST move, so a crash at any moment leaves the previous checkpoint usable (and a
lost LATEST is found again by scanning for complete folders). read_checkpoint() reads a checkpoint's weights
(loading.py recognises a run among the other kinds of model), never unpickling anything.
"""

import contextlib
import errno
import json
import math
import os
import re
import shutil
from dataclasses import asdict, fields, replace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from config import ModelConfig
from llm.base import atomic
from llm.base.distributed import shard_as
from llm.base.errors import CheckpointError, ConfigError
from llm.formats import lora
from llm.formats.hf_format import (check_context, check_declared_size, check_weights, expected_shapes,
                                   stored_shapes)
from llm.tokens.tokenizer import TOKENIZER_FILE as TOKENIZER
from modern_llm import is_stored

WEIGHTS, MODEL_CONFIG, TRAINER_STATE = "model.safetensors", "model_config.json", "trainer_state.pt"
MANIFEST = "manifest.json"  # written last: the step, its validation loss and every file's size
STEP_FOLDER = re.compile(r"step_(\d{6,})")
HOW_TO_MAKE_ONE = "train one with: python gpu_training_optimized.py"


def weights_state_dict(model: torch.nn.Module, state: dict | None = None) -> dict:
    """The model's tensors (or `state`, whole tensors of it) for safetensors: contiguous, on CPU, the tied
    head stored once (as the embedding)."""
    state = {k: v.detach().contiguous().cpu() for k, v in (state or model.state_dict()).items()}
    cfg = getattr(model, "config", None)
    return {k: v for k, v in state.items() if cfg is None or is_stored(k, cfg)}


def save_checkpoint(run_dir: str, step: int, state: dict, *, model_config: ModelConfig, tokenizer_path: str,
                    trainer_state: dict, keep: int, val_loss: float | None = None,
                    lora_meta: dict | None = None) -> str:
    """Write checkpoint `step` atomically, point LATEST at it (and BEST, when val_loss is the run's lowest
    yet), keep the newest `keep` and the best; return its folder. A failed write (a full disk) leaves no trace
    and the previous checkpoints as they were, and raises WriteError saying how much room it needs. With
    lora_meta, state holds a LoRA run's adapters, written with their adapter_config.json instead of the
    model's weights."""
    root, name = os.path.join(run_dir, "checkpoints"), f"step_{step:06d}"
    final = os.path.join(root, name)
    need = _tensor_bytes(state) + _tensor_bytes(trainer_state)
    previous = latest_checkpoint(run_dir)
    keeps = f"; {previous} is intact" if previous else ""
    with atomic.folder(final, f"writing checkpoint {name} (the run stopped here{keeps})", need) as tmp:
        with _refused_writes(tmp):
            save_file(state, os.path.join(tmp, lora.ADAPTERS if lora_meta else WEIGHTS),
                      metadata={"format": "pt"})
        if lora_meta:
            with open(os.path.join(tmp, lora.ADAPTER_CONFIG), "w", encoding="utf-8") as f:
                json.dump(lora_meta, f, indent=2)
        with open(os.path.join(tmp, MODEL_CONFIG), "w", encoding="utf-8") as f:
            json.dump(asdict(model_config), f, indent=2)
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER))
        with _refused_writes(tmp), open(os.path.join(tmp, TRAINER_STATE), "wb") as f:
            torch.save(trainer_state, f)  # through a Python file, whose OSError the zip writer's error keeps
        files = sorted(os.listdir(tmp))
        sizes = {file: os.path.getsize(os.path.join(tmp, file)) for file in files}
        # What each file holds, and its size and time as written: a file touched since is hashed when read.
        sums = {file: atomic.file_digest(os.path.join(tmp, file)) for file in files}
        written = {file: atomic.stamp(os.path.join(tmp, file)) for file in files}
        # last: its presence means complete
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"step": step, "val_loss": val_loss, "files": sizes, "sha256": sums,
                       "written": written}, f, indent=1)
    atomic.write_text(os.path.join(root, "LATEST"), name + "\n")
    best = best_checkpoint(run_dir)
    if val_loss is not None and (best is None or val_loss < _manifest(best).get("val_loss", math.inf)):
        atomic.write_text(os.path.join(root, "BEST"), name + "\n")
    _prune(run_dir, keep)
    return final


@contextlib.contextmanager
def _refused_writes(folder: str):
    """A write the disk refused, as the OSError it is (atomic.folder turns that into one line): safetensors
    reports it as SafetensorError '... (os error 28)', torch's zip writer as RuntimeError 'unexpected pos'."""
    try:
        yield
    except SafetensorError as e:
        number = re.search(r"os error (\d+)", str(e))
        if not number:
            raise
        raise OSError(int(number.group(1)), os.strerror(int(number.group(1))), folder) from None
    except RuntimeError as e:
        if "inline_container" not in str(e) and "PytorchStreamWriter" not in str(e):
            raise
        refused = e.__context__ if isinstance(e.__context__, OSError) else OSError(errno.EIO, str(e), folder)
        raise refused from None


def _tensor_bytes(obj) -> int:
    """Bytes of every tensor in nested dicts and lists: about what a checkpoint of them takes on disk."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _prune(run_dir: str, keep: int):
    """Delete all but the newest `keep` complete checkpoints and the best, and leftovers of interrupted
    writes."""
    root, best = os.path.join(run_dir, "checkpoints"), best_checkpoint(run_dir)
    for path in list_checkpoints(run_dir)[:-keep]:
        if path != best:
            shutil.rmtree(path, ignore_errors=True)
    for d in os.listdir(root):
        if d.startswith(".tmp_"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def _manifest(ckpt: str) -> dict:
    """A checkpoint's manifest.json ({} when it has none, or an unreadable one)."""
    try:
        manifest = atomic.read_json(os.path.join(ckpt, MANIFEST), "a manifest", "")
    except CheckpointError:
        return {}
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else {}


def incomplete(ckpt: str) -> str | None:
    """What is missing from a checkpoint folder, or None when every file is there at its written size (by the
    manifest, written last; checkpoints from before manifests need their four files)."""
    files = _manifest(ckpt).get("files")
    if not files:
        if os.path.exists(os.path.join(ckpt, MANIFEST)):
            return f"{MANIFEST} is unreadable"
        needed = (WEIGHTS, MODEL_CONFIG, TOKENIZER, TRAINER_STATE)
        missing = [f for f in needed if not os.path.isfile(os.path.join(ckpt, f))]
        return f"{', '.join(missing)} missing" if missing else None
    for name, size in files.items():
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} holds {os.path.getsize(path):,} of its {size:,} bytes"
    return None


def check_unchanged(ckpt: str, file: str):
    """Refuse, in one line, a checkpoint file whose bytes are not those its manifest recorded when it was
    written (hashed only where its size or time changed since); checkpoints from before sums pass."""
    manifest, path = _manifest(ckpt), os.path.join(ckpt, file)
    sums, written = manifest.get("sha256"), manifest.get("written")
    if not isinstance(sums, dict) or file not in sums or not os.path.isfile(path):
        return
    if isinstance(written, dict) and written.get(file) == atomic.stamp(path):
        return
    if atomic.file_digest(path) != sums[file]:
        raise CheckpointError(f"{path} is not the file written at step {manifest.get('step')} (its sha256 "
                              f"differs): it changed since; use an earlier checkpoint or {HOW_TO_MAKE_ONE}")


def is_complete(ckpt: str) -> bool:
    return incomplete(ckpt) is None


def checkpoint_step(ckpt: str) -> int:
    """The step in a checkpoint folder's name (step_000500 -> 500)."""
    return int(STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(ckpt))).group(1))


def holds_checkpoints(run_dir: str) -> bool:
    """Whether the run folder has any checkpoint folder at all, complete or not, LATEST or not."""
    root = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(root) and any(STEP_FOLDER.fullmatch(d) for d in os.listdir(root))


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoint folders of a run, oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [os.path.join(root, d) for d in os.listdir(root) if STEP_FOLDER.fullmatch(d)]
    return sorted((p for p in found if is_complete(p)), key=checkpoint_step)


def _pointer(run_dir: str, name: str) -> str | None:
    """The complete checkpoint folder that checkpoints/<name> names; None if it is missing, unreadable, or
    names anything but a step folder beside it (a pointer is never followed out of the run folder)."""
    try:
        with open(os.path.join(run_dir, "checkpoints", name), "rb") as f:
            target = f.read(64).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = os.path.join(run_dir, "checkpoints", target)
    return path if STEP_FOLDER.fullmatch(target) and is_complete(path) else None


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint: the one LATEST names, else (LATEST lost or damaged, say by a crash just
    after a checkpoint's rename) the newest complete folder; None when the run has none."""
    return _pointer(run_dir, "LATEST") or (list_checkpoints(run_dir) or [None])[-1]


def latest_problem(run_dir: str) -> str | None:
    """Why latest_checkpoint() could not take what LATEST names, in a sentence; None when it could."""
    pointer, root = os.path.join(run_dir, "checkpoints", "LATEST"), os.path.join(run_dir, "checkpoints")
    if _pointer(run_dir, "LATEST") or not holds_checkpoints(run_dir):
        return None
    if not list_checkpoints(run_dir):  # nothing complete at all: say what the newest folder lacks
        newest = max((d for d in os.listdir(root) if STEP_FOLDER.fullmatch(d)), key=lambda d: int(d[5:]))
        return f"{os.path.join(root, newest)} is incomplete ({incomplete(os.path.join(root, newest))})"
    if not os.path.isfile(pointer):
        return f"{pointer} is missing"
    try:
        with open(pointer, "rb") as f:
            target = f.read(64).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return f"{pointer} is unreadable"
    if not STEP_FOLDER.fullmatch(target):
        return f"{pointer} does not name a checkpoint folder of the run"
    path = os.path.join(run_dir, "checkpoints", target)
    return f"{path} is incomplete ({incomplete(path) if os.path.isdir(path) else 'the folder is missing'})"


def best_checkpoint(run_dir: str) -> str | None:
    """The checkpoint with the lowest validation loss that BEST names; None before the first one."""
    return _pointer(run_dir, "BEST")


def resolve_checkpoint(path: str, best: bool = False) -> str:
    """A checkpoint folder from a checkpoint folder, a run folder or its checkpoints/ folder; a run's newest
    complete checkpoint, or with best its best one."""
    # whole weights or adapters
    if any(os.path.isfile(os.path.join(path, f)) for f in (WEIGHTS, lora.ADAPTERS)):
        return path
    for run_dir in (path, os.path.dirname(os.path.normpath(path))):
        found = best_checkpoint(run_dir) if best else latest_checkpoint(run_dir)
        if found:
            return found
        if best and list_checkpoints(run_dir):
            raise CheckpointError(f"{run_dir} has no best checkpoint yet (none was saved at an evaluation), "
                                  "load its newest without --best")
        if holds_checkpoints(run_dir):
            raise CheckpointError(f"{run_dir} holds no complete checkpoint ({latest_problem(run_dir)}), "
                                  f"{HOW_TO_MAKE_ONE}")
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}, {HOW_TO_MAKE_ONE}")
    raise CheckpointError(f"{path} holds no checkpoint (no {WEIGHTS} and no "
                          f"checkpoints/LATEST), {HOW_TO_MAKE_ONE}")


def load_model_config(ckpt: str) -> ModelConfig:
    """The ModelConfig saved beside the weights."""
    path = os.path.join(ckpt, MODEL_CONFIG)
    values = atomic.read_json(path, "a valid model config", f"the checkpoint is damaged; {HOW_TO_MAKE_ONE}")
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} is not a valid model config (it holds a {type(values).__name__}), "
                              f"{HOW_TO_MAKE_ONE}")
    known = {f.name for f in fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in values.items() if k in known})
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{path} is not a valid model config ({e}), {HOW_TO_MAKE_ONE}") from None


def _read_weights(ckpt: str, file: str = WEIGHTS) -> dict:
    """Every tensor of a checkpoint's model.safetensors (or other file), on the CPU; CheckpointError naming
    the file otherwise."""
    path = os.path.join(ckpt, file)
    check_unchanged(ckpt, file)
    try:
        return load_file(path, device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, the checkpoint is incomplete; {HOW_TO_MAKE_ONE}") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}), use an earlier "
                              f"checkpoint or {HOW_TO_MAKE_ONE}") from None


def load_weights(ckpt: str, model: torch.nn.Module):
    """Load model.safetensors into `model` (shapes must match); the tied head follows the embedding. A LoRA
    run's checkpoint: its adapters, into the model whose adapters are injected."""
    if lora.read_meta(ckpt):
        return lora.load_adapters(model, _read_weights(ckpt, lora.ADAPTERS),
                                  os.path.join(ckpt, lora.ADAPTERS))
    path = os.path.join(ckpt, WEIGHTS)
    own = model.state_dict()
    # FSDP2: our rows
    state = {k: shard_as(v, own[k]) if k in own else v for k, v in _read_weights(ckpt).items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit the model: {str(e).splitlines()[-1].strip()}") from None
    allowed = {k for k in missing if not is_stored(k, model.config)}
    if set(missing) - allowed or unexpected:
        raise CheckpointError(f"{path} does not fit the model: missing {sorted(set(missing) - allowed)}, "
                              f"unexpected {sorted(unexpected)}")


def read_checkpoint(ckpt: str, max_seq_len: int = 0) -> tuple[ModelConfig, dict, str | None]:
    """(ModelConfig, state dict, tokenizer.json path or None) of a checkpoint of whole weights, checked name
    by name and shape by shape from the header before a weight is read; max_seq_len, when given, replaces the
    saved context length (it sizes the RoPE tables, no weight). loading.py reads a run through this."""
    cfg, weights = load_model_config(ckpt), os.path.join(ckpt, WEIGHTS)
    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    check_context(cfg, "--max_seq_len" if max_seq_len else f"{os.path.join(ckpt, MODEL_CONFIG)}: max_seq_len")
    # From the header: an absurd config is refused before anything is built or loaded.
    stored = stored_shapes([weights], f"use an earlier checkpoint or {HOW_TO_MAKE_ONE}")
    check_declared_size(cfg, stored, ckpt)
    kept = {k: v for k, v in stored.items() if is_stored(k, cfg)}
    check_weights(kept, expected_shapes(cfg), weights)
    state = {k: v for k, v in _read_weights(ckpt).items() if k in kept}
    tokenizer = os.path.join(ckpt, TOKENIZER)
    return cfg, state, tokenizer if os.path.isfile(tokenizer) else None


def read_adapters(path: str, best: bool = False) -> tuple[dict, dict]:
    """(adapter_config.json, adapters) of a LoRA run's checkpoint (a run folder: its newest or best)."""
    ckpt = resolve_checkpoint(path, best)
    meta = lora.read_meta(ckpt)
    if meta is None:
        raise ConfigError(f"{ckpt} holds whole weights, not LoRA adapters; export it without --adapter_only")
    return meta, adapter_weights(ckpt)


def adapter_weights(ckpt: str) -> dict:
    """The adapters of a LoRA run's checkpoint folder (adapters.safetensors), on the CPU."""
    return _read_weights(ckpt, lora.ADAPTERS)


def load_trainer_state(ckpt: str, mmap: bool = False) -> dict:
    """Optimizer, schedule and RNG state, read onto the CPU without unpickling code; with mmap, a tensor's
    bytes are read only when used (the model card reads a few numbers beside an optimizer state of gigabytes).
    """
    path = os.path.join(ckpt, TRAINER_STATE)
    check_unchanged(ckpt, TRAINER_STATE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, the checkpoint is "
                              "incomplete; resume from an earlier one") from None
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt ({str(e).splitlines()[0]}), "
                              "resume from an earlier checkpoint") \
            from None
