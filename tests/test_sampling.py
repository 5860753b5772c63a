"""Tests of sampling.py: the sampling maths against plain references, and text streamed from ids.

The tokenizer is the tiny checkpoint's of conftest.py, loaded as the generator loads it.
"""

import pytest
import torch
import torch.nn.functional as F

from config import SampleConfig
from llm.base.errors import ConfigError
from llm.generate import sampling


def filtered_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """The reference: (B, V) logits -> (B, V) probabilities after temperature, top-k and top-p, written
    plainly over the whole vocabulary (no ranking, no noise); filtered tokens are 0."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:  # drop a token when those ranked above it already reach p
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, generator=None) -> torch.Tensor:
    """pick() with plain arguments, every row the same: (B, V) logits -> (B, 1) ids."""
    B, V = logits.shape
    col = lambda v, dtype=torch.float32: torch.full((B, 1), v, dtype=dtype)  # noqa: E731
    noise = sampling.exp_noise((B, V), logits.device, generator) if temperature > 0 else torch.ones(B, V)
    seen = torch.zeros((B, V), dtype=torch.bool)
    return sampling.pick(logits.float(), seen, noise, col(temperature), col(top_k or V, torch.long), col(top_p),
                         col(1.0))[:, None]


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_top_p_keeps_smallest_set_reaching_p():
    """Nucleus keeps exactly the top tokens whose mass first reaches p, at least one (not one too many or
    few)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: (filtered_probs(logits, 1.0, 0, p) > 0).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.1, 0.4, 0.75, 0.85, 0.97, 1.0)] == [1, 1, 2, 3, 4, 4]
    probs = filtered_probs(logits, 1.0, 0, 0.75)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))

def test_filters_leave_a_valid_distribution():
    """After temperature, top-k and top-p the probabilities sum to 1 and are 0 outside the kept set."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.9), (0.5, 20, 0.8), (0.0, 0, 1.0)]:
        probs = filtered_probs(logits, t, k, p)
        assert torch.allclose(probs.sum(-1), torch.ones(4)) and (probs >= 0).all()
        if k:
            outside = logits < torch.topk(logits, k).values[:, -1:]
            assert (probs[outside] == 0).all() and ((probs > 0).sum(-1) <= k).all()
        ids = sample_next(logits, t, k, p, torch.Generator().manual_seed(1))
        assert ids.shape == (4, 1) and (probs.gather(1, ids) > 0).all()  # never a filtered token

def test_out_of_range_sampling_arguments_raise():
    """Bad settings must be refused where every caller's settings are made (the REPL reports the ConfigError),
    not sample garbage."""
    for kwargs in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ConfigError):
            SampleConfig(**kwargs)

def test_repetition_penalty_matches_hand_computation():
    """CTRL penalty: seen positive logits divided, seen negative multiplied, unseen untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = sampling.apply_repetition_penalty(logits, seen, 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))

def test_stream_never_prints_a_broken_utf8_character(tiny_loaded):
    """Multi-byte characters split across byte-level tokens must come out whole, never as U+FFFD."""
    _, tok = tiny_loaded
    text = "naïve café 日本語 ☃ def f(): return 'ß→∞' 🙂"
    ids = ids_of(tok, text)
    assert len(ids) > len(text.encode("utf-8")) // 2  # really byte-level pieces of multi-byte characters
    stream, pieces = sampling.TextStream(tok), []
    for i in ids:
        pieces.append(stream.push(i))
    pieces.append(stream.flush())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    half = sampling.TextStream(tok)
    assert "".join(half.push(i) for i in ids_of(tok, "日")[:-1]) + half.flush() == ""  # incomplete tail dropped

def test_stream_holds_back_possible_stop_prefix(tiny_loaded):
    """Text that may begin a stop string waits; if the stop string does not follow, it is released."""
    _, tok = tiny_loaded
    stream = sampling.TextStream(tok, stops=["\n\n"])
    out = "".join(stream.push(i) for i in ids_of(tok, "a\nb\n"))
    assert out == "a\nb" and stream.flush() == "\n"
    stream = sampling.TextStream(tok, stops=["\n\n"])
    assert "".join(stream.push(i) for i in ids_of(tok, "a\n\nb")) == "a" and stream.stopped


