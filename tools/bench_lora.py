"""LoRA against full fine-tuning: training tokens/s and peak memory (the live tensors of a step, by torch's
profiler, and the resident size), measured on this machine, and sizing.py's memory estimate for a larger model on
a GPU.

    python tools/bench_lora.py                 # a Qwen2.5-shaped model of about 100M parameters, random weights
    python tools/bench_lora.py --estimate      # sizing.py's estimate for Qwen2.5-1.5B's shape (no measurement)

Each variant runs in a process of its own (its peak resident memory is its own), through the trainer's build()
and train_step() on a fixed batch, eager; variants alternate over the rounds, and the table gives each one's
median and range. Full fine-tuning trains every weight with Muon + AdamW; LoRA (rank 16, every block matrix)
trains adapters on a base held in bf16, in int8 or in nf4 (torchao). --variants picks some of them.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

VARIANTS = {"full": {}, "lora-bf16": {"lora_rank": 16, "lora_base": "bf16"},
            "lora-int8": {"lora_rank": 16, "lora_base": "int8"},
            "lora-nf4": {"lora_rank": 16, "lora_base": "nf4"}}


def qwen25_config(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int,
                  seq: int, micro: int):
    from config import Config, ModelConfig, TrainConfig
    model = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                        max_seq_len=seq, qk_norm=False, qkv_bias=True, tie_word_embeddings=True)
    return Config(model=model, train=TrainConfig(micro_batch_size=micro, grad_accum_steps=1, compile="off",
                                                 precision="bf16", learning_rate=1e-4, muon_lr=0.01))


SMALL = dict(hidden=768, layers=12, heads=12, kv=2, inter=2048, vocab=32000, seq=256, micro=4)  # about 100M
# Qwen2.5-1.5B
LARGE = dict(hidden=1536, layers=28, heads=12, kv=2, inter=8960, vocab=151936, seq=2048, micro=4)


def measure(variant: str, steps: int) -> dict:
    """In this process: build the variant, train `steps` steps after two warm-up steps, time them."""
    import bench
    import torch

    from gpu_training_optimized import train_step
    from llm.base import distributed
    from llm.train.plan import step_settings
    from llm.train.runner import build
    cfg = qwen25_config(**SMALL)
    cfg.train = replace(cfg.train, **VARIANTS[variant])
    ranks, device = distributed.setup(), torch.device("cpu")
    b = build(cfg, step_settings(cfg, device), device, ranks)
    batches = bench.FixedBatches(cfg, device)
    for step in range(2):
        train_step(b, batches, step, cfg.train, ranks)
    sampler = RssPeak()
    start = time.perf_counter()
    for step in range(2, 2 + steps):
        loss, _, _ = train_step(b, batches, step, cfg.train, ranks)
    seconds = time.perf_counter() - start
    trained = sum(p.numel() for p in b.raw_model.parameters() if p.requires_grad)
    resident = sampler.stop()
    return {"tokens_per_s": steps * cfg.train.micro_batch_size * cfg.model.max_seq_len / seconds,
            "training_gib": resident / 2**30, "process_peak_gib": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 2**20, "trained": trained,
            "live_peak_gib": live_peak(lambda: train_step(b, batches, 2 + steps, cfg.train, ranks)) / 2**30,
            "parameters": b.raw_model.num_parameters(), "loss": loss.item()}


def live_peak(step) -> int:
    """The most bytes of live tensors during one call of step, as torch's profiler records each allocation and
    free on the CPU: the step's own memory, where the resident size also keeps what start-up freed (the fp32
    model a base was made from, a quantiser's temporaries), since the trainer keeps freed memory in the
    process."""
    import torch
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(row) for row in sizes)


class RssPeak:
    """The largest resident size of this process while training, sampled every 5 ms on a thread of its own
    (the process's lifetime peak also holds the full-precision model the base was built from)."""

    def __init__(self):
        import psutil
        self.process, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def estimate():
    """sizing.py's training-memory estimate for each variant at Qwen2.5-1.5B's shape."""
    from llm.base.sizing import training_bytes_estimate
    print("| variant (Qwen2.5-1.5B shape, 4 x 2048 tokens, gradient checkpointing) "
          "| estimated GiB | fits 24 GiB |")
    print("| --- | --- | --- |")
    for name, fields in VARIANTS.items():
        cfg = qwen25_config(**LARGE)
        cfg.model = replace(cfg.model, gradient_checkpointing=True)
        cfg.train = replace(cfg.train, **fields)
        gib = training_bytes_estimate(cfg) / 2**30
        print(f"| {name} | {gib:.1f} | {'yes' if gib < 24 * 0.9 else 'no'} |")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--estimate", action="store_true")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.steps)))
        return 0
    if args.estimate:
        estimate()
        return 0
    results = {name: [] for name in args.variants}
    for r in range(args.rounds):
        for name in (args.variants if r % 2 == 0 else args.variants[::-1]):  # ABBA: drift hits both orders
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--steps",
                                   str(args.steps)], capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {name} {results[name][-1]}", flush=True)
    print("| variant | trained parameters | tokens/s (median, range) | live tensors at the step's peak GiB "
          "(range) | resident while training GiB (range) | process peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        speed, live, rss = ([row[k] for row in rows]
                            for k in ("tokens_per_s", "live_peak_gib", "training_gib"))
        print(f"| {name} | {rows[0]['trained'] / 1e6:.1f}M of {rows[0]['parameters'] / 1e6:.0f}M | "
              f"{statistics.median(speed):,.0f} ({min(speed):,.0f}-{max(speed):,.0f}) | "
              f"{statistics.median(live):.3f} ({min(live):.3f}-{max(live):.3f}) | "
              f"{statistics.median(rss):.2f} ({min(rss):.2f}-{max(rss):.2f}) | "
              f"{statistics.median(row['process_peak_gib'] for row in rows):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
