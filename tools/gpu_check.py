"""Every GPU figure of README from one command, in parts that each finish within about 8 minutes; and, with no
GPU at all, the compile check (--compile_only).

    python tools/gpu_check.py --out gpu_results                    # every part, one after the other
    python tools/gpu_check.py --part throughput --out gpu_results  # one part; the report is rebuilt after each
    python tools/gpu_check.py --dry_run --out /tmp/dry             # CPU: every configuration on the tiny shape
    python tools/gpu_check.py --compile_only                       # no GPU: the GPU path compiled on fake tensors
Parts: throughput (ours and Hugging Face's Qwen3 of the same shape, small/medium/large, bf16, compile default,
on the trainer's own train_step; MFU, peak memory against the estimate, the optimizer's share), autotune
(the same with max-autotune), graphs (CUDA-graph modes at accumulation 1 and 4 against compile default),
startup (launch to the first step; DDP on one GPU against plain python), curves (300 steps of large,
compiled against eager, and FP8 against bf16). Each part writes OUT/<part>.json; the report,
docs/gpu_report.md, is written from all of them.
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
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import bench
import compile_check
import torch

from config import PRESETS, Config
from gpu_training_optimized import build, train_step
from llm.startup import new_model
from llm.device import machine, pick_device
from llm.distributed import setup
from llm.errors import ConfigError, error_contract
from llm.hf_format import hf_twin
from llm.monitor import device_report, peak_flops, read_metrics
from llm.sizing import fill_automatic, training_bytes_estimate

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
PRESET_NAMES = ("small", "medium", "large")
PARTS = ("throughput", "autotune", "graphs", "startup", "curves")
STEPS, WARMUP = 10, 3  # timed and untimed (compiling) steps per throughput figure
CURVE_STEPS = 300
BF16_NOISE = 0.02  # the largest relative loss difference two bf16 runs of the same steps may show


def preset(name: str, dry: bool, **train) -> Config:
    """A preset with its automatic fields filled; the dry run keeps the tiny shape and compiles nothing."""
    cfg = PRESETS["tiny" if dry else name]()
    cfg.train = replace(cfg.train, **({**train, "compile": "off"} if dry else train))
    return fill_automatic(cfg, machine(pick_device("auto")), corpus_bytes=None)[0]


def throughput(args, compile_mode: str) -> dict:
    """Ours and the transformers twin on the trainer's step; MFU, memory against the estimate, optimizer share."""
    device, rows = pick_device("auto"), []
    steps, warmup = (1, 0) if args.dry_run else (STEPS, WARMUP)
    for name in PRESET_NAMES:
        cfg = preset(name, args.dry_run, compile=compile_mode, precision="bf16" if device.type == "cuda" else "auto")
        ours = new_model(cfg, device)
        flops, peak = ours.flops_per_token(), peak_flops(device)
        runs = [bench.measure("ours", cfg, device, ours, steps, warmup, share=True)]
        del ours
        bench.release(device)
        twin = bench.TwinForTraining(hf_twin(cfg.model))
        runs.append(bench.measure("hf", cfg, device, twin, steps, warmup))
        del twin
        bench.release(device)
        for r in runs:
            rows.append({"preset": name, "compile": cfg.train.compile, **r,
                         "mfu": r["tokens_per_s"] * flops / peak if peak else None,
                         "estimate_gib": training_bytes_estimate(cfg) / 2**30})
        print(f"{name}: ours {runs[0]['tokens_per_s']:,.0f} tokens/s, hf {runs[1]['tokens_per_s']:,.0f} tokens/s, "
              f"optimizer {100 * runs[0]['share']:.1f}% of the step", flush=True)
    return {"rows": rows}


def losses(cfg: Config, device, steps: int) -> list[float]:
    """The losses of `steps` trainer steps on fixed random tokens, from the same initial weights."""
    b = build(cfg, device, setup())
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
        reference = losses(preset("small", args.dry_run, compile="default", grad_accum_steps=accum), device, steps)
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
    print(f"launch to first step {first:.1f} s; DDP on one GPU {overhead_words(result['ddp_overhead'])}", flush=True)
    return result


def overhead_words(overhead: float | None) -> str:
    """A share of time lost, in words: "2.0% slower than plain", "85.0% faster than plain" (a negative loss)."""
    if overhead is None:
        return "not measured (no tokens/s logged)"
    return f"{100 * abs(overhead):.1f}% {'slower' if overhead >= 0 else 'faster'} than plain"


