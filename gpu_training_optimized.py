"""Train the model. With no arguments: config.py's automatic fields sized for the machine (llm/autofill.py): on a CPU
the tiny preset for ten minutes on the bundled corpus (the standard library's sources), on a GPU the preset an
hour's compute suits, into runs/default; then `python text_generator.py` samples from it.

    python gpu_training_optimized.py --preset small --max_steps 2000 --micro_batch_size 16
    python gpu_training_optimized.py --resume                     # continue runs/default exactly
    torchrun --nproc_per_node=8 gpu_training_optimized.py --preset medium
`--help` lists every setting. Ctrl-C or SIGTERM finishes the step, saves, and prints how to resume.
"""

import time

PROCESS_START = time.monotonic()  # run as a script, a time budget counts from here: the imports below are in it

import json
import math
import os
import shlex
import signal
import sys
from dataclasses import dataclass, replace

if __name__ == "__main__":  # a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from config import Config
from llm import atomic
from llm import distributed, preference, report_card
from llm.distributed import Ranks
from llm.arrival import stopped_by
from llm.averaging import WeightAverage
from llm.batches import Batches
from llm.cli import parse_config
from llm.corpus import is_bundled
from llm.device import (autocast, compile_model, eager_or_stop, falls_back, float8_training, is_compile_failure,
                        keep_freed_memory, keep_grads, machine, make_deterministic, pick_device, pick_precision,
                        precision_label, release_freed_memory, uses_cuda_graphs)
from llm.errors import ConfigError, RunFailure, error_contract
from llm.evaluation import GPU_TASK_ITEMS, Probe, validation_loss
from llm.lora import add_adapters
from llm.monitor import (LossWindow, Monitor, StepProfiler, advance_bar, device_report, format_postfix, progress_bar,
                         start_report, summary)
from llm.preparation import short_of_target
from llm.resume import load_into
from llm.schedule import RunClock, StopFlag, lr_multiplier, set_lr
from llm.sizing import flops_per_token
from llm.startup import Plan, new_model, settle
from llm.step_settings import loss_chunk_rows, matmul_attention
from llm.token_cache import PreparedData
from llm.trainer_state import Record, TrainingState
from modern_llm import Execution, Transformer
from muon_optimizer import MuonAdamW, build_optimizer


# ----------------------------------------------------------------------------- build

@dataclass
class Built:
    """What build() returns: the training state (the model uncompiled, its optimizer, scaler and average, the
    counters) and how a step runs on this device: the model wrapped and compiled, autocast, the objective."""
    state: TrainingState
    model: torch.nn.Module  # DDP- or FSDP2-wrapped under torchrun, else the raw model: gradient-sync control
    compiled: torch.nn.Module  # what the step calls
    amp_dtype: torch.dtype | None
    amp: object  # the autocast context of amp_dtype
    cudagraphs: bool  # the compile mode captures CUDA graphs
    persistent_grads: bool = False  # .grad in fixed buffers zeroed in place, never None (under CUDA graphs)
    eval_model: torch.nn.Module | None = None  # what evaluation calls: raw_model, or its own compiled graph (fp8)
    objective: preference.Objective | None = None  # a preference run's loss; else the model's own next-token loss

    @property
    def raw_model(self) -> torch.nn.Module:  # uncompiled and unwrapped: checkpoints, other shapes, sampling
        return self.state.model

    @property
    def opt(self) -> MuonAdamW:
        return self.state.opt

    @property
    def scaler(self) -> torch.amp.GradScaler | None:  # fp16 only
        return self.state.scaler

    @property
    def average(self) -> WeightAverage:  # of the trained weights, which the run ends on
        return self.state.average

    def evaluate_eagerly(self):
        """After a compiler failure in evaluation's own graph: evaluation runs the model as it is."""
        self.eval_model = self.state.model

    def run_eagerly(self):
        """After a compiler failure: the step runs the model as it is, and the optimizer uncompiled."""
        self.opt.zero_grad(set_to_none=not self.persistent_grads)
        self.compiled, self.cudagraphs = self.model, False
        self.opt.use_compile(False)


