"""The model card: the README.md every export writes beside the model (Hugging Face folder or GGUF).

model_card() reads what the checkpoint's run folder holds: config.json (data sources, precision),
metrics.jsonl (validation loss, bits per byte and the code metric at the exported step), the checkpoint's
trainer_state.pt (steps, tokens, time, device, command) and the corpus counts the trainer saved beside them.
What a run did not record reads "not recorded": a card never stops an export."""

import json
import math
import os
import re

from config import ModelConfig
from llm.base import atomic
from llm.base.errors import CheckpointError
from llm.base.sizing import count_parameters
from llm.formats.checkpoint import STEP_FOLDER, resolve_checkpoint
from llm.formats.hf_families import family
from llm.formats.hf_format import CARD_MARK, is_hf_folder
from llm.formats.trainer_state import recorded
from llm.reports import markdown as md
from llm.reports.monitor import read_metrics

NOT_RECORDED = "not recorded"


def _quiet(read, *args):
    """read(*args), or None when the file is missing or unreadable: the card shows what there is."""
    try:
        return read(*args)
    except (CheckpointError, OSError, ValueError, TypeError, KeyError, RuntimeError):
        return None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _count(value) -> int | None:
    """value when it is a count (an int, not a bool), else None: a hand-edited file cannot break the card."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _real(value) -> float | None:
    return (float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else None)


def run_folder(ckpt: str) -> str | None:
    """The run folder a checkpoint folder sits in (<run>/checkpoints/step_N), or None."""
    parent = os.path.dirname(os.path.normpath(ckpt))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def export_name(ckpt: str) -> str:
    """The name an export goes by: its run folder's, else the checkpoint folder's."""
    return os.path.basename(os.path.abspath(run_folder(ckpt) or ckpt))


def ollama_tag(name: str) -> str:
    """A name Ollama takes for a model: lower case letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "model"


def run_facts(ckpt: str) -> dict:
    """What the run folder records about the checkpoint at `ckpt`; every key may be missing."""
    run = run_folder(ckpt)
    step = STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(ckpt)))
    facts = {"name": export_name(ckpt), "step": int(step.group(1)) if step else None, "tokens": None,
             "spent_s": None, "world_size": None, **recorded(ckpt)}
    if run:
        facts["config"] = _dict(_quiet(atomic.read_json, os.path.join(run, "config.json"),
                                       "a run config", ""))
        evals = [r for r in read_metrics(run, "eval") if facts["step"] is None or r["step"] <= facts["step"]]
        if evals:
            facts["eval"] = evals[-1]  # the exported step's evaluation, else the last one before it
    return facts


def trained_for_chat(ckpt: str) -> bool | None:
    """Whether the run behind the checkpoint trained on conversations, where its records say (the corpus's
    chat masks); None where they cannot: an import, a run started from another model, a corpus not recorded.
    """
    facts = run_facts(ckpt)
    train = _dict(_dict(facts.get("config")).get("train"))
    has_masks = _dict(facts.get("corpus")).get("has_masks")
    if facts.get("imported_from") or train.get("init_from") or not isinstance(has_masks, bool):
        return None
    return has_masks


PREFERENCE_OR_REWARD = ("dpo", "simpo", "grpo")  # objectives that tune a model already trained to chat


def trained_to_chat(path: str, depth: int = 0) -> bool:
    """Whether a model was trained to chat, as evaluate.py chooses its chat suite: a run of ours on
    conversations (its corpus's chat masks) or on pairs or rewards, or fine-tuned on other text from a model
    that was; a model from elsewhere whose files carry a chat template of their own. Chat tokens alone in a
    tokenizer are not enough (every tokenizer trained here has them)."""
    if os.path.isfile(path) or is_hf_folder(path):  # a GGUF file, a Hugging Face folder
        return bool(own_chat_template(path))
    path = _quiet(resolve_checkpoint, path) or path  # a run folder: its newest checkpoint
    own = trained_for_chat(path)
    facts = run_facts(path)
    train = _dict(_dict(facts.get("config")).get("train"))
    if own or train.get("objective") in PREFERENCE_OR_REWARD:
        return True
    base = train.get("init_from")
    return isinstance(base, str) and os.path.exists(base) and depth < 8 and trained_to_chat(base, depth + 1)


def own_chat_template(path: str) -> str:
    """The chat template a model from elsewhere carries (a GGUF's metadata; a Hugging Face folder's
    chat_template.jinja or tokenizer_config.json, its default where it names several); "" for none, and for a
    run of ours, whose template is the project's ChatML."""
    if os.path.isfile(path):
        from llm.formats.gguf_reader import chat_template  # the gguf package, only where a GGUF is read
        return chat_template(path)
    if not is_hf_folder(path):
        return ""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8", errors="replace") as f:
            return f.read()
    template = _dict(_quiet(atomic.read_json, os.path.join(path, "tokenizer_config.json"),
                            "a tokenizer config", "")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) else ""


