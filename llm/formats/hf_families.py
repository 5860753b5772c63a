"""The Hugging Face model families our model computes exactly, and their config.json both ways.

    qwen3    QK-norm                           qwen2    q/k/v biases (Qwen2, Qwen2.5)
    llama    Llama 2 and 3.x (llama3 RoPE), SmolLM2    mistral  within its sliding window
    smollm3  only where every layer has RoPE
One owner for the fields: hf_config() writes a family's config.json from a ModelConfig, model_config_from_hf()
reads one back, and unsupported() names every field asking for what our model cannot compute (a window shorter
than the context, NoPE layers, experts, another RoPE, ...). hf_format.py moves the weights.
"""

import os

from config import ModelConfig
from llm.base import atomic
from llm.base.errors import CheckpointError, ConfigError

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
HF_CONFIG = "config.json"
MOE_KEYS = ("num_experts", "num_local_experts", "moe_intermediate_size", "n_routed_experts")
INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "max_seq_len")
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",  # theirs -> ours
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings"}
SAVE_IT = "save the model with save_pretrained(safe_serialization=True)"


# ----------------------------------------------------------------------------- our config as theirs

def flags_family(qk_norm: bool, qkv_bias: bool) -> str:
    """The family family="auto" means: Qwen3 for QK-norm, Qwen2 for q/k/v biases, else Llama."""
    return "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"


def family(cfg: ModelConfig) -> str:
    """The family an export of cfg writes: its own, or from the flags; CheckpointError when the flags do not
    fit it (Qwen2 always has q/k/v biases, Qwen3 QK-norm, the others neither)."""
    name = cfg.family if cfg.family != "auto" else flags_family(cfg.qk_norm, cfg.qkv_bias)
    needs = {"qwen3": (True, False), "qwen2": (False, True)}.get(name, (False, False))
    if (cfg.qk_norm, cfg.qkv_bias) != needs:
        raise CheckpointError(f"family={name!r} needs qk_norm={needs[0]} and qkv_bias={needs[1]}, and this "
                              f"model has qk_norm={cfg.qk_norm} and qkv_bias={cfg.qkv_bias}; no Hugging Face "
                              "family computes it" + ("" if cfg.family == "auto" else ", set family to auto"))
    if name == "llama" and cfg.hidden_size % cfg.num_attention_heads:
        raise CheckpointError(f"transformers' LlamaConfig needs hidden_size={cfg.hidden_size} divisible by "
                              f"num_attention_heads={cfg.num_attention_heads}; this model cannot be exported")
    return name


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters (transformers 5) for cfg's RoPE."""
    values = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "llama3":
        values.update({theirs: getattr(cfg, ours) for theirs, ours in LLAMA3_KEYS.items()})
    return values


def hf_config(cfg: ModelConfig, dtype: str = "float32", bos: int | None = None, eos: int | None = None,
              pad: int | None = None) -> dict:
    """config.json of the equal model of cfg's family, readable by transformers 4.56 and 5.x."""
    name, layers = family(cfg), cfg.num_hidden_layers
    config = {
        "architectures": [FAMILIES[name]], "model_type": name, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling, and ignores the other.
        "rope_parameters": rope_parameters(cfg), "rope_theta": cfg.rope_theta,
        "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "dtype": dtype, "torch_dtype": dtype,
    }
    if cfg.rope_type != "default":
        config["rope_scaling"] = {k: v for k, v in rope_parameters(cfg).items() if k != "rope_theta"}
    full = {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * layers}
    config.update({  # Qwen2 has its biases without a field, Mistral no field for biases at all
        "qwen3": dict(attention_bias=False, max_window_layers=layers, **full),
        "qwen2": dict(max_window_layers=layers, **full),
        "llama": dict(attention_bias=False, mlp_bias=False, pretraining_tp=1),
        "mistral": dict(sliding_window=None),
        "smollm3": dict(attention_bias=False, mlp_bias=False, no_rope_layers=[1] * layers, **full),
    }[name])
    return config


# ----------------------------------------------------------------------------- their config as ours

