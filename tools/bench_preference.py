"""Preference tuning here beside TRL's DPOTrainer with PEFT: training tokens/s and peak resident memory on this
machine, the same model, pairs, LoRA rank and pairs per step.

    python tools/bench_preference.py                      # a Qwen2-shaped model of about 25M parameters, random
    python tools/bench_preference.py --steps 8 --rounds 2
    python tools/bench_preference.py --variants ours ours-one-window trl trl-two-pairs --rounds 1 --steps 4

Both run DPO with the NLL term (TRL's loss types sigmoid + sft, beta 0.1, weights 1 and 1), LoRA rank 16 on every
block matrix, AdamW, bf16 autocast, gradient checkpointing (TRL's default), eager, on 400 generated pairs (prompts
of about 40 tokens, replies of about 150). TRL pads each pair to its batch's longest sequence and runs its
reference (the adapters disabled) at every step; here pairs are packed whole into windows of --seq_len tokens,
the prompt once, the rejected reply branching off it (attention.py), each window cut after its last filled
position (rounded up to 64; the step is eager), each stretch attended on a row of its own (no window-wide mask),
the log-probabilities taken from the model's per-token losses at the replies' rows only (never the whole logits),
and the reference's computed once, before the first step (that pass is timed apart). Tokens/s counts the pairs' own tokens (no padding) per second of the
steps after two warm-up steps (the reference pass apart); the memory is each process's lifetime peak (ru_maxrss).
Each variant runs in a process of its own, the variants alternating over the rounds (ABBA).
"""

import argparse
import json
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from bench import alternate_processes, process_rounds_parser  # noqa: E402  (tools/, beside it)

