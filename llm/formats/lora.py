"""LoRA: low-rank adapters trained on a frozen base model, the base held in fp32, bf16, int8 or nf4 weights.

Each targeted nn.Linear becomes a LoraLinear: base + B @ A * alpha / rank, B starting at zero, so training
starts from the base exactly; torchao holds an int8 or an nf4 (QLoRA's 4-bit) base. The layer is ours rather
than PEFT's injection: importing PEFT brings in transformers' model stack (180 MB resident as an import alone,
61 MB of the preference bench's peak) for three lines of forward. PEFT reads what the runs write
(tests/test_lora.py holds the two to the same logits). A LoRA run's checkpoints hold the adapters
(adapters.safetensors) and adapter_config.json, which names the base and its fingerprint; readers merge the
adapters into the base the user names (--base), an nf4 base quantised again from it and dequantised, and a
resume refuses another base. export_hf.py writes the merged model, or with --adapter_only a PEFT folder for
transformers + peft."""

import contextlib
import hashlib
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import LORA_TARGETS as TARGETS
from llm.base import atomic
from llm.base.errors import CheckpointError, ConfigError, quiet_library_notices
from llm.base.fit import held_base
from llm.formats.hf_format import CARD, hf_name, is_written_card
from modern_llm import stacked

ADAPTERS, ADAPTER_CONFIG = "adapters.safetensors", "adapter_config.json"  # in a LoRA run's checkpoint folders
PEFT_WEIGHTS = "adapter_model.safetensors"  # in a PEFT folder, beside its adapter_config.json
SAMPLE_BYTES = 2**20  # a base's fingerprint reads this much of each weights file's start and end


def targets(t) -> list[str]:
    return list(t.lora_targets) or list(TARGETS)


def block_linears(model: nn.Module, names: list[str]) -> dict[str, nn.Linear]:
    """The linear layers of the blocks whose own name is one of names."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("layers.") and n.rsplit(".", 1)[-1] in names}


def check_lora(model: nn.Module, t):
    """Targets that name linear layers of the blocks, and a rank that fits each of them."""
    wanted = targets(t)
    unknown = [name for name in wanted if not block_linears(model, [name])]
    if unknown:
        raise ConfigError(f"--lora_targets {' '.join(unknown)} match no linear layer of the blocks; "
                          f"choose from {' '.join(TARGETS)}")
    side, where = min((min(m.in_features, m.out_features), n)
                      for n, m in block_linears(model, wanted).items())
    if t.lora_rank > side:
        raise ConfigError(f"--lora_rank {t.lora_rank} is larger than the smaller side ({side}) of {where}; "
                          f"pass --lora_rank {side} or less")


NF4_BLOCK = 64  # weights per absmax scale: QLoRA's and torchao's block (Dettmers et al. 2023)
# scales per fp32 factor of their int8 quantisation (torchao's default), or a divisor of it
NF4_SCALER_BLOCK = 256


def nf4_blocks(name: str, weight: torch.Tensor) -> tuple[int, int]:
    """(block, scaler block) of a matrix held in nf4: a scale per 64 weights and an fp32 factor per 256
    scales, or per the largest divisor of 256 that divides the count of scales (SmolLM2-135M's k_proj holds
    1,728 blocks); ConfigError when the weights do not split into blocks of 64."""
    if weight.numel() % NF4_BLOCK:
        raise ConfigError(f"--lora_base nf4 quantises blocks of {NF4_BLOCK} weights and {name} "
                          f"holds {'x'.join(map(str, weight.shape))} = {weight.numel():,}, not a "
                          f"multiple of {NF4_BLOCK}; pass --lora_base int8 or bf16, or leave "
                          "that layer out of --lora_targets")
    return NF4_BLOCK, math.gcd(weight.numel() // NF4_BLOCK, NF4_SCALER_BLOCK)


def to_nf4(name: str, weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4Tensor of weight, quantised from fp32 (the same source weights give the same codes, so a
    resume and a merge find the base the run trained on); it dequantises to fp32, cast to the compute dtype by
    autocast."""
    from torchao.quantization import to_nf4 as quantise
    return quantise(weight.detach().float().contiguous(), *nf4_blocks(name, weight))


