"""The tokenizer format: special tokens, the chat template, loss-mask segments, training and loading.

Every tokenizer here is byte-level (any text encodes, decoding is lossless) and knows three special
tokens: <|endoftext|> between documents, <|im_start|> and <|im_end|> around chat turns (ChatML).
preparation.py trains one from the texts it hands over; load_tokenizer() is the one way to open a
tokenizer.json for generation or export, with eos, pad and the chat template set.
"""

import base64
import os
import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from llm.base.errors import DataError

EOT_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT_TOKEN, IM_START, IM_END]  # trained tokenizers give them ids 0, 1, 2
ROLES = ("system", "user", "assistant")
# The one chat format (ChatML), for transformers' apply_chat_template; chat_segments renders the same text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
BYTE_ALPHABET = 256  # every byte-level tokenizer keeps one token per byte, so any text encodes
# GPT-4's (cl100k) pre-tokenisation: contractions, letter runs, digit groups of up to 3, punctuation, spaces.
GPT4_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
KINDS = ("bpe", "tiktoken", "wordpiece", "unigram")
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?")  # one token of a tiktoken rank file
MIN_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)
TOKENIZER_FILE = "tokenizer.json"
# The trainers' cost grows faster than linearly in a pre-tokenized word's length (a 64 KB run without a space
# took 32 s to train on), so training text is cut after every run of this many characters without (or of)
# whitespace; a word of real text is far shorter, and encoding is not cut: it stays lossless.
TRAIN_WORD_CHARS = 1024
LONG_RUN = re.compile(r"\S{%d}|\s{%d}" % (TRAIN_WORD_CHARS, TRAIN_WORD_CHARS))


# ----------------------------------------------------------------------------- files

def tokenizer_file(path: str) -> str:
    """The tokenizer.json that a path names (the file or its folder)."""
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise DataError(f"tokenizer {path} not found, pass a tokenizer.json file or a folder holding one")
    return file


def save_tokenizer(tok: Tokenizer, file: str):
    """tok.save(file), a write the disk refuses raised as the OSError it is (atomic.write_error turns that
    into one line): tokenizers reports it as a bare Exception '... No space left on device (os error 28)'."""
    try:
        tok.save(file)
    except Exception as e:  # noqa: BLE001 - tokenizers raises nothing narrower
        number = re.search(r"\(os error (\d+)\)", str(e))
        if not number:
            raise
        raise OSError(int(number.group(1)), os.strerror(int(number.group(1))), file) from None


def read_tokenizer(path: str) -> Tokenizer:
    """The tokenizers.Tokenizer of a tokenizer.json (or its folder), or of a tiktoken rank file (lines of
    'base64-token rank', such as cl100k_base.tiktoken); DataError when it is neither."""
    file = tokenizer_file(path)
    with open(file, "rb") as f:
        head = f.read(256)
    if TIKTOKEN_LINE.match(head.split(b"\n", 1)[0]):
        return _from_tiktoken(file)
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"{file} is not a tokenizers JSON file ({str(e).splitlines()[0]}), "
                        "pass a tokenizer.json saved by the tokenizers library or a tiktoken file") from None