def build(cfg: Config, device: torch.device, ranks: Ranks, raw_model: torch.nn.Module | None = None,
          init_state: dict | None = None) -> Built:
    """Model, wrapping, optimizer, loss scaler and compiled step for cfg on device. raw_model replaces our
    Transformer (the benchmarks pass a transformers twin); init_state holds weights to start from."""
    t = cfg.train
    amp_dtype = pick_precision(t.precision, device)
    if t.data_parallel == "fsdp" and amp_dtype == torch.float16 and ranks.enabled:
        raise ConfigError("--data_parallel fsdp needs bf16 or fp32, not fp16 with loss scaling: pass "
                          "--precision fp32, or use --data_parallel ddp on a GPU without bf16")
    amp = autocast(device, amp_dtype)
    if device.type == "cpu":
        keep_freed_memory()  # before the steps' first allocations
    raw_model = new_model(cfg, device) if raw_model is None else raw_model.to(device)
    if init_state is not None:
        raw_model.load_stored(init_state)
    if t.lora_rank:
        raw_model = add_adapters(raw_model, t, amp_dtype)  # freezes the base: only the adapters train
    if isinstance(raw_model, Transformer):
        # A bf16 residual stream saves a GPU's bandwidth; on a CPU it saves no time and learned a little less.
        stream = torch.bfloat16 if device.type == "cuda" and amp_dtype == torch.bfloat16 else None
        raw_model.execution = Execution(loss_chunk_rows(cfg, machine(device)), matmul_attention(cfg, machine(device)),
                                        stream)
    if t.precision == "fp8":
        raw_model = float8_training(raw_model)  # before sharding and compiling, as torchao asks
    model = ranks.wrap(raw_model, t.data_parallel, param_dtype=amp_dtype)
    opt = build_optimizer(raw_model, t)
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    cudagraphs = uses_cuda_graphs(t.compile, device)
    if cudagraphs:
        keep_grads(opt)
    # Eager FP8 layers cast and scale in unfused kernels: evaluation gets a graph of its own, warmed before timing.
    eval_model = compile_model(raw_model, "default") if t.precision == "fp8" and t.compile != "off" else raw_model
    return Built(state=TrainingState(raw_model, opt, scaler, WeightAverage(raw_model, t.weight_average)),
                 model=model, compiled=compile_model(model, t.compile, amp_dtype), amp_dtype=amp_dtype, amp=amp,
                 cudagraphs=cudagraphs, persistent_grads=cudagraphs, eval_model=eval_model)


def build_run(plan: Plan) -> tuple[Built, Plan]:
    """build() for the plan, its objective, and the state a --resume continues (a new run's at step 0); and the plan
    without --init_from's weights, which the model holds now (their read copy goes with the caller's old plan)."""
    built = build(plan.cfg, plan.device, plan.ranks, init_state=plan.init_state)
    # Before a checkpoint loads, so that a reference pass reads the weights the run started from.
    built.objective = preference.objective_for(plan, built, plan.ranks.print)
    load_into(built.state, plan.ckpt, plan.saved, plan.cfg.train.run_dir)
    return built, replace(plan, init_state=None)


@dataclass
class Session:
    """What evaluations, checkpoints and log lines read besides the model side (Built): the settled config, the
    processes, the data, the clock and where this session reports (rank 0: the monitor and the progress bar)."""
    cfg: Config
    ranks: Ranks
    data: PreparedData
    val_batches: Batches
    clock: RunClock
    monitor: Monitor | None
    bar: object
    probe: Probe
    tokens_per_step: int  # over every rank
    record: Record  # what its checkpoints record of it


# ----------------------------------------------------------------------------- one step, eval

