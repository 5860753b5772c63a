"""A GRPO run's objective, called where a language-modelling run calls its model's own loss (runner.Runner):
objective(model, batch) -> loss, batch a rollouts.RolloutBatch. Its metrics are the samplings' (rewards, reply
lengths, the share of groups that teach nothing, where the step's seconds go) and the loss's own (the KL to
the reference where beta > 0, the share of clipped tokens where num_iterations > 1). An evaluation scores
greedy replies to the held-out prompts: its "loss" is their mean reward, negated, so that the best checkpoint
is the one of the highest reward.
"""

import math

import torch

from config import SampleConfig
from llm.generate.engine import generate_all
from llm.train import grpo
from llm.train.rollouts import Rollouts, token_logps

# The device vector of sums a micro-batch adds to the log window: reply tokens, their KL sum, clipped tokens.
STATS = ("tokens", "kl", "clipped")


class Objective:
    """GRPO's loss over a step's micro-batches of sampled replies, and its evaluation on held-out prompts."""

    def __init__(self, rollouts: Rollouts, accum: int):
        self.rollouts, self.s, self.accum = rollouts, rollouts.settings, accum
        self.window = torch.zeros(len(STATS), device=rollouts.device)
        self.evaluated: dict[float, dict] = {}
        self.last_val: dict = {}

    def __call__(self, model, batch) -> torch.Tensor:
        logps = token_logps(model, batch.x, batch.y, batch.pos)
        per_token, clipped = grpo.token_losses(logps, batch.old, batch.ref, batch.adv, self.s)
        loss = grpo.reduce(per_token, batch.mask, self.s, batch.tokens, batch.completions, batch.per_reply)
        kl = grpo.kl(logps.detach(), batch.ref) if batch.ref is not None else torch.zeros_like(logps)
        self.window += torch.stack([batch.mask.sum(), (kl * batch.mask).sum(), (clipped * batch.mask).sum()])
        # The normalisers count the whole step's replies; the trainer divides every micro-batch's loss by the
        # accumulation steps, which this takes back.
        return loss * self.accum

    def take(self, ranks) -> dict:
        """The training metrics since the last log line (a host read), zeroed."""
        got = dict(zip(STATS, ranks.mean(self.window).tolist()))
        self.window.zero_()
        out = self.rollouts.take()
        if self.s.beta:
            out["kl"] = got["kl"] / max(got["tokens"], 1.0)
        if self.rollouts.t.num_iterations > 1:
            out["clipped_share"] = got["clipped"] / max(got["tokens"], 1.0)
        return out

    @torch.no_grad()
    def evaluate(self, model, amp, held, n: int, ranks, until: float = math.inf) -> tuple[float, int]:
        """Minus the mean total reward of greedy replies to the first n held-out prompts (held: a
        prompts.PromptSplit), and how many; each reward function's mean is kept by the result."""
        prompts = held.prompts[:max(1, n)]
        r = self.rollouts
        settings = SampleConfig(max_new_tokens=r.t.max_completion_length, temperature=0.0, top_k=0, top_p=1.0)
        was_training = model.training
        model.eval()
        with amp:
            replies = generate_all(model, [p.ids for p in prompts], settings, r.ends, keep_end=True)
        model.train(was_training)
        values, figures = r.score(prompts, replies, 1)
        rewards = grpo.reward_rows(values, r.weights)
        mean = float(ranks.mean(torch.nan_to_num(rewards).mean().to(held.device)))
        loss = -mean
        self.evaluated[loss] = {"val_reward": mean, **{f"val_{k}": v for k, v in figures.items()
                                                       if not k.endswith("/std")}}
        return loss, len(prompts)

    def kept(self, loss: float) -> dict:
        """The metrics of the evaluation that gave this loss; the others are dropped."""
        self.last_val = self.evaluated.pop(loss, {})
        self.evaluated.clear()
        return self.last_val

    def line(self, metrics: dict) -> str:
        """The held-out rewards as the bar and the summary print them."""
        each = ", ".join(f"{k[len('val_reward/'):]} {v:.3f}" for k, v in metrics.items()
                         if k.startswith("val_reward/"))
        return f"held-out mean reward {metrics['val_reward']:.3f} ({each}), greedy replies"

    def summary(self) -> str:
        return f"\ngrpo: {self.line(self.last_val)}" if self.last_val else ""

