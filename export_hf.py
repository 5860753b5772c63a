"""Export a checkpoint as a Hugging Face folder or a GGUF file (llama.cpp, Ollama), or import a model.

    python export_hf.py [CHECKPOINT] OUT_DIR [--dtype bfloat16] [--eos "<|im_end|>"] [--overwrite]
    python export_hf.py [CHECKPOINT] OUT_DIR --gguf f16|q8_0 [--overwrite]
    python export_hf.py LORA_RUN OUT_DIR --base BASE [--adapter_only]   (a base of ours: also OUT_DIR-base)
    python export_hf.py --import HF_DIR|hf:ORG/NAME|MODEL.gguf RUN_DIR [--tokenizer PATH] [--max_seq_len N]
Export writes config.json of the model's family (an imported model keeps its own: Qwen3, Qwen2, Llama,
Mistral, SmolLM3; else Qwen3ForCausalLM with QK-norm, Qwen2ForCausalLM with q/k/v biases, LlamaForCausalLM),
model.safetensors, the tokenizer with the chat template and generation_config.json; AutoModelForCausalLM and
AutoTokenizer load it offline. With --gguf it writes model-<type>.gguf and an Ollama Modelfile instead. Either
way README.md, the model card, says what the model is and how it trained. A LoRA run's adapters are merged
into the base given with --base, or written alone as a PEFT folder (--adapter_only; a base that is a run of
this project is exported beside it as OUT_DIR-base, which adapter_config.json names). Import reads a folder of
one of those families (sharded or not), a Hub model named hf:ORG/NAME, or a GGUF file (llama, qwen2, qwen3;
dequantized), into RUN_DIR/checkpoints/step_000000, refusing what our model cannot represent. CHECKPOINT is a
checkpoint or run folder (default runs/default). The formats live in hf_format.py, hf_families.py,
gguf_format.py, gguf_reader.py, lora.py and model_card.py; this file is only the command line.
"""

import argparse
import os
import signal
import sys

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from config import default_run_dir
from llm.base.errors import CheckpointError, ConfigError, error_contract
from llm.formats import trainer_state
from llm.formats.checkpoint import (TOKENIZER, holds_checkpoints, read_adapters, resolve_checkpoint,
                                    save_checkpoint)
from llm.formats.gguf_format import GGUF_TYPES, gguf_file_name, write_gguf_folder
from llm.formats.gguf_reader import is_gguf
from llm.formats.hf_format import DTYPES, is_hf_folder, write_hf_folder
from llm.formats.hf_hub import is_hub_name
from llm.formats.loading import Kind, detect, read, read_model
from llm.formats.lora import check_adapter_target, check_base, write_peft_folder
from llm.reports.model_card import adapter_card, export_name, model_card, ollama_tag, trained_for_chat
from llm.tokens.tokenizer import EOT_TOKEN, can_chat, read_tokenizer


def export(checkpoint: str, out: str, dtype: str = "float32", eos: str = EOT_TOKEN, overwrite: bool = False,
           gguf: str = "", base: str = "") -> str:
    """Export a checkpoint (or a run folder's newest) to out, atomically, as a Hugging Face folder or, with
    gguf (f16 or q8_0), a GGUF file; both with a model card. A LoRA run's checkpoint is merged into base.
    Returns the checkpoint folder read."""
    source = detect(checkpoint, base=base)
    if source.kind not in (Kind.RUN, Kind.LORA):
        what = "a GGUF file" if source.kind is Kind.GGUF else "already a Hugging Face model"
        raise CheckpointError(f"{checkpoint} is {what}, export a checkpoint or run folder (import it first "
                              f"with export_hf.py --import {checkpoint} RUN_DIR)")
    model = read(source)
    if model.tokenizer_path is None:
        raise CheckpointError(f"{model.path} has no {TOKENIZER}, the checkpoint is "
                              "incomplete; export another one")
    if (os.path.abspath(model.path) + os.sep).startswith(os.path.abspath(out) + os.sep):
        raise CheckpointError(f"{os.path.abspath(out)} holds the checkpoint being exported, choose another "
                              "output folder")
    # The chat template goes with a model that chats: not with one trained here on plain text alone.
    chat = can_chat(read_tokenizer(model.tokenizer_path)) and trained_for_chat(model.path) is not False
    if gguf:
        card = model_card(model.path, model.config, "gguf", gguf_file_name(gguf), chat)
        write_gguf_folder(out, model.config, model.state, model.tokenizer_path, gguf, card,
                          export_name(model.path), overwrite, chat)
    else:
        card = model_card(model.path, model.config, "hf", chat=chat)
        write_hf_folder(out, model.config, model.state, model.tokenizer_path, dtype, eos, overwrite,
                        card, chat)
    return model.path


