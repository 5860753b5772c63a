"""Preference tuning's objectives: DPO, and SimPO as the reference-free one, each with an NLL term on the
chosen reply.

A pair is one prompt with a better (chosen) and a worse (rejected) reply; log pi(c) is the log-probability the
model gives the chosen reply's tokens after the prompt, summed over them (its EOS included, the prompt not).
  dpo    -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])  (Rafailov et al., 2023),
         ref the model the run starts from; its rewards are beta * (log pi - log ref), as TRL's DPOTrainer
         logs them.
  simpo  -log sigmoid(beta * (mean log pi(c) - mean log pi(r)) - gamma)  (Meng et al., 2024):
         log-probabilities averaged over each reply's tokens, no reference; rewards beta * mean log pi, as
         TRL's CPOTrainer logs them.
SimPO rather than ORPO: SimPO is a drop-in for DPO at the same stage (after chat fine-tuning, on the same
pairs) that needs no reference pass at all, and its per-token average removes the pull of summed
log-probabilities towards longer replies; ORPO folds chat fine-tuning into the preference stage (its own NLL
plus an odds ratio), which this tool already does as a step of its own.
Both add nll_weight times the chosen replies' mean negative log-likelihood per token (RPO, Pang et al., 2024;
TRL's "sft" loss type, CPO's cpo_alpha): only the margin is optimised otherwise, and the chosen reply's own
probability can fall with the rejected one's (trl#800).
The trainer calls an Objective where it would call the model's own loss; dpo's reference log-probabilities are
computed once, before the first step, and stored beside the token cache (objective_for).
"""

import hashlib
import io
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llm.base import atomic
from llm.data.token_cache import digest
from llm.formats import lora as lora_io
from llm.scores.evaluation import validation_loss

OBJECTIVES = ("dpo", "simpo")
# The device vector of sums a batch's pairs add up to (reduced to means by metrics()).
STATS = ("pair_loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "chosen_logp",
         "chosen_tokens", "pairs")


@dataclass(frozen=True)
class Settings:
    """What a preference loss needs besides the log-probabilities."""
    objective: str = "dpo"  # one of OBJECTIVES
    beta: float = 0.1
    gamma: float = 0.0  # SimPO's target margin
    nll_weight: float = 1.0


def token_logps(model, batch) -> torch.Tensor:
    """(B, T) fp32 log-probability of each label of a PairBatch under the model, 0 where it is -100: the
    model's per-token losses (reduction "none"), taken a chunk of the replies' rows at a time, never the whole
    logits."""
    return -model(batch.x, labels=batch.y, positions=batch.pos, reduction="none")[1]


