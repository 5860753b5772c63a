"""What fits on one GPU: the fit check's estimate (llm/base/fit.py) for the models people fine-tune, on cards of 12, 24,
48 and 80 GB, training every weight or LoRA on a bf16, int8 or nf4 base, at two contexts; and beside it the same
estimate for the settings the anchors (torchtune, unsloth, litgpt) published measured figures for. Prints the
Markdown tables of docs/fine-tuning.md#what-fits. Or asks it of one model and card, from a laptop, downloading no
weight: a folder holding only its config.json, a run of ours, or hf:ORG/NAME (its config.json alone, online), with
the trainer's own flags; it prints the estimate and, where the run does not fit, the first change that does.

    python tools/what_fits.py
    python tools/what_fits.py --model hf:Qwen/Qwen2.5-1.5B-Instruct --card "RTX 4090" --max_seq_len 2048
    python tools/what_fits.py --model my_model/ --card 24GB --lora_rank 16 --lora_base nf4
"""

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import Config, ModelConfig, TrainConfig  # noqa: E402
from llm.base.errors import ConfigError, error_contract  # noqa: E402
from llm.base.fit import Target, count_parameters, estimate  # noqa: E402
from llm.base.sizing import MEMORY_FRACTION, Machine  # noqa: E402
from llm.base.sizing import loss_chunk_rows  # noqa: E402

GB = 10**9
CARDS = (12, 24, 48, 80)
CONTEXTS = (2048, 8192)
MODES = {"full": ("", 0), "LoRA bf16": ("bf16", 16), "LoRA int8": ("int8", 16), "LoRA nf4": ("nf4", 16)}


def shape(vocab, d, layers, heads, kv, ffn, tied, family, head_dim=0) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=ffn, tie_word_embeddings=tied,
                       head_dim=head_dim, qk_norm=False, qkv_bias=family == "qwen2", max_seq_len=2048)


# The shapes each model's config.json on the Hugging Face Hub declares (vocab_size, hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, tie_word_embeddings), under
# the names given.
MODELS = {
    "SmolLM2-135M": shape(49152, 576, 30, 9, 3, 1536, True, "llama"),  # HuggingFaceTB/SmolLM2-135M
    "SmolLM2-360M": shape(49152, 960, 32, 15, 5, 2560, True, "llama"),  # HuggingFaceTB/SmolLM2-360M
    "Qwen2.5-0.5B": shape(151936, 896, 24, 14, 2, 4864, True, "qwen2"),  # Qwen/Qwen2.5-0.5B
    "Llama-3.2-1B": shape(128256, 2048, 16, 32, 8, 8192, True, "llama", 64),  # meta-llama/Llama-3.2-1B
    "Qwen2.5-1.5B": shape(151936, 1536, 28, 12, 2, 8960, True, "qwen2"),  # Qwen/Qwen2.5-1.5B
    "SmolLM2-1.7B": shape(49152, 2048, 24, 32, 32, 8192, True, "llama"),  # HuggingFaceTB/SmolLM2-1.7B
    "Qwen2.5-3B": shape(151936, 2048, 36, 16, 2, 11008, True, "qwen2"),  # Qwen/Qwen2.5-3B
    "Llama-3.2-3B": shape(128256, 3072, 28, 24, 8, 8192, True, "llama", 128),  # meta-llama/Llama-3.2-3B
    "Qwen2.5-7B": shape(152064, 3584, 28, 28, 4, 18944, False, "qwen2"),  # Qwen/Qwen2.5-7B
    "Llama-3.1-8B": shape(128256, 4096, 32, 32, 8, 14336, False, "llama"),  # meta-llama/Llama-3.1-8B
}
# meta-llama/Llama-2-7b-hf, for litgpt's figures
LLAMA2_7B = shape(32000, 4096, 32, 32, 32, 11008, False, "llama")


def run(model: ModelConfig, mode: str, context: int, micro: int = 1,
        checkpointed: bool = False) -> tuple[Config, str]:
    """The config of a fine-tune (AdamW, as fine_tuning.py picks it) and the LoRA base the estimate is told.
    """
    base, rank = MODES[mode]
    cfg = Config(model=replace(model, max_seq_len=context, gradient_checkpointing=checkpointed),
                 train=TrainConfig(init_from="base", optimizer="adamw", lora_rank=rank,
                                   micro_batch_size=micro))
    return cfg, base


