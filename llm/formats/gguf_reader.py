"""Reading a GGUF file (the format of llama.cpp, Ollama and LM Studio) as our model.

read_gguf() gives what a Hugging Face folder gives (loading.py reads a .gguf through it): the shape from the
file's metadata, every tensor dequantized to fp32 by the gguf package (f32, f16, bf16, q8_0, q4_0, q4_1, the
k-quants and whatever else it reads), in our names, and the byte-level BPE tokenizer rebuilt from the metadata
as a tokenizer.json in a temporary folder of this process (which a later process removes, should this one be
killed before it can). The families are those our model computes: llama, qwen2 and qwen3. The write side (and
the name tables both sides share) is gguf_format.py."""

import atexit
import os
import shutil
import tempfile

try:
    import fcntl  # POSIX file locks: what tells a live process's tokenizer folder from a killed one's
except ImportError:
    fcntl = None

import numpy as np
import torch

from config import ModelConfig
from llm.base.atomic import write_error
from llm.base.errors import CheckpointError, ConfigError
from llm.formats.gguf_format import BLOCK, QWEN2_PATTERN, TOP, gguf_package, uninterleave_rope
from llm.formats.hf_families import family_field
from llm.formats.hf_format import check_context, check_declared_size, check_weights, expected_shapes
from llm.tokens.tokenizer import GPT4_PATTERN, TOKENIZER_FILE, save_tokenizer
from modern_llm import is_stored

FAMILIES = ("llama", "qwen2", "qwen3")
BIASES = {"attn.q_proj.bias": "ATTN_Q", "attn.k_proj.bias": "ATTN_K", "attn.v_proj.bias": "ATTN_V"}  # qwen2's
# llama.cpp's pre-tokenizer names -> (split before the byte-level step or None, digits one by one,
# ignore_merges). "smollm" and its kin isolate each digit, then split as GPT-2 does (llama.cpp's regexes for
# them).
PRE_TOKENIZERS = {"default": (None, False, False), "gpt-2": (None, False, False),
                  "smollm": (None, True, False), "starcoder": (None, True, False),
                  "refact": (None, True, False), "codeshell": (None, True, False),
                  "dbrx": (GPT4_PATTERN, False, False), "llama-bpe": (GPT4_PATTERN, False, True),
                  "llama3": (GPT4_PATTERN, False, True), "qwen2": (QWEN2_PATTERN, False, False)}
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values: special tokens, and added tokens that are not special


def is_gguf(path: str) -> bool:
    """A file named .gguf (what read_gguf reads; its magic is checked there)."""
    return path.lower().endswith(".gguf") and os.path.isfile(path)


