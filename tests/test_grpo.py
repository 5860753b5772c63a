"""GRPO's arithmetic held to independent references: advantages to a naive float64 loop over the groups, the
loss and its gradient to TRL 1.16's GRPOTrainer._compute_loss itself (a test-only dependency), for each
normalisation, with and without the KL term, on-policy and on a second iteration (old log-probabilities that
differ)."""

import collections
import math
import types

import pytest
import torch

from llm.train import grpo

trl = pytest.importorskip("trl")


def naive_advantages(rewards: list[float], group: int, scale: str) -> list[float]:
    """r - mean of its group (NaN rewards left out, and given 0), over the group's (or batch's) sample std +
    1e-4."""
    def std(values):
        values = [v for v in values if not math.isnan(v)]
        if len(values) < 2:
            return math.nan
        m = sum(values) / len(values)
        return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    out = []
    for start in range(0, len(rewards), group):
        members = rewards[start:start + group]
        seen = [v for v in members if not math.isnan(v)]
        mean = sum(seen) / len(seen) if seen else math.nan
        for r in members:
            a = r - mean
            if scale != "none":
                a /= (std(members) if scale == "group" else std(rewards)) + grpo.STD_FLOOR
            out.append(0.0 if math.isnan(a) else a)
    return out


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_advantages_equal_a_naive_loop_over_the_groups(scale):
    """A group mean taken across groups, a population std where TRL divides by the sample std, or a NaN reward
    pulled into the mean would each move these."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (12,), generator=g).double()
    rewards[4:8] = 1.0  # a group of equal rewards: zero spread
    rewards[9] = math.nan  # one completion no function judged
    adv, flat = grpo.advantages(rewards, 4, scale)
    assert adv.tolist() == pytest.approx(naive_advantages(rewards.tolist(), 4, scale), abs=1e-12)
    assert flat.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert adv[9] == 0


def test_rewards_add_up_by_weight_and_a_completion_none_judged_stays_unjudged():
    values = torch.tensor([[1.0, 0.5], [math.nan, 2.0], [math.nan, math.nan]], dtype=torch.float64)
    total = grpo.reward_rows(values, torch.tensor([2.0, -1.0], dtype=torch.float64))
    assert total[:2].tolist() == [1.5, -2.0] and math.isnan(total[2])


def trl_loss(logps, old, ref, adv, mask, loss_type, beta, accum, tokens_in_batch, max_len):
    """TRL's GRPOTrainer._compute_loss on one micro-batch, its model's per-token log-probabilities replaced by
    logps (which carry the gradient), everything else given as its inputs."""
    from trl import GRPOTrainer
    accel = types.SimpleNamespace(num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t,
                                  reduce=lambda t, reduction="sum": t, sync_gradients=True)
    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=accum)
    me = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, args=args, use_vllm=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=accum, accelerator=accel,
        max_completion_length=max_len, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    B, T = logps.shape
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "num_items_in_batch": torch.tensor(float(tokens_in_batch))}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(me, None, inputs)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("iteration", [1, 2])
def test_the_loss_and_its_gradient_equal_trls_grpo_trainer(loss_type, beta, iteration):
    """Over two micro-batches of completions of different lengths: the summed loss and the gradient it gives
    the per-token log-probabilities equal TRL's to 1e-5. On iteration 2 the old log-probabilities differ, so
    the ratio is off 1 and some tokens are clipped; a wrong clip side, KL sign or normaliser would show."""
    g = torch.Generator().manual_seed(1 + iteration)
    B, T, accum, max_len = 8, 7, 2, 7
    mask = torch.zeros(B, T)
    for row in range(B):
        mask[row, :1 + int(torch.randint(0, T, (1,), generator=g))] = 1
    base = -torch.rand(B, T, generator=g) * 3
    old = base + 0.4 * torch.randn(B, T, generator=g) if iteration == 2 else None
    ref = base + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    s = grpo.Settings(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, max_completion_length=max_len)
    tokens, completions = mask.sum().item(), float(B)
    ours_lp, theirs_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours_total, theirs_total, clipped = 0.0, 0.0, 0
    for micro in range(accum):
        rows = slice(micro * B // accum, (micro + 1) * B // accum)
        per_token, was_clipped = grpo.token_losses(ours_lp[rows], None if old is None else old[rows], ref[rows],
                                                   adv[rows], s)
        ours_total = ours_total + grpo.reduce(per_token, mask[rows], s, tokens, completions)
        clipped += int((was_clipped * mask[rows]).sum())
        theirs_total = theirs_total + trl_loss(theirs_lp[rows], None if old is None else old[rows], ref[rows],
                                               adv[rows], mask[rows], loss_type, beta, accum, tokens, max_len)
    ours_total.backward()
    theirs_total.backward()
    assert ours_total.item() == pytest.approx(theirs_total.item(), abs=1e-5)
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, atol=1e-5)
    assert ours_lp.grad.abs().sum() > 0
    assert (clipped > 0) == (iteration == 2)  # on-policy the ratio is 1: nothing is clipped


def test_the_kl_estimate_is_zero_at_the_reference_and_positive_elsewhere():
    lp = torch.tensor([[-1.0, -2.0]])
    assert grpo.kl(lp, lp).abs().max() == 0
    assert (grpo.kl(lp, lp + torch.tensor([[0.5, -0.5]])) > 0).all()


def test_settings_outside_the_arithmetic_are_refused():
    with pytest.raises(ValueError, match="loss_type"):
        grpo.check(grpo.Settings(loss_type="ppo"))
    with pytest.raises(ValueError, match="epsilon"):
        grpo.check(grpo.Settings(epsilon=1.5))