def train_step(built: Built, batches, step: int, t, ranks: Ranks):
    """One optimizer step over grad_accum_steps micro-batches. Returns device tensors (loss, grad_norm, ok)."""
    loss_sum = torch.zeros((), device=batches.device)
    batch = batches.get(step, 0)
    for micro in range(t.grad_accum_steps):
        last_micro = micro == t.grad_accum_steps - 1
        if built.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new replay may reuse the previous outputs' memory
        ranks.set_grad_sync(built.model, last_micro)  # DDP all-reduces once, on the last micro-batch
        with built.amp:
            loss = (built.objective(built.compiled, batch) if built.objective else
                    built.compiled(batch[0], labels=batch[1], positions=batch[2])[1]) / t.grad_accum_steps
        loss_sum += loss.detach()  # read the graph output into a plain tensor before the next replay
        if not last_micro:
            batch = batches.get(step, micro + 1)  # fetch while the GPU still works on this forward
        (built.scaler.scale(loss) if built.scaler else loss).backward()
    params = [p for g in built.opt.param_groups for p in g["params"]]
    if built.scaler:
        built.scaler.unscale_(built.opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip or float("inf"))  # inf: measure only
    if isinstance(grad_norm, distributed.DTensor):  # FSDP2: each rank's share of the squares, summed
        grad_norm = grad_norm.full_tensor()
    ok = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)
    built.opt.step(found_inf=(~ok).float())  # skipped on the device: no host sync (GradScaler.step would read it)
    if built.scaler:
        built.scaler.update()  # lowers the scale after non-finite gradients unscale_ found, raises it after many fine
    built.opt.zero_grad(set_to_none=not built.persistent_grads)
    return loss_sum, grad_norm, ok


def first_train_step(built: Built, batches, step: int, t, ranks: Ranks):
    """train_step, which compiles; after a compiler failure (no C compiler, say), eager from here on if allowed."""
    try:
        return train_step(built, batches, step, t, ranks)
    except Exception as e:
        if built.compiled is built.model or not is_compile_failure(e):
            raise
        ranks.print(eager_or_stop(e, t, built.state.model, "training"))
        built.run_eagerly()
        return train_step(built, batches, step, t, ranks)


def warm_eval_model(built: Built, val_batches, t, ranks: Ranks):
    """Compile evaluation's own graph (FP8 runs) before the loop times anything, eager after a compiler failure
    if allowed."""
    if built.eval_model is built.raw_model:
        return
    try:
        validation_loss(built.eval_model, built.amp, val_batches, 1, ranks, objective=built.objective)  # compiles it
    except Exception as e:
        if not is_compile_failure(e):
            raise
        ranks.print(eager_or_stop(e, t, built.state.model, "evaluating"))
        built.evaluate_eagerly()


def evaluate_and_log(session: Session, built: Built, step: int, full: bool, last: bool = False, batches: int = 0,
                     until: float = math.inf) -> float:
    """The validation loss and, when full, the code metric and the samples (every rank computes them: under
    FSDP2 a forward needs every rank), recorded, plotted and written under the progress bar. The last one first
    leaves in the better of the weight average and the last step's weights. batches and until: the final one's
    under a time budget (RunClock.final_eval), where the time left may hold fewer than eval_batches."""
    planned = session.cfg.train.eval_batches
    n, now = batches or planned, time.monotonic()
    # The first pass has a third of the time left: a second (the weight average's) reads the same batches, and a
    # busy machine's second pass may run slower.
    deadlines = [now + (until - now) / 3 if until < math.inf else math.inf]

    def val_loss_now():
        nonlocal n
        loss, n = validation_loss(built.eval_model, built.amp, session.val_batches, n, session.ranks,
                           deadlines.pop() if deadlines else math.inf, built.objective)
        return loss
    chosen = built.average.end_on_better(val_loss_now) if last else None  # (its val loss, a line saying which)
    if n < planned and session.monitor:
        session.bar.write(f"final evaluation on {n} of {planned} batches: the time budget left holds no more")
    if chosen and session.monitor:
        session.bar.write(chosen[1])
    val_loss = chosen[0] if chosen else val_loss_now()
    probe = session.probe
    with built.amp:
        (code_ok, code_n), samples = (probe.code(built.raw_model), probe.samples(built.raw_model)) if full else \
            ((float("nan"), 0), [])
        scores = probe.scores(built.raw_model) if full else []
    pairs = built.objective.kept(val_loss) if built.objective else {}  # the rewards of the weights that stay
    if session.monitor:
        r = session.monitor.eval_record(step, val_loss, session.data.meta["val_bytes_per_token"], code_ok=code_ok,
                                        code_samples=code_n, **{f"acc_{s.task}": s.acc for s in scores},
                                        **({"scored_items": scores[0].items} if scores else {}),
                                        **pairs)
        code = (f", {built.objective.line(pairs)}" if pairs else "") + \
            (f", code {100 * code_ok:.0f}% of {code_n} bodies parse" if code_n else "")
        tasks = "".join(f", {s.task} {100 * s.acc:.1f}%" for s in scores)
        per_token = "" if pairs else f", ppl {r['val_ppl']:.2f}, bpb {r['val_bpb']:.4f}"  # a pair loss has neither
        session.bar.write(f"step {step}: val loss {val_loss:.4f}{per_token}" + code + tasks)
        session.monitor.samples_record(step, samples)
        for sample in samples:
            session.bar.write(f"  {sample['prompt'] + sample['text']!r}")
    return val_loss


