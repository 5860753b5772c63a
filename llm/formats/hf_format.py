"""The Hugging Face format: our model as a transformers folder of its family (hf_families.py), and back.

One owner for the weights both ways: parameter names and shapes, the size checks, the folder writer and the
folder reader; hf_families.py owns config.json and the support check that refuses what our model cannot
compute. loading.py reads a Hugging Face folder (or a Hub model's) through load_hf_folder(); export_hf.py is
the command line; the benchmarks build their transformers twins with hf_twin(), so every path agrees on every
field."""

import json
import math
import os

import psutil
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from config import ModelConfig
from llm.base import atomic
from llm.base.errors import CheckpointError
from llm.base.sizing import count_parameters
from llm.formats.hf_families import (HF_CONFIG, SAVE_IT, declared_shape, hf_config, model_config_from_hf,
                                     raw_config)
from llm.tokens.tokenizer import EOT_TOKEN, IM_END, TOKENIZER_FILE, load_tokenizer, read_tokenizer
from modern_llm import Transformer, is_stored

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
# every file an export writes (the chat template: .jinja)
EXPORT_SUFFIXES = (".json", ".safetensors", ".jinja")
# and its model card, which --overwrite replaces only when its first line says an export wrote it (a README.md
# a user wrote in a folder stays).
CARD, CARD_MARK = ("README.md",
                   "<!-- model card written by export_hf.py; an export with --overwrite replaces it -->")
# (T, head_dim) fp32 tables alive at once while cos and sin are built: buffers, temporaries
ROPE_PEAK_TABLES = 6


# ----------------------------------------------------------------------------- names and shapes

def hf_name(name: str) -> str:
    """Our parameter name -> Hugging Face's (layers.0.attn.q_proj.weight ->
    model.layers.0.self_attn.q_proj.weight)."""
    return name if name == "lm_head.weight" else "model." + name.replace(".attn.", ".self_attn.")


def our_name(name: str) -> str:
    """Hugging Face's parameter name -> ours; the inverse of hf_name."""
    return name if name == "lm_head.weight" else name.removeprefix("model.").replace(".self_attn.", ".attn.")


def expected_shapes(cfg: ModelConfig) -> dict:
    """Our name -> shape of every stored tensor (a tied head is stored once, as the embedding)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if is_stored(k, cfg)}


def stored_shapes(files: list[str], remedy: str = "use another model folder") -> dict[str, tuple]:
    """Name -> shape of every tensor in these safetensors files, read from their headers: nothing is loaded.
    """
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing, {remedy}") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file} is corrupt ({e}), {remedy}") from None
    return shapes


def check_declared_size(cfg: ModelConfig, shapes: dict, where: str):
    """Refuse a config whose parameter count is not what the weight files hold, before anything is built from
    it (a config declaring 10^7 layers would build for hours), and weights too large for the free memory."""
    stored = sum(math.prod(shape) for name, shape in shapes.items()
                 if not name.endswith("rotary_emb.inv_freq") and is_stored(name, cfg))
    declared = count_parameters(cfg)
    if stored != declared:
        raise CheckpointError(f"{where}: its config declares {declared:,} parameters but its weight files "
                              f"hold {stored:,}; the config does not belong to these weights")
    check_memory(stored, where)


def check_memory(parameters: int, where: str):
    """Refuse weights too large for the free memory: they are read as fp32 on the CPU."""
    need, free = 4 * parameters, psutil.virtual_memory().available
    if need > free:
        raise CheckpointError(f"{where} needs {need / 2**30:.1f} GiB of memory to load and "
                              f"{free / 2**30:.1f} GiB are free; close other programs or "
                              "use a machine with more memory")


def check_context(cfg: ModelConfig, where: str):
    """Refuse a context length whose RoPE tables could not be built in the free memory (a config.json
    declaring 10^12 positions sent the allocator looking for terabytes). where: the file and field it comes
    from."""
    need, free = ROPE_PEAK_TABLES * cfg.max_seq_len * cfg.head_dim * 4, psutil.virtual_memory().available
    if need > free:
        raise CheckpointError(f"{where}: a context of {cfg.max_seq_len:,} tokens needs "
                              f"{need / 2**30:,.1f} GiB for its RoPE tables and {free / 2**30:.1f} GiB "
                              "are free; load a shorter one with --max_seq_len N (text_generator.py, "
                              "export_hf.py --import and the trainer take it)")


def check_weights(state: dict, shapes: dict, where: str):
    """Raise CheckpointError naming missing, unexpected and misshapen tensors; state maps names to tensors or
    to shapes."""
    found = {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in state.items()}
    missing, unexpected = sorted(set(shapes) - set(found)), sorted(set(found) - set(shapes))
    wrong = [f"{k} {found[k]} instead of {shapes[k]}" for k in shapes if k in found and found[k] != shapes[k]]
    if missing or unexpected or wrong:
        parts = [f"{label} {items[:4]}" + (f" and {len(items) - 4} more" if len(items) > 4 else "")
                 for label, items in (("missing", missing), ("unexpected", unexpected),
                                      ("wrong shape", wrong)) if items]
        raise CheckpointError(f"{where} does not fit the model its config describes: {'; '.join(parts)}")


# ----------------------------------------------------------------------------- the transformers twin

def hf_twin(cfg: ModelConfig, state: dict | None = None):
    """The transformers model (SDPA attention) that computes what Transformer(cfg) computes; with `state` (our
    names, a tied head optional) it holds those weights, else transformers' own initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM  # slow import, needed only here

    values = hf_config(cfg)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if state is not None:
        twin.load_state_dict({hf_name(k): v for k, v in state.items() if is_stored(k, cfg)},
                             # transformers ties the head to the embedding
                             strict=not cfg.tie_word_embeddings)
    return twin


