"""Preference tuning's losses held to TRL's own code (a test-only dependency), on log-probabilities a naive
float64 gather computes; the packed scatter of token log-probabilities into per-reply sums held to the same
gather."""

import collections
import types

import pytest
import torch

from llm.train import preference

trl = pytest.importorskip("trl")


def naive_logps(logits, labels):
    """Log-probability of each label, float64, one token at a time: the reference the others are held to."""
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] != -100:
                out[b, t] = torch.log_softmax(logits[b, t].double(), -1)[labels[b, t]]
    return out


def random_pairs(pairs=5, length=12, vocab=11, seed=0):
    """TRL's layout: rows [chosen..., rejected...], each a prompt then a completion of its own length, then
    padding; returns input_ids, completion_mask (2P, T) and the naive (2P, T - 1) log-probs of each next
    token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, length), generator=g)
    mask = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):
        prompt = 2 + row % 3
        end = prompt + 2 + int(torch.randint(0, length - prompt - 2, (1,), generator=g))
        mask[row, prompt:end] = 1
    logits = torch.randn(2 * pairs, length, vocab, generator=g) * 2
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return ids, mask, naive_logps(logits[:, :-1], labels), logits, labels


def trl_dpo(per_token, ids, mask, ref, beta, nll_weight):
    """TRL's DPOTrainer._compute_loss itself, its model replaced by one that returns these per-token log-probs
    and the reference log-probs given as precomputed (TRL's precompute_ref_logps); loss types sigmoid + sft.
    """
    from trl import DPOTrainer
    per_token = per_token.float()
    out = types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                                mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    model = types.SimpleNamespace(training=True)
    accel = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    me = types.SimpleNamespace(model=model, accelerator=accel, aux_loss_enabled=False, ld_alpha=None,
                               precompute_ref_logps=True, f_divergence_type="reverse_kl", beta=beta,
                               loss_types=["sigmoid", "sft"], loss_weights=[1.0, nll_weight], use_weighting=False,
                               _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
                               _total_train_tokens=0, _tp_size=1, label_smoothing=0.0)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "ref_chosen_logps": ref[:, 0].float(), "ref_rejected_logps": ref[:, 1].float()}
    loss = DPOTrainer._compute_loss(me, lambda **kw: out, inputs, return_outputs=False)
    m = me._metrics["train"]
    return loss.item(), {k: m[f"rewards/{k}"][0] for k in ("chosen", "rejected", "margins", "accuracies")}


def sums(per_token, pairs):
    """(pairs, 2) sums and counts of TRL's layout, chosen then rejected."""
    total, count = per_token.sum(1), (per_token != 0).sum(1).double()
    return torch.stack([total[:pairs], total[pairs:]], 1), torch.stack([count[:pairs], count[pairs:]], 1)


@pytest.mark.parametrize("beta,nll_weight", [(0.1, 0.0), (0.1, 1.0), (0.5, 0.3)])
def test_dpo_loss_and_rewards_equal_trls_own(beta, nll_weight):
    """Our DPO loss, NLL term and rewards must be TRL's DPOTrainer's (loss types sigmoid + sft) to 1e-5: a
    sign, a mean taken per sequence instead of per token, or a reward without beta would each show here."""
    pairs = 5
    ids, mask, per_token, _, _ = random_pairs(pairs)
    logps, counts = sums(per_token, pairs)
    ref = logps + torch.randn(pairs, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss, stats = preference.pair_loss(preference.Settings("dpo", beta, 0.0, nll_weight), logps, counts, ref)
    ours = preference.metrics(stats)
    trl_loss, trl_rewards = trl_dpo(per_token, ids, mask, ref, beta, nll_weight)
    assert loss.item() == pytest.approx(trl_loss, abs=1e-5)
    assert ours["reward_chosen"] == pytest.approx(trl_rewards["chosen"], abs=1e-5)
    assert ours["reward_rejected"] == pytest.approx(trl_rewards["rejected"], abs=1e-5)
    assert ours["reward_margin"] == pytest.approx(trl_rewards["margins"], abs=1e-5)
    assert ours["reward_accuracy"] == pytest.approx(trl_rewards["accuracies"], abs=1e-5)
    assert 0 < ours["reward_accuracy"] < 1  # the random pairs hold both kinds


@pytest.mark.parametrize("beta,gamma,nll_weight", [(2.5, 1.375, 0.0), (2.5, 1.375, 1.0), (0.1, 0.05, 0.5)])
def test_simpo_loss_and_rewards_equal_trls_cpo_trainer(beta, gamma, nll_weight):
    """SimPO as TRL computes it (CPOTrainer.cpo_loss with loss_type simpo, plus cpo_alpha times its NLL of the
    chosen replies): our loss and rewards to 1e-5."""
    from trl.experimental.cpo import CPOTrainer
    pairs = 6
    _, _, per_token, _, _ = random_pairs(pairs, seed=3)
    logps, counts = sums(per_token, pairs)
    loss, stats = preference.pair_loss(preference.Settings("simpo", beta, gamma, nll_weight), logps, counts)
    mean = logps / counts
    me = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                               accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    losses, chosen, rejected = CPOTrainer.cpo_loss(me, mean[:, 0], mean[:, 1])
    nll = -per_token[:pairs].sum() / counts[:, 0].sum()  # CPO's cross-entropy over the chosen labels
    assert loss.item() == pytest.approx((losses.mean() + nll_weight * nll).item(), abs=1e-5)
    ours = preference.metrics(stats)
    assert ours["reward_chosen"] == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert ours["reward_rejected"] == pytest.approx(rejected.mean().item(), abs=1e-5)
    assert ours["reward_accuracy"] == pytest.approx((chosen > rejected).double().mean().item(), abs=1e-5)


def test_packed_reply_sums_equal_a_naive_gather():
    """Pairs packed into rows (several per row, slots scattered), their log-probabilities the model's
    per-token losses: the summed log-probabilities per reply must equal a naive float64 gather from the
    model's whole logits within 1e-5, and tokens outside replies (slot -1) must count nowhere."""
    from config import ModelConfig
    from modern_llm import Transformer
    g = torch.Generator().manual_seed(5)
    B, T, V, pairs = 2, 20, 13, 3
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, max_seq_len=T))
    x, labels = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    slot = torch.full((B, T), -1)
    slot[0, 2:6], slot[0, 8:11], slot[0, 13:15] = 0, 1, 2  # pair 0 both sides and pair 1's chosen in row 0
    slot[1, 1:7], slot[1, 9:16] = 3, 4  # pair 1's rejected, pair 2's chosen
    slot[1, 17:19] = 5
    labels[slot < 0] = -100
    pos = torch.stack([torch.cat([torch.arange(8), torch.arange(12)]), torch.cat([torch.arange(9), torch.arange(11)])])
    batch = types.SimpleNamespace(x=x, y=labels, pos=pos)
    got, counts = preference.reply_logps(preference.token_logps(model, batch), slot, pairs)
    with torch.no_grad():
        naive = naive_logps(model(x, positions=pos)[0], labels)
    want = torch.stack([naive[slot == i].sum() for i in range(2 * pairs)]).view(pairs, 2)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert counts.view(-1).tolist() == [(slot == i).sum().item() for i in range(2 * pairs)]


