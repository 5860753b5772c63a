"""Tests of the training loop on CPU with a tiny model: end to end, accumulation, exact resume, signals,
the NaN guard, corrupt checkpoints and the metrics file."""

import contextlib
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import gpu_training_optimized as trainer
from config import Config, TrainConfig
from conftest import stopped_after, write_greetings
from llm.base import distributed
from llm.base.device import keep_grads
from llm.base.errors import ConfigError
from llm.formats import checkpoint as ckpt_io
from llm.formats.loading import read_model
from llm.reports.monitor import read_metrics as read_all
from llm.scores.evaluation import EVAL_SHARE
from llm.train import startup
from llm.train import runner as step_runner
from llm.train.plan import step_settings
from llm.train.runner import build
from llm.train.schedule import RunClock, lr_multiplier
from modern_llm import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_metrics(run_dir, kind="train"):
    return read_all(str(run_dir), kind)


def test_default_command_end_to_end_writes_loadable_checkpoint(corpus, tmp_path, argv_for):
    """The main command must train, evaluate and leave a checkpoint the generator can load, with every field
    promised in metrics.jsonl and bits per byte computed from meta.json."""
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 12, "--eval_interval", 6, "--save_interval", 6)) == 0
    ckpt = ckpt_io.latest_checkpoint(str(run))
    assert ckpt.endswith("step_000012")
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "model.safetensors", "model_config.json", "tokenizer.json",
                                        "trainer_state.pt"]
    model = Transformer(ckpt_io.load_model_config(ckpt))
    ckpt_io.load_weights(ckpt, model)
    state = ckpt_io.load_trainer_state(ckpt)  # weights_only=True inside
    assert state["step"] == 12 and state["tokens"] == 12 * 4 * 64
    train = read_metrics(run)
    assert [r["step"] for r in train] == list(range(1, 13))
    for field in ("loss", "lr_scale", "lr_muon", "lr_adamw", "grad_norm", "tokens", "tokens_per_s", "steps_per_s",
                  "mfu", "ram_gb", "gpu_util", "vram_gb"):
        assert field in train[0]
    # Both parts' rates are logged by name, each its own peak times the schedule (tiny: Muon 0.01, AdamW
    # 5e-3).
    assert train[0]["lr_muon"] == pytest.approx(0.01 * train[0]["lr_scale"])
    assert train[0]["lr_adamw"] == pytest.approx(5e-3 * train[0]["lr_scale"])
    assert train[0]["tokens_per_s"] is None  # the first step (compilation) is not timed, not reported as 0
    assert all(r["tokens_per_s"] > 0 and r["steps_per_s"] > 0 for r in train[1:])
    assert train[-1]["loss"] < train[0]["loss"]
    evals = read_metrics(run, "eval")
    assert [r["step"] for r in evals] == [6, 12]
    cache = next(os.path.join(corpus["cache"], d) for d in os.listdir(corpus["cache"]) if not d.startswith("."))
    parts = [json.load(open(p, encoding="utf-8")) for p in glob.glob(os.path.join(cache, "shards", "*", "part.json"))]
    bytes_per_token = sum(p["val_bytes"] for p in parts) / sum(p["val_tokens"] for p in parts)
    r = evals[-1]
    assert math.isclose(r["val_bpb"], r["val_loss"] / math.log(2) / bytes_per_token, rel_tol=1e-9)
    assert math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-5)
    assert math.isclose(state["best_val_loss"], min(e["val_loss"] for e in evals), rel_tol=1e-9)
    # What the model writes, at each evaluation: the code metric beside the loss (no documented function of
    # the validation text fits this 64-token model's prompt room, so it is reported as not measured), samples.
    assert all(r["code_ok"] is None and not r["code_samples"] for r in evals)
    samples = read_all(str(run), file="samples.jsonl")
    at_6, at_12 = ([s["prompt"] for s in samples if s["step"] == k] for k in (6, 12))
    assert at_6 and at_6 == at_12 and len(samples) == 2 * len(at_6)  # the same prompts at every evaluation
    assert all(isinstance(s["prompt"], str) and isinstance(s["text"], str) for s in samples)
    assert json.load(open(run / "config.json"))["train"]["max_steps"] == 12


def built(cfg: Config):
    """The trainer's Runner for cfg on this CPU, its step set as a run's plan sets it."""
    cpu = torch.device("cpu")
    return build(cfg, step_settings(cfg, cpu), cpu, distributed.setup())


class FixedBatches:
    """Micro-batches cut from one fixed batch, to compare accumulation with one large batch."""

    def __init__(self, x, y, micro):
        self.x, self.y, self.micro, self.device = x, y, micro, x.device

    def get(self, step, micro_step):
        sl = slice(micro_step * self.micro, (micro_step + 1) * self.micro)
        return self.x[sl], self.y[sl], None


def test_accumulating_micro_batches_equals_one_large_batch(tiny_config):
    """k micro-batches of b must update the weights like one batch of k*b (loss scaled by 1/k)."""
    model_cfg = tiny_config(vocab_size=64, hidden_size=32, max_seq_len=16)
    ids = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for micro, accum in ((8, 1), (2, 4)):
        t = TrainConfig(micro_batch_size=micro, grad_accum_steps=accum, optimizer="muon", learning_rate=3e-3,
                        muon_lr=0.02, compile="off", precision="fp32", muon_precision="fp32")
        b = built(Config(model=model_cfg, train=t))
        trainer.set_lr(b.opt, 1.0)
        loss, norm, ok = trainer.train_step(b, FixedBatches(ids[:, :-1], ids[:, 1:], micro), 0, t,
                                            distributed.setup())
        results.append((loss, norm, [p.detach().clone() for p in b.raw_model.parameters()]))
    (l1, n1, p1), (l2, n2, p2) = results
    assert torch.allclose(l1, l2, atol=1e-6) and torch.allclose(n1, n2, rtol=1e-4)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_the_compiled_cpu_step_writes_short_attention_out(tiny_config):
    """build() gives the model what attention.written_out_is_faster says: written-out attention in a compiled
    CPU step of short rows (twice as fast there as the CPU's flash kernel), SDPA's kernel eagerly."""
    model_cfg = tiny_config(vocab_size=64, hidden_size=32, max_seq_len=16)
    for compile_mode, written in (("default", True), ("off", False)):
        t = TrainConfig(micro_batch_size=2, optimizer="adamw", learning_rate=1e-3, muon_lr=0.02, compile=compile_mode,
                        precision="fp32")
        b = built(Config(model=model_cfg, train=t))
        assert b.raw_model.execution.matmul_softmax == written