# ----------------------------------------------------------------------------- writing a folder

def _write_json(path: str, values: dict):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2)


def _write_tokenizer(tokenizer_path: str, out: str, eos: str, pad: str, max_len: int, chat: bool = True):
    """tokenizer.json + tokenizer_config.json with eos, pad and (chat) the chat template, via transformers."""
    tok = load_tokenizer(tokenizer_path)
    tok.eos_token, tok.pad_token, tok.model_max_length = eos, pad, max_len
    if not chat:
        tok.chat_template = None
    tok.save_pretrained(out)
    # transformers 5 names the class TokenizersBackend and keeps the template in chat_template.jinja;
    # 4.x knows neither, and both versions read these two keys.
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        values = json.load(f)
    values = {**values, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template}
    _write_json(path, values if chat else {k: v for k, v in values.items() if k != "chat_template"})


def _write_files(out: str, cfg: ModelConfig, state: dict, tokenizer_path: str, dtype: str, eos: str,
                 chat: bool):
    """Every file of the folder, into the existing folder out."""
    tok = read_tokenizer(tokenizer_path)
    eos_id, eot_id = tok.token_to_id(eos), tok.token_to_id(EOT_TOKEN)
    if eos_id is None:
        raise CheckpointError(f"the tokenizer {tokenizer_path} has no token "
                              f"{eos!r}, pass --eos with its end token")
    pad, pad_id = (EOT_TOKEN, eot_id) if eot_id is not None else (eos, eos_id)
    state = {k: v for k, v in state.items() if is_stored(k, cfg)}
    check_weights(state, expected_shapes(cfg), "the weights to export")
    _write_json(os.path.join(out, HF_CONFIG), hf_config(cfg, dtype, eot_id, eos_id, pad_id))
    save_file({hf_name(k): v.to(DTYPES[dtype]).contiguous() for k, v in state.items()},
              os.path.join(out, HF_WEIGHTS), metadata={"format": "pt"})
    # Generation stops at the chosen end token, at <|endoftext|> (the document separator) and at <|im_end|>
    # where the tokenizer has it: a chat-trained model ends every reply there, --eos or not.
    stop = list(dict.fromkeys(i for i in (eos_id, eot_id, tok.token_to_id(IM_END)) if i is not None))
    _write_json(os.path.join(out, "generation_config.json"),
                {"bos_token_id": eot_id, "eos_token_id": stop, "pad_token_id": pad_id})
    _write_tokenizer(tokenizer_path, out, eos, pad, cfg.max_seq_len, chat)


def write_hf_folder(out: str, cfg: ModelConfig, state: dict, tokenizer_path: str, dtype: str = "float32",
                    eos: str = EOT_TOKEN, overwrite: bool = False, card: str = "", chat: bool = True):
    """Write a transformers folder atomically: into a temporary folder, renamed into place when complete.
    overwrite replaces an earlier export, never anything else (it once replaced a run folder's checkpoints);
    card, when given, is written as its README.md; chat False leaves out the chat template (a model trained on
    plain text alone)."""
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise CheckpointError(f"{os.path.abspath(out)} already exists and is not empty, pass "
                              "--overwrite or choose another folder")
    problem = _not_an_export(out) if os.path.isdir(out) and os.listdir(out) else None
    if problem:
        raise CheckpointError(f"{os.path.abspath(out)} is not an earlier export ({problem}) and --overwrite "
                              "replaces nothing else, choose another folder")
    need = sum(v.numel() for v in state.values()) * DTYPES[dtype].itemsize
    with atomic.folder(out, f"exporting to {out}", need) as tmp:
        _write_files(tmp, cfg, state, tokenizer_path, dtype, eos, chat)
        if card:
            with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
                f.write(card)


