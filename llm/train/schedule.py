"""The run's length and shape: the learning-rate schedule, and when to evaluate, save and stop.

A run is measured in steps (max_steps) or in time (max_minutes, from launch to the end of its final
checkpoint, data preparation and compile included). Either way the schedule sees progress, the fraction of the
run's steps done, so warmup and decay end where the run ends. Under a time budget the run's steps are the ones
done plus the ones the rest of the budget holds at the measured speed, once room is kept for the final
evaluation and checkpoint: set when a speed is first measured (again after the first log window) and at each
evaluation, and corrected at a sync where the pace has drifted from the plan (by REPLAN_SHARE of the steps
left), so the decay ends where the budget does; printed when it moves by NOTE_SHARE of the run. A resumed run
carries on with what its earlier sessions left. StepTimer is the run's one timer; when evaluations fall is
EvalPolicy's to say, from the same figures. Ctrl-C or SIGTERM asks the loop to stop after its step (StopFlag).
"""

import collections
import contextlib
import math
import os
import signal
import statistics
import sys
import time
from typing import NamedTuple

from llm.base.distributed import Ranks
from llm.base.sizing import FORWARDS_PER_STEP
from llm.formats.trainer_state import CLOCK_KEYS
from llm.scores.evaluation import AUTO_EVALS, CODE_SETTINGS, EVAL_SHARE, SAMPLE_SETTINGS

# The run's length reads the median step time of the last windows: at least PACE_WINDOWS of them, and a fifth
# of the session's (up to PACE_MEMORY), so a slow minute of a long run moves it no more than one slow window a
# short one.
PACE_WINDOWS, PACE_SHARE, PACE_MEMORY = 5, 0.2, 1000
# Under a budget the run's length is set again at a sync where the steps the budget holds differ from it by
# this share of the steps left: a length planned from the first windows alone once ended a 24-second run at
# 85% of its decay on one machine and reached the floor 300 steps early on another. A change under NOTE_SHARE
# of the run goes unsaid.
REPLAN_SHARE, NOTE_SHARE = 0.05, 0.05
# What a full evaluation decodes (the code metric's bodies, then the samples), one eager step each, and the
# least a step costs: dozens of small kernels, a few milliseconds on a CPU or through a GPU's launches.
PROBE_DECODE_STEPS, DECODE_STEP_S = CODE_SETTINGS.max_new_tokens + SAMPLE_SETTINGS.max_new_tokens, 0.01
# The room kept for the final evaluation and checkpoint is this much more than the longest of each seen so
# far.
RESERVE_MARGIN = 1.25
# Under a time budget the final evaluation keeps to this share of it, in fewer batches where it must: its 20
# batches once took 20 s, longer than a 0.3-minute budget's steps.
FINAL_EVAL_SHARE = 0.1
# A checkpoint's seconds before the first is timed: 16 bytes a parameter (fp32 weights, two optimizer moments,
# the weight average) at a slow disk's 200 MB/s, and a fixed part (fsync, renames: a tiny model's whole
# checkpoint took 1 s on a busy 2-core machine). A flat 2 s once kept a quarter of a 24-second budget unused.
CHECKPOINT_BYTES_PER_PARAM, DISK_BYTES_PER_S, CHECKPOINT_FIXED_S = 16, 200e6, 0.5
# An evaluation may take this much longer than the longest before it (a busy machine), the first one this much
# longer than its estimate (how fast this machine decodes is a guess until then).
EVAL_COST_MARGIN, FIRST_EVAL_MARGIN = 1.5, 4.0


def set_lr(opt, multiplier: float):
    """Every parameter group's rate at multiplier times its peak (initial_lr)."""
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * multiplier


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


