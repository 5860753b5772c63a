"""Training throughput of our model against Hugging Face's Qwen3ForCausalLM of the same shape, in one run.

    python tools/bench.py --preset tiny --compile off            # CPU
    python tools/bench.py --preset large --bench_steps 20        # GPU: bf16, compiled like the trainer
Both models run the trainer's own step (gpu_training_optimized.build and train_step: the same optimizer,
precision, compile mode, accumulation and device-side skip) on the same random tokens in the same process,
in alternating short rounds (ours, theirs, theirs, ours, ...), so a load that comes or goes on a shared machine
falls on both; the report gives the median tokens/s, MFU and peak memory of each, and the median of the
rounds' ratios with its range. MFU is against the GPU's datasheet peak, or on a CPU against a large matmul in the
step's dtype timed in the same run. `--optimizer_share` then times our model's optimizer step inside that step,
the device drained around it, and reports its share.
Every training setting of config.py applies (--micro_batch_size, --max_seq_len, --precision, ...).
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import torch

from config import DataConfig
from gpu_training_optimized import train_step
from llm.base import distributed
from llm.base.cli import parse_config
from llm.base.device import PRECISION_NAMES, machine, pick_device, pick_precision, synchronize
from llm.base.errors import error_contract
from llm.base.sizing import flops_per_token
from llm.data.preparation import prepare
from llm.formats.hf_format import hf_twin
from llm.reports.monitor import device_report, peak_flops
from llm.train.autofill import fill_automatic
from llm.train.plan import step_settings
from llm.train.runner import build
from llm.train.runner import new_model


class FixedBatches:
    """One batch of random tokens, served for every (step, micro-step): speed does not depend on the data.
    packed: each row holds PACKED_EXAMPLES examples, as windows of packed chats do."""
    PACKED_EXAMPLES = 3

    def __init__(self, cfg, device: torch.device, packed: bool = False):
        gen = torch.Generator().manual_seed(0)
        B, T = cfg.train.micro_batch_size, cfg.model.max_seq_len
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen).to(device)
        self.x, self.y, self.device = ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), device
        self.pos = ((torch.arange(T) % -(-T // self.PACKED_EXAMPLES)).expand(B, T).to(device)
                    if packed else None)

    def get(self, step: int, micro_step: int):
        return self.x, self.y, self.pos


class TwinForTraining(torch.nn.Module):
    """A transformers causal LM behind our forward contract: (input_ids, labels) -> (logits, loss), with
    labels already shifted (transformers' own loss function, told not to shift them again)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, labels=None, positions=None):
        assert positions is None, "the benchmark's twin reads unpacked rows"
        shifted = None if labels is None else labels.contiguous()  # transformers flattens it with view()
        out = self.hf(input_ids=input_ids, labels=shifted, shift_labels=shifted, use_cache=False)
        return out.logits, out.loss


def timed_optimizer(b, device) -> list[float]:
    """Make b.opt.step drain the device before and after and record its seconds; returns the list it fills."""
    spent, step = [], b.opt.step

    def timed(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        out = step(*args, **kwargs)
        synchronize(device)
        spent.append(time.perf_counter() - start)
        return out
    b.opt.step = timed
    return spent


class Contender:
    """One model's trainer step, built and warmed up (compiled), timed in rounds that resume its step count.
    """

    def __init__(self, name: str, cfg, device, raw_model, warmup: int, share: bool = False):
        allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        started = time.perf_counter()
        self.name, self.cfg, self.device, self.ranks = name, cfg, device, distributed.setup()
        self.b = build(cfg, step_settings(cfg, device), device, self.ranks, raw_model=raw_model)
        self.batches = FixedBatches(cfg, device)
        self.optimizer_s = timed_optimizer(self.b, device) if share else []
        for step in range(warmup):
            train_step(self.b, self.batches, step, cfg.train, self.ranks)
        synchronize(device)
        self.warmup_s = time.perf_counter() - started  # build and the warmup steps: a compiled step's compile
        self.step = warmup
        self.resident = torch.cuda.memory_allocated() - allocated if device.type == "cuda" else 0
        self.seconds, self.peaks = [], []

    def round(self, steps: int) -> float:
        """Time `steps` steps; returns tokens/s."""
        if self.device.type == "cuda":
            at_rest = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.optimizer_s.clear()
        start = time.perf_counter()
        for _ in range(steps):
            loss, _, _ = train_step(self.b, self.batches, self.step, self.cfg.train, self.ranks)
            self.step += 1
        loss.item()  # sync point: wait for the queued steps before stopping the clock
        self.seconds.append(time.perf_counter() - start)
        # its own resident state plus what its step adds over everything resting
        if self.device.type == "cuda":
            self.peaks.append(self.resident + torch.cuda.max_memory_allocated() - at_rest)
        t = self.cfg.train
        return steps * t.grad_accum_steps * t.micro_batch_size * self.cfg.model.max_seq_len / self.seconds[-1]


def alternate(contenders: list, rounds: int, steps: int) -> list[list[float]]:
    """Each contender's tokens/s per round, the order reversed every round (ABBA...) so neither always goes
    first after the other."""
    rates = [[] for _ in contenders]
    for r in range(rounds):
        order = list(enumerate(contenders))
        for i, c in order if r % 2 == 0 else order[::-1]:
            rates[i].append(c.round(steps))
    return rates


def process_rounds_parser(doc: str, variants: list[str], steps: int) -> argparse.ArgumentParser:
    """The command line alternate_processes' benchmarks share: the rounds, the timed steps, the variants, and
    the flags a child run is given (its variant and the folder of the data and model both sides read)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="timed steps of each run, after two warm-ups")
    p.add_argument("--variants", nargs="+", choices=variants, default=["ours", "trl"],
                   help="what to run, alternating (ABBA) over the rounds")
    p.add_argument("--child", choices=variants, help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    return p


def alternate_processes(script: str, variants: list[str], rounds: int, flags: list[str],
                        env: dict | None = None, read=None) -> dict[str, list[dict]] | None:
    """Each variant run as a process of its own (`script --child NAME FLAGS`), in ABBA order over the rounds,
    so a load that comes or goes falls on both: {name: the JSON of each run's last stdout line, with the
    machine's 1-minute load as it ended and what read(stdout) adds}. None, with the failing run's output on
    stderr, where one fails."""
    results = {name: [] for name in variants}
    for r in range(rounds):
        for name in variants if r % 2 == 0 else list(reversed(variants)):
            done = subprocess.run([sys.executable, script, "--child", name, *flags], capture_output=True,
                                  text=True, env={**os.environ, **(env or {})})
            if done.returncode:
                print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
                return None
            row = {**json.loads(done.stdout.strip().splitlines()[-1]), **(read(done.stdout) if read else {})}
            results[name].append({**row, "load": os.getloadavg()[0]})
            print(f"round {r}: {name} {results[name][-1]}", flush=True)
    return results


def result(c: Contender, rates: list[float]) -> dict:
    return {"model": c.name, "tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
            "peak_gib": max(c.peaks) / 2**30 if c.peaks else None, "warmup_s": c.warmup_s}


def measure(name: str, cfg, device, raw_model, steps: int, warmup: int, share: bool = False) -> dict:
    """One model alone (the GPU check, on a device of its own): tokens/s and peak memory; with share, also the
    optimizer step's seconds, timed with the device drained around it, and its fraction of the step."""
    c = Contender(name, cfg, device, raw_model, warmup, share=share)
    out = result(c, [c.round(steps)])
    if share:
        step_s, opt_s = c.seconds[-1] / steps, sum(c.optimizer_s) / steps
        out.update(optimizer_s=opt_s, forward_backward_s=step_s - opt_s, share=opt_s / step_s)
    return out


def beside_preparation(cfg, device, raw_model, steps: int, warmup: int, rounds: int, corpus: list) -> dict:
    """tokens/s of the trainer's step alone and beside a thread preparing a token cache (reading and
    tokenizing, as arrival.py's thread does while a Hub corpus comes in): whether that thread's Python slows
    the step. Rounds alternate, the two kinds side by side."""
    c = Contender("ours", cfg, device, raw_model, warmup)
    m, alone, beside, prepared = cfg.model, [], [], []
    with tempfile.TemporaryDirectory() as work:  # the tokenizer first, as a run has it before training starts
        first = prepare(DataConfig(sources=corpus, cache_dir=os.path.join(work, "first")), m.vocab_size,
                        m.max_seq_len, log=lambda *a: None)
        data = DataConfig(sources=corpus, tokenizer=first.tokenizer_path)
        for _ in range(rounds):
            alone.append(c.round(steps))
            with preparing(data, m.vocab_size, m.max_seq_len, prepared):
                beside.append(c.round(steps))
    return {"model": c.name, "alone_tokens_per_s": alone, "beside_tokens_per_s": beside,
            "ratio": statistics.median(beside) / statistics.median(alone), "preparations": len(prepared)}


@contextlib.contextmanager
def preparing(data: DataConfig, vocab_size: int, seq_len: int, done: list):
    """A thread preparing a fresh token cache of `data` over and over until the block ends; each finished one
    appended to done."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            with tempfile.TemporaryDirectory() as cache:
                prepare(replace(data, cache_dir=cache), vocab_size, seq_len, log=lambda *a: None)
            done.append(1)

    thread = threading.Thread(target=loop, daemon=True, name="bench-prepare")
    thread.start()
    time.sleep(1.0)  # under way: reading and tokenizing
    try:
        yield
    finally:
        stop.set()
        thread.join()


def matmul_peak(device, dtype) -> float:
    """FLOP/s of a large square matmul in dtype, the best of a few: MFU's yardstick where no datasheet figure
    is known (a CPU), measured in the same run as the steps it judges."""
    n = 2048
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = []
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return 2 * n**3 / min(seconds[1:])  # the first call warms up


def release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv=None):
    """(Config, the benchmark's own arguments) from the command line; the documentation's commands are checked
    against it."""
    def extra(parser):
        parser.add_argument("--bench_steps", type=int, default=4,
                            help="timed optimizer steps per model and round")
        parser.add_argument("--rounds", type=int, default=5, help="rounds, the models alternating")
        parser.add_argument("--warmup_steps_bench", type=int, default=3, help="untimed steps first (compile)")
        parser.add_argument("--skip_hf", action="store_true", help="time our model only")
        parser.add_argument("--optimizer_share", action="store_true",
                            help="also time the trainer's optimizer step against forward + backward")
        parser.add_argument("--json", default="", help="also write the results to this file")
    return parse_config(argv, extra=extra)


@error_contract
def main(argv=None):
    cfg, args = parse_args(argv)
    device = pick_device(cfg.train.device)
    cfg, notes = fill_automatic(cfg, machine(device), corpus_bytes=None)  # config.py's automatic fields
    for note in notes:
        print(note)
    ours = new_model(cfg, device)
    flops, params = flops_per_token(cfg.model), ours.num_parameters()
    amp_dtype = pick_precision(cfg.train.precision, device)
    precision = PRECISION_NAMES[amp_dtype]
    peak = peak_flops(device)
    if peak is None:
        dtype = amp_dtype or torch.float32
        peak = matmul_peak(device, dtype)
        print(f"peak: {peak / 1e9:,.0f} GFLOP/s, a 2048 x 2048 {str(dtype).removeprefix('torch.')} matmul "
              "measured now (MFU's yardstick)")
    print(f"device: {device_report(device)} | precision: {precision} | compile: "
          f"{cfg.train.compile} | batch {cfg.train.micro_batch_size} x {cfg.model.max_seq_len} x "
          f"{cfg.train.grad_accum_steps} | {params / 1e6:.1f}M parameters | optimizer {cfg.train.optimizer}")
    steps, warmup = args.bench_steps, args.warmup_steps_bench
    contenders = [Contender("ours", cfg, device, ours, warmup)]
    if not args.skip_hf:
        twin = TwinForTraining(hf_twin(cfg.model))
        contenders.append(Contender("hf_qwen3" if cfg.model.qk_norm else "hf_llama",
                                    cfg, device, twin, warmup))
    rates = alternate(contenders, args.rounds, steps)
    results = [result(c, r) for c, r in zip(contenders, rates)]
    del ours, contenders
    release(device)
    for r in results:
        # same shape: our FLOP count serves both
        r["mfu"] = r["tokens_per_s"] * flops / peak if peak else None
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "n/a"
        print(f"{r['model']:<10} {r['tokens_per_s']:>12,.0f} tokens/s (median of {args.rounds} rounds)   MFU "
              f"{mfu:>6}   peak memory {mem}")
    ratio = None
    if len(rates) == 2:
        ratios = sorted(a / b for a, b in zip(*rates))
        ratio = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1], "rounds": ratios}
        print(f"ratio ours / hf: {ratio['median']:.2f}x (median of {len(ratios)} rounds, range "
              f"{ratio['min']:.2f}x-{ratio['max']:.2f}x)")
    share = None
    if args.optimizer_share:
        share = measure("ours", cfg, device, None, steps, warmup, share=True)
        print(f"optimizer step ({cfg.train.optimizer}): {1e3 * share['optimizer_s']:.1f} ms, forward + "
              f"backward {1e3 * share['forward_backward_s']:.1f} ms per step: "
              f"{100 * share['share']:.1f}% of the step")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": cfg.to_dict(), "device": device_report(device), "results": results,
                       "ratio": ratio, "optimizer_share": share}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
