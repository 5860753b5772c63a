"""Train the model. With no arguments: config.py's automatic fields sized for the machine
(llm/train/autofill.py): on a CPU the tiny preset for ten minutes on the bundled corpus (the standard
library's sources), on a GPU the preset an hour's compute suits, into runs/default; then `python
text_generator.py` samples from it.

    python gpu_training_optimized.py --preset small --max_steps 2000 --micro_batch_size 16
    python gpu_training_optimized.py --resume                     # continue runs/default exactly
    torchrun --nproc_per_node=8 gpu_training_optimized.py --preset medium
`--help` lists every setting. Ctrl-C or SIGTERM finishes the step, saves, and prints how to resume.
"""

import time

# run as a script, a time budget counts from here: the imports below are in it
PROCESS_START = time.monotonic()

import json
import math
import os
import shlex
import signal
import sys
from dataclasses import dataclass

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from config import Config
from llm.base import atomic
from llm.base import distributed
from llm.base.cli import parse_config
from llm.base.device import falls_back, make_deterministic, pick_device, precision_label, release_freed_memory
from llm.base.distributed import Ranks
from llm.base.errors import ConfigError, RunFailure, error_contract
from llm.base.sizing import flops_per_token
from llm.data.arrival import stopped_by
from llm.data.corpus import is_bundled
from llm.data.corpus_totals import short_of_target
from llm.data.token_cache import PreparedData
from llm.formats.trainer_state import Record
from llm.reports import report_card
from llm.reports.monitor import (LossWindow, Monitor, StepProfiler, advance_bar, device_report,
                                 format_postfix, progress_bar, read_metrics, stood_still, summary)
from llm.reports.start_report import start_report
from llm.scores.evaluation import GPU_TASK_ITEMS, Probe
from llm.scores.rewards import RewardError
from llm.train.plan import Plan
from llm.train.runner import Runner, start as runner_for
from llm.train.schedule import RunClock, StopFlag, lr_multiplier, set_lr
from llm.train.startup import settle


# ----------------------------------------------------------------------------- reporting

@dataclass
class Session:
    """Where this session reports (rank 0: the monitor and the progress bar), the evaluations' probe, and what
    its checkpoints record of it."""
    monitor: Monitor | None
    bar: object
    probe: Probe
    record: Record
    window: LossWindow  # the losses since the last log line, on the device
    profiler: StepProfiler | None  # --profile's


# ----------------------------------------------------------------------------- one step, eval

def train_step(runner: Runner, batches, step: int, t, ranks: Ranks):
    """One optimizer step over grad_accum_steps micro-batches. Returns device tensors (loss, grad_norm, ok).
    """
    loss_sum = torch.zeros((), device=batches.device)
    batch = batches.get(step, 0)
    for micro in range(t.grad_accum_steps):
        last_micro = micro == t.grad_accum_steps - 1
        if runner.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new replay may reuse the previous outputs' memory
        ranks.set_grad_sync(runner.model, last_micro)  # DDP all-reduces once, on the last micro-batch
        loss = runner.loss(batch) / t.grad_accum_steps
        loss_sum += loss.detach()  # read the graph output into a plain tensor before the next replay
        if not last_micro:
            batch = batches.get(step, micro + 1)  # fetch while the GPU still works on this forward
        (runner.scaler.scale(loss) if runner.scaler else loss).backward()
    params = [p for g in runner.opt.param_groups for p in g["params"]]
    if runner.scaler:
        runner.scaler.unscale_(runner.opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip or float("inf"))  # inf: measure only
    if isinstance(grad_norm, distributed.DTensor):  # FSDP2: each rank's share of the squares, summed
        grad_norm = grad_norm.full_tensor()
    ok = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)
    # skipped on the device: no host sync (GradScaler.step would read it)
    runner.opt.step(found_inf=(~ok).float())
    if runner.scaler:
        # lowers the scale after non-finite gradients unscale_ found, raises it after many fine
        runner.scaler.update()
    runner.opt.zero_grad(set_to_none=not runner.persistent_grads)
    return loss_sum, grad_norm, ok