def _not_an_export(out: str) -> str | None:
    """Why the folder out is not an earlier export, which --overwrite may replace; None when it is one: a
    Hugging Face folder of only the files an export writes (no checkpoints/, no notes of the user's)."""
    if not is_hf_folder(out):
        return f"no {HF_CONFIG} with {HF_WEIGHTS}"
    others = [e for e in sorted(os.listdir(out)) if not (e.endswith(EXPORT_SUFFIXES) and
                                                         os.path.isfile(os.path.join(out, e)))
              and not (e == CARD and is_written_card(os.path.join(out, e)))]
    return f"it holds {others[0]}" if others else None


def is_written_card(path: str) -> bool:
    """Whether the file at path is a model card an export wrote: CARD_MARK is its first line, or the first
    after the short YAML header an adapter card starts with."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1024).splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return CARD_MARK in head[:1] or (head[:1] == ["---"] and CARD_MARK in head[1:8])


# ----------------------------------------------------------------------------- reading a folder

def is_hf_folder(path: str) -> bool:
    """True for a folder with config.json and safetensors weights (ours keep model_config.json instead)."""
    return (os.path.isfile(os.path.join(path, HF_CONFIG))
            and any(os.path.isfile(os.path.join(path, f)) for f in (HF_WEIGHTS, HF_INDEX)))


def _weight_files(path: str) -> list[str]:
    """model.safetensors, or the shards model.safetensors.index.json lists: files of this folder only."""
    index = os.path.join(path, HF_INDEX)
    if not os.path.isfile(index):
        return [os.path.join(path, HF_WEIGHTS)]
    values = atomic.read_json(index, "a weight index", SAVE_IT)
    try:
        shards = set(values["weight_map"].values())
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a weight index with a "
                              f"weight_map ({type(e).__name__}: {e})") from None
    bad = sorted(str(n) for n in shards if not isinstance(n, str) or os.path.basename(n) != n
                 or not n.endswith(".safetensors"))
    if bad or not shards:
        raise CheckpointError(f"{index} names {bad[:3] or 'no shards'}: shards must be "
                              ".safetensors files of the folder itself")
    missing = sorted(n for n in shards if not os.path.isfile(os.path.join(path, n)))
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} shard(s) its index "
                              f"lists: {', '.join(missing[:3])}")
    return [os.path.join(path, n) for n in sorted(shards)]


def _read_hf_weights(files: list[str]) -> dict:
    """Every tensor of these safetensors files, on the CPU."""
    state = {}
    for file in files:
        try:
            state.update(load_file(file, device="cpu"))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file} ({e})") from None
    return state


def load_hf_folder(path: str, max_seq_len: int = 0) -> tuple[ModelConfig, dict, str | None]:
    """(ModelConfig, fp32 state dict in our names, tokenizer.json path or None) of a supported family's
    folder.

    A tied head is left out of the state dict, as in our checkpoints; max_seq_len overrides
    max_position_embeddings (it sizes only the RoPE tables, no weight depends on it)."""
    if not is_hf_folder(path):
        raise CheckpointError(f"{path} is not a Hugging Face model folder ({HF_CONFIG} with {HF_WEIGHTS} or "
                              f"{HF_INDEX}), {SAVE_IT}")
    files = _weight_files(path)
    stored = stored_shapes(files)
    check_declared_size(declared_shape(raw_config(path), os.path.join(path, HF_CONFIG)), stored, path)
    cfg = model_config_from_hf(path, max_seq_len)
    check_context(cfg, f"{path}: --max_seq_len" if max_seq_len
                  else f"{path}/{HF_CONFIG}: max_position_embeddings")
    # Some tied folders store the head as well: it is dropped, as in our checkpoints.
    kept = {k: v for k, v in stored.items()
            if not k.endswith("rotary_emb.inv_freq") and is_stored(our_name(k), cfg)}
    check_weights(kept, {hf_name(k): v for k, v in expected_shapes(cfg).items()}, path)
    state = {our_name(k): v.float().contiguous() for k, v in _read_hf_weights(files).items() if k in kept}
    tokenizer = os.path.join(path, TOKENIZER_FILE)
    return cfg, state, tokenizer if os.path.isfile(tokenizer) else None