# ----------------------------------------------------------------------------- checkpoints, logging, the run

def save(session: Session, built: Built, val_loss: float | None = None) -> str | None:
    """Write a checkpoint of the training state at its step (TrainingState.save: rank 0 writes, NaN refused).
    Every rank calls it. val_loss: the evaluation at this step, if there was one."""
    return built.state.save(session.cfg, session.ranks, session.data, session.record, session.clock.timer.state(),
                            val_loss)


def write_run_config(cfg: Config):
    """config.json in the run folder: every value this run uses (after automatic sizing)."""
    atomic.write_text(os.path.join(cfg.train.run_dir, "config.json"), json.dumps(cfg.to_dict(), indent=2))


def log_window(session: Session, built: Built, window: LossWindow, grad_norm, lr_scale: float):
    """The log line of the steps since the last one; stops the run after max_bad_steps skipped steps in a row."""
    step, worst = built.state.step, int(window.worst.item())  # sync point: the window's only host reads of the device
    if worst >= session.cfg.train.max_bad_steps:
        raise FloatingPointError(f"{worst} consecutive steps had a non-finite loss or gradient (by step {step}); "
                                 "those updates were skipped, no checkpoint holds NaN. Lower --learning_rate or "
                                 "use --precision fp32, then --resume")
    mean_loss = session.ranks.mean(window.mean()).item()
    pairs = built.objective.take(session.ranks) if built.objective else {}  # a preference run's rewards
    if session.monitor:
        lrs = {f"lr_{name}": lr for name, lr in built.opt.lrs().items()}
        step_s = session.clock.timer.step_s if session.clock.timer.measured else None  # the first step compiles: no speed
        r = session.monitor.train_record(step, built.state.tokens, mean_loss, lr_scale, lrs, grad_norm.item(), step_s,
                                         compiled=built.compiled is not built.model, extra=pairs)
        session.bar.set_postfix(format_postfix(r), refresh=False)


def say(session: Session, line: str | None):
    """A line under the progress bar (rank 0), where there is one."""
    if line and session.monitor:
        session.bar.write(line)


# ----------------------------------------------------------------------------- main

def open_session(plan: Plan, built: Built, launch: float, argv) -> Session:
    """The clock, config.json, the start report, the monitor and the progress bar of this session."""
    cfg, t, ranks, device, start = plan.cfg, plan.cfg.train, plan.ranks, plan.device, built.state.step
    clock = RunClock(t, launch, ranks, start, params=sum(p.numel() for p in built.raw_model.parameters()),
                     **built.state.clock)
    if ranks.is_main:
        write_run_config(cfg)  # only now: every check has passed and automatic sizing is done
    tokens_per_step = t.micro_batch_size * cfg.model.max_seq_len * t.grad_accum_steps * ranks.world_size
    monitor = Monitor(t.run_dir, device, flops_per_token(cfg.model), tokens_per_step, tensorboard=t.tensorboard,
                      wandb=t.wandb, config=cfg.to_dict(), world_size=ranks.world_size,
                      resume_step=start if plan.ckpt else None) if ranks.is_main else None
    probe = Probe(built.raw_model.config, plan.data, python=is_bundled(cfg.data), prompts=t.sample_prompts,
                  tasks=t.eval_tasks,
                  task_items=t.eval_task_items or (GPU_TASK_ITEMS if device.type == "cuda" else 0))
    precision = precision_label(t.precision, built.amp_dtype, built.raw_model)
    ranks.print((f"resumed from {plan.ckpt} at step {start}\n" if plan.ckpt else "") + start_report(
        cfg, device, built.raw_model, built.opt, precision=precision, ranks=ranks, tokens_per_step=tokens_per_step,
        compile_fallback=falls_back(t, device)) + "\n" + probe.describe())
    args = sys.argv[1:] if argv is None else argv
    command = f"{ranks.launcher()} gpu_training_optimized.py {shlex.join(map(str, args))}"
    return Session(cfg=cfg, ranks=ranks, data=plan.data, val_batches=plan.val_batches, clock=clock, monitor=monitor,
                   tokens_per_step=tokens_per_step, bar=progress_bar(clock, start, enabled=ranks.is_main),
                   probe=probe, record=Record(command, device_report(device), precision, plan.lora_meta))


