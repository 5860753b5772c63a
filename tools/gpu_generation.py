"""The generation figures of tools/gpu_check.py --quick, from the default run's checkpoint: a one-shot reply
launch to exit (cold compile cache, eager) and a prompt on stdin answered while the decode step compiles in
the background; decode at batch 1 and 8 against the bandwidth bound, and at batch 1 under Inductor settings
that may cut its kernels (DECODE_LEADS); and greedy tokens against transformers'."""

import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import bench
import torch

from llm.base.device import pick_device
from llm.formats.hf_format import hf_twin
from llm.formats.loading import read_model
from llm.generate.inference import for_inference
from modern_llm import Transformer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
PROMPT = "def fibonacci(n):"


def command(cmd: list, env: dict | None = None) -> tuple[float, str]:
    """Run a project script as a user would; (wall seconds, stdout + stderr). RuntimeError with its end if it
    fails."""
    start = time.time()
    done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=HERE,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{done.stderr[-3000:]}")
    return time.time() - start, done.stdout + done.stderr


def first_token(args, ckpt: str) -> dict:
    """A one-shot generation from the default run's checkpoint, launch to exit: compiled first from an empty
    compile cache (what a reply waited for before the background compile), and eagerly (--compile off); then a
    prompt on stdin, answered while the step compiles in the background. (A warm cache's compile, 6 s on the
    H200, is no longer waited for, so the check spends no lease time on it.)"""
    rows = []
    for label, flags in (("compiled, cold cache", []), ("eager", ["--compile", "off"])):
        compiled = "off" if args.dry_run else "reduce-overhead"  # a CPU's compile takes half a minute
        cmd = [os.path.join(HERE, "text_generator.py"), ckpt, "--prompt", PROMPT, "--max_new_tokens", "32",
               "--temperature", "0", *(flags or ["--compile", compiled])]
        with tempfile.TemporaryDirectory() as cache:
            seconds, log = command(cmd, env={"TORCHINDUCTOR_CACHE_DIR": cache})
        compiling = re.search(r"compiling the decode step[^.]*\.\.\. (\d+) s", log)
        rows.append({"mode": label, "launch_to_exit_s": seconds,
                     "compile_s": float(compiling.group(1)) if compiling else 0.0})
        print(f"first token, {label}: {seconds:.1f} s from launch to exit", flush=True)
    try:  # a figure no other part needs: its failure is reported, and the lease goes on
        seconds, loaded_to_reply = first_reply(ckpt, "off" if args.dry_run else "auto")
        reply = {"launch_to_exit_s": seconds, "loaded_to_reply_s": loaded_to_reply}
        print(f"first reply to a prompt on stdin: {loaded_to_reply:.1f} s after the model loaded", flush=True)
    except RuntimeError as e:
        reply = {"error": str(e)[-300:]}
        print(f"first reply to a prompt on stdin: {e}", flush=True)
    return {"rows": rows, "prompt": PROMPT, "first_reply": reply}


def first_reply(ckpt: str, compile_mode: str) -> tuple[float, float]:
    """A prompt on stdin, as the REPL and a stream of prompts read it (the decode step compiles in the
    background under auto on CUDA): (launch to exit, seconds from the "loaded" line to the exit that follows
    the one reply)."""
    cmd = [sys.executable, os.path.join(HERE, "text_generator.py"), ckpt, "--max_new_tokens", "32",
           "--temperature", "0", "--compile", compile_mode]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write(PROMPT + "\n")
    proc.stdin.close()
    loaded, rated, log = None, False, []
    for line in proc.stderr:  # until the exit: the loaded line, then the reply's rate line
        log.append(line)
        if loaded is None and line.startswith("loaded "):
            loaded = time.time()
        rated = rated or re.match(r"\[\d+ tokens in ", line) is not None
    proc.stdout.read()  # the reply: a model trained a few steps may answer in whitespace, or at once with EOS
    replied = time.time()
    if proc.wait() != 0 or loaded is None or not rated:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(log)[-3000:]}")
    return time.time() - start, replied - loaded


def words(identical: bool) -> str:
    return "identical" if identical else "DIFFERENT"


def decode(args, ckpt: str) -> dict:
    """The engine's decode at batch 1 and 8 on the large shape (random weights: speed does not depend on
    them), against the bandwidth bound; and its greedy tokens against transformers' on the trained checkpoint,
    both in float32, where a trained model's ties cannot flip."""
    device = pick_device("auto")
    cfg, compiled, n, reps = decode_shape(args)
    out = {"rows": decode_rates(cfg, device, compiled, (1, 8), n, reps),
           "shape": "tiny" if args.dry_run else "large",
           "greedy_identical": greedy_identical(ckpt, device, compiled)}
    print(f"greedy check against transformers: {words(out['greedy_identical'])}", flush=True)
    return out


