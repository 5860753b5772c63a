"""Tests of tokenizer.py: training every kind, lossless round trips, the chat template and its loss masks,
and the one loader that generation and export use."""

import base64
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llm.base.errors import DataError
from llm.generate.inference import load_for_inference
from llm.tokens import tokenizer as tk

WORDS = ("the a river stone light green code data model token läuft 日本 quick brown fox jumps over lazy "
         "dog, and. (x) = 42; if else return").split()
VOCAB = 300


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(rng: random.Random, turns: int, system: bool) -> list:
    msgs = [{"role": "system", "content": "You are terse."}] if system else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": words(rng, 8) + "?"},
                 {"role": "assistant", "content": words(rng, 10) + "."}]
    return msgs


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A BPE tokenizer trained on random words, saved as tokenizer.json."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tk.train_tokenizer([words(rng, 200) for _ in range(20)], "bpe", VOCAB).save(str(path))
    return str(path)


@pytest.mark.parametrize("kind", tk.KINDS)
def test_decode_of_encode_gives_back_the_text(kind):
    """Prevents a tokenizer type that loses whitespace, bytes or characters."""
    rng = random.Random(1)
    tok = tk.train_tokenizer(["\n".join(words(rng, 30) for _ in range(5)) for _ in range(12)], kind, VOCAB)
    assert tok.get_vocab_size() <= VOCAB
    assert [tok.token_to_id(t) for t in tk.SPECIAL_TOKENS] == [0, 1, 2]
    for text in [words(rng, 40), "tabs\tand\r\nCRLF  double  spaces \u00e9\u4e2d\U0001f600 \x00\n",
                 "\u2500" * 300 + " " * 250 + "don't 1234567"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_chat_template_matches_renderer_and_transformers_tokenization(tokenizer_path):
    """Prevents the exported CHAT_TEMPLATE drifting from the renderer, and generation prompts that are not a
    prefix of what training saw."""
    tok = tk.load_tokenizer(tokenizer_path)
    assert tok.eos_token == tok.pad_token == tk.EOT_TOKEN
    msgs = conversation(random.Random(5), turns=3, system=True)
    text = tok.apply_chat_template(msgs, tokenize=False)
    ids, mask = tk.render_chat(tok, msgs)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Independently, from character offsets: learned = tokens inside an assistant's content + <|im_end|>.
    spans, pos = [], 0
    for m in msgs:
        start = text.index(tk.IM_START + m["role"] + "\n", pos) + len(tk.IM_START + m["role"] + "\n")
        pos = start + len(m["content"]) + len(tk.IM_END)
        if m["role"] == "assistant":
            spans.append((start, pos))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    assert mask == [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    prompt = tk.chat_prompt_ids(tok, msgs[:-1])
    assert tok.decode(prompt, skip_special_tokens=False) == tok.apply_chat_template(
        msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert ids[:len(prompt)] == prompt


def test_the_generators_tokenizer_is_the_loader_with_the_chat_template(tiny_checkpoint):
    """The tokenizer text_generator.py loads must be load_tokenizer's, template included: a second loader once
    shipped without it, so apply_chat_template failed only in the program users run."""
    _, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    msgs = conversation(random.Random(2), turns=1, system=False)
    assert tok.chat_template == tk.CHAT_TEMPLATE and tok.eos_token == tk.EOT_TOKEN
    rendered = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(tk.chat_prompt_ids(tok, msgs[:1]), skip_special_tokens=False) == rendered
    assert tk.can_chat(tok) and tk.stop_ids(tok) == [tok.convert_tokens_to_ids(t) for t in
                                                                (tk.EOT_TOKEN, tk.IM_END)]


def test_text_that_spells_a_special_token_stays_text(tokenizer_path):
    """A document containing '<|endoftext|>' or '<|im_start|>' literally must not forge a boundary or a turn.
    """
    tok = Tokenizer.from_file(tokenizer_path)
    (ids, _), = tk.encode_segments(tok, [[("a <|endoftext|> b <|im_start|>user", True, False)]])
    assert not set(ids) & {tok.token_to_id(t) for t in tk.SPECIAL_TOKENS}


def test_existing_tokenizer_gains_the_special_tokens_and_keeps_its_ids(tmp_path):
    """A foreign tokenizer.json gets the three special tokens appended, its own ids unchanged; one larger than
    the model's vocabulary is refused with the size to use."""
    plain = Tokenizer(models.BPE())  # a tokenizer from elsewhere: no special tokens at all
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator([words(random.Random(3), 100)] * 5, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    plain.save(str(tmp_path / "tokenizer.json"))
    before = plain.get_vocab()
    extended = tk.existing_tokenizer(str(tmp_path), vocab_size=VOCAB)
    assert {k: extended.token_to_id(k) for k in before} == before
    assert all(extended.token_to_id(t) is not None for t in tk.SPECIAL_TOKENS)
    with pytest.raises(DataError, match=f"pass --vocab_size {extended.get_vocab_size()}"):
        tk.existing_tokenizer(str(tmp_path), vocab_size=100)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(DataError, match="bad.json"):
        tk.load_tokenizer(str(tmp_path / "bad.json"))


def test_a_tiktoken_file_loads_as_the_bpe_it_describes(tmp_path):
    """--tokenizer may name a tiktoken rank file ('base64-token rank' lines): written from a tiktoken-style
    BPE trained here, it must encode exactly as that BPE does, and decode losslessly once the special tokens
    are added."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    rng = random.Random(4)
    tok = tk.train_tokenizer([words(rng, 200) + " don't 12345" for _ in range(20)], "tiktoken", VOCAB)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = sorted((i, s) for s, i in tok.get_vocab().items() if s not in tk.SPECIAL_TOKENS)
    with open(tmp_path / "mine.tiktoken", "wb") as f:
        for rank, (_, s) in enumerate(ranks):  # ranks from 0, as tiktoken files have them
            f.write(base64.b64encode(bytes(to_byte[c] for c in s)) + f" {rank}\n".encode())
    loaded = tk.read_tokenizer(str(tmp_path / "mine.tiktoken"))
    shift = {i: rank for rank, (i, _) in enumerate(ranks)}
    sample = words(rng, 60) + " don't 1234567 \u65e5\u672c"
    assert loaded.encode(sample).ids == [shift[i] for i in tok.encode(sample).ids]
    extended = tk.existing_tokenizer(str(tmp_path / "mine.tiktoken"), vocab_size=VOCAB)
    assert extended.decode(extended.encode(sample).ids) == sample
    (tmp_path / "bad.tiktoken").write_bytes(b"aGk= 0\nnot a line\n")
    with pytest.raises(DataError, match="line 2"):
        tk.read_tokenizer(str(tmp_path / "bad.tiktoken"))