def test_ranking_only_the_top_candidates_draws_the_same_tokens():
    """The engine ranks only the top 64 tokens when every row has a top_k within them, and none when every
    row is greedy: the draws must equal those over the fully sorted vocabulary, with the same noise."""
    torch.manual_seed(0)
    B, V = 6, 500
    logits, seen = torch.randn(B, V) * 3, torch.rand(B, V) < 0.05
    noise = sampling.exp_noise((B, V), "cpu", torch.Generator().manual_seed(2))
    col = lambda *v, dtype=torch.float32: torch.tensor(v, dtype=dtype)[:, None]  # noqa: E731
    settings = (col(0.7, 1.0, 1.3, 0.5, 0.0, 2.0), col(1, 10, 40, 64, 5, 50, dtype=torch.long),
                col(1.0, 0.9, 0.8, 1.0, 0.5, 0.95), col(1.0, 1.3, 1.0, 2.0, 1.0, 1.1))
    def rows(temperatures, top_ks, top_p=0.9):
        return [SampleConfig(temperature=t, top_k=k, top_p=top_p) for t, k in zip(temperatures, top_ks)]
    assert sampling.candidates(rows([0.7, 1.0, 1.3, 0.5, 0.0, 2.0], [1, 10, 40, 64, 5, 50]), V) == 64
    everything = sampling.pick(logits, seen, noise, *settings)
    assert torch.equal(sampling.pick(logits, seen, noise, *settings, ranked=64), everything)
    greedy = (col(*[0.0] * B), *settings[1:])
    assert sampling.candidates(rows([0.0] * B, [0] * B), V) == 0
    argmax = sampling.pick(logits, seen, noise, *greedy)
    assert torch.equal(sampling.pick(logits, seen, noise, *greedy, ranked=0), argmax)
    assert sampling.candidates(rows([1.0, 0.0], [0, 5]), V) == V
    assert sampling.candidates(rows([1.0], [300]), V) == 500
    # Rows that keep every token (top_k 0, top_p 1; a greedy row among them) rank none: the draws are the
    # sorted path's, token for token, with the same noise.
    off = V  # a top_k of the whole vocabulary keeps every token
    plain = (col(0.7, 1.0, 0.0, 1.3, 1.0, 2.0), col(off, off, 5, off, off, off, dtype=torch.long),
             col(*[1.0] * B), col(*[1.0] * B))
    assert sampling.candidates(rows([0.7, 1.0, 0.0, 1.3, 1.0, 2.0], [0, 0, 5, 0, 0, 0], top_p=1.0), V) == \
        sampling.UNRANKED
    sorted_draws = sampling.pick(logits, seen, noise, *plain)
    assert torch.equal(sampling.pick(logits, seen, noise, *plain, ranked=sampling.UNRANKED), sorted_draws)
    assert sampling.candidates(rows([1.0, 1.0], [0, 0], top_p=0.95), V) == V  # a nucleus ranks the vocabulary


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)])
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p):
    """pick() with exp_noise draws each token as often as the plain reference's probability says: 40,000
    draws of one row, every frequency within 4 standard errors (a noise that is not Exp(1), uniform say, or
    a filter that keeps the wrong tokens, is off by far more)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0]])
    n = 40_000
    want = filtered_probs(logits, temperature, top_k, top_p)[0]
    drawn = sample_next(logits.expand(n, -1), temperature, top_k, top_p, torch.Generator().manual_seed(3))
    got = torch.bincount(drawn[:, 0], minlength=logits.size(-1)).double() / n
    standard_error = (want.double() * (1 - want.double()) / n).sqrt()
    assert torch.all((got - want.double()).abs() <= 4 * standard_error + 1e-12), (got, want)


def test_exp_noise_is_exponential_and_never_zero():
    """exp_noise's empirical distribution function against Exp(1)'s, 1 - exp(-x), in float64 (Kolmogorov's
    bound at 200,000 draws is about 0.004), and no draw at 0, where p / 0 would win every argmax."""
    noise = sampling.exp_noise((200_000,), "cpu", torch.Generator().manual_seed(0)).double()
    assert noise.min() > 0
    points = torch.tensor([0.01, 0.1, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    empirical = (noise[:, None] <= points).double().mean(0)
    assert torch.allclose(empirical, 1 - torch.exp(-points), atol=0.004)