def test_saved_config_records_the_automatic_micro_batch(corpus, tmp_path, monkeypatch, argv_for):
    """config.json must hold the batch the run really used: it was once written before --auto_micro_batch
    changed it, so `--config run/config.json` reproduced another run."""
    def halve(raw_model, cfg, amp, ranks):  # what the CUDA search does when the whole batch does not fit
        return replace(cfg, train=replace(cfg.train, micro_batch_size=2, grad_accum_steps=2))
    monkeypatch.setattr(startup, "fit_micro_batch", halve)
    run = tmp_path / "run"
    argv = argv_for(corpus, run, "--max_steps", 3, "--eval_interval", 3, "--auto_micro_batch", "true")
    assert trainer.main(argv) == 0
    saved = json.load(open(run / "config.json"))["train"]
    assert (saved["micro_batch_size"], saved["grad_accum_steps"]) == (2, 2)
    assert read_metrics(run)[-1]["tokens"] == 3 * 2 * 2 * 64  # steps x micro-batch x accumulation x context


def test_lr_schedule_warmup_cosine_floor_and_restarts():
    """Warmup must rise linearly to the peak over warmup_ratio of the run, cosine must end at the floor
    exactly where the run ends, restarts must return to the peak."""
    t = TrainConfig(warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_multiplier(0.01, t) == pytest.approx(0.1) and lr_multiplier(0.1, t) == pytest.approx(1.0)
    assert lr_multiplier(0.55, t) == pytest.approx(0.55)  # halfway through the cosine: (1 + 0.1) / 2
    assert lr_multiplier(1.0, t) == pytest.approx(0.1)
    r = TrainConfig(warmup_ratio=0.1, lr_schedule="cosine_restarts", restart_cycles=4)
    assert lr_multiplier(0.325 + 1e-9, r) == pytest.approx(1.0) and lr_multiplier(0.32, r) < 0.2
    assert lr_multiplier(1.0, r) == pytest.approx(0.1)  # the last cycle ends at the floor, not back at the peak
    w = TrainConfig(warmup_ratio=0.1, lr_schedule="wsd", decay_ratio=0.2, min_lr_ratio=0.0)
    assert [lr_multiplier(p, w) for p in (0.05, 0.1, 0.5, 0.8, 0.9, 1.0)] == pytest.approx([0.5, 1, 1, 1, 0.5, 0])
    steps = TrainConfig(max_steps=20, warmup_ratio=0.1)
    clock = RunClock(steps, time.monotonic(), OneProcess())
    assert [clock.progress(s) for s in (0, 1, 19)] == [0.05, 0.1, 1.0]  # (step + 1) / max_steps
    assert not clock.finished(19) and clock.finished(20)


class OneProcess:
    enabled = False

    def maximum(self, values):
        return list(values)


def simulated_run(monkeypatch, t: TrainConfig, step_s: float, eval_s: float, steps: int, asks: int = 1) -> list[int]:
    """The steps a RunClock evaluates at in a run whose steps and evaluations take these seconds (a fake
    time), driven as the trainer drives it: sync at start, after each evaluation, at each log step. asks: how
    many times each step asks whether an evaluation is due."""
    now = [0.0]
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: now[0])
    clock, at = RunClock(t, 0.0, OneProcess()), []
    clock.sync(0)
    for step in range(steps):
        if step > 0 and [clock.evals.due(step) for _ in range(asks)][-1]:
            at.append(step)
            with clock.timer.pause("eval", step):
                now[0] += eval_s
            clock.evaluated(step)
        now[0] += step_s
        if clock.log_due(step + 1):
            clock.sync(step + 1)
    return at


def test_automatic_evaluations_keep_to_their_share_of_the_time(monkeypatch):
    """Six evaluations for a 10-step smoke run once took it from seconds to 5-10 minutes: automatic
    evaluations now keep to EVAL_SHARE of the time so far, none falls within half a sixth of another or of the
    end."""
    t = TrainConfig(max_steps=1000, eval_interval=0, eval_batches=2, grad_accum_steps=1)
    cheap = simulated_run(monkeypatch, t, step_s=0.5, eval_s=0.5, steps=1000)
    assert cheap == [167, 334, 500, 667, 834]  # every sixth: 2.5 s of 500 s
    dear = simulated_run(monkeypatch, t, step_s=0.5, eval_s=6.0, steps=1000)
    total = 1000 * 0.5 + 6.0 * len(dear)
    assert 1 <= len(dear) < 5 and 6.0 * len(dear) <= EVAL_SHARE * total  # within the share, by a naive count
    assert simulated_run(monkeypatch, replace(t, max_steps=10), step_s=0.5, eval_s=3.0, steps=10) == []
    explicit = simulated_run(monkeypatch, replace(t, eval_interval=100), step_s=0.5, eval_s=6.0, steps=1000)
    assert explicit == list(range(100, 1000, 100))  # an interval someone wrote is kept whatever it costs


def test_a_wait_for_data_spends_budget_but_is_not_step_time(monkeypatch):
    """While a Hub corpus arrives a step may wait for its part. Inside a measured window that wait read as
    slow steps (a 20 s wait among ten 0.1 s steps: 2.1 s a step, a twentieth of the real tokens/s); as a pause
    it is budget spent and the steps keep their speed, and out_of_time() ends a wait that outlasts the budget.
    """
    now = [0.0]
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: now[0])
    clock = RunClock(TrainConfig(max_minutes=1, eval_interval=0, eval_batches=2, grad_accum_steps=1), 0.0, OneProcess())
    clock.timer.sync(0)
    for step in range(1, 21):
        now[0] += 0.1
        if step % 10 == 0:
            clock.timer.sync(step)
    with clock.timer.pause("wait", 20):
        now[0] += 20.0
    assert not clock.out_of_time() and not clock.finished(20)
    for step in range(21, 31):
        now[0] += 0.1
    clock.timer.sync(30)
    assert clock.timer.agreed.step_s == pytest.approx(0.1) and "wait" not in clock.timer.state()["overhead_s"]
    assert clock.timer.agreed.spent_s == pytest.approx(23)  # 20 s of waiting, 3 s of steps
    assert not clock.finished(30)
    now[0] = 60 - clock.reserve_s() + 0.01  # a second wait, past the budget's end
    assert clock.out_of_time()


