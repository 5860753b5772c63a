"""GRPO's arithmetic: group-relative advantages from rewards, and the clipped policy loss over completion
tokens.

A step samples G completions of each prompt. Each completion's reward r is the weighted sum of the reward
functions' values (reward_rows); its advantage is r minus its group's mean (Shao et al., 2024), divided by the
group's standard deviation only under scale_rewards "group" ("batch": the whole batch's), as Dr. GRPO (Liu et
al., 2025) and nanochat leave it out by default. With log pi the policy's per-token log-probabilities, log old
those the completions were sampled with and log ref the reference's:
    ratio = exp(log pi - log old), the PPO ratio (1 on-policy, where only its gradient counts)
    loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
    KL_t = exp(log ref - log pi) - (log ref - log pi) - 1    (Schulman's k3 estimator, >= 0)
summed over the completions' tokens and normalised (loss_type) as TRL 1.16's GRPOTrainer does:
    dapo      over all the step's completion tokens (token-level, Yu et al., 2025): long replies weigh by
              length
    grpo      each completion's mean over its tokens, then the mean over completions (the paper's)
    dr_grpo   over completions x max_completion_length, a constant (Dr. GRPO): no length bias
A reward function may return None for a completion it does not judge (TRL's convention): it then adds nothing,
and a completion no function judges has advantage 0.
"""

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALES = ("none", "group", "batch")
# added to a standard deviation before dividing by it (TRL's), so equal rewards give 0, not NaN
STD_FLOOR = 1e-4


@dataclass(frozen=True)
class Settings:
    """What the GRPO loss needs besides the log-probabilities and advantages."""
    loss_type: str = "dapo"  # one of LOSS_TYPES
    epsilon: float = 0.2  # the ratio's lower clip, 1 - epsilon
    epsilon_high: float = 0.28  # its upper clip, 1 + epsilon_high (DAPO's clip-higher)
    beta: float = 0.0  # the KL term's weight; 0: no reference is computed
    max_completion_length: int = 256  # dr_grpo's constant per completion


def reward_rows(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N,) total reward of each completion from (N, F) values of F functions (NaN: not judged) and (F,)
    weights: the weighted sum of the values given, NaN where none is."""
    total = torch.nansum(values * weights, dim=1)
    return torch.where(torch.isnan(values).all(dim=1), torch.nan, total)


def nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """The sample standard deviation (n - 1) of the values that are not NaN; NaN where fewer than two are."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, var, torch.nan).sqrt()
    return std if keepdim else std.squeeze() if dim is None else std.squeeze(dim)


def advantages(rewards: torch.Tensor, group: int, scale: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) advantages of N = prompts x group completions, each prompt's group consecutive, and (N,) whether
    each one's group had rewards of zero spread (it teaches nothing): r - its group's mean, divided by the
    group's (or the batch's) standard deviation plus STD_FLOOR under scale "group" ("batch"). A NaN reward (no
    function judged it) stays out of the mean and gets 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    group_std = nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1) if group > 1 \
        else torch.zeros_like(rewards)
    std = nanstd(rewards).expand_as(rewards) if scale == "batch" else group_std
    out = rewards - mean
    if scale != "none":
        out = out / (std + STD_FLOOR)
    spread = torch.nan_to_num(group_std, nan=0.0)
    return torch.nan_to_num(out, nan=0.0), torch.isclose(spread, torch.zeros_like(spread))


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                 adv: torch.Tensor, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token loss of B completions, and (B, T) whether each token's ratio was clipped. logps (B,
    T): the policy's log-probabilities of the completion tokens (with gradient); old_logps: the sampling
    policy's (None: on-policy, logps detached); ref_logps: the reference's (beta > 0 only); adv (B,) a
    completion's, or (B, T) each token's (rows that hold several completions)."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    a = adv[:, None] if adv.dim() == 1 else adv
    loss = -torch.min(ratio * a, clipped_ratio * a)
    clipped = ((ratio < 1 - s.epsilon) & (a < 0)) | ((ratio > 1 + s.epsilon_high) & (a > 0))
    if s.beta:
        loss = loss + s.beta * kl(logps, ref_logps)
    return loss, clipped


def kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token estimate of KL(pi || ref) at the sampled tokens (k3: unbiased, never negative)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def reduce(loss: torch.Tensor, mask: torch.Tensor, s: Settings, tokens: float, completions: float,
           per_reply: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's share of the step's loss: loss (B, T) per token, mask (B, T) 1 at completion tokens;
    tokens and completions: the whole step's counts (every micro-batch and rank), so that the micro-batches'
    shares add up to the step's loss as loss_type defines it. per_reply (B, T): each token's weight in its
    completion's mean (mask over the completion's counted tokens), where a row holds several; None: a
    completion to a row."""
    masked = loss * mask
    if s.loss_type == "dapo":
        return masked.sum() / max(tokens, 1.0)
    if s.loss_type == "grpo":
        if per_reply is None:
            per_reply = mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return (loss * per_reply).sum() / max(completions, 1.0)
    if s.loss_type == "dr_grpo":
        return masked.sum() / (max(completions, 1.0) * s.max_completion_length)
    raise ValueError(f"loss_type {s.loss_type!r} is not one of {LOSS_TYPES}")


def check(s: Settings):
    """Settings a loss can be computed with (config.py refuses bad values first; this holds the arithmetic's
    own)."""
    if s.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {s.loss_type!r} is not one of {LOSS_TYPES}")
    if not (0 <= s.epsilon < 1 and s.epsilon_high >= 0 and math.isfinite(s.epsilon_high)):
        raise ValueError(f"epsilon={s.epsilon} must be in [0, 1) and epsilon_high={s.epsilon_high} >= 0")