def test_the_stored_reference_is_checked_on_the_way_back_in_and_computed_again_where_it_is_not_what_was_written(
        tmp_path):
    """The DPO reference once came back from np.load unchecked: another shape raised IndexError, random bytes
    or an object array ValueError, and values scaled by 0.5 (same shape and dtype) trained silently on a wrong
    reference. Each is now found (shape, dtype, finite values, the sha256 recorded when written), said in one
    line and computed again; an object array is never unpickled."""
    import hashlib

    import numpy as np

    from llm.train.preference import stored_reference
    truth = np.arange(10, dtype=np.float32).reshape(5, 2) - 20
    calls, said = [], []

    def compute():
        calls.append(1)
        return truth.copy()
    path = tmp_path / "reference" / "k.npy"
    got = stored_reference(str(tmp_path), "k", compute, "the train pairs", 5, said.append)
    assert (got == truth).all() and len(calls) == 1 and not said
    assert (path.parent / "k.npy.sha256").read_text() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (stored_reference(str(tmp_path), "k", compute, "the train pairs", 5, said.append) == truth).all()
    assert len(calls) == 1  # read back, not computed

    class Payload:  # what unpickling an object array would run
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))
    damages = {"another shape": np.zeros((3, 2), np.float32), "halved": truth * 0.5,
               "NaN": np.full((5, 2), np.nan, np.float32), "strings": np.array([["a", "b"]] * 5),
               "an object array": np.array([Payload()] * 10, dtype=object).reshape(5, 2)}
    for name, values in damages.items():
        with open(path, "wb") as f:
            np.save(f, values, allow_pickle=True)
        got = stored_reference(str(tmp_path), "k", compute, "the train pairs", 5, said.append)
        assert (got == truth).all() and said[-1].startswith("the stored reference log-probabilities of the train "
                                                           f"pairs ({path})"), name
    path.write_bytes(b"\x93NUMPY random bytes")
    assert (stored_reference(str(tmp_path), "k", compute, "the train pairs", 5, said.append) == truth).all()
    assert len(calls) == 1 + len(damages) + 1 and not (tmp_path / "ran").exists()