def budgeted_run(monkeypatch, t: TrainConfig, setup_s: float, step_s: float, eval_s: float, save_s: float,
                 asks: int = 1) -> tuple[list[int], int]:
    """(the steps a RunClock evaluates at, the step the run ends at) under a time budget, after setup_s of
    data preparation, each evaluation followed by its checkpoint, driven as the trainer drives it. asks: how
    many times each step asks what is due."""
    now = [setup_s]
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: now[0])
    clock, at, step = RunClock(t, 0.0, OneProcess()), [], 0
    clock.sync(0)
    while not [clock.finished(step) for _ in range(asks)][-1]:
        if step > 0 and [clock.evals.due(step) for _ in range(asks)][-1]:
            at.append(step)
            with clock.timer.pause("eval", step):
                now[0] += eval_s
            clock.evaluated(step)
            assert clock.evals.save_due(step)  # automatic checkpoints come with the evaluations
            with clock.timer.pause("save", step):
                now[0] += save_s
        now[0] += step_s
        step += 1
        if clock.log_due(step):
            clock.sync(step)
    return at, step


@pytest.mark.parametrize("minutes,step_s,eval_s", [(0.4, 0.1, 8.0), (1, 0.3, 8.0), (1, 0.05, 1.0), (1, 0.1, 1.0)])
def test_under_a_time_budget_no_evaluation_falls_near_the_end(monkeypatch, minutes, step_s, eval_s):
    """In a 24-second budget an evaluation estimated from its forward passes alone (0.07 s) took 8 s, and the
    room then kept for the final one as well: the run ended a step later (steps 33, 34), and the time-budget
    test failed now and then. An evaluation's estimate now counts what it decodes, and each automatic one
    leaves half a sixth of the run after it, paid for its own cost and the larger room the final one will
    need."""
    t = TrainConfig(max_minutes=minutes, eval_interval=0, eval_batches=2, grad_accum_steps=1)
    at, end = budgeted_run(monkeypatch, t, setup_s=2.0, step_s=step_s, eval_s=eval_s, save_s=1.0)
    assert all(b - a > end / 12 for a, b in zip(at, at[1:] + [end])), (at, end)
    assert at or eval_s > EVAL_SHARE * 60 * minutes  # a cheap evaluation still happens


def test_a_budget_ends_within_a_step_when_the_machine_slows_mid_run_and_trims_its_final_evaluation(monkeypatch):
    """A 0.3-minute run on a 2-core machine measured 0.47 s steps at its log step 10, then a busy neighbour
    made them 3.9 s: reading the clock only at log steps, it trained ten more and ended at 48 s, and its final
    evaluation's 20 batches took 20 s more. Now one process reads the clock every step, and the final
    evaluation takes the batches the time left holds."""
    now = [5.0]  # setup
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: now[0])
    t = TrainConfig(max_minutes=0.3, eval_interval=0, eval_batches=20, grad_accum_steps=1, log_interval=10)
    clock, step = RunClock(t, 0.0, OneProcess()), 0
    clock.sync(0)
    while not clock.finished(step):
        now[0] += 0.47 if step < 10 else 3.9
        step += 1
        if clock.log_due(step):
            clock.sync(step)
    assert now[0] <= 18 + 3.9 and step > 10  # within the budget plus one (slow) step
    assert clock.final_eval() == (20, 18 - clock.timer.save_guess_s)  # one process reads batches until the time is up
    forward_s = 2 * 3.9 / 3  # ranks read alike: as many as the speed the clock last measured says fit
    batches = clock.final_batches(passes=2)
    assert 1 <= batches < 20 and batches * forward_s <= max(18 - now[0] - clock.timer.save_guess_s, forward_s)
    assert RunClock(replace(t, max_minutes=0, max_steps=5), 0.0, OneProcess()).final_eval() == (20, math.inf)


def test_a_budgets_run_length_follows_the_pace_but_not_one_slow_window(monkeypatch):
    """Under a budget the run's length is the steps it holds at the measured pace: set at the first measured
    step, again at the end of the first log window and at evaluations, with a line where it changes. Between,
    one slow window (a hiccup of the machine) moves nothing: progress is the step over that count (a length
    refreshed from each window's pace once made progress jump ahead and back). A lasting change of pace sets
    it again, so the decay still ends with the budget (a length set only at the start ended a 24-second run at
    85% of its decay)."""
    now = [2.0]  # setup
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: now[0])
    t = TrainConfig(max_minutes=1, eval_interval=0, eval_batches=2, grad_accum_steps=1, log_interval=10)
    clock = RunClock(t, 0.0, OneProcess())
    lines = {0: clock.sync(0)}
    assert lines[0] is None and clock.length is None and clock.progress(5) == 0.0  # no speed yet
    # 0.1 s a step; one window at 0.3 (steps 21-30); from step 51 the machine runs at half its speed for good
    pace = [None] + [0.1] * 20 + [0.3] * 10 + [0.1] * 20 + [0.2] * 30
    for step in range(1, 71):
        now[0] += pace[step]
        if clock.log_due(step):
            lines[step] = clock.sync(step)
            if step == 2:
                first = clock.length
            if step == 50:
                settled, progress = clock.length, clock.progress(49)
            if step == 60:
                was = clock.length
    assert lines[1] is None and lines[2] == f"run length: {first:,} steps at 0.1 s a step"
    assert 520 < first < 58 / 0.1 + 2  # about 58 s left at 0.1 s a step, less the room for the final ones
    assert abs(settled - first) <= 2
    assert all(lines[s] is None for s in (10, 20, 30, 40, 50))  # the hiccup changed nothing
    assert progress == 50 / settled
    # The time the slow steps took is counted at once (step 60: the same pace, fewer seconds left); by step 70
    # the median window runs at 0.2 s a step: 70 + 47 s left, less the room for the final ones, at 0.2 s a
    # step
    assert lines[60] == f"run length: {was:,} steps at 0.1 s a step (was {settled:,})" and was < settled
    assert lines[70] == f"run length: {clock.length:,} steps at 0.2 s a step (was {was:,})"
    assert 70 + 42 / 0.2 < clock.length < 70 + 47 / 0.2
    line = clock.evaluated(70)  # measured again: the same pace, the same length, nothing to say
    assert line is None and 70 + 42 / 0.2 < clock.length < 70 + 47 / 0.2
    length = clock.length
    with clock.timer.pause("eval", 71):  # the final evaluation: 5 s, which would take 25 steps off the length
        now[0] += 5.0
    assert clock.evaluated(71, last=True) is None and clock.length == length  # the run is over: nothing said
    assert RunClock(replace(t, max_minutes=0, max_steps=30), 0.0, OneProcess()).length == 30