def _tiktoken_ranks(file: str) -> dict[bytes, int]:
    """bytes -> rank of a tiktoken file, read as data (base64 and integers): nothing in it runs."""
    ranks = {}
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not TIKTOKEN_LINE.match(line.rstrip(b"\n")):
                raise DataError(f"{file} line {number} is not 'base64-token rank', pass a tiktoken file")
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _from_tiktoken(file: str) -> Tokenizer:
    """A tiktoken rank file as a byte-level BPE with GPT-4's pre-tokenisation (transformers' converter)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class LocalFile(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):  # the converter's own loader needs the tiktoken package
            return _tiktoken_ranks(path)
    return LocalFile(vocab_file=file, pattern=GPT4_PATTERN).converted()


def load_tokenizer(path: str):
    """A tokenizer.json (or its folder) as a transformers fast tokenizer: <|endoftext|> as eos and pad where
    the vocabulary has it, and the chat template."""
    from transformers import PreTrainedTokenizerFast  # slow import, needed only by its callers

    raw = read_tokenizer(path)
    eot = EOT_TOKEN if raw.token_to_id(EOT_TOKEN) is not None else None
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eot, pad_token=eot)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def stop_ids(tokenizer) -> list[int]:
    """Ids that end a generation, on every route (the REPL, completions, chat): <|endoftext|>, and <|im_end|>
    where the tokenizer has it (a chat-trained model ends its reply there, in a chat or a plain prompt alike).
    """
    vocab = tokenizer.get_vocab()
    return [vocab[n] for n in (EOT_TOKEN, IM_END) if n in vocab]


def can_chat(tokenizer) -> bool:
    """Whether the tokenizer has the ChatML tokens a chat-trained model needs."""
    vocab = tokenizer.get_vocab()
    return IM_START in vocab and IM_END in vocab


# ----------------------------------------------------------------------------- training

def new_tokenizer(kind: str, vocab_size: int):
    """An untrained byte-level tokenizer of the given kind, and its trainer."""
    common = dict(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind in ("bpe", "tiktoken"):
        model, trainer = models.BPE(), trainers.BpeTrainer(**common)
        if kind == "tiktoken":  # GPT-4's split first, then bytes: a tiktoken-style BPE
            byte_level = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(GPT4_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif kind == "wordpiece":
        # No "##" prefix: the byte-level decoder then joins pieces as they are, and decoding stays lossless.
        # No word length limit: every byte is in the vocabulary, so no word ever needs an [UNK] it lacks.
        model = models.WordPiece(continuing_subword_prefix="", max_input_chars_per_word=2**31 - 1)
        trainer = trainers.WordPieceTrainer(continuing_subword_prefix="", **common)
    elif kind == "unigram":
        model, trainer = models.Unigram(), trainers.UnigramTrainer(**common)
    else:
        raise DataError(f"tokenizer_type={kind!r} is invalid: choose {', '.join(KINDS)}")
    tok = Tokenizer(model)
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok, trainer


def bounded_words(text: str):
    """Yield text in pieces, none holding a run of more than TRAIN_WORD_CHARS characters without (or of)
    whitespace: each piece ends after such a run, so the trainer never sees a longer word."""
    start = 0
    for run in LONG_RUN.finditer(text):  # no earlier run reaches into a match: the first long run is matched
        yield text[start:run.end()]
        start = run.end()
    yield text[start:]


def train_tokenizer(texts, kind: str, vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer of `kind` trained on an iterable of strings (long runs cut: bounded_words)."""
    tok, trainer = new_tokenizer(kind, vocab_size)
    reading = []  # a failure of the texts' iterator (reading the data), which is not the tokenizer's

    def watched():
        try:
            for text in texts:
                yield from bounded_words(text)
        except Exception as e:
            reading.append(e)
            raise
    try:
        tok.train_from_iterator(watched(), trainer)
    except Exception as e:  # the Rust trainers raise bare Exceptions
        if reading:  # the data's own failure: a DataError says what is wrong with it, anything else is a bug
            raise reading[0] from None
        raise DataError(f"training a {kind} tokenizer of {vocab_size} tokens failed "
                        f"({str(e).splitlines()[0]}), try another --tokenizer_type or --vocab_size") from None
    return tok


def existing_tokenizer(path: str, vocab_size: int) -> Tokenizer:
    """A local tokenizer.json, with the special tokens added where it lacks them."""
    tok = read_tokenizer(path)
    tok.add_special_tokens(SPECIAL_TOKENS)  # keeps the ids of tokens it already has
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer {path} has {tok.get_vocab_size()} tokens, more than "
                        f"vocab_size={vocab_size}, pass --vocab_size {tok.get_vocab_size()} or more")
    return tok


# ----------------------------------------------------------------------------- chat format and loss masks

