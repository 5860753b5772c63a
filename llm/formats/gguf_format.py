"""The GGUF format: our model as one file for llama.cpp and Ollama, written with the gguf package (llama.cpp's
own).

write_gguf_folder() writes <out>/model-<type>.gguf, an Ollama Modelfile beside it and the model card,
atomically; export_hf.py --gguf is the command line. The file follows llama.cpp's converter
(convert_hf_to_gguf.py): the qwen3 architecture for QK-norm models, llama otherwise, its tensor names and
hyperparameter keys, the tokenizer as a byte-level BPE ("gpt2": tokens, types, merges, pre-tokenizer name,
special ids) and the chat template. Types: f16 (norms stay f32, as the converter keeps them) and q8_0 (blocks
of 32 weights sharing one f16 scale)."""

import json
import os
from pathlib import Path

import numpy as np
import torch

from config import ModelConfig, SampleConfig
from llm.base import atomic
from llm.base.errors import CheckpointError, ConfigError
from llm.formats.hf_families import hf_config
from llm.formats.hf_format import CARD, check_weights, expected_shapes, is_written_card
from llm.tokens.tokenizer import CHAT_TEMPLATE, EOT_TOKEN, GPT4_PATTERN, IM_END, IM_START, read_tokenizer
from modern_llm import is_stored

GGUF_TYPES = ("f16", "q8_0")
MODELFILE = "Modelfile"
ARCHITECTURES = ("qwen3", "llama")  # hf_format's model types that llama.cpp knows under the same name
Q8_BLOCK = 32  # weights per q8_0 block: a row whose length it does not divide stays f16, as in the converter
F16_MAX = 65504.0
# Our names -> llama.cpp's tensor kinds (gguf.MODEL_TENSOR members): the top of the model, then each block's.
TOP = {"embed_tokens.weight": "TOKEN_EMBD", "norm.weight": "OUTPUT_NORM", "lm_head.weight": "OUTPUT"}
BLOCK = {"input_layernorm.weight": "ATTN_NORM", "attn.q_proj.weight": "ATTN_Q",
         "attn.k_proj.weight": "ATTN_K", "attn.v_proj.weight": "ATTN_V", "attn.o_proj.weight": "ATTN_OUT",
         "attn.q_norm.weight": "ATTN_Q_NORM", "attn.k_norm.weight": "ATTN_K_NORM",
         "post_attention_layernorm.weight": "FFN_NORM", "mlp.gate_proj.weight": "FFN_GATE",
         "mlp.up_proj.weight": "FFN_UP", "mlp.down_proj.weight": "FFN_DOWN"}
# Qwen2's split (single digits), which Qwen3 folders imported with export_hf.py --import bring along.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# (split pattern, ignore_merges) -> llama.cpp's pre-tokenizer name. GPT-4's split is Llama 3's; llama.cpp's
# "llama-bpe" also skips the merges of a word that is one token ("ignore_merges"), which our trainer's BPE
# does not, and "dbrx" is the name that splits the same way and merges as we do.
PRE_TOKENIZERS = {(GPT4_PATTERN, False): "dbrx", (GPT4_PATTERN, True): "llama-bpe",
                  (QWEN2_PATTERN, False): "qwen2"}


def gguf_package(need: str = "--gguf"):
    """The gguf module, or ConfigError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"{need} needs the gguf package, install it with: pip install gguf") from None
    return gguf


# ----------------------------------------------------------------------------- names and weights

def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for this model: the model type of its Hugging Face export, where llama.cpp has
    it."""
    model_type = hf_config(cfg)["model_type"]
    # llama3 RoPE would need a rope_freqs tensor
    if model_type not in ARCHITECTURES or cfg.rope_type != "default":
        model_type += "" if cfg.rope_type == "default" else f" (rope_type {cfg.rope_type})"
        raise CheckpointError(f"a {model_type} model has no GGUF export here (only "
                              f"{' and '.join(ARCHITECTURES)}); export a Hugging Face folder and convert it "
                              "with llama.cpp's convert_hf_to_gguf.py")
    return model_type


def gguf_name(name: str, arch: str) -> str:
    """Our parameter name -> llama.cpp's (layers.3.attn.q_proj.weight -> blk.3.attn_q.weight)."""
    gguf = gguf_package()
    parts = name.split(".", 2)
    block = len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit()
    kind = BLOCK.get(parts[2]) if block else TOP.get(name)
    tensor = getattr(gguf.MODEL_TENSOR, kind) if kind else None
    arch_tensors = gguf.MODEL_TENSORS[getattr(gguf.MODEL_ARCH, arch.upper())]
    if tensor is None or tensor not in arch_tensors:
        raise CheckpointError(f"the tensor {name} has no place in llama.cpp's {arch} architecture; this "
                              "model cannot be written as GGUF")
    return gguf.TENSOR_NAMES[tensor].format(bid=int(parts[1]) if block else 0) + ".weight"