def test_an_evaluation_with_a_deadline_reads_batches_until_it_passes():
    """The final evaluation of a budgeted run stops reading batches once its time is up (at least one), and
    says how many it read: the mean is over those, as a naive loop over them computes it."""
    from llm.scores.evaluation import validation_loss
    losses = [3.0, 1.0, 2.0, 6.0]

    class Model(torch.nn.Module):
        def forward(self, x, labels=None, positions=None):
            time.sleep(0.05)
            return None, torch.tensor(losses[int(x)])

    class Val:
        device = torch.device("cpu")

        def get(self, micro_step, i):
            return torch.tensor(i), None, None

    class Ranks:
        def mean(self, t):
            return t
    model, amp = Model(), contextlib.nullcontext()
    assert validation_loss(model, amp, Val(), 4, Ranks()) == (pytest.approx(3.0), 4, None)
    assert validation_loss(model, amp, Val(), 4, Ranks(), until=time.monotonic() + 0.08) == \
        (pytest.approx(2.0), 2, None)
    assert validation_loss(model, amp, Val(), 4, Ranks(), until=time.monotonic() - 1) == (pytest.approx(3.0), 1, None)


def test_asking_what_is_due_changes_nothing(monkeypatch):
    """The clock's eval_due (now EvalPolicy.due) once moved its own record of the sixths evaluated when asked,
    so asking twice could give two answers. Asked three times a step, the clock must evaluate and end where it
    does asked once."""
    t = TrainConfig(max_steps=600, eval_interval=0, eval_batches=2, grad_accum_steps=1)
    assert simulated_run(monkeypatch, t, 0.5, 0.5, 600, asks=3) == simulated_run(monkeypatch, t, 0.5, 0.5, 600)
    budget = TrainConfig(max_minutes=1, eval_interval=0, eval_batches=2, grad_accum_steps=1)
    once = budgeted_run(monkeypatch, budget, setup_s=2.0, step_s=0.1, eval_s=1.0, save_s=0.5)
    assert budgeted_run(monkeypatch, budget, setup_s=2.0, step_s=0.1, eval_s=1.0, save_s=0.5, asks=3) == once
    assert len(once[0]) >= 2


def test_an_evaluation_too_dear_at_its_sixth_comes_later_in_it(monkeypatch):
    """A sixth's evaluation that the time share cannot pay for when the sixth begins is owed until halfway
    through it (the old clock dropped it), and never falls in a sixth's second half."""
    t = TrainConfig(max_steps=1200, eval_interval=0, eval_batches=2, grad_accum_steps=1)
    at = simulated_run(monkeypatch, t, step_s=0.5, eval_s=6.0, steps=1200)
    # The second 6 s evaluation keeps to 5% of the time from step 456 (1.9 x 6 s <= 2.5% of the step), not
    # 400.
    assert at[:2] == [200, 456] and all(a % 200 < 100 for a in at), at


@pytest.mark.parametrize("data", ["corpus", "chat_corpus", "lora"])
def test_resume_gives_bit_identical_losses(data, request, tmp_path, argv_for):
    """N steps, then --resume for N more, must log exactly the losses of 2N steps in one run; for chats too,
    whose packed windows go round more than one epoch in the run, and for LoRA adapters on a frozen base."""
    if data == "lora":
        corpus = {"src": write_greetings(tmp_path / "chats.jsonl", 100), "cache": str(tmp_path / "cache")}
        lora = ("--init_from", request.getfixturevalue("qwen3_folder"), "--lora_rank", 4)
    else:
        corpus, lora = request.getfixturevalue(data), ()
    full = tmp_path / "full"
    common = ("--max_steps", 16, "--eval_interval", 8, "--save_interval", 8, *lora)
    trainer.main(argv_for(corpus, full, *common))
    reference = [r["loss"] for r in read_metrics(full)]
    # Interrupt a fresh run after step 8 by asking it to stop, as SIGTERM would.
    broken = tmp_path / "broken"
    assert stopped_after(trainer, 8, argv_for(corpus, broken, *common)) == 143  # saved, unfinished: `&& export` stops
    assert ckpt_io.latest_checkpoint(str(broken)).endswith("step_000008")
    trainer.main(argv_for(corpus, broken, *common, "--resume"))
    resumed = [r["loss"] for r in read_metrics(broken)]
    assert len(resumed) == 16 and resumed == reference  # bit-identical, not approximately equal


@pytest.mark.slow
def test_sigterm_in_a_subprocess_saves_and_resume_matches(corpus, tmp_path, argv_for):
    """A real SIGTERM mid-run must leave a loadable checkpoint, print how to resume and exit 143 (DESIGN.md:
    128 + the signal, so that `train && export` does not go on with an unfinished run)."""
    run = tmp_path / "run"
    args = argv_for(corpus, run, "--max_steps", 400, "--eval_interval", 400, "--save_interval", 400)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "resume with: python gpu_training_optimized.py" in out and "--resume" in out
    ckpt = ckpt_io.latest_checkpoint(str(run))
    step = ckpt_io.load_trainer_state(ckpt)["step"]
    assert 3 <= step < 400
    model = Transformer(ckpt_io.load_model_config(ckpt))
    ckpt_io.load_weights(ckpt, model)