# Inductor settings with which the compile check found a cheaper decode step, which no GPU has run yet (the
# large shape at batch 1 for an H100, docs/gpu-check.md). Coordinate descent tuning makes each batch-1 matmul
# a Triton reduction tuned on the GPU, the norm before it and SwiGLU's product fused in: no cuBLAS call left,
# 154 kernels to 142, estimate 604 us to 467. Combo kernels also launch a block's independent kernels as one:
# 117, 411 us.
DECODE_LEADS = {"coordinate descent tuning": {"coordinate_descent_tuning": True},
                "coordinate descent tuning and combo kernels": {"coordinate_descent_tuning": True,
                                                                "combo_kernels": True}}


def decode_leads(args, ckpt: str) -> dict:
    """decode at batch 1 under each of DECODE_LEADS, and its greedy tokens against transformers'. A lead that
    fails to compile or run is reported, and the part goes on to the next."""
    device = pick_device("auto")
    cfg, compiled, n, reps = decode_shape(args)
    out = {"rows": [], "shape": "tiny" if args.dry_run else "large", "greedy_identical": {}, "errors": {}}
    for lead, flags in DECODE_LEADS.items():
        try:
            with torch._inductor.config.patch(**flags):  # read when a step compiles: at its first call
                out["rows"] += [dict(r, lead=lead)
                                for r in decode_rates(cfg, device, compiled, (1,), n, reps)]
                out["greedy_identical"][lead] = greedy_identical(ckpt, device, compiled)
            print(f"{lead}: greedy check against transformers: "
                  f"{words(out['greedy_identical'][lead])}", flush=True)
        except Exception as e:
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            out["errors"][lead] = f"{type(e).__name__}: {first[:300]}"
            print(f"{lead}: failed: {out['errors'][lead]}", flush=True)
        torch._dynamo.reset()  # the next lead compiles its own steps
        bench.release(device)
    return out


def decode_shape(args) -> tuple:
    """(model config, compile mode, tokens per timed run, runs) of the decode figures: the large shape as a
    CUDA graph, or the tiny one eagerly in a dry run."""
    import bench_generate as bg
    n, reps = (8, 1) if args.dry_run else (128, 3)
    return (bg.shape("tiny" if args.dry_run else "large"),
            "off" if args.dry_run else "reduce-overhead", n, reps)


def decode_rates(cfg, device, compiled: str, batches: tuple, n: int, reps: int) -> list[dict]:
    """Tokens per second of a model of this shape (its own compiled steps) at each batch size, and the bound.
    """
    import bench_generate as bg
    torch.manual_seed(0)
    model, rows = for_inference(Transformer(cfg).to(device), device, compile=compiled), []
    for batch in batches:
        prompts = torch.randint(0, cfg.vocab_size, (batch, 64), device=device)
        step = functools.partial(bg.ours, model, prompts)
        runs = bg.decode_rates({"ours": step}, batch, n, reps, device)["ours"]
        rate = statistics.median(r[0] for r in runs)
        bound = batch * bg.bandwidth(device) / bg.bytes_per_step(model, batch, 64 + n / 2)
        rows.append({"batch": batch, "tokens_per_s": rate, "ms_per_step": 1e3 * batch / rate,
                     "bound_share": rate / bound})
        print(f"decode, batch {batch}: {rate:,.0f} tokens/s, "
              f"{100 * rate / bound:.0f}% of the bandwidth bound",
              flush=True)
    del model, step  # the partial holds the model too
    bench.release(device)
    return rows


def greedy_identical(ckpt: str, device, compiled: str) -> bool:
    """Whether our greedy tokens from the trained checkpoint (float32, compiled as asked) are transformers'.
    """
    import bench_generate as bg
    found = read_model(ckpt)
    with torch.device("meta"):  # no random draws for weights the checkpoint replaces
        ours = Transformer(found.config)
    ours.materialize(device).load_stored(found.state)
    twin = hf_twin(found.config, ours.state_dict()).to(device).float().eval()
    ours = for_inference(ours, device, compile=compiled).float()
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=device)
    return bg.ours(ours, prompt, 32) == bg.theirs(twin, prompt, 32, fastest=False)