def next_token_train(path: str, depth: int = 0) -> dict | None:
    """The train settings of the run behind path, or where it tuned by preference or reward, of the run it
    started from: the rates of a run that trained by next-token loss (a preference or GRPO run's are scaled
    down)."""
    train = _dict(_dict(run_facts(_quiet(resolve_checkpoint, path) or path).get("config")).get("train"))
    base = train.get("init_from")
    if train.get("objective") in PREFERENCE_OR_REWARD:
        return (next_token_train(base, depth + 1)
                if isinstance(base, str) and os.path.exists(base) and depth < 8 else None)
    return train or None


def _number(n) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _data_rows(facts: dict) -> list[tuple[str, str]]:
    sources = _dict(_dict(facts.get("config")).get("data")).get("sources")
    if not isinstance(sources, list):
        text = NOT_RECORDED
    else:
        text = (", ".join(md.code(md.shared_name(s)) for s in sources)
                or "the Python standard library's own sources")
    rows = [("data", text)]
    corpus = _dict(facts.get("corpus"))
    counts = [_count(corpus.get(k))
              for k in ("train_tokens", "val_tokens", "train_documents", "val_documents")]
    if None not in counts:
        chat = ("; holds chat examples, trained on the assistant turns"
                if corpus.get("has_masks") is True else "")
        rows.append(("corpus", f"{counts[0]:,} training and {counts[1]:,} validation tokens in "
                               f"{counts[2] + counts[3]:,} documents{chat}"))
    return rows


def _training_rows(facts: dict) -> list[tuple[str, str]]:
    train = _dict(_dict(facts.get("config")).get("train"))
    tokens, steps, seconds = facts.get("tokens"), facts.get("step"), facts.get("spent_s")
    if facts.get("imported_from"):
        return [("origin",
                 f"imported from {md.code(md.shared_name(facts['imported_from']))}, not trained here")]
    ranks = facts.get("world_size") or 1
    return [("tokens seen", f"{tokens:,} over {steps:,} steps" if tokens is not None and steps is not None
             else NOT_RECORDED),
            ("training time", f"{seconds / 60:.1f} min, data preparation and compilation included"
             if seconds is not None else NOT_RECORDED),
            ("device", md.text(facts["device"]) + (f", {ranks} processes" if ranks > 1 else "")
             if facts.get("device") else NOT_RECORDED),
            ("precision", md.text(facts.get("precision") or train.get("precision", NOT_RECORDED)))]


def _eval_rows(facts: dict) -> list[tuple[str, str]]:
    r = facts.get("eval")
    if not r:
        return [("validation", NOT_RECORDED)]
    at = f" (step {r['step']:,})"
    rows = [("validation loss", f"{r['val_loss']:.4f}{at}")]
    if _real(r.get("val_bpb")) is not None:
        rows.append(("bits per byte", f"{r['val_bpb']:.4f}{at}: the validation loss / ln 2 / "
                                      "the split's UTF-8 bytes per token"))
    if _count(r.get("code_samples")) and _real(r.get("code_ok")) is not None:
        ok = round(r["code_ok"] * r["code_samples"])
        rows.append(("code metric", f"{ok} of {r['code_samples']} documented "
                                    f"functions get a body that parses{at}"))
    scores = {k.removeprefix("acc_"): v for k, v in r.items()
              if k.startswith("acc_") and _real(v) is not None}
    if scores:
        items = f"the first {r['scored_items']} items of each, " if _count(r.get("scored_items")) else ""
        rows.append(("benchmarks", ", ".join(f"{k} {100 * v:.1f}%" for k, v in scores.items())
                     + f" (accuracy; {items}zero-shot, lm-eval's prompts){at}"))
    return rows


def _origin(facts: dict) -> str:
    start = _dict(_dict(facts.get("config")).get("train")).get("init_from")
    if facts.get("imported_from"):
        return f"imported from {md.code(md.shared_name(facts['imported_from']))}"
    return f"trained with modern-llm from the weights of {md.code(md.shared_name(start))}" if start else \
        "trained from scratch with modern-llm"


def _table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows])