def nf4_round_trip(name: str, weight: torch.Tensor) -> torch.Tensor:
    """weight as an nf4 base holds it: quantised, then dequantised (fp32)."""
    return to_nf4(name, weight).get_original_weight()


def base_dtype(t, amp_dtype) -> str:
    """How the frozen base is held (fit.held_base), refusing a bf16 base without bf16 compute."""
    if t.lora_base == "bf16" and amp_dtype != torch.bfloat16:
        raise ConfigError("--lora_base bf16 needs bf16 compute: pass --precision bf16, "
                          "or --lora_base fp32, int8 or nf4")
    return held_base(t.lora_base, amp_dtype == torch.bfloat16)


class LoraLinear(nn.Module):
    """A frozen linear layer (base_layer) plus a trainable low-rank update: y = base(x) + B(A(dropout(x))) *
    scaling. A draws as nn.Linear does (PEFT's default), B starts at zero. `enabled` False runs the base alone
    (a preference run's reference)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer, self.scaling, self.enabled, self.dropout = base, alpha / rank, True, dropout
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = torch.is_autocast_enabled(x.device.type)
        # cast once, not for the base and A apart
        x = x.to(torch.get_autocast_dtype(x.device.type)) if amp else x
        # The weights read as they are, not through three layers' calls: a CPU's LoRA decode step is small
        # enough for the calls' overhead to show (2-3% of a GRPO rollout's sampling).
        y = F.linear(x, self.base_layer.weight, self.base_layer.bias)
        if not self.enabled:
            return y
        h = F.dropout(x if amp else x.to(self.lora_A.weight.dtype), self.dropout, self.training)
        update = F.linear(F.linear(h, self.lora_A.weight), self.lora_B.weight)
        return torch.add(y, update, alpha=self.scaling)


def adapter_layers(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model's base for the duration, every adapter switched off (no copy), on again after, whatever
    happens inside: a LoRA run's reference (DPO's stored log-probabilities, GRPO's KL term). A model without
    adapters is its own base."""
    layers = adapter_layers(model)
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


