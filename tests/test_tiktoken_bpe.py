"""Tests of tiktoken_bpe.py: the ids tiktoken gives for a converted tokenizer are tokenizers' own, byte for
byte, on the tests' corpora and on the text that splits hardest; what does not convert keeps tokenizers and
says why; a cache prepared through tiktoken is the one tokenizers would have written."""

import json
import os
import textwrap

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from config import DataConfig
from conftest import CODE, prepare
from llm.base.errors import DataError
from llm.data import preparation
from llm.tokens.tiktoken_bpe import Encoder, encoder_for
from llm.tokens.tokenizer import encode_batch, encode_segments, train_tokenizer

pytest.importorskip("tiktoken")

HARD = [
    "", " ", "  leading and trailing  ", "\n" * 300, " " * 1000 + "x", "\t \n \r\n\u3000 \xa0end",
    "1234567890" * 40, "3.14159 2,718 1e-9 0x1F 100_000 ①②③ ٣٤٥", "don't I'll we've she's they'd DON'T I'LL",
    "日本語のテキストと中文文本，还有한국어", "emoji 👩‍👩‍👧‍👦 🇫🇷 👍🏽 ❤️‍🔥", "e\u0301 a\u0308 combining", "עברית ومرحبا mixed",
    "<|endoftext|> text <|im_start|>user\nhi<|im_end|>", "\ufffd replaced \ufffd\ufffd bytes", "a\x00b\x01\x7f\x85",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n", "http://example.com/a?b=c&d=e#f",
    "MiXeD CaSe ABCdef ǅ ß ﬁ", "…—–‘’“”•™", "x" * 5000, " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" * 3,
]


def stdlib_texts(n: int = 120) -> list[str]:
    """Real text of several kinds: standard-library modules, the tests' code, the hard strings."""
    folder = os.path.dirname(textwrap.__file__)
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))[:n]
    return [open(os.path.join(folder, name), encoding="utf-8").read() for name in names] + [CODE] + HARD


@pytest.fixture(scope="module", params=["bpe", "tiktoken"])
def trained(request):
    """A tokenizer of each kind that converts, trained on standard-library text with the hard strings in it.
    """
    return train_tokenizer(stdlib_texts(60) * 2, request.param, 2048)


def test_tiktoken_gives_tokenizers_ids_byte_for_byte(trained):
    """Any difference, a document split otherwise, would make a cache prepared here differ from one prepared
    where tiktoken is missing."""
    encoder = Encoder(trained)
    assert encoder.name == "tiktoken", encoder.why
    texts = stdlib_texts()
    ours, theirs = encoder(texts), encode_batch(trained, texts)
    assert [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b] == []
    assert sum(map(len, ours)) > 100_000  # enough text to have met every kind of split


@pytest.mark.parametrize("kind", ["bpe", "tiktoken"])
def test_held_out_text_encodes_alike_at_a_larger_vocabulary(kind):
    """Text the tokenizer was not trained on, at 8,192 tokens: merges meet words they were not learned from.
    """
    texts = stdlib_texts(120)
    tok = train_tokenizer(texts[:60], kind, 8192)
    held_out = texts[60:]
    assert Encoder(tok)(held_out) == encode_batch(tok, held_out)


def test_the_tests_corpora_encode_alike(corpus, chat_corpus, tmp_path):
    """The corpora the other tests prepare, plain and chat, through encode_segments as preparation calls it.
    """
    for source, cache in ((corpus["src"], corpus["cache"]), (chat_corpus["src"], chat_corpus["cache"])):
        data = prepare(DataConfig(sources=[source], cache_dir=str(tmp_path / os.path.basename(cache))))
        tok = Tokenizer.from_file(data.tokenizer_path)
        texts = preparation.split_texts(DataConfig(sources=[source]), None)
        assert Encoder(tok).name == "tiktoken"
        assert Encoder(tok)(texts) == encode_batch(tok, texts)


def test_what_does_not_convert_keeps_tokenizers_and_says_why(trained):
    """WordPiece, Unigram, a normalizer, another split rule: tiktoken would split or merge otherwise."""
    wordpiece, unigram = (train_tokenizer(stdlib_texts(10), kind, 600) for kind in ("wordpiece", "unigram"))
    normalized = Tokenizer.from_str(trained.to_str())
    normalized.normalizer = normalizers.NFC()
    other_split = Tokenizer.from_str(trained.to_str())
    other_split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    spec = json.loads(trained.to_str())
    spec["model"]["merges"] = spec["model"]["merges"][::-1]  # merge order no longer that of the ids
    reordered = Tokenizer.from_str(json.dumps(spec))
    for tok, why in ((wordpiece, "WordPiece"), (unigram, "Unigram"), (normalized, "normalizes"),
                     (other_split, "another rule"), (reordered, "do not follow its ids")):
        encoder, lines = Encoder(tok), []
        assert encoder.name == "tokenizers" and why in encoder.why
        encoder_for(tok, lines.append)
        assert lines == [f"data: encoding with tokenizers ({encoder.why})"]
        texts = stdlib_texts(3)
        assert encoder(texts) == encode_batch(tok, texts)


def test_a_lone_surrogate_is_refused_by_either_encoder(trained):
    """tokenizers refuses a lone surrogate (a JSON "\\ud800"), tiktoken would replace it: both refuse it."""
    fast, plain = Encoder(trained), Encoder(train_tokenizer(stdlib_texts(5), "unigram", 600))
    for encoder in (fast, plain):
        with pytest.raises(DataError, match="cannot encode this text"):
            encode_segments(encoder.tok, ["fine", "bad \ud800 text"], encoder)


def test_a_cache_prepared_through_tiktoken_is_the_one_tokenizers_writes(corpus, chat_corpus, tmp_path, monkeypatch):
    """End to end: the same parts, byte for byte, and the log says which encoder ran."""
    def parts(cache):
        found = {}
        for root, _, files in os.walk(cache):
            for name in files:
                if name.endswith(".bin"):
                    with open(os.path.join(root, name), "rb") as f:
                        found[os.path.relpath(os.path.join(root, name), cache)] = f.read()
        return found
    for source in (corpus["src"], chat_corpus["src"]):
        logs = []
        fast = prepare(DataConfig(sources=[source], cache_dir=str(tmp_path / "fast")), logs)
        assert "data: encoding with tiktoken" in logs
        monkeypatch.setattr(preparation, "encoder_for", lambda tok, log: _plain(tok))
        prepare(DataConfig(sources=[source], cache_dir=str(tmp_path / "plain")))
        monkeypatch.undo()
        assert parts(tmp_path / "fast") == parts(tmp_path / "plain") and parts(tmp_path / "fast")
        assert fast.meta["train_tokens"] > 1000


def _plain(tok) -> Encoder:
    """An Encoder that uses tokenizers whatever the tokenizer."""
    encoder = Encoder(tok)
    encoder.tiktoken, encoder.name = None, "tokenizers"
    return encoder
