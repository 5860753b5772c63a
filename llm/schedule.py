"""The run's length and shape: the learning-rate schedule, and when to evaluate, save and stop.

A run is measured in steps (max_steps) or in time (max_minutes, from launch to the end of its final
checkpoint, data preparation and compile included). Either way the schedule sees progress, the fraction
of the run's steps done, so warmup and decay end where the run ends. Under a time budget the run's steps
are the ones done plus the ones the rest of the budget holds at the measured speed, once room is kept
for the final evaluation and checkpoint; a resumed run carries on with what its earlier sessions left.
Evaluations left automatic fall at every sixth of the run, as long as evaluating keeps to EVAL_SHARE of the
time so far (a 10-step smoke run evaluates only at its end), or later in the sixth's first half when the share
can pay then; one that would fall just before the final one is left to it. RunClock is also the run's one step
timer. Ctrl-C or SIGTERM asks the loop to stop after its step (StopFlag).
"""

import contextlib
import math
import os
import signal
import sys
import time

from llm.distributed import Ranks
from llm.evaluation import CODE_SETTINGS, SAMPLE_SETTINGS
from llm.sizing import AUTO_EVALS, EVAL_SHARE

PACE_WEIGHT = 0.25  # the newest window's share of the smoothed step time
# What a full evaluation decodes (the code metric's bodies, then the samples), one eager step each, and the least a
# step costs: dozens of small kernels, a few milliseconds on a CPU or through a GPU's launches.
PROBE_DECODE_STEPS, DECODE_STEP_S = CODE_SETTINGS.max_new_tokens + SAMPLE_SETTINGS.max_new_tokens, 0.01
# An evaluation may take this much longer than the longest before it (a busy machine), the first one this much
# longer than its estimate (how fast this machine decodes is a guess until then).
EVAL_COST_MARGIN, FIRST_EVAL_MARGIN = 1.5, 4.0
# Under a time budget the final evaluation keeps to this share of it, in fewer batches where it must: its 20 batches
# once took 20 s, longer than a 0.3-minute budget's steps.
FINAL_EVAL_SHARE = 0.1
# A checkpoint's seconds before the first is timed: 16 bytes a parameter (fp32 weights, two optimizer moments, the
# weight average) at a slow disk's 200 MB/s, and a fixed part (fsync, renames: a tiny model's whole checkpoint took
# 1 s on a busy 2-core machine). A flat 2 s once kept a quarter of a 24-second budget unused.
CHECKPOINT_BYTES_PER_PARAM, DISK_BYTES_PER_S, CHECKPOINT_FIXED_S = 16, 200e6, 0.5


def lr_multiplier(progress: float, t) -> float:
    """Linear warmup over warmup_ratio of the run, then cosine (or cosine with restarts) to min_lr_ratio,
    constant, or wsd: the peak held until the last decay_ratio of the run, which decays linearly to
    min_lr_ratio (the speedrun recipes' schedule). progress is the fraction of the run done when the step
    ends, in (0, 1]."""
    if progress < t.warmup_ratio:
        return progress / t.warmup_ratio
    if t.lr_schedule == "constant":
        return 1.0
    if t.lr_schedule == "wsd":
        left = (1.0 - progress) / t.decay_ratio  # 1 where the decay starts, 0 at the end
        return 1.0 if left >= 1 else t.min_lr_ratio + (1 - t.min_lr_ratio) * max(0.0, left)
    x = min(1.0, (progress - t.warmup_ratio) / (1 - t.warmup_ratio))
    if t.lr_schedule == "cosine_restarts" and x < 1:
        x = x * t.restart_cycles % 1.0
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x))