# The block's layers that read one input: the module holding them, its attribute for them stacked, their
# names.
READ_TOGETHER = (("attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                 ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


class LoraStack(nn.Module):
    """LoRA layers that read one input, run as one: their frozen bases as one stacked matrix (a matmul where
    there were three or two), their A matrices stacked at each call, each B apart. The block calls it as it
    calls an inference model's stacked layer (modern_llm's fuse_projections). The LoraLinear layers keep their
    adapters under their names (the checkpoints' and PEFT's) and give their bases up to it."""

    def __init__(self, layers: list[LoraLinear]):
        super().__init__()
        self.base = stacked(*[m.base_layer for m in layers])
        self.layers = tuple(layers)  # a tuple, not registered: their parameters keep their own names
        for m in layers:
            m.base_layer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = torch.is_autocast_enabled(x.device.type)
        x = x.to(torch.get_autocast_dtype(x.device.type)) if amp else x  # once, as LoraLinear
        y = F.linear(x, self.base.weight, self.base.bias)
        first = self.layers[0]
        if not first.enabled:  # the adapters are switched off together (adapters_off)
            return y
        h = x if amp else x.to(first.lora_A.weight.dtype)
        if first.dropout and self.training:  # each adapter its own dropout, as LoraLinear's
            downs = [F.linear(F.dropout(h, m.dropout), m.lora_A.weight) for m in self.layers]
        else:
            downs = F.linear(h, torch.cat([m.lora_A.weight for m in self.layers])).split(
                first.lora_A.out_features, dim=-1)
        update = torch.cat([F.linear(d, m.lora_B.weight) for d, m in zip(downs, self.layers)], dim=-1)
        return torch.add(y, update, alpha=first.scaling)


def stack_adapters(model: nn.Module):
    """Each block's LoRA layers that read one input (READ_TOGETHER), where every one of them is adapted, as a
    LoraStack: a CPU's LoRA decode step is mostly small matmuls and their fixed costs, and this makes four
    fewer a block (the GRPO bench's sampling took 6% less)."""
    for block in model.layers:
        for owner, attribute, names in READ_TOGETHER:
            holder = getattr(block, owner)
            layers = [getattr(holder, name) for name in names]
            if all(isinstance(m, LoraLinear) for m in layers):
                setattr(holder, attribute, LoraStack(layers))


def add_adapters(model: nn.Module, t, amp_dtype, held: str) -> nn.Module:
    """Freeze `model`, hold its targeted linear layers as `held` says (base_dtype's reading of t.lora_base:
    fp32, bf16, int8 or nf4), and add trainable adapters (fp32). Under bf16 compute on a 16-bit or quantised
    base, the frozen embedding table and head are held in bf16 too."""
    check_lora(model, t)
    model.requires_grad_(False)
    layers = block_linears(model, targets(t))
    if held == "nf4":  # every shape checked before anything changes
        for name, layer in layers.items():
            nf4_blocks(name, layer.weight)
    if held in ("int8", "nf4"):
        quiet_library_notices()  # torchao announces its enums as it imports
    if held == "int8":  # before the adapters, which then wrap the quantized layers
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, name: name in layers)
        layers = {name: model.get_submodule(name) for name in layers}
    with torch.device(model.embed_tokens.weight.device):  # adapters made where they live
        for name, layer in layers.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    LoraLinear(layer, t.lora_rank, alpha(t), t.lora_dropout))
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.data = p.data.float()  # fp32 master weights, whatever the base is held in
        elif held == "bf16" and name.removesuffix(".base_layer.weight") in layers:
            p.data = p.data.to(torch.bfloat16)
    if held == "nf4":
        for name in layers:
            layer = model.get_submodule(name).base_layer
            layer.weight = nn.Parameter(to_nf4(name, layer.weight), requires_grad=False)
    if held != "fp32" and amp_dtype == torch.bfloat16:
        hold_embeddings_in_bf16(model)
    # On a CPU, where a LoRA decode step is small matmuls' fixed costs. Compiled for an H100 the stacks made
    # 128 kernels against 111 (tools/compile_check.py's train-lora: its step 1.5% longer by the calibrated
    # roofline). A quantised base's layers stay apart: their weights do not concatenate.
    if held in ("fp32", "bf16") and model.embed_tokens.weight.device.type == "cpu":
        stack_adapters(model)
    return model


def hold_embeddings_in_bf16(model: nn.Module):
    """The frozen embedding table and head (one tensor when tied) in bf16: half the bytes, and autocast keeps
    no 16-bit copy of the head. The table's rows come out in fp32, as the fp32 table's did, so the residual
    stream keeps the dtype the trainer chose for it."""
    for layer in (model.embed_tokens, model.lm_head):
        layer.weight.data = layer.weight.data.to(torch.bfloat16)  # a tied head is the same Parameter
    model.embed_tokens.register_forward_hook(lambda module, args, out: out.float())


def alpha(t) -> float:
    return t.lora_alpha or 2.0 * t.lora_rank