def curves(args) -> dict:
    """300 steps of large compiled against eager (compile must change nothing it should not), FP8 against bf16."""
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
        print(f"{a} against {b}: largest relative loss difference {max(diffs):.3f} over the second half", flush=True)
    if not fp8:
        out["fp8"] = "skipped: needs a GPU of compute capability 8.9 or newer (H100, L4, RTX 40xx)"
    return out


def write_report(out: str, path: str):
    """docs/gpu_report.md from every part's JSON found in out."""
    found = {p: json.load(open(os.path.join(out, f"{p}.json"))) for p in PARTS
             if os.path.isfile(os.path.join(out, f"{p}.json"))}
    meta = next(iter(found.values()), {}).get("meta", {})
    lines = ["# GPU report", "", f"Written by `python tools/gpu_check.py` on {meta.get('device', 'n/a')}, torch "
             f"{meta.get('torch', 'n/a')}, {meta.get('date', '')}.", ""]
    for part in ("throughput", "autotune"):
        if part in found:
            lines += [f"## Training throughput, {part}", "", "| preset | model | tokens/s | MFU | peak GiB | "
                      "estimate GiB | optimizer share |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in found[part]["rows"]:
                mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
                share = f"{100 * r['share']:.1f}%" if "share" in r else ""
                peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
                lines.append(f"| {r['preset']} | {r['model']} | {r['tokens_per_s']:,.0f} | {mfu} | {peak} | "
                             f"{r['estimate_gib']:.1f} | {share} |")
            lines.append("")
    if "graphs" in found:
        lines += ["## CUDA-graph modes against compile default", "", "| mode | accumulation | largest relative "
                  "loss difference | within bf16 noise |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['mode']} | {r['grad_accum_steps']} | {r['max_relative_difference']:.2e} | "
                  f"{r['within_noise']} |" for r in found["graphs"]["rows"]] + [""]
    if "startup" in found:
        s = found["startup"]
        lines += ["## Start-up and DDP", "", f"- launch to first step (`large`, data prepared): "
                  f"{s['launch_to_first_step_s']:.1f} s", f"- DDP on one GPU: "
                  f"{overhead_words(s['ddp_overhead'])} python ({s['tokens_per_s']['ddp']:,.0f} against "
                  f"{s['tokens_per_s']['plain']:,.0f} tokens/s)", ""]
    if "curves" in found:
        c = found["curves"]
        lines += ["## Loss curves", ""]
        lines += [f"- {k.replace('_vs_', ' against ')}: largest relative loss difference "
                  f"{v['max_relative_difference']:.3f} over the second half, final {v['final'][0]:.3f} against "
                  f"{v['final'][1]:.3f}" for k, v in c.items() if "_vs_" in k]
        lines += [f"- fp8: {c['fp8']}" if isinstance(c.get("fp8"), str) else "", ""]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile_only", action="store_true", help="no GPU needed: compile the training step and the "
                                                               "decode steps for an H100 (and an RTX 4090, an A100) "
                                                               "on fake tensors, down to cubin (compile_check.py)")
    p.add_argument("--out", help="folder for each part's JSON and the data cache")
    p.add_argument("--part", choices=PARTS + ("all",), default="all")
    p.add_argument("--dry_run", action="store_true", help="every configuration on the tiny shape, one step each, "
                                                          "no compile: checks the script on a CPU")
    p.add_argument("--sources", nargs="*", default=[], help="training text (default: the default corpus)")
    p.add_argument("--report", default="", help="where the report goes; default docs/gpu_report.md, or OUT/ for a "
                                                "dry run")
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
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run}
    jobs = {"throughput": lambda: throughput(args, "default"), "autotune": lambda: throughput(args, "max-autotune"),
            "graphs": lambda: graphs(args), "startup": lambda: startup(args), "curves": lambda: curves(args)}
    for part in PARTS if args.part == "all" else (args.part,):
        start = time.time()
        print(f"part {part}...", flush=True)
        result = {"meta": meta, **jobs[part](), "seconds": time.time() - start}
        with open(os.path.join(args.out, f"{part}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
        print(f"part {part}: {result['seconds']:.0f} s", flush=True)
        gc.collect()
        write_report(args.out, args.report)
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
