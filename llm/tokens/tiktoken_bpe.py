"""A byte-level BPE tokenizer of the tokenizers library, encoded through tiktoken: the same ids, about three
times faster per core (tiktoken merges by the rank of the merged bytes, which for a BPE whose merged tokens'
ids follow its merge order picks the merges the BPE's own rules pick).

The token cache's preparation encodes through encoder_for(): tiktoken where the tokenizer converts (a plain
byte-level BPE split as GPT-2 or GPT-4 split, as every bpe and tiktoken tokenizer trained here is), tokenizers
otherwise (WordPiece, Unigram, a normalizer, another split rule, tiktoken not installed), saying which and
why."""

import json
import os

from tokenizers import Tokenizer, pre_tokenizers

from llm.tokens.tokenizer import GPT4_PATTERN, encode_batch

# The split of tokenizers' ByteLevel pre-tokenizer (use_regex=True), GPT-2's, written as tiktoken reads it.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PLAIN_BPE = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}


def byte_of_char() -> dict[str, int]:
    """ByteLevel's printable stand-in for each byte, reversed: the character a token's string holds -> its
    byte. GPT-2's table: the visible Latin-1 bytes stand for themselves, the others take chr(256), chr(257),
    ... in order."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in visible]
    table = {chr(b): b for b in visible} | {chr(256 + i): b for i, b in enumerate(others)}
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())  # the characters tokenizers itself uses
    return table


def split_pattern(pre_tokenizer: dict | None) -> str | None:
    """The regex a tokenizer.json's pre-tokenizer splits with before the bytes, when it is one tiktoken runs
    alike."""
    if pre_tokenizer == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                         "use_regex": True}:
        return GPT2_PATTERN
    parts = (pre_tokenizer or {}).get("pretokenizers", [])
    if (pre_tokenizer or {}).get("type") == "Sequence" and len(parts) == 2 \
            and parts[0] == {"type": "Split", "pattern": {"Regex": GPT4_PATTERN}, "behavior": "Isolated",
                             "invert": False} \
            and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex") \
            and not parts[1].get("add_prefix_space"):
        return GPT4_PATTERN
    return None


def ranks_of(tok: Tokenizer) -> tuple[dict[bytes, int] | None, str, str]:
    """(tiktoken's mergeable ranks, the split regex, why not) for a tokenizer; ranks None when it does not
    convert. The ranks are the tokenizer's own ids, so tiktoken's output needs no mapping."""
    spec = json.loads(tok.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return None, "", f"a {model.get('type', 'unknown')} tokenizer, not a BPE"
    if spec.get("normalizer") is not None:
        return None, "", "the tokenizer normalizes text first"
    if any(model.get(k) != v for k, v in PLAIN_BPE.items()):
        return None, "", "its BPE takes options tiktoken does not have"
    pattern = split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, "", "its pre-tokenizer splits text by another rule"
    chars, vocab = byte_of_char(), model["vocab"]
    special = {t["content"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(chars[c] for c in token): i for token, i in vocab.items() if token not in special}
    except KeyError:
        return None, "", "its vocabulary holds tokens that are not byte-level"
    merged = [vocab.get("".join(m) if isinstance(m, list) else m.replace(" ", "", 1))
              for m in model["merges"]]
    byte_ids = [ranks.get(bytes([b])) for b in range(256)]
    if (len(ranks) != len(vocab) - len(special & set(vocab)) or None in byte_ids or None in merged
        or any(a >= b for a, b in zip(merged, merged[1:]))
        or max(byte_ids) >= min(merged, default=len(vocab))):
        return None, "", "its merges do not follow its ids"
    return ranks, pattern, ""


class Encoder:
    """Batches of texts -> their ids, as tokenizers' encode_batch_fast gives them with special tokens read as
    text; through tiktoken where the tokenizer converts. name and why say which runs."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.tiktoken = tok, None
        ranks, pattern, self.why = ranks_of(tok)
        if ranks is not None:
            try:
                import tiktoken
            except ImportError:
                self.why = "tiktoken is not installed (pip install tiktoken)"
            else:
                self.tiktoken = tiktoken.Encoding("bpe", pat_str=pattern, mergeable_ranks=ranks,
                                                  special_tokens={})
        self.name = "tiktoken" if self.tiktoken else "tokenizers"

    def __call__(self, texts: list[str]) -> list[list[int]]:
        """Raises on text the tokenizer cannot encode (a lone surrogate; for tokenizers, also a WordPiece
        without [UNK])."""
        if self.tiktoken is None:
            return encode_batch(self.tok, texts)
        for text in texts:
            if not text.isascii():
                # a lone surrogate raises, as tokenizers refuses it (tiktoken would replace it)
                text.encode("utf-8")
        return self.tiktoken.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)


def encoder_for(tok: Tokenizer, log=print) -> Encoder:
    """The fastest encoder that gives this tokenizer's ids; one log line says which."""
    encoder = Encoder(tok)
    log(f"data: encoding with {encoder.name}" + (f" ({encoder.why})" if encoder.why else ""))
    return encoder