def test_the_stop_flag_answers_130_for_ctrl_c_and_143_for_sigterm():
    """DESIGN.md's convention, as a shell shows a process the signal ended: Ctrl-C 130, SIGTERM 143."""
    from llm.train.schedule import StopFlag
    try:
        for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            stop = StopFlag()
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # the handler runs between bytecodes of this thread
            assert stop.requested and stop.exit_status() == status
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_non_finite_loss_is_skipped_then_stops_and_no_checkpoint_holds_nan(corpus, tmp_path, monkeypatch, capsys,
                                                                          argv_for):
    """Injected NaN losses must not reach the weights; enough consecutive ones stop the run with exit 1."""
    run = tmp_path / "run"
    original = Transformer.forward
    calls = {"n": 0}

    def poisoned(self, input_ids, labels=None, **kw):
        logits, loss = original(self, input_ids, labels=labels, **kw)
        calls["n"] += 1
        if loss is not None and calls["n"] > 4:
            loss = loss * float("nan")
        return logits, loss
    monkeypatch.setattr(Transformer, "forward", poisoned)
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(argv_for(corpus, run, "--max_steps", 40, "--save_interval", 2, "--eval_interval", 40,
                             "--max_bad_steps", 3))
    assert exit_info.value.code == 1
    assert "consecutive steps had a non-finite loss" in capsys.readouterr().err
    for ckpt in ckpt_io.list_checkpoints(str(run)):
        model = Transformer(ckpt_io.load_model_config(ckpt))
        ckpt_io.load_weights(ckpt, model)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_damaged_checkpoints_are_named_and_resume_falls_back_to_a_complete_one(corpus, tmp_path, capsys, argv_for):
    """A weights file cut short (a full disk, a copy interrupted) makes its checkpoint incomplete: --resume
    says so and continues from the newest complete one. Bytes damaged in place (same size) are found on
    loading: one error line naming the file and the checkpoint to resume instead, exit 2."""
    run = tmp_path / "run"
    trainer.main(argv_for(corpus, run, "--max_steps", 4, "--save_interval", 2, "--eval_interval", 4))
    first, second = ckpt_io.list_checkpoints(str(run))
    weights = os.path.join(second, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 16)  # the header's length field: garbage, at the same size
    with pytest.raises(ckpt_io.CheckpointError, match="model.safetensors"):
        ckpt_io.load_weights(second, Transformer(ckpt_io.load_model_config(second)))
    capsys.readouterr()  # drop the first run's output
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(argv_for(corpus, run, "--max_steps", 6, "--resume"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "model.safetensors" in err and f"--resume {first}" in err  # names the checkpoint to fall back to

    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert ckpt_io.latest_checkpoint(str(run)) == first
    assert trainer.main(argv_for(corpus, run, "--max_steps", 6, "--resume")) == 0
    out = capsys.readouterr().out
    assert "step_000004 is incomplete" in out and f"resumed from {first} at step 2" in out
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))  # steps 3-4 logged once, not twice


def test_resume_refuses_a_different_model_shape(corpus, tmp_path, capsys, argv_for):
    """Resuming with another shape must name the differing field instead of failing inside load_state_dict."""
    run = tmp_path / "run"
    trainer.main(argv_for(corpus, run, "--max_steps", 3, "--eval_interval", 3))
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(argv_for(corpus, run, "--max_steps", 4, "--resume", "--hidden_size", "128"))
    assert exit_info.value.code == 2
    assert "hidden_size" in capsys.readouterr().err


def test_init_from_starts_a_new_run_from_trained_weights(corpus, tmp_path, argv_for):
    """--init_from must load the weights (not just the shape): the new run's first loss is the old run's
    level, far below a fresh start."""
    first, second = tmp_path / "first", tmp_path / "second"
    trainer.main(argv_for(corpus, first, "--max_steps", 30, "--eval_interval", 30, "--learning_rate", 1e-2))
    trainer.main(argv_for(corpus, second, "--max_steps", 3, "--eval_interval", 3, "--init_from", first))
    before, after = read_metrics(first), read_metrics(second)
    assert after[0]["loss"] < before[0]["loss"] - 1.0
    assert abs(after[0]["loss"] - before[-1]["loss"]) < 0.5
    assert ckpt_io.load_trainer_state(ckpt_io.latest_checkpoint(str(second)))["step"] == 3


def test_wandb_logs_offline_into_the_run_folder(corpus, tmp_path, monkeypatch, argv_for):
    """--wandb must open an offline run under the run folder (no account, no network) and log every
    metrics.jsonl value at its step; a stand-in wandb module records the calls."""
    import types
    calls = {"init": None, "logs": [], "finished": False}

    class Run:
        def log(self, values, step):
            calls["logs"].append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 4, "--eval_interval", 4, "--save_interval", 4,
                                 "--wandb", "true")) == 0
    assert calls["init"]["mode"] == "offline" and calls["init"]["dir"] == str(run)
    assert calls["init"]["config"]["train"]["max_steps"] == 4
    logged = {step: values for step, values in calls["logs"] if "train/loss" in values}
    for record in read_metrics(run):
        assert logged[record["step"]]["train/loss"] == record["loss"]
    evals = [values for step, values in calls["logs"] if step == 4 and "eval/val_bpb" in values]
    assert evals and evals[0]["eval/val_bpb"] == read_metrics(run, "eval")[-1]["val_bpb"]
    assert calls["finished"]


def snapshot(run_dir) -> dict:
    """Every file under run_dir with its bytes: what a refused command must leave exactly as it was."""
    files = {}
    for folder, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, run_dir)] = open(path, "rb").read()
    return files