def reply_logps(token_lp: torch.Tensor, slot: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, the summed log-probabilities of its two replies and their token counts, each (pairs, 2) with
    column 0 chosen and 1 rejected. slot (B, T): 2 * pair + side for a reply's tokens, -1 elsewhere; scattered
    on the device (no host sync), the -1 tokens into a spare last entry that is dropped."""
    n = 2 * pairs
    where = torch.where(slot >= 0, slot, n).reshape(-1)
    sums = torch.zeros(n + 1, device=token_lp.device).index_add_(0, where, token_lp.reshape(-1))
    counts = torch.zeros(n + 1, device=token_lp.device).index_add_(0, where,
                                                                   torch.ones_like(token_lp).reshape(-1))
    return sums[:n].view(pairs, 2), counts[:n].view(pairs, 2)


def pair_loss(s: Settings, logps: torch.Tensor, counts: torch.Tensor,
              ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss (its pairs' mean, plus the NLL term) and the sums of STATS, detached. logps, counts,
    ref: (pairs, 2), chosen then rejected; ref (the reference's summed log-probabilities) for dpo only."""
    if s.objective == "dpo":
        ratios = logps - ref  # (pairs, 2)
        rewards = s.beta * ratios
        z = s.beta * (ratios[:, 0] - ratios[:, 1])
    else:
        mean = logps / counts.clamp(min=1)
        rewards = s.beta * mean
        z = s.beta * (mean[:, 0] - mean[:, 1]) - s.gamma
    losses = -F.logsigmoid(z)
    chosen_tokens = counts[:, 0].sum()
    nll = -logps[:, 0].sum() / chosen_tokens.clamp(min=1)
    loss = losses.mean() + s.nll_weight * nll
    margin = rewards[:, 0] - rewards[:, 1]
    stats = torch.stack([losses.sum(), rewards[:, 0].sum(), rewards[:, 1].sum(), margin.sum(),
                         (margin > 0).sum(), logps[:, 0].sum(), chosen_tokens,
                         torch.tensor(float(len(margin)), device=margin.device)])
    return loss, stats.detach().float()


def metrics(stats: torch.Tensor, prefix: str = "") -> dict:
    """Means of a vector of STATS sums (a host read): the pairs' loss and rewards, the share of pairs whose
    margin is above 0, and the chosen replies' mean log-probability per token."""
    got = dict(zip(STATS, stats.tolist()))
    pairs = max(got["pairs"], 1.0)
    out = {name: got[name] / pairs for name in STATS[:5]}
    out["chosen_logp"] = got["chosen_logp"] / max(got["chosen_tokens"], 1.0)
    return {prefix + k: v for k, v in out.items()}


# ----------------------------------------------------------------------------- the run's objective

class Objective:
    """A preference run's loss, called where a language-modelling run calls its model's own: objective(model,
    batch) -> loss, batch a batches.PairBatch. ref: per split, the reference's summed log-probabilities of
    each pair's replies ((pairs, 2) on the device; dpo only). Training's STATS sums stay on the device until
    the log line takes them; each evaluation's metrics are kept by its loss (the run's end evaluates twice,
    keeps one)."""

    def __init__(self, s: Settings, ref: dict | None, device):
        self.s, self.ref = s, ref
        self.window = torch.zeros(len(STATS), device=device)
        self.evaluated: dict[float, dict] = {}
        self.last_val: dict = {}  # the metrics of the evaluation kept last

    def compute(self, model, batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        logps, counts = reply_logps(token_logps(model, batch), batch.slot, batch.pairs)
        ref = self.ref[split][batch.pair_ids] if self.ref is not None else None
        return pair_loss(self.s, logps, counts, ref)

    def __call__(self, model, batch) -> torch.Tensor:
        loss, stats = self.compute(model, batch, "train")
        # a skipped (non-finite) step leaves the log line's figures alone
        self.window += torch.nan_to_num(stats)
        return loss

    def take(self, ranks) -> dict:
        """The training metrics since the last call, over every rank (a host read: the log line's), zeroed."""
        out = metrics(ranks.mean(self.window))
        self.window.zero_()
        return out

    @torch.no_grad()
    def evaluate(self, model, amp, val_batches, n: int, ranks, until: float = math.inf) -> tuple[float, int]:
        """The mean loss over n fixed validation micro-batches and the batches read
        (evaluation.validation_loss's loop, its pairs' metrics kept by the loss)."""
        loss, read, stats = validation_loss(model, amp, val_batches, n, ranks, until,
                                            lambda m, batch: self.compute(m, batch, "val"))
        self.evaluated[loss] = metrics(stats, "val_")
        return loss, read

    def kept(self, loss: float) -> dict:
        """The metrics of the evaluation that gave this loss (of the two at a run's end, the one whose weights
        the run keeps); the others are dropped."""
        self.last_val = self.evaluated.pop(loss, {})
        self.evaluated.clear()
        return self.last_val

    def summary(self) -> str:
        """The summary's line: the rewards of the evaluation kept last ("" before any)."""
        return f"\npreference, validation pairs: {self.line(self.last_val)}" if self.last_val else ""

    def line(self, metrics_: dict) -> str:
        """Rewards and accuracy as the bar and the summary print them."""
        p = "val_" if "val_reward_accuracy" in metrics_ else ""
        return (f"reward accuracy {100 * metrics_[p + 'reward_accuracy']:.1f}%, margin "
                f"{metrics_[p + 'reward_margin']:.3f} (chosen {metrics_[p + 'reward_chosen']:.3f}, "
                f"rejected {metrics_[p + 'reward_rejected']:.3f}), chosen log-prob "
                f"{metrics_[p + 'chosen_logp']:.3f} per token")


@torch.no_grad()
def reference_logps(model, amp, loader) -> np.ndarray:
    """(pairs, 2) float32: each pair's replies' summed log-probabilities under the model the run starts from
    (a LoRA run's base, adapters off), one pass over the split's windows in file order."""
    out = np.full((loader.plan.pairs, 2), np.nan, np.float32)
    was_training = model.training
    model.eval()
    with lora_io.adapters_off(model):
        for first in range(0, loader.plan.windows, loader.batch_size):
            batch = loader.of_windows(range(first, min(first + loader.batch_size, loader.plan.windows)))
            with amp:
                logps, _ = reply_logps(token_logps(model, batch), batch.slot, batch.pairs)
            out[batch.pair_ids.cpu().numpy()] = logps.cpu().numpy()
    model.train(was_training)
    return out


def stored_reference(folder: str, key: str, compute, what: str, pairs: int, log) -> np.ndarray:
    """The reference log-probabilities stored under folder (beside the token cache) by key: (pairs, 2)
    float32, finite, and the bytes whose sha256 was recorded beside them when written. Computed and written
    (under temporary names, then renamed; the values before their record) where absent, and again, saying so
    through log, where what is read back is not what was written (a damaged or edited file is never used)."""
    path = os.path.join(folder, "reference", key + ".npy")
    if os.path.isfile(path):
        values, problem = read_reference(path, pairs)
        if problem is None:
            return values
        log(f"the stored reference log-probabilities of {what} ({path}) {problem}: computing them again")
    values = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic.write_bytes(path, _npy_bytes(values))
    atomic.write_text(path + ".sha256", hashlib.sha256(_npy_bytes(values)).hexdigest())
    return values


def read_reference(path: str, pairs: int) -> tuple[np.ndarray | None, str | None]:
    """A stored reference file's values and None, or None and what is wrong with it: a file unreadable as a
    plain array (never unpickled), of another shape or dtype, not finite, or whose bytes are not those
    recorded."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        with open(path + ".sha256", encoding="utf-8") as f:
            recorded = f.read().strip()
        values = np.load(io.BytesIO(raw), allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        return None, f"cannot be read ({type(e).__name__})"
    if values.dtype != np.float32 or values.shape != (pairs, 2):
        return None, f"hold {values.dtype} {values.shape}, not float32 ({pairs}, 2)"
    if not np.isfinite(values).all():
        return None, "hold NaN or Inf"
    if hashlib.sha256(raw).hexdigest() != recorded:
        return None, "are not the values recorded when they were written"
    return values, None


def _npy_bytes(values: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, values, allow_pickle=False)
    return out.getvalue()


def objective_for(t, data, loaders: dict, model, amp, settings, start_id: str, log) -> Objective | None:
    """A preference run's Objective (None for a language-modelling run), before a checkpoint's weights load: t
    the run's TrainConfig, data its PreparedData, loaders its {"train", "val"} PairBatches, model the raw
    model (its execution already set for the step) under amp, settings the step's (plan.StepSettings: the
    autocast dtype and how a LoRA base is held), start_id the identity of the --init_from weights it starts
    from (lora.fingerprint). Its dpo reference log-probabilities are read from beside the token cache or
    computed there once, before the first step, from the model the run starts from (full fine-tuning: the
    --init_from weights, no second model kept; LoRA: the base, adapters off). log gets the line saying what
    the pairs are and where the reference came from."""
    if t.objective not in OBJECTIVES:
        return None
    plans = {split: loader.plan for split, loader in loaders.items()}
    line = (f"preference: {plans['train'].pairs:,} train pairs in {plans['train'].windows:,} windows, "
            f"{plans['val'].pairs:,} validation pairs; {sum(p.cut for p in plans.values())} prompts cut "
            f"from the left to fit the window, {sum(p.dropped for p in plans.values())} pairs left out "
            "(their replies alone overflow it)")
    ref, device = None, loaders["train"].device
    if t.objective == "dpo":
        start, ref = time.perf_counter(), {}
        for split, loader in loaders.items():
            key = digest(start_id, settings.lora_base or "full", str(settings.amp_dtype), data.fingerprint,
                         split, loader.seq_len, loader.plan.pairs)
            values = stored_reference(data.path, key,
                                      lambda: reference_logps(model, amp, loader),
                                      f"the {split} pairs", loader.plan.pairs, log)
            ref[split] = torch.from_numpy(values).to(device)
        source = "the base, adapters off" if t.lora_rank else "the --init_from weights"
        line += (f"; the reference's log-probabilities ({source}) ready in "
                 f"{time.perf_counter() - start:.1f}s, stored in {os.path.join(data.path, 'reference')}")
    log(line)
    return Objective(Settings(t.objective, t.beta, t.simpo_gamma, t.nll_weight), ref, device)
