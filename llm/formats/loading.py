"""Loading a model by kind: what a name is, recognised once (detect), then read top to bottom by its kind's
reader.

    RUN   a checkpoint or run folder of ours (a run: its newest checkpoint, or its best): checkpoint.py
    LORA  a LoRA run's checkpoint: its adapters merged into the base --base names, itself read as any kind is
    HF    a Hugging Face folder: hf_format.py        HUB   hf:ORG/NAME, fetched by hf_hub.py, then read as HF
    GGUF  a .gguf file (llama.cpp, Ollama): gguf_reader.py
Each reader checks names, shapes and sizes before it reads a weight, unpickles nothing, and gives a
ModelFiles.
"""

import os
from dataclasses import dataclass
from enum import Enum

import torch

from config import ModelConfig
from llm.base.errors import CheckpointError, ConfigError
from llm.formats import lora
from llm.formats.checkpoint import TOKENIZER, adapter_weights, read_checkpoint, resolve_checkpoint
from llm.formats.gguf_reader import is_gguf, read_gguf
from llm.formats.hf_format import is_hf_folder, load_hf_folder
from llm.formats.hf_hub import is_hub_name, resolve


class Kind(Enum):
    RUN = "a checkpoint or run folder"
    LORA = "a LoRA run's adapters over its base"
    HF = "a Hugging Face folder"
    HUB = "a Hub model, hf:ORG/NAME"
    GGUF = "a GGUF file"


@dataclass(frozen=True)
class Source:
    """A model to read: its kind, the path its reader opens, and what the user asked of it."""
    kind: Kind
    path: str  # RUN, LORA: the checkpoint folder; HF: the folder; HUB: hf:ORG/NAME; GGUF: the file
    # when given, replaces the saved context length (it sizes the RoPE tables, no weight)
    max_seq_len: int = 0
    base: str = ""  # LORA: the model its adapters join, as the user named it (never a path read from a file)


@dataclass
class ModelFiles:
    """What a reader found: the shape, the weights (CPU, our names, a tied head stored once), the tokenizer.
    """
    config: ModelConfig
    state: dict
    tokenizer_path: str | None
    path: str  # the checkpoint or Hugging Face folder, or the GGUF file, read


def detect(name: str, max_seq_len: int = 0, best: bool = False, base: str = "") -> Source:
    """The kind of model `name` is, by its name and the files it holds; a run folder resolved to its
    checkpoint (best: its best one), which CheckpointError names when there is none."""
    if is_hub_name(name):
        return Source(Kind.HUB, name, max_seq_len, base)
    if is_hf_folder(name):
        return Source(Kind.HF, name, max_seq_len, base)
    if is_gguf(name):
        return Source(Kind.GGUF, name, max_seq_len, base)
    ckpt = resolve_checkpoint(name, best)
    # what a LoRA run saves beside its adapters
    adapters = os.path.isfile(os.path.join(ckpt, lora.ADAPTER_CONFIG))
    return Source(Kind.LORA if adapters else Kind.RUN, ckpt, max_seq_len, base)


def read_model(name: str, max_seq_len: int = 0, best: bool = False, base: str = "") -> ModelFiles:
    """The model `name` names, of any kind (Kind), read by its kind's reader and checked name by name and
    shape by shape; CheckpointError with one line for every failure. max_seq_len, when given, replaces the
    saved context length; best picks a run folder's best checkpoint instead of its newest; base: the model a
    LoRA run adapts."""
    return read(detect(name, max_seq_len, best, base))


def read(source: Source) -> ModelFiles:
    """The model of a source detect() recognised, read by its kind's reader; NaN or Inf weights refused."""
    found = READERS[source.kind](source)
    broken = [k for k, v in found.state.items() if not torch.isfinite(v).all()]
    if broken:
        raise CheckpointError(f"{found.path}: the weights {', '.join(broken[:3])} hold NaN or Inf (the run "
                              "diverged before it was saved); use an earlier checkpoint")
    return found


# ----------------------------------------------------------------------------- one reader per kind

def read_run(source: Source) -> ModelFiles:
    return ModelFiles(*read_checkpoint(source.path, source.max_seq_len), source.path)


def read_hf(source: Source) -> ModelFiles:
    return ModelFiles(*load_hf_folder(source.path, source.max_seq_len), source.path)


def read_hub(source: Source) -> ModelFiles:
    """Fetched into huggingface_hub's cache (config.json checked before the weights come), then read as a
    folder."""
    folder = resolve(source.path, source.max_seq_len)
    return ModelFiles(*load_hf_folder(folder, source.max_seq_len), folder)


def read_gguf_file(source: Source) -> ModelFiles:
    return ModelFiles(*read_gguf(source.path, source.max_seq_len), source.path)


def read_lora(source: Source) -> ModelFiles:
    """A LoRA checkpoint's adapters merged into the base the user named, read as any model is (so a base of
    any kind serves), after checking that it is the base they were trained on and that every adapter fits it.
    """
    ckpt = source.path
    meta = lora.read_meta(ckpt)
    if not source.base:
        raise ConfigError(f"{ckpt} holds LoRA adapters trained on {meta['base']}; pass --base with "
                          "that model (a checkpoint, run or Hugging Face folder) to merge them into "
                          "it; to train on from them, export the merged model (export_hf.py RUN OUT "
                          "--base BASE) and --init_from OUT")
    base = read_model(source.base, source.max_seq_len)
    lora.check_base(meta, base.path, ckpt, "--base")
    adapters = adapter_weights(ckpt)
    _check_adapters(adapters, meta, base, os.path.join(ckpt, lora.ADAPTERS))
    tokenizer = os.path.join(ckpt, TOKENIZER)
    return ModelFiles(base.config, lora.merged(base.state, adapters, meta),
                      tokenizer if os.path.isfile(tokenizer) else base.tokenizer_path, ckpt)


def _check_adapters(adapters: dict, meta: dict, base: ModelFiles, where: str):
    """Adapters in lora_A/lora_B pairs, each of the shape its base layer and rank give."""
    shapes = {k: tuple(v.shape) for k, v in base.state.items()}
    pairs = {name.rsplit(".lora_", 1)[0] for name in adapters}
    if set(adapters) != {f"{module}.lora_{kind}.weight" for module in pairs for kind in "AB"}:
        raise CheckpointError(f"{where} does not hold pairs of lora_A and lora_B "
                              "weights; the checkpoint is damaged")
    for name, tensor in adapters.items():
        module, kind = name.rsplit(".lora_", 1)
        rows, cols = shapes.get(module + ".weight", (0, 0))
        if tuple(tensor.shape) != ((meta["rank"], cols) if kind.startswith("A") else (rows, meta["rank"])):
            raise CheckpointError(f"{where}: {name} of shape {tuple(tensor.shape)} does not fit "
                                  f"{base.path}; the checkpoint is damaged")


READERS = {Kind.RUN: read_run, Kind.LORA: read_lora, Kind.HF: read_hf, Kind.HUB: read_hub,
           Kind.GGUF: read_gguf_file}