def test_a_refused_resume_writes_nothing(corpus, tmp_path, capsys, argv_for):
    """config.json was once rewritten before --resume's checks failed, so the run's own config then failed to
    resume it too. A refused --resume (another shape, past max_steps, no checkpoint) must change no file."""
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 3, "--eval_interval", 3)) == 0
    before = snapshot(run)
    for extra in (("--hidden_size", 128), ("--max_steps", 3)):
        with pytest.raises(SystemExit) as e:
            trainer.run(argv_for(corpus, run, "--max_steps", 4, "--resume", *extra))
        assert e.value.code == 2 and snapshot(run) == before
    assert "already at step 3 and max_steps=3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, tmp_path / "empty", "--max_steps", 4, "--resume"))
    assert e.value.code == 2 and not (tmp_path / "empty").exists()
    again = trainer.main(argv_for(corpus, run, "--config", run / "config.json", "--max_steps", 5, "--resume"))
    assert again == 0 and [r["step"] for r in read_metrics(run)][-2:] == [4, 5]


def test_resume_from_a_chosen_checkpoint_into_a_new_folder(corpus, tmp_path, argv_for):
    """--resume FOLDER continues from that checkpoint exactly (the losses of the uninterrupted run), into a
    new run folder; in its own run folder, which went on past it, it is refused rather than mixing two
    histories."""
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 6, "--eval_interval", 3, "--keep_checkpoints", 5)) == 0
    ckpt = os.path.join(run, "checkpoints", "step_000003")
    with pytest.raises(ConfigError, match="holds later checkpoints"):
        trainer.main(argv_for(corpus, run, "--max_steps", 6, "--resume", ckpt))
    branch = tmp_path / "branch"
    assert trainer.main(argv_for(corpus, branch, "--max_steps", 6, "--eval_interval", 3, "--resume", ckpt)) == 0
    assert [r["loss"] for r in read_metrics(branch)] == [r["loss"] for r in read_metrics(run) if r["step"] > 3]


def test_the_best_checkpoint_survives_pruning(corpus, tmp_path, monkeypatch, argv_for):
    """keep_checkpoints prunes old checkpoints but never the one of lowest validation loss, which BEST names and
    --best loads; scripted validation losses make step 4 the best of six evaluations."""
    losses = iter([3.0, 2.0, 2.5, 2.7, 2.9, 3.1, 3.1])  # the last two: the final weights, raw and averaged
    monkeypatch.setattr(step_runner, "validation_loss", lambda *args: (next(losses), args[3], None))  # batches read
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 12, "--eval_interval", 2, "--keep_checkpoints", 1)) == 0
    assert [os.path.basename(c) for c in ckpt_io.list_checkpoints(str(run))] == ["step_000004", "step_000012"]
    assert ckpt_io.best_checkpoint(str(run)).endswith("step_000004")
    assert read_model(str(run), best=True).path == ckpt_io.best_checkpoint(str(run))
    assert read_model(str(run)).path.endswith("step_000012")


def test_one_step_runs_and_warmup_fits_any_length(corpus, tmp_path, argv_for):
    """--max_steps 1 must run (warmup once outlasted short runs and was refused): warmup is a share of the
    run."""
    assert trainer.main(argv_for(corpus, tmp_path / "run", "--max_steps", 1, "--warmup_ratio", 0.5)) == 0
    (record,) = read_metrics(tmp_path / "run")
    assert record["step"] == 1 and record["lr_scale"] == pytest.approx(0.1)  # the last step: the schedule's floor


@pytest.mark.slow
def test_a_time_budget_ends_the_run_with_its_schedule(corpus, tmp_path, argv_for):
    """Under --max_minutes the run stops inside the budget, final evaluation and checkpoint included, and the
    learning rate reaches its floor at the last step; automatic evaluations spread over the run keep to their
    share of its time (they once took 40% of a busy machine's default run). Each run is a process of its own,
    as a user starts it: in the suite's process, grown by the tests before, the tiny step ran at half its
    pace."""
    run = tmp_path / "run"

    def train(*extra):
        done = subprocess.run([sys.executable, "gpu_training_optimized.py", *argv_for(corpus, run, *extra)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    start = time.monotonic()
    out = train("--max_minutes", 0.4, "--eval_batches", 2, "--log_interval", 1)
    took = time.monotonic() - start
    assert took <= 0.4 * 60 + 3, took  # a second for the last log line and the summary, two for the interpreter
    train_records, evals = read_metrics(run, "train"), read_metrics(run, "eval")
    assert len(train_records) > 20 and train_records[-1]["lr_scale"] == pytest.approx(0.1, abs=0.03)
    assert max(r["lr_scale"] for r in train_records) == pytest.approx(1.0, abs=0.05)
    assert 1 <= len(evals) <= 6 and evals[-1]["step"] == train_records[-1]["step"]
    assert all(b["step"] - a["step"] > len(train_records) / 12 for a, b in zip(evals, evals[1:])), (  # once: 210, 211
        [e["step"] for e in evals], len(train_records))
    share = float(re.search(r"evaluation: \d+ in [\d.]+ s, ([\d.]+)%", out).group(1))
    assert share < 10  # EVAL_SHARE is 5%: the first evaluation's cost is a guess, and the machine may be busy
    state = ckpt_io.load_trainer_state(ckpt_io.latest_checkpoint(str(run)))
    assert 0.3 * 60 < state["spent_s"] <= 0.4 * 60
    # Resumed with a longer budget, the run continues from its step with what the budget has left.
    out = train("--max_minutes", 0.6, "--eval_batches", 2, "--resume")
    more = read_metrics(run, "train")
    assert more[-1]["step"] > train_records[-1]["step"] and more[-1]["lr_scale"] == pytest.approx(0.1, abs=0.03)
    assert "resumed from" in out


def test_a_resumed_time_budget_keeps_its_schedule_position(corpus, tmp_path, argv_for):
    """Under --max_minutes the clock once saved only the seconds spent: the first steps of a resumed session,
    before their speed was measured, saw progress 0, so the learning rate dropped from mid-schedule to 0 (or
    to the peak without warmup) and back. The checkpoint keeps the step time, and the first resumed step
    continues the schedule."""
    run = tmp_path / "run"
    budget = ("--max_minutes", 30, "--warmup_ratio", 0.5, "--eval_interval", 100)
    assert trainer.main(argv_for(corpus, run, *budget, "--max_steps", 6)) == 0
    before = read_metrics(run, "train")
    assert trainer.main(argv_for(corpus, run, *budget, "--max_steps", 9, "--resume")) == 0
    after = [r for r in read_metrics(run, "train") if r["step"] > 6]
    assert [r["step"] for r in after] == [7, 8, 9]
    last, first = before[-1]["lr_scale"], after[0]["lr_scale"]
    assert last > 0 and 0.5 * last < first < 3 * last, (last, first)  # warmup: it only rises, at the same pace


def test_persistent_gradients_keep_their_storage_and_step_the_same(tiny_config):
    """Under CUDA graphs a backward's outputs live in the graph's pool and the next replay overwrites them, so
    gradients must stay in buffers of their own: with persistent gradients (forced here on a CPU), every .grad
    keeps one storage across micro-steps and steps, and training takes exactly the usual steps."""
    ids = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    t = TrainConfig(micro_batch_size=4, grad_accum_steps=2, learning_rate=3e-3, muon_lr=0.02, compile="off",
                    precision="fp32")
    cfg = Config(model=tiny_config(vocab_size=64, hidden_size=32, max_seq_len=16), train=t)
    usual, kept = (built(cfg) for _ in range(2))
    kept.persistent_grads = True
    keep_grads(kept.opt)
    seen = {}
    for p in kept.raw_model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.setdefault(id(p), set()).add(p.grad.data_ptr()))
    for b in (usual, kept):
        for step in range(3):
            trainer.set_lr(b.opt, 1.0)
            trainer.train_step(b, FixedBatches(ids[:, :-1], ids[:, 1:], 4), step, t, distributed.setup())
    assert len(seen) == len(list(kept.raw_model.parameters())) and all(len(ptrs) == 1 for ptrs in seen.values())
    assert all(p.grad is None for p in usual.raw_model.parameters())  # the usual path frees them
    for a, b in zip(usual.raw_model.parameters(), kept.raw_model.parameters()):
        assert torch.equal(a, b)


def test_mfu_is_per_gpu_under_several_ranks(tmp_path, monkeypatch):
    """tokens/s counts every rank's tokens: MFU once divided them by one GPU's peak, so 8 GPUs read 8x."""
    from llm.reports import monitor
    monkeypatch.setattr(monitor, "peak_flops", lambda device: 100e12)
    flops, tokens, world = 1e6, 40_000, 4
    m = monitor.Monitor(str(tmp_path), torch.device("cpu"), flops, tokens, world_size=world)
    r = m.train_record(1, tokens, 2.0, 1.0, {}, 1.0, step_s=0.2)
    assert r["tokens_per_s"] == pytest.approx(tokens / 0.2)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] / world * flops / 100e12)