class RunClock:
    """Progress by steps, or by time under a budget; the one timer of the run's steps; answers what is due.

    The questions (finished, eval_due, save_due, log_due, progress) change nothing; the figures they read change
    only in sync() and pause(), which every rank calls at the same steps with the same agreed values, and in
    mark_evaluated(). So every rank computes the same learning rate, evaluates and stops at the same step.
    """

    def __init__(self, t, launch: float, ranks: Ranks, start: int = 0, spent_s: float = 0.0, step_s: float = 0.0,
                 overhead_s: dict | None = None, params: int = 0):
        """launch: time.monotonic() when this session started; ranks: the processes that agree on the figures
        (llm.distributed.Ranks); start: the session's first step; spent_s, step_s and overhead_s: what earlier
        sessions measured (state()), so a resumed run's schedule continues where it stopped; params: the model's,
        which size a checkpoint before one is timed."""
        self.t, self.ranks, self.start, self.by_time = t, ranks, start, t.max_minutes > 0
        self.save_guess_s = CHECKPOINT_FIXED_S + CHECKPOINT_BYTES_PER_PARAM * params / DISK_BYTES_PER_S
        self.budget_s = t.max_minutes * 60
        self.launch, self.session_start = launch - spent_s, launch
        self.step_s = step_s  # the mean seconds of a step over the last window, 0 until measured
        self.measured = False  # whether the last sync measured step_s (not the first, compiling step)
        self.pace_s = step_s  # the same smoothed over windows: what the schedule's progress reads
        self.overhead_s = {"eval": 0.0, "save": 0.0, **(overhead_s or {})}  # the longest evaluation and checkpoint
        self.eval_spent_s, self.evals = 0.0, 0  # this session's evaluations: seconds in all, and how many
        self.synced_step, self.synced_remaining = 0, math.inf
        self.synced_eval = (0.0, 0.0, 0.0)  # (evaluation seconds spent, one evaluation's expected, seconds spent)
        self._window_start = self._window_step = None
        self._evaluated = None  # (step, sixths of the run reached, progress) at this session's last evaluation

    # ---- measuring
    def spent_s(self) -> float:
        """Seconds of the budget used, this session and the earlier ones."""
        return time.monotonic() - self.launch

    @contextlib.contextmanager
    def pause(self, kind: str, step: int):
        """Time an evaluation, a checkpoint or a wait for data before this step: its time is counted against the
        budget at once, but not as step time (a collective: every rank pauses alike). Room is kept for the final
        evaluation and checkpoint by the longest seen."""
        started = time.monotonic()
        yield
        seconds = time.monotonic() - started
        if kind in self.overhead_s:
            self.overhead_s[kind] = max(self.overhead_s[kind], seconds)
        if kind == "eval":
            self.eval_spent_s, self.evals = self.eval_spent_s + seconds, self.evals + 1
        self._sync(step, measure=False)

    def eval_s(self) -> float:
        """One evaluation's seconds: the longest seen, or before any, the forward passes of its batches (a forward
        is about a third of a step) and the decode steps of the code metric and the samples."""
        forwards = self.t.eval_batches * self.step_s / self.t.grad_accum_steps / 3
        return self.overhead_s["eval"] or forwards + PROBE_DECODE_STEPS * DECODE_STEP_S

    def reserve_s(self) -> float:
        """Room kept for the final evaluation and checkpoint: the longest seen, or an estimate before any; under a
        budget at most FINAL_EVAL_SHARE of it for the evaluation, which final_batches() trims to fit."""
        final_eval = min(self.eval_s(), FINAL_EVAL_SHARE * self.budget_s) if self.by_time else self.eval_s()
        return 1.25 * (final_eval + self._save_s()) + self.step_s

    def _save_s(self) -> float:
        return self.overhead_s["save"] or self.save_guess_s  # the longest checkpoint, or a guess before any

    def _left_s(self) -> float:
        """The budget's seconds left for the final evaluation, once the final checkpoint's are set aside."""
        return self.budget_s - self.spent_s() - self._save_s()

    def final_eval(self) -> tuple[int, float]:
        """The final evaluation's batches and the time.monotonic() its batches stop by: under a budget, one process
        reads batches until the time left (less the final checkpoint's) is spent; ranks, which must read alike,
        read as many as the measured speed says that time holds."""
        if not self.by_time:
            return self.t.eval_batches, math.inf
        if self.ranks.enabled:
            return self.final_batches(passes=2), math.inf
        return self.t.eval_batches, self.launch + self.budget_s - self._save_s()

    def final_batches(self, passes: int) -> int:
        """The final evaluation's batches: eval_batches, or under a budget as many as the time left holds (at least
        one). passes: forward passes over each batch (two where the weight average is compared with the last
        weights); a forward is about a third of a step."""
        if not self.by_time or not self.step_s:
            return self.t.eval_batches
        forward_s = passes * self.step_s / self.t.grad_accum_steps / 3
        return max(1, min(self.t.eval_batches, int(0.8 * self._left_s() / forward_s)))

    def sync(self, step: int):
        """Measure the steps since the last sync and agree on the time figures over ranks (a collective): at the
        session's start and at each log step. The session's first step compiles: its time is not a speed."""
        self._sync(step, measure=step > self.start + 1)

    def _sync(self, step: int, measure: bool):
        now = time.monotonic()
        self.measured = measure and self._window_start is not None and step > self._window_step
        if self.measured:
            self.step_s = (now - self._window_start) / (step - self._window_step)
        self._window_start, self._window_step = now, step
        spent = self.spent_s()
        remaining = self.budget_s - spent - self.reserve_s()
        # The slowest rank's clock is everyone's: the longest step, the least time left, the most spent.
        self.step_s, neg_remaining, *evals = self.ranks.maximum([self.step_s, -remaining, self.eval_spent_s,
                                                                 self.eval_s(), spent])
        self.synced_step, self.synced_remaining, self.synced_eval = step, -neg_remaining, tuple(evals)
        # One slow window (a hiccup of the machine) once made progress jump ahead and back: an evaluation fired and
        # the rate dipped. The schedule reads a smoothed pace; finishing still reads the last window's speed.
        self.pace_s = self.step_s if not self.pace_s else PACE_WEIGHT * self.step_s + (1 - PACE_WEIGHT) * self.pace_s

    # ---- deciding
    def _since_sync(self, step: int) -> float:
        return (step - self.synced_step) * self.step_s

    def progress(self, step: int) -> float:
        """The fraction of the run done when this step (0-based) ends: in steps, of max_steps or, under a time
        budget, of the steps the budget holds at the measured speed (0 until a step is measured)."""
        if not self.by_time:
            return min(1.0, (step + 1) / self.t.max_steps)
        if not self.pace_s:
            return 0.0
        total = self.synced_step + self.synced_remaining / self.pace_s
        return min(1.0, (step + 1) / max(total, step + 1))

    def out_of_time(self) -> bool:
        """Whether the budget is spent now, but for the room kept for the final evaluation and checkpoint: a wait for
        data (which no step measures) asks it."""
        return self.by_time and self.spent_s() > self.budget_s - self.reserve_s()

    def finished(self, step: int) -> bool:
        """Whether the run ends before this step: its last step is done, or the budget holds no other."""
        if self.t.max_steps and step >= self.t.max_steps:
            return True
        if self.by_time and not self.ranks.enabled:  # one process reads the clock itself at every step: a machine
            return self.budget_s - self.spent_s() - self.reserve_s() < self.step_s  # slowing mid-run is seen at once
        return self.by_time and self.synced_remaining - self._since_sync(step) < self.step_s

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate before this step (besides the final one): every eval_interval steps, or when
        automatic, in the first half of each sixth of the run not yet evaluated at, where the evaluation is
        affordable and half a sixth apart from the last one and from the end. Asking changes nothing;
        mark_evaluated() does."""
        if self.t.eval_interval:
            return step % self.t.eval_interval == 0
        if step <= self.start + 1:  # a session's first steps: the checkpoint it resumed holds an evaluation
            return False
        done = self.progress(step - 1)
        _, evaluated_sixths, evaluated_at = self._evaluated or (None, self._sixths(self.progress(self.start)), 0.0)
        # Half a sixth apart at least, the final one included: a budget's estimate of the run's length moves.
        apart = done - evaluated_at > 0.5 / AUTO_EVALS and self._leaves_room(step, done)
        sixths = self._sixths(done)
        # Owed from the sixth's start until halfway through it: a late one would crowd the next.
        owed = sixths > evaluated_sixths and AUTO_EVALS * done - sixths < 0.5
        return owed and apart and self.affords_eval(step)

    def mark_evaluated(self, step: int):
        """An evaluation ran before this step: the sixths reached so far are evaluated."""
        done = self.progress(step - 1)
        self._evaluated = (step, self._sixths(done), done)

    @staticmethod
    def _sixths(progress: float) -> int:
        return math.floor(AUTO_EVALS * progress + 1e-9)

    def _leaves_room(self, step: int, done: float) -> bool:
        """Whether half a sixth of the run follows an evaluation before this step. Under a budget the evaluation and
        its checkpoint are paid from the steps that would follow, and the room kept for the final ones grows to
        its measured cost: judged by the progress before them, the last one once came a step before the end."""
        if not self.by_time:
            return done < 1 - 0.5 / AUTO_EVALS
        cost = self.eval_s() * (EVAL_COST_MARGIN if self.overhead_s["eval"] else FIRST_EVAL_MARGIN)
        save = self._save_s()
        reserve_then = 1.25 * (cost + save) + self.step_s  # reserve_s() once this evaluation is measured
        left_s = self.synced_remaining + self.reserve_s() - self._since_sync(step) - cost - save - reserve_then
        steps_after = left_s / max(self.step_s, self.pace_s)
        return steps_after > 0.5 / AUTO_EVALS * (step + steps_after)

    def affords_eval(self, step: int) -> bool:
        """Whether an evaluation before this step keeps evaluating within EVAL_SHARE of the time spent so far
        (from the figures agreed at the last sync, so every rank decides alike)."""
        spent_on_evals, one, spent = self.synced_eval
        if not one:
            return False  # neither a step nor an evaluation measured yet: nothing to judge the cost by
        return spent_on_evals + one <= EVAL_SHARE * (spent + self._since_sync(step) + one)

    def full_eval(self, step: int, last_step: bool) -> bool:
        """Whether the evaluation before this step adds the code metric and samples to the val loss: always, but
        at the end of a run where they would pass EVAL_SHARE, or, under a budget, cost time not yet measured."""
        if self.t.eval_interval or not last_step:
            return True
        measured = self.overhead_s["eval"]  # a full evaluation's seconds, once one ran: under a budget, it must fit
        return self.affords_eval(step) and (not self.by_time or 0 < measured < self._left_s())

    def eval_report(self) -> str:
        """One line: this session's evaluations and their share of its time."""
        share = self.eval_spent_s / max(time.monotonic() - self.session_start, 1e-9)
        return (f"evaluation: {self.evals} in {self.eval_spent_s:.1f} s, {100 * share:.1f}% of this session's time"
                + ("" if self.t.eval_interval else f" (automatic ones keep to {100 * EVAL_SHARE:.0f}%)"))

    def save_due(self, step: int) -> bool:
        """A checkpoint before this step (besides the final one): every save_interval steps, or with each
        evaluation when automatic."""
        if self.t.save_interval:
            return step % self.t.save_interval == 0
        return self._evaluated is not None and self._evaluated[0] == step

    def log_due(self, done: int) -> bool:
        """A log line (and a sync) after this many steps: every log_interval, the session's first two (the first
        compiles, the second is its first speed) and the run's last."""
        return done % self.t.log_interval == 0 or done - self.start <= 2 or done == self.t.max_steps

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the budget and the schedule's position: without
        the step time, its first steps would see progress 0 (learning rate 0, or the peak without warmup)."""
        return {"spent_s": self.spent_s(), "step_s": self.step_s, "overhead_s": dict(self.overhead_s)}


class StopFlag:
    """Ctrl-C or SIGTERM asks the loop to finish its step and save; a second Ctrl-C leaves at once."""

    def __init__(self):
        self.requested, self.signum = False, None
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            print("\nsecond interrupt: leaving without saving", file=sys.stderr)
            os._exit(130)
        self.requested, self.signum = True, signum

    def exit_status(self) -> int:
        """The status of a run stopped early, saved: 128 + the signal, as a shell shows a process the signal ended
        (130 Ctrl-C, 143 SIGTERM), so that `train && export` does not go on. A rank another one's signal stopped
        (stop_vote) answers as SIGTERM."""
        return 128 + (self.signum or signal.SIGTERM)