def import_hf(path: str, run_dir: str, tokenizer: str = "", max_seq_len: int = 0) -> str:
    """Write a Hugging Face folder, hf:ORG/NAME or a GGUF file as step 0 of run_dir (weights, shape,
    tokenizer; no optimizer state)."""
    if holds_checkpoints(run_dir):  # complete or not, LATEST or not: as the trainer refuses a new run there
        raise CheckpointError(f"{run_dir} already holds checkpoints, choose a new RUN_DIR")
    if not is_hf_folder(path) and not is_hub_name(path) and not is_gguf(path):
        raise CheckpointError(f"{path} is not a Hugging Face model folder (config.json with "
                              "model.safetensors) or a .gguf file, save the model with "
                              "save_pretrained(safe_serialization=True)")
    model = read_model(path, max_seq_len)
    if tokenizer and os.path.isdir(tokenizer):
        tokenizer = os.path.join(tokenizer, TOKENIZER)
    tokenizer = tokenizer or model.tokenizer_path
    if not tokenizer or not os.path.isfile(tokenizer):
        raise CheckpointError(f"{model.path} has no {TOKENIZER}, pass --tokenizer "
                              "with the model's tokenizer.json")
    # No optimizer state: the trainer starts it fresh (--init_from), so this is a start, not a resume.
    return save_checkpoint(run_dir, 0, model.state, model_config=model.config, tokenizer_path=tokenizer,
                           trainer_state=trainer_state.imported(path), keep=1)


def loadable_base(base: str, checkpoint: str, meta: dict, out: str, args) -> str:
    """The base as adapter_config.json names it, which AutoPeftModelForCausalLM loads: a Hub name or a Hugging
    Face folder's path as it is; a run of this project (no model transformers loads by name) exported first as
    a Hugging Face folder beside out, OUT-base, so one command gives both; a GGUF file is refused."""
    if is_hub_name(base) or is_hf_folder(base):
        return base if is_hub_name(base) else os.path.abspath(base)
    if is_gguf(base):
        raise ConfigError(f"the adapters of {checkpoint} adapt {base}, a GGUF file, which transformers "
                          "cannot load by name; import it (export_hf.py --import BASE BASE_RUN), export that "
                          "as a Hugging Face folder (export_hf.py BASE_RUN BASE_HF) and pass --base BASE_HF")
    # before a whole model is written for nothing
    check_base(meta, resolve_checkpoint(base), checkpoint, "--base")
    folder = os.path.normpath(out) + "-base"
    export(base, folder, args.dtype, args.eos, args.overwrite)
    print(f"exported the base {base} to {folder}, which adapter_config.json names (a run of ours loads in "
          "PEFT only as a Hugging Face folder)")
    return os.path.abspath(folder)


def export_adapters(checkpoint: str, out: str, args):
    """A LoRA run's adapters as a PEFT folder naming a base PEFT can load (exported first if it is a run of
    ours)."""
    meta, adapters = read_adapters(checkpoint)
    check_adapter_target(out, args.overwrite)  # refused before a base is exported for nothing
    base = loadable_base(args.base or meta["base"], checkpoint, meta, out, args)
    card = adapter_card(resolve_checkpoint(checkpoint), meta, base)
    write_peft_folder(out, meta, adapters, base, args.overwrite, card)
    print(f"exported the adapters of {checkpoint} to {out}, for the base {base.removeprefix('hf:')}")
    print(f"load with: AutoPeftModelForCausalLM.from_pretrained({out!r})")