def read_gguf(path: str, max_seq_len: int = 0) -> tuple[ModelConfig, dict, str]:
    """(ModelConfig, fp32 state dict in our names, tokenizer.json path) of a GGUF file; CheckpointError with
    one line for a file that is not one, a family or feature our model does not compute, or a type gguf cannot
    read. max_seq_len, when given, replaces the file's context length."""
    reader = _open(path)
    _check_layout(reader, path)
    meta = _metadata(reader, path)
    cfg = _model_config(meta, reader, path, max_seq_len)
    _check_vocabulary(meta, path)  # before the weights are read: a damaged vocabulary is refused at once
    arch = meta["general.architecture"]
    check_context(cfg, f"{path}: --max_seq_len" if max_seq_len else f"{path}: {arch}.context_length")
    _check_blocks(reader, cfg.num_hidden_layers, f"{path}: {arch}.block_count")
    names = _our_names(arch, cfg.num_hidden_layers)
    shapes = {names.get(t.name, t.name): tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    # llama3 scaling: refused with the config
    shapes = {k: v for k, v in shapes.items() if k != "rope_freqs.weight"}
    check_declared_size(cfg, shapes, path)
    check_weights({k: v for k, v in shapes.items() if is_stored(k, cfg)}, expected_shapes(cfg), path)
    state = {}
    for t in reader.tensors:
        name = names[t.name]
        if is_stored(name, cfg):
            state[name] = _dequantized(t, path, shapes[name])
    if arch == "llama":  # llama.cpp rotates adjacent channel pairs; we rotate halves
        for name in [k for k in state if k.endswith(("q_proj.weight", "k_proj.weight"))]:
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            state[name] = uninterleave_rope(state[name], heads)
    return cfg, state, _tokenizer_file(meta, path, cfg.vocab_size)


def _open(path: str):
    gguf = gguf_package("reading a .gguf")
    try:
        return gguf.GGUFReader(path, "r")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # the reader raises ValueError, struct and numpy errors for a file it cannot parse
        raise CheckpointError(f"{path} is not a readable GGUF file "
                              f"({type(e).__name__}: {str(e)[:160]})") from None


def _metadata(reader, path: str) -> dict:
    """Every key's value (strings decoded, arrays as lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:
        raise CheckpointError(f"{path}: its metadata cannot be read "
                              f"({type(e).__name__}: {str(e)[:160]})") from None


def chat_template(path: str) -> str:
    """The chat template a GGUF file carries ("" where none)."""
    template = _metadata(_open(path), path).get("tokenizer.chat_template")
    return template if isinstance(template, str) else ""


def _check_layout(reader, path: str):
    """Each tensor's bytes (from its type and shape) must fill its space, from its offset to the next tensor's
    (or the file's end), padded to the alignment, as llama.cpp lays them out: tensors that overlap (every
    offset 0) or f16 data labelled q8_0 otherwise load as other numbers without a word."""
    starts = [t.data_offset - reader.data_offset for t in reader.tensors]
    ends = starts[1:] + [len(reader.data) - reader.data_offset]
    if starts and starts[0] != 0:
        raise CheckpointError(f"{path}: tensor {reader.tensors[0].name} starts at byte {starts[0]:,} of the "
                              "data region, not 0; the file is damaged")
    for t, start, end in zip(reader.tensors, starts, ends):
        padded = -(-int(t.n_bytes) // reader.alignment) * reader.alignment
        if not t.n_bytes <= end - start <= padded:
            shape = " x ".join(str(int(n)) for n in reversed(t.shape))
            raise CheckpointError(f"{path}: tensor {t.name} ({t.tensor_type.name}, {shape}) takes "
                                  f"{int(t.n_bytes):,} bytes but has {end - start:,} up to the next tensor "
                                  "or the file's end; the file is damaged (overlapping tensors, or a type or "
                                  "shape that does not match the data)")


def _check_vocabulary(meta: dict, path: str):
    """The vocabulary's keys must hold what their names say (tokens and merges strings, special ids tokens of
    the list): tokens stored as integers once reached tokenizers, which failed in two lines blaming the
    merges."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for key, kind in (("tokenizer.ggml.tokens", str), ("tokenizer.ggml.merges", str),
                      ("tokenizer.ggml.token_type", (int, np.integer))):
        values = meta.get(key) or []
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise CheckpointError(f"{path}: {key} is not a list of "
                                  f"{'strings' if kind is str else 'integers'}, the file is damaged")
    for key in [k for k in meta if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]:
        value = meta[key]
        if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
            or not 0 <= value < len(tokens)):
            raise CheckpointError(f"{path}: {key}={value!r} is not a token id (0 to "
                                  f"{len(tokens) - 1}), the file is damaged")


def _number(meta: dict, key: str, path: str, default: float) -> float:
    """A positive finite number from the metadata (a RoPE base written as a string is damage, not a number).
    """
    value = meta.get(key, default)
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool) \
            or not np.isfinite(value) or value <= 0:
        raise CheckpointError(f"{path}: {key}={value!r} is not a positive number, the file is damaged")
    return float(value)


def _int(meta: dict, key: str, path: str, default: int | None = None) -> int:
    """A size from the metadata; every one a model has is at least 1 (a context length of 0 once reached the
    generator, which then asked for prompts of 1 to -1 tokens)."""
    value = meta.get(key, default)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: {key}={value!r} is not a positive count, the "
                              "file is damaged or not a model")
    return int(value)


def _check_blocks(reader, layers: int, where: str):
    """The declared block count must be the blocks the file's tensors hold (blk.0 to blk.N-1), checked before
    a name is built for each: a file declaring 10^12 blocks once built names until memory ran out."""
    held = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    # len first: range(10**12) is never built
    if len(held) != layers or held != {str(i) for i in range(layers)}:
        raise CheckpointError(f"{where}={layers:,} but the file's tensors hold {len(held):,} blocks; the "
                              "file is damaged or not a model")