class Agreed(NamedTuple):
    """What every rank agreed on at a sync, frozen until the next (StepTimer.agreed): the run's length, its
    end and its evaluations are decided from these alone, so every rank decides alike."""
    step: int = 0  # the step it was agreed at
    spent_s: float = 0.0  # the budget's seconds used, evaluations and checkpoints included
    eval_spent_s: float = 0.0  # this session's evaluations, in all
    eval_s: float = 0.0  # one evaluation's: the longest seen, or an estimate before any
    eval_measured: bool = False  # whether an evaluation has run (else eval_s is the estimate)
    save_s: float = 0.0  # one checkpoint's: the longest seen, or a guess before any
    step_s: float = 0.0  # a step's over the last window; 0 until one is measured
    pace_s: float = 0.0  # the median of the last windows' (PACE_SHARE): what the run's length reads
    measured: bool = False  # whether this sync measured a window (a session's first step compiles: no speed)

    def since(self, step: int) -> float:
        """The seconds the steps after this sync took, at the agreed step time."""
        return (step - self.step) * self.step_s


class StepTimer:
    """The run's one timer: the seconds spent (this session's and the earlier ones'), the step time measured
    over each window between syncs, and the longest evaluation and checkpoint. At each sync() and pause(),
    which every rank calls at the same steps, the ranks agree on these figures and the timer publishes them
    (agreed)."""

    def __init__(self, t, launch: float, ranks: Ranks, start: int = 0, spent_s: float = 0.0,
                 step_s: float = 0.0, overhead_s: dict | None = None, params: int = 0):
        """launch: time.monotonic() when this session started; start: its first step; spent_s, step_s and
        overhead_s: what earlier sessions measured (state()); params: the model's, which size a checkpoint
        before one is timed."""
        self.t, self.ranks, self.start = t, ranks, start
        self.save_guess_s = CHECKPOINT_FIXED_S + CHECKPOINT_BYTES_PER_PARAM * params / DISK_BYTES_PER_S
        self.launch, self.session_start = launch - spent_s, launch
        self.recent_s = collections.deque(maxlen=PACE_MEMORY)  # the last windows' agreed step times
        self.windows = 0  # this session's measured windows
        # the longest evaluation and checkpoint
        self.overhead_s = {"eval": 0.0, "save": 0.0, **(overhead_s or {})}
        self.eval_spent_s, self.evals = 0.0, 0  # this session's evaluations: seconds in all, and how many
        self.agreed = Agreed(save_s=self.save_s(), step_s=step_s, pace_s=step_s)  # an earlier session's speed
        self._window_start = self._window_step = None

    def spent_s(self) -> float:
        """Seconds of the budget used, this session and the earlier ones."""
        return time.monotonic() - self.launch

    @contextlib.contextmanager
    def pause(self, kind: str, step: int):
        """Time an evaluation, a checkpoint or a wait for data before this step: its time is counted against
        the budget at once, but not as step time (a collective: every rank pauses alike)."""
        started = time.monotonic()
        yield
        seconds = time.monotonic() - started
        if kind in self.overhead_s:
            self.overhead_s[kind] = max(self.overhead_s[kind], seconds)
        if kind == "eval":
            self.eval_spent_s, self.evals = self.eval_spent_s + seconds, self.evals + 1
        self._sync(step, measure=False)

    def eval_s(self, step_s: float) -> float:
        """One evaluation's seconds: the longest seen, or before any, the forward passes of its batches (a
        forward is 1 / FORWARDS_PER_STEP of a step) and the decode steps of the code metric and the samples.
        """
        forwards = self.t.eval_batches * step_s / self.t.grad_accum_steps / FORWARDS_PER_STEP
        return self.overhead_s["eval"] or forwards + PROBE_DECODE_STEPS * DECODE_STEP_S

    def save_s(self) -> float:
        return self.overhead_s["save"] or self.save_guess_s  # the longest checkpoint, or a guess before any

    def sync(self, step: int):
        """Measure the steps since the last sync and agree on the figures over ranks (a collective): at the
        session's start and at each log step. The session's first step compiles: its time is not a speed."""
        self._sync(step, measure=step > self.start + 1)

    def _sync(self, step: int, measure: bool):
        now, was = time.monotonic(), self.agreed
        measured = measure and self._window_start is not None and step > self._window_step
        step_s = (now - self._window_start) / (step - self._window_step) if measured else was.step_s
        self._window_start, self._window_step = now, step
        # The slowest rank's clock is everyone's: the longest step, evaluation and checkpoint, the most spent.
        figures = [step_s, self.spent_s(), self.eval_spent_s, self.eval_s(step_s), self.overhead_s["eval"],
                   self.save_s()]
        step_s, spent, eval_spent, eval_s, eval_measured, save_s = self.ranks.maximum(figures)
        # One slow window (a hiccup of the machine) once made progress jump ahead and back: an evaluation
        # fired and the rate dipped. The run's length reads the median pace; finishing still reads the last
        # window's speed.
        if measured:
            self.recent_s.append(step_s)
            self.windows += 1
        last = max(PACE_WINDOWS, int(PACE_SHARE * self.windows))
        pace_s = statistics.median(list(self.recent_s)[-last:]) if self.recent_s else was.pace_s
        self.agreed = Agreed(step, spent, eval_spent, eval_s, eval_measured > 0, save_s, step_s, pace_s,
                             measured)

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the budget and the schedule's position:
        without a step time, its first steps would see progress 0 (learning rate 0, or the peak without
        warmup). The pace, not the last window's time: the run's length was planned by it, and one slow window
        is no speed."""
        return dict(zip(CLOCK_KEYS, (self.spent_s(), self.agreed.pace_s, dict(self.overhead_s))))


class RunClock:
    """The run's length: progress by steps, or by time under a budget, and whether the run is finished; its
    timer (StepTimer) and its evaluation policy (EvalPolicy) beside it. Asking changes nothing."""

    def __init__(self, t, launch: float, ranks: Ranks, start: int = 0, spent_s: float = 0.0,
                 step_s: float = 0.0, overhead_s: dict | None = None, params: int = 0):
        """As StepTimer's: ranks are the processes that agree on the figures (llm.base.distributed.Ranks)."""
        self.t, self.ranks, self.start, self.by_time = t, ranks, start, t.max_minutes > 0
        self.budget_s = t.max_minutes * 60
        self.timer = StepTimer(t, launch, ranks, start, spent_s, step_s, overhead_s, params)
        self.evals = EvalPolicy(t, self)
        # The run's steps: max_steps, or under a budget what it holds at the measured pace, set by
        # plan_length() when a speed is first measured, after each evaluation, and where the pace drifts from
        # the plan (REPLAN_SHARE).
        self.length = None if self.by_time else t.max_steps
        self._first_window = True  # the session's first measured windows are one step each: a rough speed

    def sync(self, step: int) -> str | None:
        """The timer's sync (a collective); under a budget the run's length set once a speed is measured,
        again at the end of the first whole log window, and corrected where the pace drifted. Returns
        plan_length()'s line, or None."""
        self.timer.sync(step)
        window_ends = self._first_window and step - self.start > 2 and self.timer.agreed.measured
        if self.length is None or window_ends:
            self._first_window = self.length is None  # set the first time, or again at the first window's end
            return self.plan_length()
        return self.plan_length(drifted_only=True) if self.timer.agreed.measured else None

    def evaluated(self, step: int, last: bool = False) -> str | None:
        """An evaluation ran before this step: the policy marks it, and but for the final one the run's length
        is measured again (its line where it changed, or None)."""
        self.evals.mark(step)
        return None if last else self.plan_length()

    def plan_length(self, drifted_only: bool = False) -> str | None:
        """Under a budget, set the run's length from the figures the ranks last agreed on: the steps done and
        the ones the rest of the budget holds at the median pace (drifted_only: only where that differs from
        the plan by REPLAN_SHARE of the steps left). Returns a line saying it where it moved by NOTE_SHARE of
        the run, else None."""
        agreed = self.timer.agreed
        if not self.by_time or not agreed.pace_s:
            return None
        done = agreed.step
        length = max(done + 1, round(done + self.remaining_s() / agreed.pace_s))
        if drifted_only and abs(length - self.length) <= REPLAN_SHARE * (self.length - done):
            return None
        was, self.length = self.length, length
        if was and abs(length - was) < max(1, NOTE_SHARE * was):
            return None
        was_said = f" (was {was:,})" if was else ""
        return f"run length: {length:,} steps at {agreed.pace_s:.3g} s a step{was_said}"

    def reserve_s(self, eval_s: float | None = None) -> float:
        """Room kept for the final evaluation (eval_s, by default the longest seen or an estimate; under a
        budget at most FINAL_EVAL_SHARE of it, which final_batches() trims to fit) and the final checkpoint.
        """
        agreed = self.timer.agreed
        final_eval = agreed.eval_s if eval_s is None else eval_s
        final_eval = min(final_eval, FINAL_EVAL_SHARE * self.budget_s) if self.by_time else final_eval
        return RESERVE_MARGIN * (final_eval + agreed.save_s) + agreed.step_s

    def remaining_s(self) -> float:
        """The budget's seconds left for steps at the last sync, once the room for the final ones is kept."""
        return self.budget_s - self.timer.agreed.spent_s - self.reserve_s()

    def left_s(self) -> float:
        """The budget's seconds left now for the final evaluation, once the final checkpoint's are set aside.
        """
        return self.budget_s - self.timer.spent_s() - self.timer.save_s()

    def progress(self, step: int) -> float:
        """The fraction of the run done when this step (0-based) ends: of its length (max_steps or, under a
        time budget, the steps plan_length() last set: 0 until a step is measured)."""
        if not self.length:
            return 0.0
        return min(1.0, (step + 1) / max(self.length, step + 1))

    def out_of_time(self) -> bool:
        """Whether the budget is spent now, but for the room kept for the final evaluation and checkpoint: a
        wait for data (which no step measures) asks it."""
        return self.by_time and self.timer.spent_s() > self.budget_s - self.reserve_s()

    def finished(self, step: int) -> bool:
        """Whether the run ends before this step: its last step is done, or the budget holds no other."""
        if self.t.max_steps and step >= self.t.max_steps:
            return True
        if not self.by_time:
            return False
        # one process reads the clock itself at every step: a machine slowing is seen
        if not self.ranks.enabled:
            return self.budget_s - self.timer.spent_s() - self.reserve_s() < self.timer.agreed.step_s
        return self.remaining_s() - self.timer.agreed.since(step) < self.timer.agreed.step_s

    def final_eval(self) -> tuple[int, float]:
        """The final evaluation's batches and the time.monotonic() its batches stop by: under a budget, one
        process reads batches until the time left (less the final checkpoint's) is spent; ranks, which must
        read alike, read as many as the measured speed says that time holds."""
        if not self.by_time:
            return self.t.eval_batches, math.inf
        if self.ranks.enabled:
            return self.final_batches(passes=2), math.inf
        return self.t.eval_batches, self.timer.launch + self.budget_s - self.timer.save_s()

    def final_batches(self, passes: int) -> int:
        """The final evaluation's batches: eval_batches, or under a budget as many as the time left holds (at
        least one). passes: forward passes over each batch (two where the weight average is compared with the
        last weights); a forward is 1 / FORWARDS_PER_STEP of a step."""
        if not self.by_time or not self.timer.agreed.step_s:
            return self.t.eval_batches
        forward_s = passes * self.timer.agreed.step_s / self.t.grad_accum_steps / FORWARDS_PER_STEP
        return max(1, min(self.t.eval_batches, int(0.8 * self.left_s() / forward_s)))

    def log_due(self, done: int) -> bool:
        """A log line (and a sync) after this many steps: every log_interval, the session's first two (the
        first compiles, the second is its first speed) and the run's last."""
        return done % self.t.log_interval == 0 or done - self.start <= 2 or done == self.t.max_steps


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
        """The status of a run stopped early, saved: 128 + the signal, as a shell shows a process the signal
        ended (130 Ctrl-C, 143 SIGTERM), so that `train && export` does not go on. A rank another one's signal
        stopped (stop_vote) answers as SIGTERM."""
        return 128 + (self.signum or signal.SIGTERM)


