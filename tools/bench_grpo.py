"""GRPO here beside TRL's GRPOTrainer (its default generation: transformers' generate, no vLLM) with PEFT:
replies trained per second and peak resident memory on this machine, the same model, prompts, replies per
prompt, reply length, LoRA rank and prompts per step.

    python tools/bench_grpo.py                         # a Qwen2-shaped model of about 6M parameters, random
    python tools/bench_grpo.py --steps 4 --rounds 2 --max_new_tokens 64

Both sample num_generations replies to each of the step's prompts at temperature 1 from the model being
trained (LoRA rank 16 on every block matrix, AdamW, bf16 autocast, eager), score them with the gsm8k reward
(llm/scores/rewards.py, passed to TRL as it is), and train one on-policy step (dapo loss, beta 0). A reply
ends at the same two ids on both sides (<|im_end|>, <|endoftext|>); a random model draws one of them now and
then, so the replies run a little short of max_new_tokens, and as long on both sides (the table's reply
tokens). Replies/s counts the step's replies over the median seconds of the steps after two warm-up steps; the
memory is each process's lifetime peak (ru_maxrss), or on a GPU the peak its tensors held there (both sides
run on CUDA where it is: TRL without use_cpu); ours runs without matplotlib, as the README installs it, so it
draws no loss plot, as TRL's side draws none. Each variant runs in a process of its own, on one thread,
the variants alternating over the rounds (ABBA). Where each side's step time goes: ours logs its sampling and
rewarding seconds; TRL's are timed around its model's generate and the reward function. The rest of a step is
training.
"""

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from bench import alternate_processes, process_rounds_parser  # noqa: E402  (tools/, beside it)

SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
RANK, PROMPTS, PER_STEP, GROUP = 16, 200, 4, 8