# Our config's fields by the GGUF key (after "ARCH.") they are read from, to name a refused value as the file
# does.
GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length",
             "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
             "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
             "intermediate_size": "feed_forward_length", "max_seq_len": "context_length"}


def _model_config(meta: dict, reader, path: str, max_seq_len: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise CheckpointError(f"{path}: the architecture {arch!r} is not one our model computes (only "
                              f"{', '.join(FAMILIES)})")
    a = f"{arch}."
    why = []
    if meta.get(a + "rope.scaling.type", "none") not in ("none", "") or meta.get(a + "expert_count"):
        why.append("RoPE scaling" if meta.get(a + "rope.scaling.type", "none") not in ("none", "")
                   else "experts")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        why.append("RoPE frequency factors (Llama 3.1's scaling)")
    if meta.get(a + "attention.sliding_window"):
        why.append(f"a sliding window of {meta[a + 'attention.sliding_window']} tokens")
    heads = _int(meta, a + "attention.head_count", path)
    hidden = _int(meta, a + "embedding_length", path)
    head_dim = _int(meta, a + "attention.key_length", path, hidden // max(heads, 1))
    if _int(meta, a + "attention.value_length", path, head_dim) != head_dim:
        why.append("values and keys of different widths")
    if _int(meta, a + "rope.dimension_count", path, head_dim) != head_dim:
        why.append(f"RoPE on {meta[a + 'rope.dimension_count']} of each head's {head_dim} channels")
    if why:
        raise CheckpointError(f"{path} cannot be represented by our model: {'; '.join(why)}")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    theta = _number(meta, a + "rope.freq_base", path, 10000.0)
    eps = _number(meta, a + "attention.layer_norm_rms_epsilon", path, 1e-6)
    try:
        return ModelConfig(
            vocab_size=_int(meta, a + "vocab_size", path, len(tokens)), hidden_size=hidden,
            num_hidden_layers=_int(meta, a + "block_count", path), num_attention_heads=heads,
            num_key_value_heads=_int(meta, a + "attention.head_count_kv", path, heads), head_dim=head_dim,
            intermediate_size=_int(meta, a + "feed_forward_length", path),
            max_seq_len=max_seq_len or _int(meta, a + "context_length", path),
            rope_theta=theta, rms_norm_eps=eps,
            qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2",
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            family=family_field(arch))
    except ConfigError as e:  # named by the file's own key where it has one: what a GGUF's user can look up
        key = GGUF_KEYS.get(getattr(e, "field", ""))
        if key is None:
            raise CheckpointError(f"{path} gives an invalid model shape: {e}") from None
        raise CheckpointError(f"{path}: {a}{key}={e.value:,} is invalid: "
                              f"{str(e).split(' is invalid: ', 1)[-1]}; the "
                              "file is damaged or not a model") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} gives an invalid model shape: {e}") from None


def _our_names(arch: str, layers: int) -> dict:
    """llama.cpp's tensor names -> ours, for every tensor this architecture has."""
    gguf = gguf_package("reading a .gguf")
    names = {gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)] + ".weight": ours
             for ours, kind in TOP.items()}
    for i in range(layers):
        for table, suffix in ((BLOCK, ".weight"), (BIASES, ".bias")):
            for ours, kind in table.items():
                theirs = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=i) + suffix
                names[theirs] = f"layers.{i}.{ours}"
    return names


def _dequantized(tensor, path: str, shape: tuple) -> torch.Tensor:
    """One tensor as fp32, in our (rows, columns) layout."""
    gguf = gguf_package("reading a .gguf")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # np.require copies what is read-only: an f32 tensor is the memory-mapped file itself.
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)
    except NotImplementedError:
        raise CheckpointError(f"{path}: {tensor.name} is of type {tensor.tensor_type.name}, "
                              "which the gguf package cannot dequantize; convert the model to "
                              "another type (f16, q8_0, q4_k)") from None
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: {tensor.name} cannot be read "
                              f"({str(e)[:160]}), the file is damaged") from None