def parse_args(argv) -> argparse.Namespace:
    """Paths and flags of both directions; exits 2 with one line when the paths don't fit."""
    formatter = type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                   argparse.ArgumentDefaultsHelpFormatter), {})
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    p.add_argument("paths", nargs="+", help="export: [CHECKPOINT] OUT_DIR; with --import: HF_DIR (or "
                                            "hf:ORG/NAME, or MODEL.gguf) RUN_DIR")
    p.add_argument("--import", dest="do_import", action="store_true",
                   help="read a Hugging Face folder, Hub model or GGUF file into a run folder instead of "
                        "exporting")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="export: dtype of the saved weights")
    p.add_argument("--eos", default=EOT_TOKEN, help="export: the tokenizer's end token; generation "
                                                    "stops at it, at <|endoftext|> and at "
                                                    "<|im_end|> (chat models) either way")
    p.add_argument("--gguf", choices=GGUF_TYPES, help="export: write a GGUF file of this type (llama.cpp, "
                                                      "Ollama) instead of a Hugging Face folder")
    p.add_argument("--overwrite", action="store_true", help="export: replace an existing OUT_DIR")
    p.add_argument("--base", default="", help="export of a LoRA run: the base "
                                              "model its adapters were trained on")
    p.add_argument("--adapter_only", action="store_true",
                   help="export of a LoRA run: a PEFT folder of the adapters (adapter_config.json naming "
                        "--base, or the base the run recorded; adapter_model.safetensors)")
    p.add_argument("--tokenizer", default="", help="import: tokenizer.json when HF_DIR has none")
    p.add_argument("--max_seq_len", type=int, default=0, help="import: context length; 0: "
                                                              "max_position_embeddings")
    args = p.parse_args(argv)
    if args.adapter_only and (args.gguf or args.do_import):
        raise ConfigError("--adapter_only writes a PEFT folder of a LoRA run's "
                          "adapters; leave out --gguf and --import")
    if len(args.paths) > 2 or (args.do_import and len(args.paths) != 2):
        raise ConfigError(f"got {len(args.paths)} paths, give [CHECKPOINT] OUT_DIR to "
                          "export or --import HF_DIR RUN_DIR")
    if args.gguf and (args.do_import or args.dtype != "float32" or args.eos != EOT_TOKEN):
        raise ConfigError(f"--gguf {args.gguf} writes a GGUF file: it takes no --import, "
                          "--dtype or --eos (the type is --gguf's, and a chat tokenizer's end "
                          "token is <|im_end|>); leave them out")
    return args


@error_contract
def main(argv=None) -> int:
    """Export or import as the command line says; bad input exits 2 with one `error:` line."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.do_import:
        ckpt = import_hf(args.paths[0], args.paths[1], args.tokenizer, args.max_seq_len)
        print(f"imported {args.paths[0]} as {ckpt}")
        print(f"generate with: python text_generator.py {ckpt}")
    else:
        checkpoint, out = args.paths if len(args.paths) == 2 else (default_run_dir(), args.paths[0])
        if args.adapter_only:
            export_adapters(checkpoint, out, args)
            return 0
        ckpt = export(checkpoint, out, args.dtype, args.eos, args.overwrite, args.gguf or "", args.base)
        if args.gguf:
            file = os.path.join(out, gguf_file_name(args.gguf))
            print(f"exported {ckpt} to {file} ({args.gguf}), with a Modelfile and README.md")
            print(f"run with: llama-cli -m {file}, or: ollama create {ollama_tag(export_name(ckpt))} -f "
                  f"{os.path.join(out, 'Modelfile')}")
        else:
            print(f"exported {ckpt} to {out} ({args.dtype})")
            print(f"load with: AutoModelForCausalLM.from_pretrained({out!r}), "
                  f"AutoTokenizer.from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