def write_report_card(session: Session, ckpt: str | None) -> str:
    """The run's report card (report.md, report.json) from its newest full evaluation's scores; the lines the
    summary prints of it ("" without scores)."""
    scores, probe = session.probe.last_scores, session.probe
    if not scores or not ckpt:
        return ""
    device = str(session.monitor.device) if session.monitor else ""
    items = max(s.items for s in scores)
    text = report_card.report(ckpt, scores, items, probe.chances, device)
    report_card.write_report(session.cfg.train.run_dir, text, report_card.as_json(scores, ckpt, items, probe.chances))
    return f"\n{report_card.table(scores, probe.chances)}\nreport card: {session.cfg.train.run_dir}/report.md"


def trained_short(cfg: Config, data: PreparedData) -> str:
    """The summary's line where the run had fewer tokens than its target: a corpus still arriving counts once in."""
    return short_of_target(cfg.data, data.meta) if data.arrived else ""


def finish(plan: Plan, built: Built, session: Session, first: int, ckpt: str | None, data_lost: bool,
           interrupted: bool):
    """After the loop: the end of a run that never stepped or lost its data, else the summary (rank 0)."""
    t, clock, state = plan.cfg.train, session.clock, built.state
    if state.step == first and not plan.ckpt and not data_lost:
        raise ConfigError(f"the {t.max_minutes:g}-minute budget was spent before the first step "
                          f"({clock.timer.spent_s():.0f} s on data preparation and setup), raise --max_minutes")
    if session.monitor:
        session.monitor.close()
    if data_lost:  # the corpus stopped arriving (the Hub, the disk): the work up to here is saved
        raise stopped_by(plan.batches.failure, state.step, ckpt)
    if plan.ranks.is_main:
        print(summary(step=state.step, tokens=state.tokens, seconds=clock.timer.spent_s(), best_val=state.best_val,
                      bytes_per_token=plan.data.meta["val_bytes_per_token"], ckpt=ckpt, device=plan.device,
                      interrupted=interrupted, launcher=plan.ranks.launcher(), base=t.init_from if t.lora_rank else "")
              + (built.objective.summary() if built.objective else "")
              + "\n" + clock.evals.report() + write_report_card(session, ckpt)
              + "".join(f"\n{line}" for line in [trained_short(plan.cfg, plan.data)] if line))
    plan.ranks.barrier()  # no rank closes its connections while another still talks to it (gloo aborts on that)
    plan.ranks.cleanup()


def make_plan(argv) -> Plan:
    """The run settled once, before any model exists: flags parsed, processes joined, device picked, data read."""
    cfg, _ = parse_config(argv)
    ranks = distributed.setup()
    device = pick_device(cfg.train.device if not ranks.enabled else ("cuda" if torch.cuda.is_available() else "cpu"),
                         ranks.local_rank)
    if cfg.train.deterministic:
        make_deterministic()
    return settle(cfg, ranks, device)