def interleave_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q_proj or k_proj reordered for llama.cpp's llama architecture, which rotates adjacent pairs of
    each head's channels where we (and transformers) rotate its first half against its second: (out, in) ->
    same."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def uninterleave_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """interleave_rope's inverse: rows of a llama GGUF's attn_q or attn_k back in our order."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_tensors(cfg: ModelConfig, state: dict, qtype: str) -> list[tuple[str, np.ndarray, object]]:
    """(name, data, raw type or None) of every tensor in llama.cpp's layout: f32 norms, f16 or q8_0 matrices.
    """
    gguf, arch = gguf_package(), gguf_arch(cfg)
    state = {k: v for k, v in state.items() if is_stored(k, cfg)}  # a tied head is the embedding: not written
    check_weights(state, expected_shapes(cfg), "the weights to export")
    out = []
    for name, value in state.items():
        value = value.detach().float().cpu()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = interleave_rope(value, cfg.num_attention_heads if "q_proj" in name
                                    else cfg.num_key_value_heads)
        if value.dim() == 1:
            out.append((gguf_name(name, arch), value.numpy(), None))
            continue
        if value.abs().max() > F16_MAX:  # f16 and q8_0's f16 scales hold no larger value: it would be inf
            raise CheckpointError(f"{name} holds values beyond f16's range "
                                  f"({value.abs().max():.3g}); GGUF f16 and q8_0 cannot store it, "
                                  "export a Hugging Face folder with --dtype float32")
        if qtype == "q8_0" and value.shape[-1] % Q8_BLOCK == 0:
            quant = gguf.GGMLQuantizationType.Q8_0
            out.append((gguf_name(name, arch), gguf.quants.quantize(value.numpy(), quant), quant))
        else:
            out.append((gguf_name(name, arch), value.half().numpy(), None))
    return out


# ----------------------------------------------------------------------------- the tokenizer

def _pre_tokenizer(spec: dict, where: str) -> str:
    """llama.cpp's name for the tokenizer's split into words, or CheckpointError when it has none that
    matches."""
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    merges_whole = bool(model.get("ignore_merges"))
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    last = steps[-1] if steps else {}
    if last.get("type") == "ByteLevel" and not last.get("add_prefix_space"):
        if len(steps) == 1 and last.get("use_regex", True) and not merges_whole:
            return "gpt-2"  # GPT-2's split, built into the byte-level step
        digits = steps[0] if len(steps) == 2 else {}
        if (digits.get("type") == "Digits" and digits.get("individual_digits")
            and last.get("use_regex", True) and not merges_whole):
            return "smollm"  # each digit alone, then GPT-2's split (SmolLM's tokenizer)
        split = steps[0] if len(steps) == 2 and not last.get("use_regex", True) else {}
        if split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert"):
            name = PRE_TOKENIZERS.get(((split.get("pattern") or {}).get("Regex"), merges_whole))
            if name:
                return name
    raise CheckpointError(f"{where}: llama.cpp has no pre-tokenizer that splits text as this tokenizer does "
                          f"({json.dumps(pre)[:120]}); GGUF export needs a tokenizer trained here with "
                          "--tokenizer_type bpe or tiktoken")