def _how_to_load(kind: str, file: str, name: str, chat: bool, cfg: ModelConfig) -> str:
    tag = ollama_tag(name)
    if kind == "gguf":
        # transformers reads no head width from a qwen3 GGUF file and assumes Qwen3's 128.
        head = f", head_dim={cfg.head_dim}" if cfg.qk_norm and cfg.head_dim != 128 else ""
        lines = [f"llama.cpp: `llama-cli -m {file}`, or its OpenAI-compatible "
                 f"server: `llama-server -m {file}`.",
                 f"Ollama: `ollama create {tag} -f Modelfile`, then `ollama run {tag}` (the Modelfile sets "
                 "the template, the stop tokens, the context and the sampling).",
                 f"transformers (with the gguf and accelerate packages): "
                 f"`AutoModelForCausalLM.from_pretrained(\".\", gguf_file=\"{file}\"{head})`."]
    else:
        lines = ["transformers, in this folder: `AutoModelForCausalLM.from_pretrained(\".\")` and "
                 "`AutoTokenizer.from_pretrained(\".\")`" + (", with `apply_chat_template` for chat" if chat
                                                             else "") + ".",
                 "This project's generator: `python text_generator.py FOLDER`.",
                 "llama.cpp and Ollama: export the checkpoint with `python "
                 "export_hf.py CHECKPOINT OUT --gguf q8_0`."]
    return "\n".join(f"- {line}" for line in lines)


def model_card(ckpt: str, cfg: ModelConfig, kind: str = "hf", file: str = "", chat: bool = False) -> str:
    """README.md for an export of the checkpoint folder ckpt: kind "hf" (a transformers folder) or "gguf"
    (file)."""
    facts = run_facts(ckpt)
    arch = {"qwen3": "Qwen3 (QK-norm)", "qwen2": "Qwen2 (q/k/v biases)", "llama": "Llama",
            "mistral": "Mistral", "smollm3": "SmolLM3"}.get(family(cfg), family(cfg))
    params = count_parameters(cfg)
    model = [("architecture", f"{arch}: grouped-query attention, RoPE, SwiGLU, RMSNorm"),
             ("parameters", f"{_number(params)} ({params:,})"), ("layers", str(cfg.num_hidden_layers)),
             ("width", f"{cfg.hidden_size} (SwiGLU {cfg.intermediate_size})"),
             ("heads", f"{cfg.num_attention_heads} query, {cfg.num_key_value_heads} "
                       f"key/value, {cfg.head_dim} wide"),
             ("context", f"{cfg.max_seq_len:,} tokens"), ("vocabulary", f"{cfg.vocab_size:,} tokens"),
             ("embeddings", "tied to the output head"
              if cfg.tie_word_embeddings else "separate from the output head")]
    parts = [CARD_MARK, f"# {md.text(facts['name'])}", "",
             f"A {_number(params)}-parameter language model {_origin(facts)}, exported "
             + ("as a Hugging Face transformers folder." if kind == "hf"
                else f"as the GGUF file {md.code(os.path.basename(file))}."), "",
             "## Model", "", _table(model), "",
             "## Training", "", _table(_data_rows(facts) + _training_rows(facts)), "",
             "## Evaluation", "", _table(_eval_rows(facts)), "", "## Use", "",
             _how_to_load(kind, file, facts["name"], chat, cfg), ""]
    return "\n".join(parts)


def adapter_card(ckpt: str, meta: dict, base_name: str) -> str:
    """README.md for a PEFT adapter folder of the LoRA checkpoint ckpt: the base it adapts (as
    adapter_config.json names it), the adapters' settings, the run's numbers and how to load it. PEFT's own
    cards start with this YAML header, which the Hub reads."""
    facts, base = run_facts(ckpt), base_name.removeprefix("hf:")
    lora = [("base model", md.code(md.shared_name(base))), ("rank", str(meta["rank"])),
            ("alpha", f"{meta['alpha']:g}"), ("dropout", f"{meta['dropout']:g}"),
            ("targets", ", ".join(md.code(t) for t in meta["targets"]))]
    use = ["PEFT: `AutoPeftModelForCausalLM.from_pretrained(\".\")` loads the base named above with these "
           "adapters; or `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), \".\")`.",
           "This project: `python text_generator.py RUN --base BASE` on the run's checkpoint, or merged into "
           "one model with `python export_hf.py RUN OUT --base BASE`."]
    parts = ["---", f"base_model: {json.dumps(md.shared_name(base))}", "library_name: peft", "---", CARD_MARK,
             f"# {md.text(facts['name'])}", "",
             f"LoRA adapters {_origin(facts)}, for {md.code(md.shared_name(base))}, "
             "exported as a PEFT adapter folder.",
             "",
             "## Adapters", "", _table(lora), "",
             "## Training", "", _table(_data_rows(facts) + _training_rows(facts)), "",
             "## Evaluation", "", _table(_eval_rows(facts)), "", "## Use", "",
             "\n".join(f"- {line}" for line in use), ""]
    return "\n".join(parts)