def first_train_step(runner: Runner, batches, step: int, t, ranks: Ranks):
    """train_step, which compiles; after a compiler failure (no C compiler, say), eager from here on if
    allowed."""
    try:
        return train_step(runner, batches, step, t, ranks)
    except Exception as e:
        runner.fall_back(e, t, ranks)  # or raises e again
        return train_step(runner, batches, step, t, ranks)


def evaluate_and_log(plan: Plan, runner: Runner, session: Session, step: int, full: bool, last: bool = False,
                     batches: int = 0, until: float = math.inf) -> float:
    """The validation loss and, when full, the code metric and the samples (every rank computes them: under
    FSDP2 a forward needs every rank), recorded, plotted and written under the progress bar. The last one
    first leaves in the better of the weight average and the last step's weights. batches and until: the final
    one's under a time budget (RunClock.final_eval), where the time left may hold fewer than eval_batches."""
    planned, objective = plan.cfg.train.eval_batches, runner.objective
    n, now = batches or planned, time.monotonic()
    # The first pass has a third of the time left: a second (the weight average's) reads the same batches, and
    # a busy machine's second pass may run slower.
    deadlines = [now + (until - now) / 3 if until < math.inf else math.inf]

    def val_loss_now():
        nonlocal n
        until_now = deadlines.pop() if deadlines else math.inf
        loss, n = objective.evaluate(runner.eval_model, runner.amp, plan.val_batches, n,
                                     plan.ranks, until_now)
        return loss
    # (its val loss, a line saying which)
    chosen = runner.average.end_on_better(val_loss_now) if last else None
    if n < planned and session.monitor:
        session.bar.write(f"final evaluation on {n} of {planned} batches: the time budget left holds no more")
    if chosen and session.monitor:
        session.bar.write(chosen[1])
    val_loss = chosen[0] if chosen else val_loss_now()
    probe = session.probe
    with runner.amp:
        (code_ok, code_n), samples = ((probe.code(runner.raw_model), probe.samples(runner.raw_model)) if full
                                      else ((float("nan"), 0), []))
        scores = probe.scores(runner.raw_model) if full else []
    pairs = objective.kept(val_loss)  # a preference run's rewards of the weights that stay
    if session.monitor:
        r = session.monitor.eval_record(step, val_loss, plan.data.meta["val_bytes_per_token"],
                                        code_ok=code_ok, code_samples=code_n,
                                        **{f"acc_{s.task}": s.acc for s in scores},
                                        **({"scored_items": scores[0].items} if scores else {}), **pairs)
        code = (f", {objective.line(pairs)}" if pairs else "") + \
            (f", code {100 * code_ok:.0f}% of {code_n} bodies parse" if code_n else "")
        tasks = "".join(f", {s.task} {100 * s.acc:.1f}%" for s in scores)
        # a pair loss has neither
        per_token = "" if pairs else f", ppl {r['val_ppl']:.2f}, bpb {r['val_bpb']:.4f}"
        session.bar.write(f"step {step}: val loss {val_loss:.4f}{per_token}" + code + tasks)
        session.monitor.samples_record(step, samples)
        for sample in samples:  # the prompt, then what the model wrote after it
            session.bar.write(f"  {sample['prompt']!r} -> {sample['text']!r}")
    return val_loss


# ----------------------------------------------------------------------------- checkpoints, logging, the run

def save(plan: Plan, runner: Runner, session: Session, clock: RunClock,
         val_loss: float | None = None) -> str | None:
    """Write a checkpoint of the training state at its step (TrainingState.save: rank 0 writes, NaN refused).
    Every rank calls it. val_loss: the evaluation at this step, if there was one."""
    return runner.state.save(plan.cfg, plan.ranks, plan.data, session.record, clock.timer.state(), val_loss)


