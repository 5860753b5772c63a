"""The GPU check's runs of the trainer as a user launches it (tools/gpu_check.py --quick): the no-flag first
run, and a budget shorter than the first compile.

The no-flag run on a GPU reads FineWeb-Edu from the Hub, sized for an hour. A lent machine has no network, so
the check serves FineWeb-Edu's path from a stand-in Hub on 127.0.0.1 (hub_stand_in.py) holding the bundled
corpus's text: the run takes the same path as a user's (the Hub asked, the preset and micro-batch the hour
picks, the files downloaded and tokenized while it trains), and half a minute after its first timed step it is
stopped as a user's Ctrl-C stops it (SIGTERM: the step finishes, the run saves)."""

import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import gpu_generation as gen
import pyarrow as pa
import pyarrow.parquet as pq
from hub_stand_in import Hub

from llm.data.corpus import GPU_CORPUS, bundled_files
from llm.formats.checkpoint import latest_checkpoint
from llm.reports.monitor import read_metrics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
TRAINER = os.path.join(HERE, "gpu_training_optimized.py")
FINEWEB = "HuggingFaceFW/fineweb-edu"  # GPU_CORPUS's repository; its files are sample/10BT/NNN_00000.parquet
# the no-flag run trains this long after its first timed step (dozens of steps), then is stopped
FIRST_RUN_S = 30.0
STOP_WAIT_S = 300.0  # for the stopped run to finish its step and save


def fresh_run(args, name: str, flags: list, env: dict | None = None) -> tuple[str, float, str]:
    """The trainer launched as a user would, into a new OUT/<name> run folder, on the check's token cache:
    (the run folder, wall seconds, its output). RuntimeError with the output's end if it fails."""
    run_dir = os.path.join(args.out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    data = ["--sources", *args.sources] if args.sources else []
    seconds, log = gen.command([TRAINER, "--run_dir", run_dir, "--cache_dir", os.path.join(args.out, "cache"),
                                *data, *map(str, flags)], env)
    return run_dir, seconds, log


def fineweb_files(dry: bool) -> dict:
    """FineWeb-Edu's layout, filled with the bundled corpus's text: each file a parquet of it with a `text`
    column, as FineWeb-Edu's are, its documents in another order so that no two files are the same bytes (the
    Hub's cache would link a copy without downloading it). A dry run: a few of its files, in two."""
    paths = [p for p, _ in bundled_files()][:40 if dry else None]
    texts = [open(p, encoding="utf-8", errors="replace").read() for p in paths]
    files = {}
    for i in range(2 if dry else 8):
        buffer, turn = io.BytesIO(), i * len(texts) // 8
        pq.write_table(pa.table({"text": texts[turn:] + texts[:turn]}), buffer)
        files[f"sample/10BT/{i:03d}_00000.parquet"] = buffer.getvalue()
    return files


def stopped_run(args, name: str, flags: list, env: dict, after_s: float) -> tuple[str, float, str]:
    """The trainer launched with flags into OUT/<name> and stopped by SIGTERM after_s seconds after its first
    timed step (or left to end by itself first): (the run folder, its launch time, its output). RuntimeError
    with the output's end if it fails or does not stop."""
    run_dir, log_path = os.path.join(args.out, name), os.path.join(args.out, f"{name}.log")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, TRAINER, "--run_dir", run_dir, "--cache_dir", os.path.join(args.out, "cache"),
           *map(str, flags)]
    launched, stop_at, stopped = time.time(), None, False
    # a file, not a pipe: a long run's output never blocks it
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE,
                                env={**os.environ, **env})
        while proc.poll() is None:
            time.sleep(0.5)
            if stop_at is None and any(r["tokens_per_s"] for r in read_metrics(run_dir, "train")):
                stop_at = time.time() + after_s
            if stop_at is not None and time.time() >= stop_at:
                proc.send_signal(signal.SIGTERM)
                stopped = True
                break
        try:
            code = proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    output = open(log_path, encoding="utf-8", errors="replace").read()
    if code != (143 if stopped else 0):  # a run SIGTERM stopped saves, then exits 143
        raise RuntimeError(f"{' '.join(cmd[1:])} ended with status {code}:\n{output[-3000:]}")
    return run_dir, launched, output