def peak(cfg: Config, base: str, card_gb: int) -> int:
    """The estimate on a card of card_gb, compiled in bf16, with the loss chunked as the trainer would chunk
    it."""
    rows = loss_chunk_rows(cfg, Machine("cuda", f"{card_gb} GB", card_gb * GB))
    return estimate(cfg, Target("cuda", 2, compiled=True, loss_rows=rows), base).total


def cell(model: ModelConfig, mode: str, context: int) -> str:
    """The smallest card a micro-batch of one fits, without and then with gradient checkpointing."""
    found = []
    for checkpointed in (False, True):
        cfg, base = run(model, mode, context, checkpointed=checkpointed)
        card = next((gb for gb in CARDS if peak(cfg, base, gb) <= MEMORY_FRACTION * gb * GB), None)
        gib = peak(cfg, base, card or CARDS[-1]) / 2**30
        found.append(f"{gib:.1f} GiB: {card} GB" if card else f"{gib:.0f} GiB: none")
    plain, ckpt = found
    return plain if plain.endswith(ckpt.split(": ")[1]) else f"{plain}; ckpt {ckpt}"


def fits_table(context: int) -> list[str]:
    lines = [f"| {context:,} tokens | parameters | " + " | ".join(MODES) + " |",
             "| --- | ---: |" + " --- |" * len(MODES)]
    for name, model in MODELS.items():
        lines.append(f"| {name} | {count_parameters(model) / 1e9:.2f}B | " +
                     " | ".join(cell(model, mode, context) for mode in MODES) + " |")
    return lines


# Published peak memory: (what was run, their figure, our model, mode, micro-batch, context, checkpointed,
# source)
ANCHORS = [
    ("torchtune, Llama 3.1 8B full, batch 2 x 2,048 packed, compiled, RTX 4090", "18.9 GiB",
     "Llama-3.1-8B", "full", 2, 2048, True, "torchtune README, Memory and training speed"),
    ("torchtune, Llama 3.1 8B LoRA, same", "16.2 GiB", "Llama-3.1-8B", "LoRA bf16", 2, 2048, True,
     "torchtune README"),
    ("torchtune, Llama 3.1 8B QLoRA, same", "7.4 GiB", "Llama-3.1-8B", "LoRA nf4", 2, 2048, True,
     "torchtune README"),
    ("unsloth, 8B QLoRA (4-bit), the least", "6 GB", "Llama-3.1-8B", "LoRA nf4", 1, 2048, True,
     "unsloth.ai docs, Unsloth Requirements"),
    ("unsloth, 8B LoRA (16-bit), the least", "22 GB", "Llama-3.1-8B", "LoRA bf16", 1, 2048, True,
     "unsloth.ai docs, Unsloth Requirements"),
    ("unsloth, 3B QLoRA / LoRA, the least", "3.5 / 8 GB", "Llama-3.2-3B", "LoRA nf4", 1, 2048, True,
     "unsloth.ai docs, Unsloth Requirements"),
    ("litgpt, Llama 2 7B LoRA, micro-batch 1, Alpaca (at most 1,304 tokens), A100 40GB", "21.30 GB",
     "Llama-2-7B", "LoRA bf16", 1, 1304, False, "litgpt tutorials/resource-tables.md (2023-10-20)"),
    ("litgpt, the same on bnb.nf4 / nf4-dq", "14.14 / 13.84 GB", "Llama-2-7B", "LoRA nf4", 1, 1304, False,
     "litgpt tutorials/resource-tables.md"),
]


def anchors_table() -> list[str]:
    lines = ["| published | their peak | ours, same shape and batch | source |",
             "| --- | ---: | ---: | --- |"]
    for what, theirs, name, mode, micro, context, checkpointed, source in ANCHORS:
        model = LLAMA2_7B if name == "Llama-2-7B" else MODELS[name]
        cfg, base = run(model, mode, context, micro, checkpointed)
        ours = f"{peak(cfg, base, 80) / 2**30:.1f} GiB ({mode}{', ckpt' if checkpointed else ''})"
        if "/" in theirs and mode == "LoRA nf4" and name == "Llama-3.2-3B":  # the LoRA figure beside QLoRA's
            cfg, base = run(model, "LoRA bf16", context, micro, checkpointed)
            ours = (ours.replace(" (", f" / {peak(cfg, base, 80) / 2**30:.1f} GiB (")
                    .replace("LoRA nf4", "nf4 / bf16"))
        lines.append(f"| {what} | {theirs} | {ours} | {source} |")
    return lines