class EvalPolicy:
    """When the trainer evaluates (and, left automatic, saves with it). Every eval_interval steps where one is
    given; else at each sixth of the run (AUTO_EVALS), in the first half of the sixth, as soon as an
    evaluation there keeps evaluating within EVAL_SHARE of the time so far (a 10-step smoke run evaluates only
    at its end), half a sixth apart from the one before and from the end (one that would fall just before the
    final one is left to it). The final one is always run, without the code metric and samples where they
    would pass the share. It reads the run's length and the figures its timer agreed on (schedule.RunClock),
    so every rank decides alike; asking changes nothing: mark() records an evaluation that ran."""

    def __init__(self, t, clock):
        self.t, self.clock = t, clock
        # (step, sixths of the run reached, progress) at this session's last evaluation
        self._evaluated = None

    def due(self, step: int) -> bool:
        """Whether to evaluate before this step, besides the final one."""
        if self.t.eval_interval:
            return step % self.t.eval_interval == 0
        clock = self.clock
        if step <= clock.start + 1:  # a session's first steps: the checkpoint it resumed holds an evaluation
            return False
        done = clock.progress(step - 1)
        _, evaluated_sixths, evaluated_at = (self._evaluated
                                             or (None, self._sixths(clock.progress(clock.start)), 0.0))
        # Half a sixth apart at least, the final one included: a budget's estimate of the run's length moves.
        apart = done - evaluated_at > 0.5 / AUTO_EVALS and self._leaves_room(step, done)
        sixths = self._sixths(done)
        # Owed from the sixth's start until halfway through it: a late one would crowd the next.
        owed = sixths > evaluated_sixths and AUTO_EVALS * done - sixths < 0.5
        return owed and apart and self.affordable(step)

    def mark(self, step: int):
        """An evaluation ran before this step: the sixths reached so far are evaluated."""
        done = self.clock.progress(step - 1)
        self._evaluated = (step, self._sixths(done), done)

    @staticmethod
    def _sixths(progress: float) -> int:
        return math.floor(AUTO_EVALS * progress + 1e-9)

    def _leaves_room(self, step: int, done: float) -> bool:
        """Whether half a sixth of the run follows an evaluation before this step. Under a budget the
        evaluation and its checkpoint are paid from the steps that would follow, and the room kept for the
        final ones grows to its measured cost: judged by the progress before them, the last one once came a
        step before the end."""
        clock, agreed = self.clock, self.clock.timer.agreed
        if not clock.by_time:
            return done < 1 - 0.5 / AUTO_EVALS
        cost = agreed.eval_s * (EVAL_COST_MARGIN if agreed.eval_measured else FIRST_EVAL_MARGIN)
        left_s = clock.budget_s - agreed.spent_s - agreed.since(step) - cost - agreed.save_s - \
            clock.reserve_s(cost)  # the room kept for the final ones once this evaluation is measured
        steps_after = left_s / max(agreed.step_s, agreed.pace_s)
        return steps_after > 0.5 / AUTO_EVALS * (step + steps_after)

    def affordable(self, step: int) -> bool:
        """Whether an evaluation before this step keeps evaluating within EVAL_SHARE of the time spent so
        far."""
        agreed = self.clock.timer.agreed
        one = agreed.eval_s
        if not one:
            return False  # neither a step nor an evaluation measured yet: nothing to judge the cost by
        spent = agreed.spent_s + agreed.since(step) + one
        return agreed.eval_spent_s + one <= EVAL_SHARE * spent

    def full(self, step: int, last_step: bool) -> bool:
        """Whether the evaluation before this step adds the code metric and samples to the val loss: always,
        but at the end of a run where they would pass EVAL_SHARE, or, under a budget, cost time not yet
        measured."""
        if self.t.eval_interval or not last_step:
            return True
        measured = self.clock.timer.overhead_s["eval"]  # a full evaluation's seconds, once one ran
        return self.affordable(step) and (not self.clock.by_time or 0 < measured < self.clock.left_s())

    def save_due(self, step: int) -> bool:
        """A checkpoint before this step (besides the final one): every save_interval steps, or with each
        evaluation when automatic."""
        if self.t.save_interval:
            return step % self.t.save_interval == 0
        return self._evaluated is not None and self._evaluated[0] == step

    def report(self) -> str:
        """One line: this session's evaluations and their share of its time."""
        timer = self.clock.timer
        share = timer.eval_spent_s / max(time.monotonic() - timer.session_start, 1e-9)
        return (f"evaluation: {timer.evals} in {timer.eval_spent_s:.1f} s, "
                f"{100 * share:.1f}% of this session's time"
                + ("" if self.t.eval_interval else " (automatic ones are spaced for "
                                                   f"{100 * EVAL_SHARE:.0f}% of a run; the final one, "
                                                   "and a short run's, may take more)"))