def adapter_state(model: nn.Module) -> dict:
    """The adapters' tensors under our names (layers.0.attn.q_proj.lora_A.weight), contiguous, on the CPU."""
    return {k: v.detach().float().contiguous().cpu()
            for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def load_adapters(model: nn.Module, state: dict, where: str):
    """Copy saved adapters into an injected model; CheckpointError when they do not fit it."""
    own = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    if set(own) != set(state) or any(own[k].shape != state[k].shape for k in own):
        raise CheckpointError(f"{where} does not fit this run's adapters (other --lora_rank or "
                              "--lora_targets, or another base shape); resume with the run's LoRA settings")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def merged(base: dict, adapters: dict, meta: dict) -> dict:
    """The base's weights with every adapter added in (W + B @ A * alpha / rank), in fp32; W as the run held
    it for an nf4 base (quantised again from the base, then dequantised), the file's weights for the others.
    """
    out, scale = dict(base), meta["alpha"] / meta["rank"]
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name[:-len(".lora_A.weight")]
            a, b = adapters[name].double(), adapters[module + ".lora_B.weight"].double()
            w = base[module + ".weight"]
            w = nf4_round_trip(module, w) if meta.get("base_format") == "nf4" else w
            out[module + ".weight"] = (w.double() + scale * b @ a).float()
    return out


def fingerprint(folder: str) -> str:
    """The base's identity: each weights file's name, size, and its first and last MiB (the safetensors header
    names every tensor and shape); quick on gigabytes, and it survives a copy to another machine. A GGUF base
    is its one file."""
    h = hashlib.sha256()
    files = [folder] if os.path.isfile(folder) else \
        [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    for path in files:
        name = os.path.basename(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h.update(f"{name}\0{size}\0".encode() + f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def meta_of(t, base_path: str) -> dict:
    """adapter_config.json of a run's checkpoints: its LoRA settings and the base they adapt."""
    # a Hub model by its name
    named = t.init_from if t.init_from.startswith("hf:") else os.path.abspath(base_path)
    return {"rank": t.lora_rank, "alpha": alpha(t), "dropout": t.lora_dropout, "targets": targets(t),
            "base": named, "base_fingerprint": fingerprint(base_path), "base_format": t.lora_base}


def read_meta(ckpt: str) -> dict | None:
    """A checkpoint's adapter_config.json, or None for a checkpoint of whole weights."""
    path = os.path.join(ckpt, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if not _plausible_meta(meta):
            raise ValueError("fields out of range")  # checked without assert: `python -O` strips those
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is damaged (it should hold rank, alpha, dropout, targets, base and "
                              "base_fingerprint); use another checkpoint") from None


def _plausible_meta(meta) -> bool:
    """An adapter config's fields of the types and ranges a run writes."""
    targets = meta.get("targets") if isinstance(meta, dict) else None
    return isinstance(meta, dict) and int(meta["rank"]) > 0 and float(meta["alpha"]) > 0 and \
        0 <= float(meta["dropout"]) < 1 and isinstance(targets, list) and bool(targets) and \
        all(isinstance(t, str) for t in targets) and isinstance(meta["base_fingerprint"], str) and \
        isinstance(meta["base"], str)


def check_base(meta: dict, base_folder: str, where: str, flag: str):
    """The base given is the one the adapters were trained on."""
    if fingerprint(base_folder) != meta["base_fingerprint"]:
        raise ConfigError(f"{flag} {base_folder} is not the base {where} was trained on ({meta['base']}, "
                          f"weights fingerprint {meta['base_fingerprint']}); pass that model")


def peft_state(adapters: dict) -> dict:
    """Adapters under PEFT's names for a transformers model (base_model.model.model.layers.0.self_attn...)."""
    return {"base_model.model." + hf_name(k): v for k, v in adapters.items()}


def peft_config(meta: dict, base_name: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal language model."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_name.removeprefix("hf:"),
            "r": meta["rank"], "lora_alpha": meta["alpha"], "lora_dropout": meta["dropout"],
            "target_modules": meta["targets"], "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "inference_mode": True, "modules_to_save": None, "init_lora_weights": True}


def check_adapter_target(out: str, overwrite: bool):
    """out must be empty, or (with overwrite) hold an earlier adapter export and nothing else."""
    if os.path.isdir(out) and os.listdir(out):
        others = sorted(f for f in set(os.listdir(out)) - {PEFT_WEIGHTS, ADAPTER_CONFIG}
                        if not (f == CARD and is_written_card(os.path.join(out, f))))
        if not overwrite or others:
            raise CheckpointError(f"{os.path.abspath(out)} is not empty"
                                  + (f" (it holds {others[0]})" if others else "") + ", choose another folder"
                                  + ("" if others else " or pass --overwrite"))


def write_peft_folder(out: str, meta: dict, adapters: dict, base_name: str, overwrite: bool = False,
                      card: str = ""):
    """adapter_config.json, adapter_model.safetensors under PEFT's names and the card (README.md), atomically;
    only an earlier adapter export is replaced (with overwrite), never another folder."""
    from safetensors.torch import save_file
    check_adapter_target(out, overwrite)
    with atomic.folder(out, f"exporting adapters to {out}", sum(v.nbytes for v in adapters.values())) as tmp:
        save_file(peft_state(adapters), os.path.join(tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(peft_config(meta, base_name), f, indent=2)
        if card:
            with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
                f.write(card)