def evaluate_and_save(plan: Plan, runner: Runner, session: Session, clock: RunClock, step: int,
                      last_step: bool, stopping: bool) -> str | None:
    """At a step after the session's first: the evaluation where due (the final one at the run's end), then
    the checkpoint where due or stopping; the checkpoint's path, if one was written."""
    evals, timer, val_loss = clock.evals, clock.timer, None
    if last_step or evals.due(step):
        with timer.pause("eval", step):
            n, until = clock.final_eval() if last_step else (0, math.inf)  # a budget's end may hold fewer
            val_loss = evaluate_and_log(plan, runner, session, step, full=evals.full(step, last_step),
                                        last=last_step, batches=n, until=until)
        say(session, clock.evaluated(step, last_step))  # marked; the run's length is measured again
        runner.state.best_val = min(runner.state.best_val, val_loss)
    if last_step or stopping or evals.save_due(step):
        with timer.pause("save", step):
            return save(plan, runner, session, clock, val_loss)
    return None


def take_step(plan: Plan, runner: Runner, session: Session, clock: RunClock, step: int, first: int):
    """One training step at the schedule's rate, then the weight average and the counters; the log line where
    due."""
    t, state, started = plan.cfg.train, runner.state, time.perf_counter()
    lr_scale = lr_multiplier(clock.progress(step), t)
    set_lr(runner.opt, lr_scale)
    if step == first and not runner.eager:  # the bar would sit at its first step without a word
        say(session, "compiling the step: from an empty cache it takes 20-60 s on a "
                     "CPU, minutes for a large model")
    try:
        loss, grad_norm, ok = (first_train_step if step == first else train_step)(runner, plan.batches, step,
                                                                                   t, plan.ranks)
    # a user's reward function failed before the step changed anything: keep the work so far
    except RewardError:
        save(plan, runner, session, clock)
        raise
    if step == first and not runner.eager:
        say(session, f"the first step, compiled, took {time.perf_counter() - started:.0f} s")
    runner.average.update(step, clock.progress(step))
    session.window.add(loss, ok)
    state.advance(plan.tokens_per_step)
    if session.profiler:
        session.profiler.step(step + 1)  # the steps after the first two, which compile
    if clock.log_due(step + 1):
        say(session, clock.sync(step + 1))
        log_window(plan, runner, session, clock, grad_norm, lr_scale)
    epochs = state.tokens / plan.cfg.model.max_seq_len / plan.batches.epoch_sequences if t.epochs else None
    advance_bar(session.bar, clock, step + 1, epochs)


def write_run_config(cfg: Config):
    """config.json in the run folder: every value this run uses (after automatic sizing)."""
    atomic.write_text(os.path.join(cfg.train.run_dir, "config.json"), json.dumps(cfg.to_dict(), indent=2))


def log_window(plan: Plan, runner: Runner, session: Session, clock: RunClock, grad_norm, lr_scale: float):
    """The log line of the steps since the last one; stops the run after max_bad_steps skipped steps in a row.
    """
    step, window = runner.state.step, session.window
    worst = int(window.worst.item())  # sync point: the window's only host reads of the device
    if worst >= plan.cfg.train.max_bad_steps:
        raise FloatingPointError(f"{worst} consecutive steps had a non-finite loss or gradient (by step "
                                 f"{step}); those updates were skipped, no checkpoint holds NaN. Lower "
                                 "--learning_rate or use --precision fp32, then --resume")
    mean_loss = plan.ranks.mean(window.mean()).item()
    pairs = runner.objective.take(plan.ranks)  # a preference run's rewards
    if session.monitor:
        lrs = {f"lr_{name}": lr for name, lr in runner.opt.lrs().items()}
        step_s = clock.timer.agreed.step_s if clock.timer.agreed.measured else None  # the first step compiles
        r = session.monitor.train_record(step, runner.state.tokens, mean_loss, lr_scale, lrs,
                                         grad_norm.item(), step_s, compiled=not runner.eager, extra=pairs)
        session.bar.set_postfix(format_postfix(r), refresh=False)


def say(session: Session, line: str | None):
    """A line under the progress bar (rank 0), where there is one."""
    if line and session.monitor:
        session.bar.write(line)


# ----------------------------------------------------------------------------- main