def setup(folder: str) -> str:
    """Arithmetic prompts with their answers (JSONL) and a random Qwen2 model with a ChatML tokenizer, saved
    as a download."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llm.tokens.tokenizer import load_tokenizer, save_tokenizer, stop_ids, train_tokenizer
    rng = random.Random(0)
    rows = []
    for _ in range(PROMPTS):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"Tom has {a} apples and buys "
                                                            f"{b} more. How many now?"}],
                     "answer": str(a + b)})
    prompts = os.path.join(folder, "prompts.jsonl")
    with open(prompts, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tok = train_tokenizer((r["prompt"][0]["content"] + " " + r["answer"] for r in rows), "bpe", 512)
    model_dir = os.path.join(folder, "model")
    os.makedirs(model_dir)
    save_tokenizer(tok, os.path.join(model_dir, "tokenizer.json"))
    load_tokenizer(model_dir).save_pretrained(model_dir)  # eos, pad and the chat template, for TRL
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), **SHAPE))
    # A reply ends at the same ids on both sides, as a chat model's generation config lists them: TRL reads
    # them there, ours from the tokenizer (without it TRL's replies ran 12% longer).
    model.generation_config.eos_token_id = stop_ids(load_tokenizer(model_dir))
    model.save_pretrained(model_dir)
    return prompts


def ours(folder: str, steps: int, new_tokens: int, compile_mode: str = "off") -> dict:
    """This project's trainer: --objective grpo with LoRA, PER_STEP prompts x GROUP replies a step, eager or
    (compile_mode) with the step and the decode step compiled."""
    # As the README installs it: matplotlib is an extra, so no loss plot is drawn (the test requirements bring
    # it here, and its plot at the run's end added 17 MB to the compiled run's peak; TRL's side draws none).
    sys.modules["matplotlib"] = None
    import gpu_training_optimized as trainer
    from llm.reports.monitor import read_metrics
    run = os.path.join(folder, f"ours-{time.time_ns()}")
    start = time.perf_counter()
    assert trainer.main(["--init_from", os.path.join(folder, "model"), "--objective", "grpo", "--sources",
                         os.path.join(folder, "prompts.jsonl"), "--reward", "gsm8k", "--run_dir", run,
                         "--lora_rank", str(RANK), "--max_seq_len", "512", "--num_generations", str(GROUP),
                         "--prompts_per_step", str(PER_STEP), "--max_completion_length", str(new_tokens),
                         "--max_steps", str(steps + 2), "--compile", compile_mode, "--optimizer", "adamw",
                         "--learning_rate", "1e-5", "--log_interval", "1", "--eval_batches", "1",
                         "--weight_average", "0", "--precision", "bf16"]) == 0
    logged = read_metrics(run, "train")[2:]
    step_s = statistics.median(1 / r["steps_per_s"] for r in logged)
    generate_s = statistics.median(r["generate_s"] for r in logged)
    reward_s = statistics.median(r["reward_s"] for r in logged)
    return {"replies_per_s": PER_STEP * GROUP / step_s, "step_s": step_s, "generate_s": generate_s,
            "reward_s": reward_s, "train_s": step_s - generate_s - reward_s,
            "reply_len": statistics.mean(r["completion_len"] for r in logged),
            "wall_s": time.perf_counter() - start, **peak()}


def peak() -> dict:
    """This process's peak memory in GiB, and of what: the GPU's tensors where CUDA ran the variant, else the
    process's resident memory (ru_maxrss)."""
    import torch
    if torch.cuda.is_available():
        return {"peak_gib": torch.cuda.max_memory_allocated() / 2**30, "peak_of": "GPU"}
    return {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_of": "process"}


def trl(folder: str, steps: int, new_tokens: int) -> dict:
    """TRL's GRPOTrainer with a PEFT LoRA config on the same model, prompts and reward, PER_STEP x GROUP
    replies a step in one generation batch and one forward."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from config import LORA_TARGETS
    from llm.scores.rewards import gsm8k
    model_dir = os.path.join(folder, "model")
    rows = [json.loads(line) for line in open(os.path.join(folder, "prompts.jsonl"), encoding="utf-8")]
    spent = {"generate_s": 0.0, "reward_s": 0.0}  # running totals, read at each step's end
    times, totals = [], []

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        wrapper.__name__ = fn.__name__  # TRL names a reward's metrics after its function
        return wrapper

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())
            totals.append(dict(spent))

    start = time.perf_counter()
    args = GRPOConfig(output_dir=os.path.join(folder, f"trl-{time.time_ns()}"),
                      per_device_train_batch_size=PER_STEP * GROUP, num_generations=GROUP,
                      max_completion_length=new_tokens, max_steps=steps + 2, logging_steps=1, beta=0.0,
                      loss_type="dapo", scale_rewards="none", temperature=1.0, report_to="none",
                      use_cpu=not torch.cuda.is_available(),
                      save_strategy="no", bf16=True, learning_rate=1e-5, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    model.generate = timed(model.generate, "generate_s")  # PEFT's and TRL's wrappers end in this call
    run = GRPOTrainer(model=model, reward_funcs=[timed(gsm8k, "reward_s")],
                      args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(model_dir),
                      peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LORA_TARGETS),
                                             task_type="CAUSAL_LM"), callbacks=[Clock()])
    run.train()
    # the steps after two warm-up steps
    step_s = statistics.median(b - a for a, b in zip(times[1:], times[2:]))
    split = {k: statistics.median(b[k] - a[k] for a, b in zip(totals[1:], totals[2:])) for k in spent}
    lengths = [r["completions/mean_length"] for r in run.state.log_history if "completions/mean_length" in r]
    return {"replies_per_s": PER_STEP * GROUP / step_s, "step_s": step_s, **split,
            "train_s": step_s - split["generate_s"] - split["reward_s"],
            "reply_len": statistics.mean(lengths[2:]), "wall_s": time.perf_counter() - start, **peak()}


def ours_compiled(folder: str, steps: int, new_tokens: int) -> dict:
    """ours with --compile default: Inductor compiles the training step and, for the rollouts, the decode step
    (on a CPU; on CUDA `auto` already replays the decode step as a CUDA graph)."""
    return ours(folder, steps, new_tokens, "default")


def ours_auto(folder: str, steps: int, new_tokens: int) -> dict:
    """ours as a run left at --compile auto runs: on CUDA the training step compiled and the decode step a
    CUDA graph; elsewhere both eager (autofill.eager_reason), as the ours row."""
    return ours(folder, steps, new_tokens, "auto")


VARIANTS = {"ours": ours, "trl": trl, "ours-compiled": ours_compiled, "ours-auto": ours_auto}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = process_rounds_parser(__doc__, list(VARIANTS), steps=4)
    p.add_argument("--max_new_tokens", type=int, default=64, help="the longest reply (both sides)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        import torch
        torch.set_num_threads(1)  # one thread each: the other core stays quiet for the one being timed
        print(json.dumps(VARIANTS[args.child](args.folder, args.steps, args.max_new_tokens)))
        return 0
    folder = tempfile.mkdtemp(prefix="bench_grpo_")
    setup(folder)
    flags = ["--steps", str(args.steps), "--max_new_tokens", str(args.max_new_tokens), "--folder", folder]
    results = alternate_processes(os.path.abspath(__file__), args.variants, args.rounds, flags,
                                  env={"OMP_NUM_THREADS": "1"})
    if results is None:
        return 1
    peak_of = next(iter(results.values()))[0].get("peak_of", "process")
    print("| variant | replies a step | reply tokens | replies/s (median, range) | step s: sampling, "
          f"rewards, training | {peak_of} peak GiB (median, range) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        speed, peak = [row["replies_per_s"] for row in rows], [row["peak_gib"] for row in rows]
        split = ", ".join(f"{statistics.median(row[k] for row in rows):.2f}"
                          for k in ("generate_s", "reward_s", "train_s"))
        print(f"| {name} | {PER_STEP * GROUP} | {statistics.mean(r['reply_len'] for r in rows):.1f} | "
              f"{statistics.median(speed):.2f} ({min(speed):.2f}-{max(speed):.2f}) | {split} | "
              f"{statistics.median(peak):.2f} ({min(peak):.2f}-{max(peak):.2f}) | "
              f"{min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