def default_run(args) -> dict:
    """The trainer with no flags, as a user's first run, stopped FIRST_RUN_S after its first timed step: the
    corpus and the size it chose, the seconds from launch to its first step, its speed and MFU. On a CPU (a
    dry run) the same path is asked for by flags: FineWeb-Edu from the stand-in, the tiny shape, no compile.
    """
    hub = Hub({FINEWEB: fineweb_files(args.dry_run)})
    home = os.path.join(args.out, "hf_home")
    shutil.rmtree(home, ignore_errors=True)  # a first run: nothing cached
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": home, "HF_HUB_OFFLINE": "0"}
    flags = ["--sources", GPU_CORPUS, "--max_tokens", 10**6, "--compile", "off", "--micro_batch_size", 2,
             "--max_seq_len", 64] if args.dry_run else []
    after_s = 2.0 if args.dry_run else FIRST_RUN_S
    try:
        run_dir, launched, log = stopped_run(args, "default_run", flags, env, after_s)
    finally:
        hub.stop()
    train = read_metrics(run_dir, "train")
    timed = [r for r in train if r["tokens_per_s"]][-5:] or train[-1:]
    median = lambda key: statistics.median(r[key] or 0 for r in timed)  # noqa: E731
    settings = json.load(open(os.path.join(run_dir, "config.json"), encoding="utf-8"))
    t, preset = settings["train"], re.search(r"\(the (\w+) preset", log)
    row = {"steps": train[-1]["step"], "first_step_s": train[0]["time"] - launched,
           "stopped_after_s": after_s, "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
           "vram_gb": max(r["vram_gb"] or 0 for r in train), "preset": preset.group(1) if preset else "given",
           "batch": f"{t['micro_batch_size']} x {settings['model']['max_seq_len']} x {t['grad_accum_steps']}",
           "default_corpus": "data: the GPU default corpus" in log,
           "while_arriving": "training starts on" in log,
           "files_fetched": sum(method == "GET" and path.endswith(".parquet")
                                for method, path, _ in hub.requests),
           "checkpoint": latest_checkpoint(run_dir)}
    print(f"default run: {row['steps']} steps, the first {row['first_step_s']:.0f} s after launch, "
          f"{row['tokens_per_s']:,.0f} tokens/s", flush=True)
    return row


def trained_checkpoint(args) -> str:
    """The default run's checkpoint (default_run makes it when no earlier part did). Where that run failed
    (its row says how), a short run of the tiny preset on the bundled corpus trains one, for the generation
    parts."""
    path = os.path.join(args.out, "default_run.json")
    found = json.load(open(path)) if os.path.isfile(path) else default_run(args)
    if found.get("checkpoint"):
        return found["checkpoint"]
    flags = ["--preset", "tiny", "--max_steps", 2 if args.dry_run else 200,
             *([] if args.sources else ["--sources", "stdlib"]),
             *(["--compile", "off", "--micro_batch_size", 2, "--max_seq_len", 64] if args.dry_run else [])]
    run_dir, _, _ = fresh_run(args, "fallback_run", flags)
    return latest_checkpoint(run_dir)


def short_budget(args) -> dict:
    """`--preset small --max_minutes 1` with an empty compile cache: a compile would take about as long as the
    budget, so compile left automatic trains eagerly (under 2 minutes), and the run must end on its budget,
    counted from the process's start, with a checkpoint and exit 0. Last, so a lease running short loses only
    this. The dry run's budget holds a busy CPU's imports (5-10 s)."""
    flags = ["--preset", "tiny", "--max_minutes", 0.3, "--compile", "off", "--micro_batch_size", 2,
             "--max_seq_len", 64] if args.dry_run else ["--preset", "small", "--max_minutes", 1]
    with tempfile.TemporaryDirectory() as cold:
        try:
            run_dir, seconds, log = fresh_run(args, "short_budget", flags, {"TORCHINDUCTOR_CACHE_DIR": cold})
        except RuntimeError as e:  # the finding itself: reported in the table
            return {"error": str(e)[-300:]}
    train = read_metrics(run_dir, "train")
    print(f"short budget: {train[-1]['step'] if train else 0} steps in {seconds:.0f} s", flush=True)
    return {"seconds": seconds, "steps": train[-1]["step"] if train else 0,
            "checkpoint": latest_checkpoint(run_dir), "traceback": "Traceback" in log}