def tables() -> str:
    return "\n\n".join("\n".join(lines) for lines in [*map(fits_table, CONTEXTS), anchors_table()])


# Cards by the names people give them, and their memory in GB (the makers' figures).
CARD_GB = {"rtx 3060": 12, "rtx 3080": 10, "rtx 3090": 24, "rtx 4060 ti": 16, "rtx 4070": 12, "rtx 4080": 16,
           "rtx 4090": 24, "rtx 5090": 32, "t4": 16, "l4": 24, "a10": 24, "a10g": 24, "l40s": 48, "a6000": 48,
           "v100": 32, "a100": 80, "a100 40gb": 40, "h100": 80, "h200": 141}


def card_memory(card: str) -> tuple[str, int]:
    """(its name, bytes) of a card given by name ("RTX 4090", "H100") or by memory ("24GB", "24")."""
    key = card.strip().lower().replace("nvidia ", "").replace("geforce ", "")
    size = key.removesuffix("gb").strip()
    if size.replace(".", "", 1).isdigit():
        return f"a {float(size):g} GB card", int(float(size) * GB)
    if key not in CARD_GB:
        raise ConfigError(f"--card {card!r} is not a card this knows; give its memory (--card 24GB) or one "
                          f"of {', '.join(sorted(CARD_GB))}")
    return f"{card} ({CARD_GB[key]} GB)", CARD_GB[key] * GB


def model_shape(name: str, max_seq_len: int) -> ModelConfig:
    """A model's shape from its config.json alone: a folder (no weights needed), a run of ours, or
    hf:ORG/NAME."""
    from llm.formats.checkpoint import load_model_config, resolve_checkpoint
    from llm.formats.hf_format import model_config_from_hf
    from llm.formats.hf_hub import hub_shape, is_hub_name
    if is_hub_name(name):
        return hub_shape(name, max_seq_len)
    if not os.path.isdir(name):
        raise ConfigError(f"--model {name} is not a folder; give a folder with its "
                          "config.json, a run, or hf:ORG/NAME")
    if (os.path.isfile(os.path.join(name, "config.json"))
        and not os.path.isdir(os.path.join(name, "checkpoints"))):
        return model_config_from_hf(name, max_seq_len)
    shape = load_model_config(resolve_checkpoint(name))
    return replace(shape, max_seq_len=max_seq_len or shape.max_seq_len)


def ask(model: str, card: str, flags: list[str]) -> str:
    """The estimate of a run of the trainer's flags on `model` and `card`; a run that does not fit gets the
    line the trainer would refuse it with, and the first change that fits."""
    import torch

    from llm.base.cli import parse_config
    from llm.train.startup import fit_lines
    cfg, _ = parse_config(["--init_from", model, *flags])
    shape = model_shape(model, cfg.model.max_seq_len)
    cfg = replace(cfg, model=replace(shape, gradient_checkpointing=cfg.model.gradient_checkpointing),
                  train=replace(cfg.train,
                                optimizer="adamw" if cfg.train.optimizer == "auto" else cfg.train.optimizer))
    name, memory = card_memory(card)
    try:
        return ("\n".join(fit_lines(cfg, Machine("cuda", name, memory), torch.bfloat16, memory))
                + "\nit fits by the estimate")
    except ConfigError as e:
        return f"does not fit: {e}"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The tool's own options; the rest are the trainer's flags (--lora_rank, --max_seq_len, ...)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a folder with config.json, a run of ours, or hf:ORG/NAME")
    p.add_argument("--card", default="24GB", help="a GPU by name (RTX 4090, H100, ...) or memory (24GB)")
    return p.parse_known_args(argv)


@error_contract
def main(argv=None):
    args, flags = parse_args(argv)
    print(ask(args.model, args.card, flags) if args.model else tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())