def open_session(plan: Plan, runner: Runner, launch: float, argv) -> tuple[Session, RunClock]:
    """The clock, config.json, the start report, the monitor and the progress bar of this session."""
    cfg, t, ranks, device, start = plan.cfg, plan.cfg.train, plan.ranks, plan.device, runner.state.step
    clock = RunClock(t, launch, ranks, start, params=sum(p.numel() for p in runner.raw_model.parameters()),
                     **runner.state.clock)
    if ranks.is_main:
        write_run_config(cfg)  # only now: every check has passed and automatic sizing is done
    monitor = Monitor(t.run_dir, device, flops_per_token(cfg.model), plan.tokens_per_step,
                      tensorboard=t.tensorboard, wandb=t.wandb, config=cfg.to_dict(),
                      world_size=ranks.world_size,
                      resume_step=start if plan.ckpt else None) if ranks.is_main else None
    probe = Probe(runner.raw_model.config, plan.data, python=is_bundled(cfg.data), prompts=t.sample_prompts,
                  tasks=t.eval_tasks,
                  task_items=t.eval_task_items or (GPU_TASK_ITEMS if device.type == "cuda" else 0))
    precision = precision_label(t.precision, runner.amp_dtype, runner.raw_model)
    ranks.print((f"resumed from {plan.ckpt} at step {start}\n" if plan.ckpt else "") + start_report(
        cfg, device, runner.raw_model, runner.opt, precision=precision, ranks=ranks, row=plan.row,
        tokens_per_step=plan.tokens_per_step,
        compile_fallback=falls_back(t, device)) + "\n" + probe.describe())
    args = sys.argv[1:] if argv is None else argv
    command = f"{ranks.launcher()} gpu_training_optimized.py {shlex.join(map(str, args))}"
    profiler = StepProfiler(t.run_dir, device, first=start + 2) if t.profile and ranks.is_main else None
    session = Session(monitor=monitor, bar=progress_bar(clock, start, enabled=ranks.is_main), probe=probe,
                      record=Record(command, device_report(device), precision, plan.lora_meta),
                      window=LossWindow(device), profiler=profiler)
    return session, clock


def write_report_card(plan: Plan, session: Session, ckpt: str | None) -> str:
    """The run's report card (report.md, report.json) from its newest full evaluation's scores; the lines the
    summary prints of it ("" without scores)."""
    scores, probe = session.probe.last_scores, session.probe
    if not scores or not ckpt:
        return ""
    device = str(session.monitor.device) if session.monitor else ""
    items = max(s.items for s in scores)
    text = report_card.report(ckpt, scores, items, probe.chances, device)
    run_dir = plan.cfg.train.run_dir
    report_card.write_report(run_dir, text, report_card.as_json(scores, ckpt, items, probe.chances), scores,
                             probe.chances)
    return f"\n{report_card.table(scores, probe.chances)}\nreport card: {run_dir}/report.md"


def trained_short(cfg: Config, data: PreparedData) -> str:
    """The summary's line where the run had fewer tokens than its target: a corpus still arriving counts once
    in."""
    return short_of_target(cfg.data, data.meta) if data.arrived else ""


def learned(plan: Plan) -> str:
    """The summary's line where the run's training loss (a GRPO run's reward) moved less than its noise."""
    key = "reward" if plan.cfg.train.objective == "grpo" else "loss"
    return stood_still(read_metrics(plan.cfg.train.run_dir, "train"), key)


def finish(plan: Plan, runner: Runner, session: Session, clock: RunClock, first: int, ckpt: str | None,
           data_lost: bool, interrupted: bool):
    """After the loop: the end of a run that never stepped or lost its data, else the summary (rank 0)."""
    t, state = plan.cfg.train, runner.state
    if state.step == first and not plan.ckpt and not data_lost:
        raise ConfigError(f"the {t.max_minutes:g}-minute budget was spent before the "
                          f"first step ({clock.timer.spent_s():.0f} s on data preparation "
                          "and setup), raise --max_minutes")
    if session.monitor:
        session.monitor.close()
    if data_lost:  # the corpus stopped arriving (the Hub, the disk): the work up to here is saved
        raise stopped_by(plan.batches.failure, state.step, ckpt)
    if plan.ranks.is_main:
        print(summary(step=state.step, tokens=state.tokens, seconds=clock.timer.spent_s(),
                      best_val=state.best_val, bytes_per_token=plan.data.meta["val_bytes_per_token"],
                      ckpt=ckpt, device=plan.device, interrupted=interrupted, launcher=plan.ranks.launcher(),
                      base=t.init_from if t.lora_rank else "")
              + runner.objective.summary()
              + "\n" + clock.evals.report() + write_report_card(plan, session, ckpt)
              + "".join(f"\n{line}" for line in [trained_short(plan.cfg, plan.data), learned(plan)] if line))
    # no rank closes its connections while another still talks to it (gloo aborts on that)
    plan.ranks.barrier()
    plan.ranks.cleanup()


