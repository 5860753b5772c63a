"""Tests of sampling.py: sampling maths, cached batched generation, eos and stop strings, streaming text.

The model and tokenizer are the tiny checkpoint of conftest.py, loaded as the generator loads it.
"""

from dataclasses import replace

import pytest
import torch

import sampling
from config import SampleConfig
from conftest import CODE as TEXT
from text_generator import load_for_inference

GREEDY = SampleConfig(temperature=0.0, max_new_tokens=12, seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    model, tok, cfg, path = load_for_inference(tiny_checkpoint, "cpu")
    return model, tok


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_greedy_matches_full_forward_argmax(loaded):
    """The cached decode must equal argmax over a full forward per step (catches cache/position bugs)."""
    model, tok = loaded
    prompt = ids_of(tok, "def push(self")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    first = sampling.generate(model, [prompt], GREEDY)
    assert first == [ids[len(prompt):]]
    assert sampling.generate(model, [prompt], GREEDY) == first  # deterministic


def test_top_k_one_is_greedy(loaded):
    """top_k=1 must pick the argmax whatever the temperature (an off-by-one in the k-th value breaks it)."""
    model, tok = loaded
    prompt = [ids_of(tok, "class Stack")]
    sampled = sampling.generate(model, prompt, replace(GREEDY, temperature=1.5, top_k=1, top_p=1.0, seed=3))
    assert sampled == sampling.generate(model, prompt, GREEDY)
    logits = torch.randn(5, 50)
    assert torch.equal(sampling.sample_next(logits, 2.0, top_k=1), logits.argmax(-1, keepdim=True))


def test_top_p_keeps_smallest_set_reaching_p():
    """Nucleus keeps exactly the top tokens whose mass first reaches p, at least one (not one too many or few)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: (sampling.filtered_probs(logits, 1.0, 0, p) > 0).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.1, 0.4, 0.75, 0.85, 0.97, 1.0)] == [1, 1, 2, 3, 4, 4]
    probs = sampling.filtered_probs(logits, 1.0, 0, 0.75)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_filters_leave_a_valid_distribution():
    """After temperature, top-k and top-p the probabilities sum to 1 and are 0 outside the kept set."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.9), (0.5, 20, 0.8), (0.0, 0, 1.0)]:
        probs = sampling.filtered_probs(logits, t, k, p)
        assert torch.allclose(probs.sum(-1), torch.ones(4)) and (probs >= 0).all()
        if k:
            outside = logits < torch.topk(logits, k).values[:, -1:]
            assert (probs[outside] == 0).all() and ((probs > 0).sum(-1) <= k).all()
        ids = sampling.sample_next(logits, t, k, p, torch.Generator().manual_seed(1))
        assert ids.shape == (4, 1) and (probs.gather(1, ids) > 0).all()  # never a filtered token


def test_out_of_range_sampling_arguments_raise():
    """Bad arguments must raise ValueError (which the REPL reports), not sample garbage."""
    logits = torch.randn(1, 10)
    for kwargs in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            sampling.sample_next(logits, **kwargs)


def test_repetition_penalty_matches_hand_computation():
    """CTRL penalty: seen positive logits divided, seen negative multiplied, unseen untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = sampling.apply_repetition_penalty(logits, seen, 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))


def test_repetition_penalty_counts_prompt_and_generated_tokens(loaded):
    """With a huge penalty, greedy never repeats a token of the prompt or of its own output."""
    model, tok = loaded
    prompt = ids_of(tok, "return n")
    out = sampling.generate(model, [prompt], replace(GREEDY, repetition_penalty=1e6, max_new_tokens=20))[0]
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_batch_of_different_lengths_equals_one_by_one(loaded):
    """Right-padded prefill with input_lengths must not let padding or other rows change any row."""
    model, tok = loaded
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    batched = sampling.generate(model, prompts, GREEDY)
    assert batched == [sampling.generate(model, [p], GREEDY)[0] for p in prompts]


def test_seed_and_counts(loaded):
    """Same seed, same samples; max_new_tokens and num_return_sequences are respected exactly."""
    model, tok = loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "for name")]
    s = SampleConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=9, num_return_sequences=3, seed=5)
    a, b = sampling.generate(model, prompts, s), sampling.generate(model, prompts, s)
    assert a == b and len(a) == 6 and all(len(x) == 9 for x in a)
    assert sampling.generate(model, prompts, replace(s, seed=6)) != a
    assert len({tuple(x) for x in a}) > 1  # the sequences of one prompt are different samples


def test_eos_ends_a_sequence(loaded):
    """A sampled eos id ends its row, is not returned, and the other rows go on."""
    model, tok = loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "import")]
    full = sampling.generate(model, prompts, GREEDY)
    eos = full[0][3]
    cut = sampling.generate(model, prompts, GREEDY, eos_ids=[eos])
    assert cut[0] == full[0][:full[0].index(eos)]
    assert cut[1] == (full[1][:full[1].index(eos)] if eos in full[1] else full[1])


def test_generation_stops_at_the_context(loaded):
    """A row that reaches max_seq_len stops there (the cache cannot grow); a too-long prompt is refused."""
    model, tok = loaded
    ctx = model.config.max_seq_len
    prompt = (ids_of(tok, TEXT) * 4)[:ctx - 5]
    out = sampling.generate(model, [prompt, prompt[:10]], replace(GREEDY, max_new_tokens=30))
    assert [len(o) for o in out] == [5, 30]
    with pytest.raises(ValueError, match="context"):
        sampling.generate(model, [prompt + prompt[:5]], GREEDY)


def test_stop_strings_stop_and_are_not_printed(loaded):
    """Generation ends at a stop string spanning tokens; the streamed text ends just before it."""
    model, tok = loaded
    s = replace(GREEDY, max_new_tokens=30)
    (text,), (ids,) = sampling.generate_text(model, tok, ["def push"], s, eos_ids=[])
    stop = text[8:12]  # some text the model does produce
    assert len(stop) == 4 and stop not in text[:11]
    (cut,), (cut_ids,) = sampling.generate_text(model, tok, ["def push"], replace(s, stop=["zzz", stop]), eos_ids=[])
    assert cut == text[:text.index(stop)]
    assert tok.decode(cut_ids).startswith(cut + stop) and len(cut_ids) < len(ids)


def test_stream_never_prints_a_broken_utf8_character(loaded):
    """Multi-byte characters split across byte-level tokens must come out whole, never as U+FFFD."""
    _, tok = loaded
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


def test_stream_holds_back_possible_stop_prefix(loaded):
    """Text that may begin a stop string waits; if the stop string does not follow, it is released."""
    _, tok = loaded
    stream = sampling.TextStream(tok, stops=["\n\n"])
    out = "".join(stream.push(i) for i in ids_of(tok, "a\nb\n"))
    assert out == "a\nb" and stream.flush() == "\n"
    stream = sampling.TextStream(tok, stops=["\n\n"])
    assert "".join(stream.push(i) for i in ids_of(tok, "a\n\nb")) == "a" and stream.stopped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_cuda_decode_matches_eager(tiny_checkpoint):
    """The CUDA-graph decode step must give eager's greedy tokens, across calls and batch sizes (a stale
    graph output or a cache whose address changed would show up here)."""
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cuda")
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    eager = sampling.generate(model, prompts, GREEDY)
    for batch in (prompts, prompts[:1], prompts):
        assert sampling.generate(model, batch, replace(GREEDY, compile=True)) == eager[:len(batch)]
