"""Preference tuning's objectives: DPO, and SimPO as the reference-free one, each with an NLL term on the chosen reply.

A pair is one prompt with a better (chosen) and a worse (rejected) reply; log pi(c) is the log-probability the
model gives the chosen reply's tokens after the prompt, summed over them (its EOS included, the prompt not).
  dpo    -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])  (Rafailov et al., 2023), ref
         the model the run starts from; its rewards are beta * (log pi - log ref), as TRL's DPOTrainer logs them.
  simpo  -log sigmoid(beta * (mean log pi(c) - mean log pi(r)) - gamma)  (Meng et al., 2024): log-probabilities
         averaged over each reply's tokens, no reference; rewards beta * mean log pi, as TRL's CPOTrainer logs them.
SimPO rather than ORPO: SimPO is a drop-in for DPO at the same stage (after chat fine-tuning, on the same pairs)
that needs no reference pass at all, and its per-token average removes the pull of summed log-probabilities
towards longer replies; ORPO folds chat fine-tuning into the preference stage (its own NLL plus an odds ratio),
which this tool already does as a step of its own.
Both add nll_weight times the chosen replies' mean negative log-likelihood per token (RPO, Pang et al., 2024;
TRL's "sft" loss type, CPO's cpo_alpha): only the margin is optimised otherwise, and the chosen reply's own
probability can fall with the rejected one's (trl#800).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits and (B, T) labels -> (B, T) fp32 log-probability of each label, 0 where it is -100."""
    flat = labels.reshape(-1)
    lp = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100, reduction="none")
    return lp.view(labels.shape)


def reply_logps(token_lp: torch.Tensor, slot: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, the summed log-probabilities of its two replies and their token counts, each (pairs, 2) with
    column 0 chosen and 1 rejected. slot (B, T): 2 * pair + side for a reply's tokens, -1 elsewhere; scattered
    on the device (no host sync), the -1 tokens into a spare last entry that is dropped."""
    n = 2 * pairs
    where = torch.where(slot >= 0, slot, n).reshape(-1)
    sums = torch.zeros(n + 1, device=token_lp.device).index_add_(0, where, token_lp.reshape(-1))
    counts = torch.zeros(n + 1, device=token_lp.device).index_add_(0, where, torch.ones_like(token_lp).reshape(-1))
    return sums[:n].view(pairs, 2), counts[:n].view(pairs, 2)


def pair_loss(s: Settings, logps: torch.Tensor, counts: torch.Tensor,
              ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss (its pairs' mean, plus the NLL term) and the sums of STATS, detached. logps, counts, ref:
    (pairs, 2), chosen then rejected; ref (the reference's summed log-probabilities) for dpo only."""
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
    stats = torch.stack([losses.sum(), rewards[:, 0].sum(), rewards[:, 1].sum(), margin.sum(), (margin > 0).sum(),
                         logps[:, 0].sum(), chosen_tokens, torch.tensor(float(len(margin)), device=margin.device)])
    return loss, stats.detach().float()


def metrics(stats: torch.Tensor, prefix: str = "") -> dict:
    """Means of a vector of STATS sums (a host read): the pairs' loss and rewards, the share of pairs whose
    margin is above 0, and the chosen replies' mean log-probability per token."""
    got = dict(zip(STATS, stats.tolist()))
    pairs = max(got["pairs"], 1.0)
    out = {name: got[name] / pairs for name in STATS[:5]}
    out["chosen_logp"] = got["chosen_logp"] / max(got["chosen_tokens"], 1.0)
    return {prefix + k: v for k, v in out.items()}