def make_plan(argv) -> Plan:
    """The run settled once, before any model exists: flags parsed, processes joined, device picked, data
    read."""
    cfg, _ = parse_config(argv)
    ranks = distributed.setup()
    device = pick_device((cfg.train.device if not ranks.enabled
                          else ("cuda" if torch.cuda.is_available() else "cpu")), ranks.local_rank)
    if cfg.train.deterministic:
        make_deterministic()
    return settle(cfg, ranks, device)


@distributed.record  # under torchrun: the failing rank's error becomes the 'Root Cause' of torchrun's report
def main(argv=None) -> int:
    launch = PROCESS_START if __name__ == "__main__" else time.monotonic()  # a time budget counts from here
    # the final config, processes, device, data, and the checkpoint a --resume continues
    plan = make_plan(argv)
    runner, plan = runner_for(plan)  # the model, its state and how its step runs, decided once
    # what setup freed on the host (the weights' read copy, a reference pass) leaves it
    release_freed_memory()
    session, clock = open_session(plan, runner, launch, argv)  # the start report, the clock, the bar
    first, batches, stop, last_ckpt = runner.state.step, plan.batches, StopFlag(), None
    runner.warm_evaluation(plan.val_batches, plan.cfg.train, plan.ranks)  # before the clock times anything

    say(session, clock.sync(first))
    while True:
        step = runner.state.step
        last_step = clock.finished(step)  # max_steps done, or the budget holds no other
        # A download that failed ends the run here, at the next step, not at the step that would need its
        # part.
        data_lost = not last_step and batches.failure is not None
        # still arriving: a wait is budget, not a step
        if not (last_step or data_lost) and not batches.in_hand(step):
            with clock.timer.pause("wait", step):
                data_lost = not batches.ready(step, give_up=lambda: stop.requested or clock.out_of_time())
            last_step = clock.finished(step)  # the wait spent budget, perhaps all of it
        stopping = plan.ranks.stop_vote(stop.requested or data_lost)  # every rank stops at the same step
        if step > first:  # a new run has nothing to evaluate yet; a resumed one did both before it stopped
            last_ckpt = (evaluate_and_save(plan, runner, session, clock, step, last_step, stopping)
                         or last_ckpt)
        if last_step or (stopping and step > first):
            break
        take_step(plan, runner, session, clock, step, first)  # the rate, the step, the average, a log line
    session.bar.close()
    finish(plan, runner, session, clock, first, last_ckpt, data_lost, interrupted=stopping and not last_step)
    # An unfinished run exits 130 or 143, so `train && export` stops; under torchrun rank 0 alone says it,
    # since a rank's failing exit makes torchrun end the others, which would cut rank 0's last writes.
    return stop.exit_status() if stopping and not last_step and plan.ranks.is_main else 0


@error_contract
def run(argv=None) -> int:
    """main() under the error contract of DESIGN.md, with the trainer's advice for its own failures."""
    try:
        return main(argv)
    except torch.OutOfMemoryError:
        raise RunFailure("out of GPU memory; lower --micro_batch_size (raise --grad_accum_steps to keep "
                         "tokens per step), lower --max_seq_len, set --gradient_checkpointing true, try "
                         "--auto_micro_batch true, or pick a smaller --preset") from None
    except BrokenPipeError:
        raise
    except OSError as e:  # a write outside the checkpoint (metrics, the loss plot) the disk refused
        raise atomic.write_error(e, "writing the run's files", where=e.filename or "") from None


if __name__ == "__main__":
    sys.exit(run())