def gguf_vocab(tokenizer_path: str, vocab_size: int, chat: bool = True) -> dict:
    """The tokenizer as GGUF metadata: tokens (one per embedding row, unused rows named [PADi]), token types,
    merges, pre-tokenizer name, special ids, and whether it chats (chat, and it has the ChatML tokens)."""
    gguf = gguf_package()
    tok = read_tokenizer(tokenizer_path)
    spec = json.loads(tok.to_str())
    model, normalizer, decoder = spec.get("model") or {}, spec.get("normalizer"), spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or model.get("byte_fallback"):
        raise CheckpointError(f"{tokenizer_path} is not a byte-level BPE tokenizer (a {model.get('type')} "
                              f"model with a {decoder.get('type')} decoder), which GGUF's gpt2 tokenizer "
                              "needs; train one with --tokenizer_type bpe or tiktoken")
    if normalizer and normalizer.get("type") != "NFC":  # NFC: llama.cpp leaves it out for Qwen too
        raise CheckpointError(f"{tokenizer_path} normalizes text ({normalizer.get('type')}), which "
                              "llama.cpp's byte-level BPE does not; GGUF would tokenize differently")
    pre = _pre_tokenizer(spec, tokenizer_path)
    vocab, added = tok.get_vocab(with_added_tokens=True), tok.get_added_tokens_decoder()
    if max(vocab.values()) >= vocab_size:
        raise CheckpointError(f"{tokenizer_path} has ids up to {max(vocab.values())}, past the model's "
                              f"vocab_size={vocab_size}; the tokenizer does not belong to this model")
    by_id, kinds = {i: t for t, i in vocab.items()}, gguf.TokenType
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [kinds.UNUSED if i not in by_id else kinds.NORMAL if i not in added else
             kinds.CONTROL if added[i].special else kinds.USER_DEFINED for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    chat = chat and IM_START in vocab and IM_END in vocab  # tokenizer.can_chat's rule
    eot = vocab.get(EOT_TOKEN)
    eos = vocab[IM_END] if chat else eot  # llama.cpp also stops at <|endoftext|> and <|im_end|> by their text
    if eos is None:
        raise CheckpointError(f"{tokenizer_path} has neither {EOT_TOKEN} nor {IM_END}, so nothing would end "
                              "a generation; export a model whose tokenizer has one")
    return {"tokens": tokens, "types": [int(t) for t in types], "merges": merges, "pre": pre, "chat": chat,
            "bos": eot if eot is not None else eos, "eos": eos, "pad": eot if eot is not None else eos}


# ----------------------------------------------------------------------------- writing

def write_gguf(path: str, cfg: ModelConfig, state: dict, tokenizer_path: str, qtype: str = "f16",
               name: str = "model", chat: bool = True):
    """One GGUF file at path (no temporary name: write_gguf_folder's folder is the atomic unit)."""
    gguf, arch = gguf_package(), gguf_arch(cfg)
    if qtype not in GGUF_TYPES:
        raise ConfigError(f"--gguf {qtype!r} is not a GGUF type written here, "
                          f"choose {' or '.join(GGUF_TYPES)}")
    vocab, tensors = gguf_vocab(tokenizer_path, cfg.vocab_size, chat), gguf_tensors(cfg, state, qtype)
    w = gguf.GGUFWriter(None, arch)
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)  # llama.cpp's default is hidden_size / heads, which head_dim need not be
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)  # every channel rotates
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(False)  # the model trained on text as it comes, with no token put in front
    w.add_add_eos_token(False)
    if vocab["chat"]:
        w.add_eot_token_id(vocab["eos"])
        w.add_chat_template(CHAT_TEMPLATE)
    for tensor_name, data, raw_type in tensors:
        w.add_tensor(tensor_name, data, raw_dtype=raw_type)
    try:
        w.write_header_to_file(Path(path))
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return vocab


def modelfile(gguf_file: str, cfg: ModelConfig, chat: bool) -> str:
    """An Ollama Modelfile for the file beside it: ChatML for a chat tokenizer, the prompt as it is otherwise;
    our generator's default sampling (Ollama's own defaults differ) and the context the model trained at."""
    sample = SampleConfig()
    if chat:  # the text CHAT_TEMPLATE renders, in Ollama's Go template language
        template = ('{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
                    '<|im_start|>assistant\n')
        stops = [IM_END, EOT_TOKEN, IM_START]
    else:
        template, stops = "{{ .Prompt }}", [EOT_TOKEN]
    lines = [f"FROM ./{gguf_file}", f'TEMPLATE """{template}"""', f"PARAMETER num_ctx {cfg.max_seq_len}",
             f"PARAMETER temperature {sample.temperature}", f"PARAMETER top_k {sample.top_k}",
             f"PARAMETER top_p {sample.top_p}", f"PARAMETER repeat_penalty {sample.repetition_penalty}"]
    return "\n".join(lines + [f'PARAMETER stop "{s}"' for s in stops]) + "\n"


def gguf_file_name(qtype: str) -> str:
    return f"model-{qtype}.gguf"


def write_gguf_folder(out: str, cfg: ModelConfig, state: dict, tokenizer_path: str, qtype: str = "f16",
                      card: str = "", name: str = "model", overwrite: bool = False, chat: bool = True) -> str:
    """Write out/ (the GGUF file, the Modelfile, the card) into a temporary folder renamed into place when
    complete; overwrite replaces only an earlier GGUF export; chat False: no chat template (a model trained on
    plain text alone). Returns the GGUF file's path."""
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise CheckpointError(f"{os.path.abspath(out)} already exists and is not empty, pass "
                                  "--overwrite or choose another folder")
        others = [e for e in sorted(os.listdir(out)) if not ((e.endswith(".gguf") or e == MODELFILE) and
                                                             os.path.isfile(os.path.join(out, e)))
                  and not (e == CARD and is_written_card(os.path.join(out, e)))]
        if others:
            raise CheckpointError(f"{os.path.abspath(out)} is not an earlier GGUF export "
                                  f"(it holds {others[0]}) and --overwrite replaces "
                                  "nothing else, choose another folder")
    file = gguf_file_name(qtype)
    need = sum(v.numel() for v in state.values()) * (2 if qtype == "f16" else 1.07)
    with atomic.folder(out, f"exporting to {out}", int(need)) as tmp:
        vocab = write_gguf(os.path.join(tmp, file), cfg, state, tokenizer_path, qtype, name, chat)
        with open(os.path.join(tmp, MODELFILE), "w", encoding="utf-8") as f:
            f.write(modelfile(file, cfg, vocab["chat"]))
        if card:
            with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
                f.write(card)
    return os.path.join(out, file)