def test_profile_writes_a_trace_of_steps_after_compiling(corpus, tmp_path, argv_for):
    """--profile true: a chrome trace of four steps after the first two (which compile) in <run>/profile/."""
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 7, "--eval_interval", 7, "--profile", "true")) == 0
    trace = json.load(open(run / "profile" / "trace.json"))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)
    assert any("Optimizer.step" in n or "MuonAdamW" in n or "aten::_foreach" in n for n in names)


@pytest.mark.slow
def test_evaluations_compile_nothing_inside_the_run(corpus, tmp_path, monkeypatch, argv_for):
    """The first evaluation once recompiled the model (other mode, no gradients): inside the timed loop. Count
    dynamo's compiled graphs at every step of a compiled run with evaluations between: no growth after step 1.
    """
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    graphs, original = [], trainer.train_step

    def counting(b, batches, step, *args):
        out = original(b, batches, step, *args)
        graphs.append(counters["stats"]["unique_graphs"])
        return out
    monkeypatch.setattr(trainer, "train_step", counting)
    argv = argv_for(corpus, tmp_path / "run", "--max_steps", 6, "--eval_interval", 2)
    argv[argv.index("--compile") + 1] = "default"
    assert trainer.main(argv) == 0
    assert len(graphs) == 6 and graphs[0] > 0 and len(set(graphs)) == 1, graphs


