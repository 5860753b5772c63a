"""What the training loop reports as it runs: the progress bar, MFU, memory, GPU use, metrics.jsonl and
samples.jsonl, the loss plot, TensorBoard, W&B, the summary, and whether the run stood still. The lines before
the first step are start_report.py's.

Everything here reads values the loop already has on the host; nothing here forces a GPU sync.
metrics.jsonl has one writer (Monitor) and one reader (read_metrics), both here.
"""

import json
import math
import os
import sys
import time

import psutil
import torch
from tqdm import tqdm

from llm.base import atomic
from llm.base.sizing import gpu_peak_flops

METRICS_FILE, SAMPLES_FILE = "metrics.jsonl", "samples.jsonl"


def peak_flops(device: torch.device) -> float | None:
    """The device's peak bf16/fp16 FLOP/s (sizing's table), or None when unknown (MFU then shows as n/a)."""
    return gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def gpu_utilization(device: torch.device) -> float | None:
    """GPU busy percent from NVML when the driver reports it."""
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # no pynvml / NVML: the figure is optional
        return None


def device_report(device: torch.device) -> str:
    """One line naming the device and its memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    ram = psutil.virtual_memory().total / 2**30
    return f"{device.type}, {torch.get_num_threads()} threads, {ram:.1f} GiB RAM"


class Monitor:
    """Turns the loop's numbers into log lines, metrics.jsonl records, a loss plot and optional TensorBoard.
    """

    def __init__(self, run_dir: str, device: torch.device, flops_per_token: float, tokens_per_step: int, *,
                 tensorboard: bool = False, wandb: bool = False, config: dict | None = None,
                 resume_step: int | None = None, world_size: int = 1):
        """tokens_per_step: over every rank. resume_step: the run continues from this step, so records logged
        after it (by the session that went on past its last checkpoint) are dropped: the file then reads as
        one uninterrupted run. world_size: GPUs sharing the tokens/s, so MFU is per GPU (the tokens of one GPU
        against that GPU's peak)."""
        self.run_dir, self.device, self.flops_per_token = run_dir, device, flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak = peak_flops(device) * world_size if peak_flops(device) else None
        self.metrics_path = os.path.join(run_dir, METRICS_FILE)
        kept = ([r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
                if resume_step is not None else [])
        if resume_step is not None:
            self._rewrite(kept)
        self.train_points = [(r["step"], r["loss"]) for r in kept if r.get("kind") == "train"]
        self.eval_points = [(r["step"], r["val_loss"]) for r in kept if r.get("kind") == "eval"]
        self.code_points = [(r["step"], 100 * r["code_ok"]) for r in kept
                            if r.get("kind") == "eval" and r.get("code_ok") is not None]
        self.score_points = [(r["step"], mean_score(r)) for r in kept
                             if r.get("kind") == "eval" and mean_score(r) is not None]
        self.writer = self.wandb_run = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                print("warning: tensorboard is not installed; pip install tensorboard to use it")
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                print("warning: wandb is not installed; pip install wandb to use it")
            else:
                # Offline: no account or network needed; `wandb sync <run_dir>/wandb/offline-run-*` uploads
                # later.
                self.wandb_run = wandb_lib.init(project="modern-llm",
                                                name=os.path.basename(os.path.normpath(run_dir)),
                                                dir=run_dir, mode="offline", config=config or {})

    def train_record(self, step: int, tokens: int, loss: float, lr_scale: float, lrs: dict, grad_norm: float,
                     step_s: float | None, compiled: bool = False, extra: dict | None = None) -> dict:
        """Throughput from the seconds of a step (the run clock's, None for the first step, which compiles),
        plus memory; appended to metrics.jsonl.

        lr_scale is the schedule's multiplier of the peak rates; lrs names each rate ({"lr_muon": ..., ...});
        compiled: whether the step ran compiled; extra: other figures of the steps (a preference run's
        rewards)."""
        timed = bool(step_s)
        tok_s = self.tokens_per_step / step_s if timed else None
        record = {"kind": "train", "step": step, "loss": loss, "lr_scale": lr_scale, **lrs,
                  "grad_norm": grad_norm, "compiled": compiled, "tokens": tokens, "tokens_per_s": tok_s,
                  "steps_per_s": 1 / step_s if timed else None,
                  "mfu": tok_s * self.flops_per_token / self.peak if self.peak and timed else None,
                  "ram_gb": psutil.Process().memory_info().rss / 2**30,
                  "gpu_util": gpu_utilization(self.device),
                  "vram_gb": None, "vram_total_gb": None, **(extra or {}), "time": time.time()}
        if self.device.type == "cuda":
            record["vram_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            record["vram_total_gb"] = torch.cuda.get_device_properties(self.device).total_memory / 2**30
        self.train_points.append((step, loss))
        self._write(record)
        return record

    def eval_record(self, step: int, val_loss: float, bytes_per_token: float | None, **extra) -> dict:
        """Validation loss, perplexity and bits per byte (loss / ln 2 / bytes per token), and any other
        figures of the evaluation (the code metric: code_ok, code_samples)."""
        per_token = bytes_per_token is not None  # None: a loss that is no text's (GRPO's negated reward)
        record = {"kind": "eval", "step": step, "val_loss": val_loss,
                  # 700: exp overflows past ~709
                  "val_ppl": math.exp(min(val_loss, 700.0)) if per_token else None,
                  "val_bpb": val_loss / math.log(2) / bytes_per_token if per_token else None,
                  **{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in extra.items()},
                  "time": time.time()}
        self.eval_points.append((step, val_loss))
        if record.get("code_ok") is not None:
            self.code_points.append((step, 100 * record["code_ok"]))
        if mean_score(record) is not None:
            self.score_points.append((step, mean_score(record)))
        self._write(record)
        self.plot()
        return record

    def samples_record(self, step: int, samples: list[dict]):
        """The evaluation's samples, one line each in samples.jsonl."""
        with open(os.path.join(self.run_dir, SAMPLES_FILE), "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **sample}) + "\n" for sample in samples)

    def _rewrite(self, records: list[dict]):
        """Replace metrics.jsonl by these records, atomically."""
        atomic.write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def _write(self, record: dict):
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {f"{record['kind']}/{key}": value for key, value in record.items()
                   if isinstance(value, (int, float)) and key not in ("step", "time")}
        if self.writer:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, record["step"])
        if self.wandb_run:
            self.wandb_run.log(scalars, step=record["step"])

    def plot(self):
        """loss.png: train and val loss, and beside them the code metric and the benchmarks' mean accuracy
        where there are (matplotlib only)."""
        drawn = (len(self.train_points), len(self.eval_points))
        if drawn == getattr(self, "_drawn", None):
            return
        self._drawn = drawn
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        panels = 2 if self.code_points or self.score_points else 1
        fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False)
        ax = axes[0][0]
        if self.train_points:
            ax.plot(*zip(*self.train_points), label="train", linewidth=1)
        if self.eval_points:
            ax.plot(*zip(*self.eval_points), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        if panels == 2:
            right = axes[0][1]
            for points, label, color in [(self.code_points, "function bodies that parse", "tab:green"),
                                         (self.score_points, "benchmarks' mean accuracy", "tab:purple")]:
                if points:
                    right.plot(*zip(*points), "o-", color=color, label=label)
            right.set_xlabel("step")
            right.set_ylabel("%")
            right.set_ylim(0, 100)
            right.grid(alpha=0.3)
            right.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(self.run_dir, "loss.png"), dpi=100)
        plt.close(fig)

    def close(self):
        self.plot()
        if self.writer:
            self.writer.close()
        if self.wandb_run:
            self.wandb_run.finish()


class StepProfiler:
    """--profile: a torch.profiler trace of a few steps once compiling is done, and on CUDA a memory snapshot
    of them, written to <run>/profile/ (trace.json opens in chrome://tracing or ui.perfetto.dev; the snapshot
    in pytorch.org/memory_viz)."""

    def __init__(self, run_dir: str, device: torch.device, first: int, steps: int = 4):
        self.folder, self.device, self.first, self.last = (os.path.join(run_dir, "profile"),
                                                           device, first, first + steps)
        self.profiler = None

    def step(self, done: int):
        """Call after each step, with the number of steps done."""
        if done == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = torch.profiler.profile(activities=activities,
                                                   record_shapes=True, with_stack=False)
            self.profiler.__enter__()
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        elif done == self.last and self.profiler:
            if self.device.type == "cuda":
                # the steps' kernels, not only their launches, in the trace
                torch.cuda.synchronize(self.device)
            self.profiler.__exit__(None, None, None)
            os.makedirs(self.folder, exist_ok=True)
            self.profiler.export_chrome_trace(os.path.join(self.folder, "trace.json"))
            if self.device.type == "cuda":
                torch.cuda.memory._dump_snapshot(os.path.join(self.folder, "memory_snapshot.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            print(f"profile: steps {self.first + 1}-{self.last} written to {self.folder}")
            self.profiler = None


def read_metrics(run_dir: str, kind: str | None = None, file: str = METRICS_FILE) -> list[dict]:
    """The records of a run's metrics.jsonl (or samples.jsonl) in file order, only those of `kind` ("train",
    "eval") when given. Reading is best-effort: a missing file reads as no records, and a line that is not a
    record this file's writer could have written (the half-written last line of a killed run, an edit) is
    skipped."""
    records = []
    try:
        with open(os.path.join(run_dir, file), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                    continue
                if _well_formed(record) and (kind is None or record.get("kind") == kind):
                    records.append(record)
    except FileNotFoundError:
        pass
    return records


def _well_formed(record) -> bool:
    """An object whose step, if any, is an integer; a train or eval record also needs its step, its loss
    (loss, val_loss) a number, and every other figure a number, true, false or null: what Monitor writes."""
    if not isinstance(record, dict) or type(record.get("step", 0)) is not int:
        return False
    if record.get("kind") not in ("train", "eval"):
        return True
    loss = record.get("loss" if record["kind"] == "train" else "val_loss")
    figures = [v for k, v in record.items() if k != "kind"]
    return "step" in record and type(loss) in (int, float) and all(type(v) in (bool, int, float, type(None))
                                                                   for v in figures)


def progress_bar(clock, start: int, enabled: bool):
    """The one progress bar: steps, or for a time budget the seconds of it spent (steps in the description).
    """
    if not clock.by_time:
        return tqdm(total=clock.t.max_steps, initial=start, disable=not enabled,
                    dynamic_ncols=True, desc="train")
    total = round(clock.budget_s)
    # n_fmt/total_fmt, not {total:.0f}: tqdm sets total to None once n passes it, and a format must not end
    # the run.
    return tqdm(total=total, initial=_budget_seconds(clock, total), disable=not enabled,
                dynamic_ncols=True, desc=f"train step {start}",
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} s "
                           "of the time budget{postfix}")


def _budget_seconds(clock, total: int) -> int:
    """The budget's seconds spent, at most its total: a step (the first, compiling) may end past the budget.
    """
    return min(round(clock.timer.spent_s()), total)


def advance_bar(bar, clock, step: int, epoch: float | None = None):
    """One step further: one tick, or the seconds spent under a time budget; with epochs, the one under way.
    """
    if epoch is not None:
        bar.set_description(f"train epoch {min(math.floor(epoch) + 1, math.ceil(clock.t.epochs))}"
                            f"/{clock.t.epochs:g}", refresh=False)
    if clock.by_time:
        bar.set_description(f"train step {step}", refresh=False)
        bar.update(max(0, _budget_seconds(clock, bar.total) - bar.n))
    else:
        bar.update(1)


def mean_score(record: dict) -> float | None:
    """An evaluation's benchmarks' mean accuracy in % (its acc_TASK fields), or None without them."""
    scores = [v for k, v in record.items() if k.startswith("acc_") and isinstance(v, (int, float))]
    return 100 * sum(scores) / len(scores) if scores else None


def summary(*, step: int, tokens: int, seconds: float, best_val: float, bytes_per_token: float | None,
            ckpt: str | None, device: torch.device, interrupted: bool, launcher: str = "python",
            base: str = "") -> str:
    """The lines printed at the end: what the run did, its best validation loss, where it is, how to go on.
    best_val: inf when no evaluation ran. base: the model a LoRA run's adapters join."""
    bits = f" ({best_val / math.log(2) / bytes_per_token:.4f} bits per byte)" if bytes_per_token else ""
    evaluated = f"best val loss {best_val:.4f}{bits}" if math.isfinite(best_val) else "no evaluation yet"
    peak = (f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
            if device.type == "cuda" else "n/a (CPU)")
    lines = [f"{'stopped' if interrupted else 'done'}: {step} steps, {tokens:,} tokens, {seconds / 60:.1f} "
             f"min, {evaluated}, peak memory {peak}"]
    if ckpt:
        lines += [f"checkpoint: {ckpt}", f"chat with it: python text_generator.py {ckpt}"
                  + (f" --base {base}" if base else "")]
    if interrupted:
        lines.append(f"resume with: {launcher} gpu_training_optimized.py "
                     f"{' '.join(sys.argv[1:])} --resume".replace(
            " --resume --resume", " --resume"))
    return "\n".join(lines)


def format_postfix(r: dict) -> dict:
    """The progress bar's fields, plain text."""
    timed = r["tokens_per_s"] is not None
    post = {"loss": f"{r['loss']:.3f}", **({"acc": f"{100 * r['reward_accuracy']:.0f}%", "margin":
                                              f"{r['reward_margin']:.2f}"} if "reward_accuracy" in r else {}),
            "lr": f"{r['lr_scale']:.3f}x",
            "tok/s": f"{r['tokens_per_s']:,.0f}" if timed else "n/a",
            "step/s": f"{r['steps_per_s']:.2f}" if timed else "n/a",
            "mfu": f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"}
    if r["vram_gb"] is not None:
        post["vram"] = f"{r['vram_gb']:.1f}/{r['vram_total_gb']:.0f}G"
    if r["gpu_util"] is not None:
        post["gpu"] = f"{r['gpu_util']:.0f}%"
    post["ram"] = f"{r['ram_gb']:.1f}G"
    return post


class LossWindow:
    """Device-side sums of the losses between two log lines, and the longest run of skipped steps."""

    def __init__(self, device: torch.device):
        self.loss, self.ok = torch.zeros((), device=device), torch.zeros((), device=device)
        self.streak = torch.zeros((), device=device, dtype=torch.long)
        self.worst = torch.zeros((), device=device, dtype=torch.long)

    def add(self, loss: torch.Tensor, ok: torch.Tensor):
        self.loss += torch.where(ok, loss, 0.0)
        self.ok += ok
        self.streak = (self.streak + 1) * (~ok)  # consecutive non-finite steps, counted on the device
        self.worst = torch.maximum(self.worst, self.streak)

    def mean(self) -> torch.Tensor:
        """The mean loss of the finite steps since the last reset; zeroes the sums."""
        mean = self.loss / self.ok.clamp(min=1)
        self.loss, self.ok = torch.zeros_like(self.loss), torch.zeros_like(self.ok)
        return mean


def stood_still(records: list[dict], key: str) -> str:
    """A line where the run's training figure `key` (its loss, or a GRPO run's reward) moved less than its own
    noise between the first and the last quarter of its logged windows: a run that learned nothing says so at
    its end. The noise is two standard errors of the difference of the two quarters' means. Only windows of
    the run's usual length count: the first steps' lines are a step each, as noisy as one step, and two equal
    ones once read as no noise at all (a GRPO run whose held-out score rose 7% to 20% was told it learned
    nothing)."""
    values = [r[key] for r in usual_windows(records) if isinstance(r.get(key), (int, float))
              and math.isfinite(r[key])]
    k = len(values) // 4
    if k < 2:
        return ""
    first, last = values[:k], values[-k:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
    moved, noise = mean(last) - mean(first), 2 * math.sqrt((var(first) + var(last)) / k)
    if abs(moved) > noise:
        return ""
    return (f"warning: the training {key} moved {moved:+.4f} (from {mean(first):.4f} to {mean(last):.4f}), "
            f"within its noise ({noise:.4f}): the run may have learned nothing; raise --learning_rate, or "
            "the steps (--epochs, --max_steps)")


def usual_windows(records: list[dict]) -> list[dict]:
    """The log lines whose window spans the run's most common number of steps (all of them where the lines
    carry no step)."""
    steps = [r.get("step") for r in records]
    if not all(isinstance(step, int) for step in steps):
        return records
    spans = [b - a for a, b in zip([0] + steps, steps)]
    usual = max(set(spans), key=lambda span: (spans.count(span), span))  # a tie: the longer
    return [r for r, span in zip(records, spans) if span == usual]