def unsupported(hf, raw: dict, context: int) -> list[str]:
    """What a transformers config asks for that our model cannot compute over `context` tokens; empty when it
    fits. Each reason names the config.json field."""
    model_type = raw["model_type"]
    why = []
    if raw.get("architectures") not in (None, [FAMILIES[model_type]]):
        why.append(f"architectures={raw['architectures']} (only {FAMILIES[model_type]})")
    if getattr(hf, "hidden_act", "silu") != "silu":
        why.append(f"hidden_act={hf.hidden_act!r} (ours is silu)")
    if getattr(hf, "attention_bias", False):
        why.append("attention_bias=true (it puts a bias on o_proj too; ours has q/k/v biases only, as Qwen2)")
    if getattr(hf, "mlp_bias", False):
        why.append("mlp_bias=true (our MLP has no biases)")
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        why.append(f"rope_parameters rope_type={rope_type!r} (ours is {' or '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        why.append(f"partial_rotary_factor={rope['partial_rotary_factor']} (ours rotates every channel)")
    if 0 in (getattr(hf, "no_rope_layers", None) or []):
        why.append(f"no_rope_layers={hf.no_rope_layers} (a 0 is a layer without RoPE, "
                   "NoPE; ours rotates in every layer)")
    why += _window(hf, raw, context)
    if any(k in raw for k in MOE_KEYS):
        why.append("mixture of experts (ours has one dense MLP per layer)")
    if raw.get("quantization_config"):
        why.append("quantized weights (quantization_config)")
    return why


def _window(hf, raw: dict, context: int) -> list[str]:
    """Sliding-window attention is full attention over any context no longer than the window: refused only
    when the window is shorter than the context we use."""
    layer_types = getattr(hf, "layer_types", None) or []
    window = getattr(hf, "sliding_window", None)
    sliding = layer_types.count("sliding_attention") if layer_types else hf.num_hidden_layers if window else 0
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return [f"layer_types {sorted(set(layer_types))} (every layer must be full_attention)"]
    if sliding and (not isinstance(window, int) or window < context):
        return [f"sliding_window={window} on {sliding} of {hf.num_hidden_layers} layers is shorter than the "
                f"context of {context} tokens (sliding window attention in use; ours attends to the whole "
                f"context), load it with --max_seq_len {window} or less"]
    return []


def model_config_from_hf(path: str, max_seq_len: int = 0) -> ModelConfig:
    """Our ModelConfig for a folder of a supported family; CheckpointError naming what differs if there is
    none. max_seq_len, when given, is the context used instead of max_position_embeddings."""
    from transformers import AutoConfig  # it fills in the defaults that save_pretrained leaves out

    file, raw = os.path.join(path, HF_CONFIG), raw_config(path)
    try:
        hf = AutoConfig.from_pretrained(path)
        context = max_seq_len or hf.max_position_embeddings
        if not isinstance(context, int) or context < 1:  # 0 would read as "automatic" and reach the generator
            raise ConfigError(f"max_position_embeddings={context!r} is not a positive context length, the "
                              "file is damaged; load it with --max_seq_len N")
        why = unsupported(hf, raw, context)
        # transformers 5 gathers RoPE settings in rope_parameters; 4.x keeps rope_scaling (key rope_type or
        # type)
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        llama3 = {ours: rope[theirs] for theirs, ours in LLAMA3_KEYS.items()} \
            if (rope.get("rope_type") or rope.get("type")) == "llama3" else {}
        cfg = ModelConfig(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or 0, intermediate_size=hf.intermediate_size,
            max_seq_len=context, rope_theta=float(rope.get("rope_theta")
                                                  or getattr(hf, "rope_theta", 10000.0)),
            rms_norm_eps=float(hf.rms_norm_eps), qk_norm=raw["model_type"] == "qwen3",
            qkv_bias=raw["model_type"] == "qwen2", tie_word_embeddings=bool(hf.tie_word_embeddings),
            init_std=float(hf.initializer_range), family=family_field(raw["model_type"]),
            **({"rope_type": "llama3", **llama3} if llama3 else {}))
    except ConfigError as e:
        raise CheckpointError(f"{file} gives an invalid model shape: {e}") from None
    except Exception as e:  # transformers raises many kinds for a malformed file; a field of a wrong type too
        raise CheckpointError(f"{file} is not a valid transformers config ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None
    if why:
        raise CheckpointError(f"{path} cannot be represented by our model: {'; '.join(why)}")
    if any(not isinstance(getattr(cfg, f), int) or isinstance(getattr(cfg, f), bool) for f in INT_FIELDS):
        raise CheckpointError(f"{file}: the sizes {', '.join(INT_FIELDS)} must be integers")
    return cfg


def family_field(model_type: str) -> str:
    """ModelConfig.family of an import: auto where the flags say it already (a Qwen3, Qwen2 or Llama folder is
    then the same config as a model trained here), else the family itself."""
    qk_norm, qkv_bias = model_type == "qwen3", model_type == "qwen2"
    return "auto" if flags_family(qk_norm, qkv_bias) == model_type else model_type


def raw_config(path: str) -> dict:
    """config.json as written, refused unless it is an object naming a model type we can represent."""
    file = os.path.join(path, HF_CONFIG)
    raw = atomic.read_json(file, "a transformers config", SAVE_IT)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a {type(raw).__name__}, not a config object")
    if raw.get("model_type") not in FAMILIES:
        raise CheckpointError(f"{file}: model_type={raw.get('model_type')!r} is not supported, "
                              f"only {', '.join(FAMILIES)}")
    return raw


def declared_shape(raw: dict, file: str) -> ModelConfig:
    """The shape config.json declares, read from its own fields: transformers is not given a config before
    its sizes are checked against the weights (building one with 10^7 layers takes it minutes)."""
    heads = raw.get("num_attention_heads")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size"):
        if not isinstance(raw.get(name), int) or isinstance(raw.get(name), bool):
            raise CheckpointError(f"{file} is not a valid transformers config "
                                  f"({name}={raw.get(name)!r} is not an integer)")
    try:
        return ModelConfig(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                           num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
                           num_key_value_heads=raw.get("num_key_value_heads") or heads,
                           head_dim=raw.get("head_dim") or 0, intermediate_size=raw["intermediate_size"],
                           qk_norm=raw["model_type"] == "qwen3", qkv_bias=raw["model_type"] == "qwen2",
                           max_seq_len=1, tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                                                   # its default
                                                                   raw["model_type"] == "smollm3")))
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{file} is not a valid transformers config "
                              f"({type(e).__name__}: {e})") from None