@pytest.mark.slow
def test_a_compile_failure_stops_the_run_unless_a_fallback_is_allowed(corpus, tmp_path, argv_for):
    """A failing compiler (here a C++ compiler that does not exist, as on a machine without one) once turned
    every run into an eager one with a warning: on a GPU a fraction of the speed, unnoticed. With
    compile_fallback false (CUDA's default) the run stops with one line naming the error and the ways out;
    with a fallback it trains eagerly, and metrics.jsonl says the step is not compiled."""
    env = dict(os.environ, CXX=os.path.join(str(tmp_path), "no-such-c++"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # nothing compiled earlier may be reused
    runs = {}
    for fallback in ("false", "auto"):
        argv = argv_for(corpus, tmp_path / fallback, "--max_steps", 2, "--compile_fallback", fallback)
        argv[argv.index("--compile") + 1] = "default"
        runs[fallback] = subprocess.run([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), *argv],
                                        env=env, capture_output=True, text=True, timeout=600)
    stopped, fell_back = runs["false"], runs["auto"]
    assert stopped.returncode == 1, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("error: torch.compile failed (") and "--compile off" in last and "Traceback" not in \
        stopped.stderr
    assert not ckpt_io.holds_checkpoints(str(tmp_path / "false"))
    assert fell_back.returncode == 0, fell_back.stderr[-2000:]
    assert "eager if compiling fails" in fell_back.stdout and "training eagerly" in fell_back.stdout + fell_back.stderr
    assert [r["compiled"] for r in read_metrics(tmp_path / "auto")] == [False, False]


def test_loss_scaling_skips_overflowing_steps_on_the_device_and_matches_unscaled_steps(tiny_config):
    """fp16's GradScaler.step read found_inf on the host every step (a sync, and a step the GPU compile check
    cannot follow); the step now goes through the optimizer's device-side skip. A power-of-two scale must
    change no weight, an overflowing one must skip the update and lower the scale."""
    model_cfg = tiny_config(vocab_size=64, hidden_size=32, max_seq_len=16)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    t = TrainConfig(micro_batch_size=4, grad_accum_steps=1, compile="off", precision="fp32", muon_precision="fp32",
                    learning_rate=3e-3, muon_lr=0.02)
    weights = {}
    for scale in (None, 2.0**10, 2.0**127):  # none, a fine scale, one that overflows fp32 gradients
        b = built(Config(model=model_cfg, train=t))
        start = [p.detach().clone() for p in b.raw_model.parameters()]
        b.state.scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        trainer.set_lr(b.opt, 1.0)
        _, _, ok = trainer.train_step(b, FixedBatches(ids[:, :-1], ids[:, 1:], 4), 0, t, distributed.setup())
        weights[scale] = (bool(ok), start, [p.detach().clone() for p in b.raw_model.parameters()], b.scaler)
    ok, start, plain, _ = weights[None]
    ok_scaled, _, scaled, _ = weights[2.0**10]
    assert ok and ok_scaled and any(not torch.equal(a, b) for a, b in zip(start, plain))
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    ok_over, start, after, scaler = weights[2.0**127]
    assert not ok_over and all(torch.equal(a, b) for a, b in zip(start, after))
    assert scaler.get_scale() < 2.0**127


@pytest.mark.slow
def test_a_deterministic_run_trains_and_repeats_itself(corpus, tmp_path, argv_for):
    """--deterministic true switches torch to deterministic kernels only (an op without one raises): the
    trainer's whole path must still run under it, and two runs must log the same losses."""
    losses = []
    for name in ("a", "b"):
        argv = argv_for(corpus, tmp_path / name, "--max_steps", 3, "--deterministic", "true")
        done = subprocess.run([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), *argv],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append([r["loss"] for r in read_metrics(tmp_path / name)])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_throughput_after_an_evaluation_leaves_the_evaluation_out(corpus, tmp_path, monkeypatch, argv_for):
    """Tokens/s and MFU once counted the evaluation and checkpoint time in the window after them, so the bar
    dipped after each. An evaluation that takes 100 s on the run's clock must not show in the next step's
    rate: the clock is moved on inside the evaluation, so no real time is waited and none is measured."""
    original, real, moved = trainer.evaluate_and_log, time.monotonic, [0.0]
    monkeypatch.setattr("llm.train.schedule.time.monotonic", lambda: real() + moved[0])

    def slow(*args, **kwargs):
        moved[0] += 100.0
        return original(*args, **kwargs)
    monkeypatch.setattr(trainer, "evaluate_and_log", slow)
    assert trainer.main(argv_for(corpus, tmp_path / "run", "--max_steps", 6, "--eval_interval", 3)) == 0
    after = next(r for r in read_metrics(tmp_path / "run") if r["step"] == 4)
    # Counted, the evaluation would hold the rate under 1 / 100 s; a step of the tiny model takes tens of ms.
    assert after["steps_per_s"] > 0.1, after


def test_the_summary_of_a_run_stopped_before_its_first_evaluation_says_so():
    """A run stopped before any evaluation ended with "best val loss inf (nan bits per byte)"."""
    from llm.reports import monitor
    common = dict(step=3, tokens=300, seconds=6.0, bytes_per_token=3.0, ckpt=None, device=torch.device("cpu"),
                  interrupted=True)
    before = monitor.summary(best_val=float("inf"), **common).splitlines()[0]
    assert "no evaluation yet" in before and "inf" not in before and "nan" not in before
    after = monitor.summary(best_val=2.0794415, **common).splitlines()[0]  # ln 8: 3 bits, over 3 bytes a token
    assert "best val loss 2.0794 (1.0000 bits per byte)" in after


def test_a_first_step_longer_than_the_budget_ends_the_run_cleanly(corpus, tmp_path, monkeypatch, capsys, argv_for):
    """--max_minutes 0.3 with a cold compile cache: the first step ended past the budget, tqdm then dropped
    the bar's total and its format raised TypeError (in the loop, and again while the error contract closed
    the bar). A step that overshoots the budget must end the run as any budget does: final evaluation,
    checkpoint, exit 0."""
    shift = [0.0]
    real_monotonic = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + shift[0])
    original = trainer.first_train_step

    def compiling(*args, **kwargs):
        shift[0] += 60.0  # a minute-long compile: 42 s past an 18 s budget
        return original(*args, **kwargs)
    monkeypatch.setattr(trainer, "first_train_step", compiling)
    run = tmp_path / "run"
    assert trainer.run(argv_for(corpus, run, "--max_minutes", 0.3, "--eval_batches", 2)) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "error:" not in err, err[-2000:]
    assert "done: 1 steps" in out
    assert ckpt_io.latest_checkpoint(str(run)).endswith("step_000001")
    assert read_metrics(run, "eval")[-1]["step"] == 1


def test_a_run_whose_loss_stood_still_says_so_at_its_end():
    """A fine-tune at a rate that moves nothing ended "done" with no word: its training loss, flat within its
    noise between the first and last quarter of its log windows, now gets a warning line; a loss that fell
    does not."""
    import random

    from llm.reports.monitor import stood_still
    rng = random.Random(0)
    flat = [{"loss": 2.0 + rng.gauss(0, 0.05)} for _ in range(40)]
    falling = [{"loss": 2.0 - 0.02 * i + rng.gauss(0, 0.05)} for i in range(40)]
    assert stood_still(flat, "loss").startswith("warning: the training loss moved")
    assert stood_still(falling, "loss") == "" and stood_still(flat[:7], "loss") == ""  # too few windows to judge
    assert stood_still([{"reward": 0.5 + 0.01 * i} for i in range(40)], "reward") == ""


def test_the_first_steps_lines_of_a_step_each_do_not_judge_a_run():
    """A run logs its first two steps alone, then every 10. Two equal single-step rewards once made the first
    quarter read as noiseless, and a reward that rose over the regular windows was called flat."""
    from llm.reports.monitor import stood_still
    early = [{"step": 1, "reward": 0.30}, {"step": 2, "reward": 0.30}]
    rising = [{"step": 10 * i, "reward": 0.20 + 0.01 * i + 0.005 * (-1) ** i} for i in range(1, 13)]
    assert stood_still(early + rising, "reward") == ""
    flat = [{"step": 10 * i, "reward": 0.25 + 0.02 * (-1) ** i} for i in range(1, 13)]
    assert stood_still(early + flat, "reward").startswith("warning: the training reward moved")
