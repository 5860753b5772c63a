"""The GPU path compiled for an H100 (and an RTX 4090, an A100) on a machine with no GPU.

    python tools/gpu_check.py --compile_only              # every configuration; a table; exit 1 on any failure
    python tools/compile_check.py --only train-default    # one configuration
Needs a CUDA build of torch (it brings Triton and its ptxas) and a C compiler; no GPU and no driver.

fake_gpu.py stands in for the CUDA runtime and driver: it answers the device queries with the properties of
the chosen GPU and runs no code; every kernel Triton compiles is checked to be a cubin for that GPU's
architecture, and counted. The model, the optimizer and the data are fake tensors (FakeTensorMode) on device
"cuda", so the trainer's own build() and train_step run: dynamo captures, AOTAutograd and Inductor lower,
Triton compiles to PTX and cubin, and the compiled code then runs as shape propagation on the fake tensors.
Inductor's decisions by timing are made without it (choose_without_timing says how). What this proves: the
step compiles and captures for that GPU, with these shapes, dtypes, kernels and memory. What it cannot:
numbers, speed, or a CUDA graph's replay.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import compile_workloads as work
from compile_workloads import run_generation, run_training
from fake_gpu import GPUS, fake_gpu_env, shim_library
from roofline import Roofline

from llm.base.errors import ConfigError, error_contract

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root


# ----------------------------------------------------------------------------- in the fake GPU's process

CONFIGS = {  # name -> what runs, and which GPU it is compiled for
    "train-default": (lambda: run_training("bf16", "default"), "h100"),
    "train-reduce-overhead": (lambda: run_training("bf16", "reduce-overhead"), "h100"),
    "train-max-autotune-no-cudagraphs": (lambda: run_training("bf16", "max-autotune-no-cudagraphs"), "h100"),
    "train-max-autotune": (lambda: run_training("bf16", "max-autotune"), "h100"),
    "train-fp8": (lambda: run_training("fp8", "default"), "h100"),
    "train-fp16": (lambda: run_training("fp16", "default"), "h100"),
    "train-deterministic": (lambda: run_training("bf16", "default", deterministic=True), "h100"),
    "train-packed": (lambda: run_training("bf16", "default", packed=True), "h100"),
    "train-lora": (lambda: run_training("bf16", "default", packed=True, lora_rank=16), "h100"),
    "train-lora-nf4": (lambda: run_training("bf16", "default", packed=True, lora_rank=16,
                                            lora_base="nf4"), "h100"),
    "generate": (run_generation, "h100"),
    "calibrate-large-h200": (lambda: run_training("bf16", "default", whole="large"), "h200"),
    "calibrate-small-h200": (lambda: run_training("bf16", "default", whole="small"), "h200"),
    "train-chunked-loss-rtx4090": (lambda: run_training("bf16", "default", loss_chunk_rows=2048), "rtx4090"),
    "train-default-a100": (lambda: run_training("bf16", "default"), "a100"),
    "train-dpo": (lambda: run_training("bf16", "default", packed="pairs"), "h100"),
    "train-grpo": (lambda: run_training("bf16", "default", packed="grpo", lora_rank=16), "h100"),
}


def child(name: str, library: str, inductor: dict | None = None) -> dict:
    """Run one configuration in this (fake-GPU) process, under these Inductor settings; what it compiled and
    what went wrong."""
    import torch
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch._inductor.config.wrap_inductor_compiled_regions = True  # compiled code runs as fake propagation
    torch._inductor.config.fx_graph_cache = False  # every graph compiled here, so the roofline costs it
    work.choose_without_timing()
    work.ROOFLINE = Roofline(GPUS[CONFIGS[name][1]])
    work.ROOFLINE.install()
    start, failure, result = time.time(), None, {}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch._inductor.config.patch(inductor or {}):
            result = CONFIGS[name][0]()
    except Exception as e:  # the point of the check: any failure is reported, by configuration
        traceback.print_exc()  # the whole story on stderr, shown with --verbose
        failure = summary(e)
    fake = ctypes.CDLL(library)
    breaks = sum(counters["graph_break"].values())
    skips = counters["inductor"]["cudagraph_skips"]
    problems = [failure] if failure else []
    problems += [f"{breaks} graph breaks: {dict(counters['graph_break'])}"] if breaks else []
    problems += [f"{counters['frames']['total'] - counters['frames']['ok']} frames not compiled"] \
        if counters["frames"]["total"] != counters["frames"]["ok"] else []
    problems += [f"{fake.fake_gpu_foreign_cubins()} kernels compiled for another GPU"] \
        if fake.fake_gpu_foreign_cubins() else []
    unaligned = sorted(set(work.UNALIGNED))
    problems += ["matmuls of unaligned shapes: "
                 f"{', '.join(unaligned)}"] if unaligned and name != "generate" else []
    problems += ([f"CUDA graphs skipped {skips} times"]
                 if skips and ("reduce-overhead" in name
                               or "max-autotune" in name and "no-cudagraphs" not in name)
                 else [])
    return {"name": name, "gpu": CONFIGS[name][1], "ok": not problems, "problems": problems,
            "graphs": counters["stats"]["unique_graphs"], "kernels": fake.fake_gpu_cubins(),
            "unaligned": unaligned, "seconds": time.time() - start, **result}


def summary(e: BaseException) -> str:
    """An exception in one line: its type and its first lines that say something (a compiler error wraps the
    real one after 'raised:')."""
    lines = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.strip().endswith("raised:")]
    return f"{type(e).__name__}: {' '.join(lines[:2])[:400]}"


# ----------------------------------------------------------------------------- the command

def run_all(names: list[str], inductor: list[str] = ()) -> int:
    """Each configuration in a fresh fake-GPU process (under --inductor's settings), one after the other; the
    table; 1 if any failed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        print("error: the compile check needs a CUDA build of torch (with Triton): pip install torch (the "
              "default wheel on Linux), in a virtual environment of its own if this one keeps the CPU build",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_check_") as cache:
        for name in names:
            try:
                library = shim_library(GPUS[CONFIGS[name][1]])
            except (OSError, subprocess.CalledProcessError) as e:  # no gcc, or it failed
                detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[:1]
                print(f"error: building the fake GPU library needs gcc ({' '.join(detail)}); install gcc",
                      file=sys.stderr)
                return 2
            out = os.path.join(cache, f"{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", out,
                   "--inductor", *inductor]
            print(f"{name}: compiling for {GPUS[CONFIGS[name][1]].name}...", flush=True)
            done = subprocess.run(cmd, env=fake_gpu_env(library, cache), cwd=HERE,
                                  capture_output=True, text=True)
            if os.path.isfile(out):
                with open(out, encoding="utf-8") as f:
                    rows.append(json.load(f))
            else:  # the child died before it could report (a crash in the shim or in torch)
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"name": name, "gpu": CONFIGS[name][1], "ok": False,
                             "problems": [f"exit {done.returncode}: {tail[0][:300]}"]})
            print(row_line(rows[-1]), flush=True)
    print(table(rows))
    failed = [r["name"] for r in rows if not r["ok"]]
    if failed:
        print(f"error: the GPU compile check failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"compile check: {len(rows)} configurations compiled for the GPU, no graph break, no recompile")
    return 0


def roofline_text(r: dict) -> str:
    """The step's roofline estimate in a few words (a decode step's for generation), or n/a."""
    if "decode_kernels" in r:
        return (f"decode step {r['decode_kernels']} kernels ({r['decode_matmuls']} matmuls), roofline "
                f"{r['decode_roofline_us']:.0f} us, estimate {r['decode_estimate_us']:.0f} us")
    if r.get("roofline_ms") is None:
        return f"not costed ({r['roofline_missing']})" if r.get("roofline_missing") else "n/a"
    mfu = f", MFU {r['roofline_mfu']:.0%}" if r.get("roofline_mfu") else ""
    calibrated = (f"; calibrated {r['calibrated_ms']:.1f} ms (forward and backward "
                  f"{r['calibrated_forward_backward_ms']:.1f}), MFU {r['calibrated_mfu']:.0%}"
                  if r.get("calibrated_mfu") else "")
    return (f"{r['roofline_ms']:.1f} ms (matmul {r['roofline_matmul_ms']:.1f}, other "
            f"{r['roofline_other_ms']:.1f}, optimizer {r['roofline_optimizer_ms']:.1f}){mfu}{calibrated}")


def row_line(r: dict) -> str:
    if not r["ok"]:
        return f"  FAILED: {'; '.join(r['problems'])}"
    casts = f", weight casts {r['weight_casts_gib']:.2f} GiB a step ({r['weight_casts_ms']:.2f} ms)" \
        if "weight_casts_gib" in r else ""
    roof = (f", roofline estimate {roofline_text(r)}"
            if r.get("roofline_ms") is not None or "decode_kernels" in r else "")
    return (f"  ok: {r['kernels']} kernels, {r['graphs']} graphs, SDPA {r['sdpa']}{casts}{roof}, "
            f"{r['seconds']:.0f} s")


def table(rows: list[dict]) -> str:
    lines = ["| configuration | GPU | result | Triton kernels (cubin) | graphs | SDPA "
             "backend | fake-tensor peak GiB | sizing estimate GiB | weight casts a step | "
             "step time, roofline estimate | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        est = f"{r['estimate_gib']:.2f}" if r.get("estimate_gib") is not None else "n/a"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "n/a"
        casts = (f"{r['weight_casts_gib']:.2f} GiB, {r['weight_casts_ms']:.2f} ms"
                 if "weight_casts_gib" in r else "n/a")
        lines.append(f"| {r['name']} | {GPUS[r['gpu']].name} | {'ok' if r['ok'] else 'FAILED'} | "
                     f"{r.get('kernels', 'n/a')} | {r.get('graphs', 'n/a')} | {r.get('sdpa', 'n/a')} | "
                     f"{peak} | {est} | {casts} | {roofline_text(r)} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), default=list(CONFIGS),
                   help="configurations to check")
    p.add_argument("--inductor", nargs="*", default=[], metavar="NAME=VALUE",
                   help="Inductor settings to compile every configuration under, as the GPU check's decode "
                        "leads try them: --only generate --inductor coordinate_descent_tuning=True")
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    settings = inductor_settings(args.inductor)
    if args.child:
        result = child(args.child, os.environ["LD_PRELOAD"], settings)
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    return run_all(args.only, args.inductor)


def inductor_settings(pairs: list[str]) -> dict:
    """--inductor's NAME=VALUE pairs as Inductor settings: True, False, a whole number, else the text.
    ConfigError on a name Inductor does not have."""
    import torch
    known, settings = torch._inductor.config.get_config_copy(), {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if name not in known:
            raise ConfigError(f"--inductor {pair}: Inductor has no setting "
                              f"{name!r} (torch {torch.__version__})")
        settings[name] = {"True": True, "False": False}.get(text,
                                                            int(text) if text.lstrip("-").isdigit() else text)
    return settings


if __name__ == "__main__":
    sys.exit(main())