# ----------------------------------------------------------------------------- the tokenizer

def gguf_tokenizer(meta: dict, path: str, vocab_size: int):
    """The tokenizers.Tokenizer the metadata describes: a byte-level BPE (tokenizer.ggml.model "gpt2") with
    its pre-tokenizer from the name llama.cpp gives it, its control tokens special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: its tokenizer is {kind!r}, and only byte-level BPE (gpt2) is read "
                              "from a GGUF here; load the model's Hugging Face folder instead")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: the pre-tokenizer {pre!r} is not one read here "
                              f"({', '.join(PRE_TOKENIZERS)}); load the model's Hugging Face folder instead")
    _check_vocabulary(meta, path)
    tokens, merges = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.merges") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or len(tokens) > vocab_size or len(types) != len(tokens) or len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{path}: its {len(tokens)} tokens do not fit a vocabulary of {vocab_size} (or "
                              "repeat one), the file is damaged")
    split, digits, ignore_merges = PRE_TOKENIZERS[pre]
    try:
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges],
                         ignore_merges=ignore_merges)
    # tokenizers raises a bare Exception for a merge of unknown tokens, over several lines
    except Exception as e:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                              f"({str(e).splitlines()[0][:120]}), the file is damaged") from None
    tok = Tokenizer(bpe)
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated")] if split else []
    steps += [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok


FOLDER_PREFIX, LOCK_SUFFIX = "gguf-tokenizers-", ".lock"
_folder = None
_lock = None  # the open file descriptor of _folder's lock, locked for this process's life


def _tokenizer_file(meta: dict, path: str, vocab_size: int) -> str:
    """gguf_tokenizer() saved as tokenizer.json in a folder of this process, removed when it exits."""
    global _folder
    tok = gguf_tokenizer(meta, path, vocab_size)
    try:
        if _folder is None:
            _folder = _own_folder()
        file = os.path.join(_folder, f"{len(os.listdir(_folder))}", TOKENIZER_FILE)
        os.makedirs(os.path.dirname(file))
        save_tokenizer(tok, file)
    except OSError as e:  # a full temporary folder: one line (exit 1), as for every other write
        raise write_error(e, f"writing the tokenizer of {path}") from None
    return file


def _own_folder() -> str:
    """A new folder of this process in the temporary folder, removed at its exit. A process killed (kill -9,
    the OOM killer) runs no exit code, so its folder once stayed for good. Now each folder F has a file F.lock
    beside it, made first and locked for the process's life (the kernel lets go of a lock when its process
    dies, however it dies); each new folder's process first removes every folder whose lock is free. Without
    POSIX locks (Windows), a folder as before: removed at a normal exit."""
    global _lock
    if fcntl is None:
        folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        atexit.register(shutil.rmtree, folder, True)
        return folder
    _remove_orphans(tempfile.gettempdir())
    while True:
        fd, lock = tempfile.mkstemp(prefix=FOLDER_PREFIX, suffix=LOCK_SUFFIX)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:  # not taken for an orphan's by another process between mkstemp and flock
            break
        os.close(fd)
    folder, _lock = lock.removesuffix(LOCK_SUFFIX), fd
    atexit.register(_remove, folder, lock)  # first: a failed mkdir (a full disk) leaves no lock file either
    os.mkdir(folder, 0o700)
    return folder


def _remove(folder: str, lock: str):
    """A folder, then its lock file (in this order: a folder never lacks its lock)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.unlink(lock)
    except OSError:
        pass


def _remove_orphans(temp: str):
    """Remove the tokenizer folders in `temp` whose lock no process holds: their processes were killed. A live
    process's lock is held; another user's cannot be opened. Folders without a lock file (made before locks
    were) are left alone: their process may still live."""
    try:
        locks = [e.path for e in os.scandir(temp)
                 if e.name.startswith(FOLDER_PREFIX) and e.name.endswith(LOCK_SUFFIX)]
    except OSError:
        return
    for lock in locks:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:  # gone already, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # still the file that was opened, not a new one
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except OSError:  # held: a live process's folder (or the file went meanwhile)
            same = False
        try:
            if same:
                _remove(lock.removesuffix(LOCK_SUFFIX), lock)
        finally:
            os.close(fd)