@distributed.record  # under torchrun: the failing rank's error becomes the 'Root Cause' of torchrun's report
def main(argv=None) -> int:
    launch = PROCESS_START if __name__ == "__main__" else time.monotonic()  # a time budget counts from here
    plan = make_plan(argv)  # the final config, processes, device, data, and the checkpoint a --resume continues
    cfg, t, ranks, batches = plan.cfg, plan.cfg.train, plan.ranks, plan.batches
    built, plan = build_run(plan)
    release_freed_memory()  # what setup freed on the host (the weights' read copy, a reference pass) leaves it
    state, first = built.state, built.state.step
    session = open_session(plan, built, launch, argv)
    clock, timer, evals = session.clock, session.clock.timer, session.clock.evals  # run length, timer, evaluations
    stop, window, last_ckpt = StopFlag(), LossWindow(plan.device), None
    warm_eval_model(built, plan.val_batches, t, ranks)
    profiler = StepProfiler(t.run_dir, plan.device, first=first + 2) if t.profile and ranks.is_main else None

    say(session, clock.sync(first))
    while True:
        step = state.step
        last_step = clock.finished(step)  # max_steps done, or the budget holds no other
        # A download that failed ends the run here, at the next step, not at the step that would need its part.
        data_lost = not last_step and batches.failure is not None
        if not (last_step or data_lost) and not batches.in_hand(step):  # still arriving: a wait is budget, not a step
            with timer.pause("wait", step):
                data_lost = not batches.ready(step, give_up=lambda: stop.requested or clock.out_of_time())
            last_step = clock.finished(step)  # the wait spent budget, perhaps all of it
        stopping = ranks.stop_vote(stop.requested or data_lost)  # every rank stops at the same step, whichever asked
        if step > first:  # a new run has nothing to evaluate yet; a resumed one did both before it stopped
            val_loss = None
            if last_step or evals.due(step):
                with timer.pause("eval", step):
                    n, until = clock.final_eval() if last_step else (0, math.inf)  # a budget's end may hold fewer
                    val_loss = evaluate_and_log(session, built, step, full=evals.full(step, last_step), last=last_step,
                                                batches=n, until=until)
                say(session, clock.evaluated(step, last_step))  # marked; the run's length is measured again
                state.best_val = min(state.best_val, val_loss)
            if last_step or stopping or evals.save_due(step):
                with timer.pause("save", step):
                    last_ckpt = save(session, built, val_loss) or last_ckpt
        if last_step or (stopping and step > first):
            break

        lr_scale = lr_multiplier(clock.progress(step), t)
        set_lr(built.opt, lr_scale)
        loss, grad_norm, ok = (first_train_step if step == first else train_step)(built, batches, step, t, ranks)
        built.average.update(step, clock.progress(step))
        window.add(loss, ok)
        state.advance(session.tokens_per_step)
        if profiler:
            profiler.step(step + 1)  # the steps after the first two, which compile
        if clock.log_due(step + 1):
            say(session, clock.sync(step + 1))
            log_window(session, built, window, grad_norm, lr_scale)
        advance_bar(session.bar, clock, step + 1, state.tokens / cfg.model.max_seq_len / batches.epoch_sequences
                    if t.epochs else None)
    session.bar.close()
    finish(plan, built, session, first, last_ckpt, data_lost, interrupted=stopping and not last_step)
    # An unfinished run exits 130 or 143, so `train && export` stops; under torchrun rank 0 alone says it, since a
    # rank's failing exit makes torchrun end the others, which would cut rank 0's last writes.
    return stop.exit_status() if stopping and not last_step and ranks.is_main else 0


@error_contract
def run(argv=None) -> int:
    """main() under the error contract of DESIGN.md, with the trainer's advice for its own failures."""
    try:
        return main(argv)
    except torch.OutOfMemoryError:
        raise RunFailure("out of GPU memory; lower --micro_batch_size (raise --grad_accum_steps to keep tokens per "
                         "step), lower --max_seq_len, set --gradient_checkpointing true, try --auto_micro_batch "
                         "true, or pick a smaller --preset") from None
    except BrokenPipeError:
        raise
    except OSError as e:  # a write outside the checkpoint (metrics, the loss plot) the disk refused
        raise atomic.write_error(e, "writing the run's files", where=e.filename or "") from None


if __name__ == "__main__":
    sys.exit(run())