def check_messages(messages, need_assistant: bool = True) -> list:
    """Raise DataError unless messages is a list of {role, content} with known roles."""
    if not isinstance(messages, list) or not messages:
        raise DataError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise DataError(f"unknown role {role!r}, use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"a {m['role']} message has no string content")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError("the conversation has no assistant turn, so nothing in it would be learned")
    return messages


def chat_segments(messages) -> list[tuple[str, bool, bool]]:
    """CHAT_TEMPLATE as (text, learned, is_special) pieces: assistant content and its <|im_end|> are learned.
    """
    out = []
    for m in messages:
        learned = m["role"] == "assistant"
        out += [(IM_START, False, True), (m["role"] + "\n", False, False), (m["content"], learned, False),
                (IM_END, learned, True), ("\n", False, False)]
    return out


def chat_text(messages) -> str:
    """A conversation as the text CHAT_TEMPLATE renders (special tokens written out)."""
    return "".join(text for text, _, _ in chat_segments(messages))


def template_prompt(tok, messages, template: str = "") -> str:
    """The text asking for the assistant's reply to messages: in `template` (a model's own chat template,
    rendered by transformers' apply_chat_template in its sandbox, as lm-eval's --apply_chat_template renders
    it), else in the project's ChatML."""
    if not template:
        return chat_text(messages) + IM_START + "assistant\n"
    return tok.apply_chat_template(list(messages), chat_template=template, add_generation_prompt=True,
                                   tokenize=False)


def encode_batch(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, every core at once; text that happens to contain "<|endoftext|>" stays text: it
    must not forge a boundary or a turn."""
    before, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    finally:
        tok.encode_special_tokens = before


def encode_segments(tok: Tokenizer, docs: list, encode=None) -> list[tuple[list[int], list[bool]]]:
    """Token ids and learned-flags of documents given as segments, or as plain strings (learned text), with
    one parallel encode call (`encode`: texts -> ids, by default tokenizers' own, encode_batch); a plain
    string's flags come as True (every token learned)."""
    # Each piece is encoded on its own, so a prompt's ids are always a prefix of the full conversation's.
    plain = all(isinstance(d, str) for d in docs)  # pretraining text: no per-document work before the call
    texts = docs if plain else [text for segs in docs for text, _, special in
                                ([(segs, True, False)] if isinstance(segs, str) else segs) if not special]
    try:
        encoded = (encode or (lambda batch: encode_batch(tok, batch)))(texts)
    # a tokenizer from elsewhere may fail on some text (a WordPiece without [UNK], say)
    except Exception as e:
        raise DataError(f"the tokenizer cannot encode this text ({str(e).splitlines()[0]}), pass another "
                        "--tokenizer or --tokenizer_type") from None
    if plain:
        return [(ids, True) for ids in encoded]
    encoded, out = iter(encoded), []
    for segs in docs:
        if isinstance(segs, str):
            out.append((next(encoded), True))
            continue
        ids, mask = [], []
        for text, learned, special in segs:
            piece = [tok.token_to_id(text)] if special else next(encoded)
            ids += piece
            mask += [learned] * len(piece)
        out.append((ids, mask))
    return out


def marked_text(tok, ids: list[int], learned: list[bool], marks=("[[", "]]")) -> str:
    """Token ids as text (special tokens written out), each run of learned tokens between the two marks."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or learned[end] != learned[start]:
            text = tok.decode(ids[start:end], skip_special_tokens=False)
            out.append(marks[0] + text + marks[1] if learned[start] else text)
            start = end
    return "".join(out)


def render_chat(tok, messages) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation in CHAT_TEMPLATE and its loss mask (True: learned)."""
    backend = getattr(tok, "backend_tokenizer", tok)  # the Rust tokenizer inside a transformers one
    return encode_segments(backend, [chat_segments(check_messages(messages, False))])[0]


def chat_prompt_ids(tok, messages) -> list[int]:
    """Token ids of the conversation so far followed by '<|im_start|>assistant\\n', to generate the reply."""
    prompt = [(IM_START, False, True), ("assistant\n", False, False)]
    segments = chat_segments(check_messages(messages, False)) + prompt
    return encode_segments(getattr(tok, "backend_tokenizer", tok), [segments])[0][0]