WORDS = ("the a river stone cloud tiger lamp green paper music orange window silver "
         "garden candle quiet bright under over runs sings holds keeps finds makes small "
         "large old new warm cold early late").split()
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
RANK, PAIRS, BATCH_PAIRS = 16, 400, 8


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def setup(folder: str, pairs: int = PAIRS) -> str:
    """The pairs (JSONL) and a random Qwen2 model with a ChatML tokenizer trained on them, saved as a
    download."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llm.tokens.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": sentence(rng, 30)}],
             "chosen": [{"role": "assistant", "content": sentence(rng, rng.randint(80, 160))}],
             "rejected": [{"role": "assistant", "content": sentence(rng, rng.randint(80, 160))}]}
            for _ in range(pairs)]
    pairs = os.path.join(folder, "pairs.jsonl")
    with open(pairs, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tok = train_tokenizer((m["content"] for r in rows for k in ("prompt", "chosen") for m in r[k]),
                          "bpe", 1024)
    model_dir = os.path.join(folder, "model")
    os.makedirs(model_dir)
    save_tokenizer(tok, os.path.join(model_dir, "tokenizer.json"))
    load_tokenizer(model_dir).save_pretrained(model_dir)  # eos, pad and the chat template, for TRL
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), **SHAPE)).save_pretrained(model_dir)
    return pairs


def ours(folder: str, steps: int, seq: int, one_window: bool = False) -> dict:
    """This project's trainer: LoRA DPO on windows of packed pairs, as many windows a step as hold
    BATCH_PAIRS, in one forward, or with one_window one window a forward, accumulated over the step's windows.
    """
    import gpu_training_optimized as trainer
    from config import DataConfig
    from llm.data.batches import PairBatches
    from llm.data.preparation import prepare
    from llm.reports.monitor import read_metrics
    model_dir, run = os.path.join(folder, "model"), os.path.join(folder, f"ours-{time.time_ns()}")
    cache = run + "-cache"  # a cache of its own: each round computes the reference pass again, and times it
    data = prepare(DataConfig(sources=[os.path.join(folder, "pairs.jsonl")], cache_dir=cache,
                              tokenizer=os.path.join(model_dir, "tokenizer.json")),
                   1024, seq, log=lambda *a: None)
    plan = PairBatches(data, "train", 1, seq, 1337).plan
    tokens_per_window = plan.length[plan.pair_ids].sum() / plan.windows
    # windows holding about BATCH_PAIRS
    windows = max(1, round(BATCH_PAIRS * plan.windows / len(plan.pair_ids)))
    micro, accum = (1, windows) if one_window else (windows, 1)
    start = time.perf_counter()
    assert trainer.main(["--init_from", model_dir, "--sources", os.path.join(folder, "pairs.jsonl"),
                         "--cache_dir", cache, "--run_dir", run, "--lora_rank", str(RANK),
                         "--max_seq_len", str(seq), "--micro_batch_size", str(micro),
                         "--grad_accum_steps", str(accum), "--max_steps", str(steps + 2), "--compile", "off",
                         "--optimizer", "adamw", "--learning_rate", "1e-5", "--log_interval", "1",
                         "--eval_batches", "1", "--weight_average", "0", "--precision", "bf16",
                         "--gradient_checkpointing", "true"]) == 0
    wall = time.perf_counter() - start
    step_s = [1 / r["steps_per_s"] for r in read_metrics(run, "train")[2:]]
    return {"tokens_per_s": windows * tokens_per_window / statistics.median(step_s),
            "pairs_per_step": windows * len(plan.pair_ids) / plan.windows, "wall_s": wall,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def trl(folder: str, steps: int, seq: int, per_forward: int = BATCH_PAIRS) -> dict:
    """TRL's DPOTrainer with a PEFT LoRA config on the same model and pairs, BATCH_PAIRS pairs a step,
    per_forward of them a forward (gradient accumulation over the rest)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from config import LORA_TARGETS
    model_dir = os.path.join(folder, "model")
    rows = [json.loads(line) for line in open(os.path.join(folder, "pairs.jsonl"), encoding="utf-8")]
    times, tokens = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                tokens.append(logs["num_tokens"])

    start = time.perf_counter()
    args = DPOConfig(output_dir=os.path.join(folder, f"trl-{time.time_ns()}"),
                     per_device_train_batch_size=per_forward,
                     gradient_accumulation_steps=BATCH_PAIRS // per_forward, max_steps=steps + 2,
                     logging_steps=1, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0],
                     report_to="none", use_cpu=True, save_strategy="no", max_length=None, bf16=True,
                     learning_rate=1e-5, dataloader_num_workers=0, gradient_checkpointing=True)
    run = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"), args=args,
                     train_dataset=Dataset.from_list(rows),
                     processing_class=AutoTokenizer.from_pretrained(model_dir),
                     peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LORA_TARGETS),
                                            task_type="CAUSAL_LM"), callbacks=[Clock()])
    run.train()
    step_s = [b - a for a, b in zip(times[1:], times[2:])]  # the steps after two warm-up steps
    per_step = [b - a for a, b in zip(tokens[1:], tokens[2:])]
    return {"tokens_per_s": statistics.median(n / s for n, s in zip(per_step, step_s)),
            "pairs_per_step": BATCH_PAIRS, "wall_s": time.perf_counter() - start,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def reference_s(stdout: str) -> dict:
    """The seconds our reference pass took, as its start line says (None for TRL's, which runs each step)."""
    ready = re.search(r"log-probabilities \(.*?\) ready in ([0-9.]+)s", stdout)
    return {"reference_s": float(ready.group(1)) if ready else None}


# Each side as it runs the step's 8 pairs by default (one forward), and each one a smaller forward at a time.
VARIANTS = {"ours": ours, "trl": trl, "ours-one-window": partial(ours, one_window=True),
            "trl-two-pairs": partial(trl, per_forward=2)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = process_rounds_parser(__doc__, list(VARIANTS), steps=8)
    p.add_argument("--seq_len", type=int, default=1024, help="our windows' length (a "
                                                             "pair is about 380 tokens)")
    p.add_argument("--pairs", type=int, default=PAIRS, help="pairs generated (the reference "
                                                            "pass reads them all)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(VARIANTS[args.child](args.folder, args.steps, args.seq_len)))
        return 0
    folder = tempfile.mkdtemp(prefix="bench_preference_")
    setup(folder, args.pairs)
    flags = ["--steps", str(args.steps), "--seq_len", str(args.seq_len), "--folder", folder]
    here = os.path.abspath(__file__)
    results = alternate_processes(here, args.variants, args.rounds, flags, read=reference_s)
    if results is None:
        return 1
    print("| variant | pairs a step | tokens/s (median, range) | process peak GiB (median, "
          "range) | reference pass s | load |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        speed, peak = [row["tokens_per_s"] for row in rows], [row["peak_gib"] for row in rows]
        print(f"| {name} | {rows[0]['pairs_per_step']:.1f} | {statistics.median(speed):,.0f} "
              f"({min(speed):,.0f}-{max(speed):,.0f}) | {statistics.median(peak):.2f} "
              f"({min(peak):.2f}-{max(peak):.2f}) | "
              f"{statistics.median(r['reference_s'] for r in rows) if rows[0]['reference_s'] else 'each step'} | "
              f"{min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
