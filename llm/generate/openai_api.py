"""The OpenAI API as serve.py speaks it: a request's values checked and turned into what the worker takes
(prompts as token ids, sampling settings, echo and logprobs), and the logprobs object of a completion.

Every value is checked before a request joins a batch; a bad one raises BadRequest naming its parameter (a
400 with OpenAI's error body). The logprobs object is the completions API's, which evaluation harnesses read
to score a continuation: tokens, token_logprobs (null for a prompt's first token, which nothing predicts),
top_logprobs (at each place, the `logprobs` most likely tokens and the chosen one: text -> log-probability)
and text_offset (where each token's text starts, counted from the start of the prompt).
"""

import functools
import itertools
import json
import math
from dataclasses import dataclass

from config import SampleConfig
from llm.base.errors import ConfigError
from llm.generate.sampling import TextStream
from llm.tokens.tiktoken_bpe import byte_of_char
from llm.tokens.tokenizer import stop_ids

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_BODY = 2**20  # bytes of a request body: the text of a 32k-token context is about 128 KB
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's 4 stop strings; each one's prefixes are checked at every token
MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts per request (a harness's batch)
MAX_LOGPROBS = 20  # OpenAI's bound on the alternatives given per token
INT64_MAX = 2**63 - 1  # a seed or top_k past torch's int64 overflows in the worker


class BadRequest(Exception):
    """A request the server refuses: HTTP status, message, the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


# Parameters of OpenAI's API this server does not implement -> the values that ask for nothing, which are
# accepted; any other value is refused by name rather than ignored (best_of also passes when it equals n).
UNIMPLEMENTED = {"best_of": (1,), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
                 "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
                 "function_call": ("none", "auto"), "response_format": ({"type": "text"},)}


@dataclass
class Scoring:
    """What a request asks to see besides its new text."""
    echo: bool = False  # the prompt too, its tokens scored like the new ones
    logprobs: int | None = None  # alternatives given per token (0 to MAX_LOGPROBS); None: no logprobs object


def refuse_unimplemented(body: dict):
    """BadRequest naming the first parameter of UNIMPLEMENTED that asks for something (NaN and 10^9 included).
    """
    for name, neutral in UNIMPLEMENTED.items():
        value = body.get(name)
        fine = value is None or any(value == v and type(value) is not bool for v in neutral) or (
            name == "best_of" and value == body.get("n", 1) and type(value) is int)
        if not fine:
            raise BadRequest(f"{name}={value!r:.60} is not implemented "
                             f"by this server; leave {name} out", name)


def stream_options_of(body: dict) -> bool:
    """Whether a streamed answer ends with a chunk of usage (stream_options.include_usage), checked."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    unknown = (sorted(set(options) - {"include_usage", "include_obfuscation"})
               if isinstance(options, dict) else [])
    if not isinstance(usage, bool) or unknown:
        raise BadRequest("stream_options must be an object with include_usage: true or false"
                         + (f" ({unknown[0]!r:.40} is not an option)" if unknown else ""), "stream_options")
    return usage


def check_text(body: dict):
    """Refuse a field holding a lone surrogate (JSON's "\\ud800"): no tokenizer or UTF-8 answer can carry one.
    """
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            name = name.encode("utf-8", "backslashreplace").decode()  # the name itself may hold the surrogate
            raise BadRequest(f"{name} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is "
                             "not text; send valid Unicode", name) from None
        except RecursionError:
            raise BadRequest(f"{name} nests too deeply", name) from None


def number(body: dict, name: str, default, kind=float, low=None, high=None):
    """body[name], or default when absent or null, as a finite int or float in [low, high]; BadRequest naming
    it."""
    value = body.get(name)
    value = default if value is None else value
    # JSON allows Infinity
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not finite or (kind is int and value != int(value)):
        raise BadRequest(f"{name} must be a{'n integer' if kind is int else ' finite number'}, "
                         f"got {value!r:.40}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"{name}={value!r:.40} is out of range [{low}, {high}]", name)
    return kind(value)


def settings_of(body: dict, ctx: int, chat: bool = False, echo: bool = False) -> SampleConfig:
    """SampleConfig from an OpenAI request body; BadRequest naming the parameter when a value is wrong.
    Without max_tokens a completion gets OpenAI's 16 tokens and a chat reply the rest of the context; with
    echo, max_tokens may be 0 (the prompt scored, nothing generated: the caller reads body["max_tokens"])."""
    default = number(body, "max_completion_tokens", ctx if chat else DEFAULT_MAX_TOKENS, int, 1, ctx)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"a stop string has {max(map(len, stop))} characters, more than the "
                         f"{MAX_STOP_CHARS} allowed; shorten it", "stop")
    try:
        return SampleConfig(max_new_tokens=max(1, number(body, "max_tokens", default, int,
                                                         0 if echo else 1, ctx)),
                            temperature=number(body, "temperature", 1.0, float, 0, 2),
                            top_p=max(number(body, "top_p", 1.0, float, 0, 1), 1e-9),
                            top_k=max(number(body, "top_k", 0, int, -1, INT64_MAX), 0),  # -1: off, as in vLLM
                            seed=number(body, "seed", -1, int, -1, INT64_MAX),
                            num_return_sequences=number(body, "n", 1, int, 1, MAX_N),
                            stop=stop, repetition_penalty=1.0)
    except ConfigError as e:
        raise BadRequest(str(e), getattr(e, "field", None)) from None


def scoring_of(body: dict) -> Scoring:
    """echo and logprobs of a completion request, checked. Neither streams: the scores come once a choice
    ends."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r:.40}", "echo")
    logprobs = None if body.get("logprobs") is None else number(body, "logprobs", 0, int, 0, MAX_LOGPROBS)
    for name, asked in (("echo", bool(echo)), ("logprobs", logprobs is not None)):
        if asked and body.get("stream"):
            raise BadRequest(f"{name} is not available with stream: true; ask without streaming", name)
    return Scoring(bool(echo), logprobs)


def chat_scoring_of(body: dict) -> Scoring:
    """logprobs (true or false) and top_logprobs (0 to 20, with logprobs: true) of a chat request, checked."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be true or false in a chat "
                         f"request, got {logprobs!r:.40}", "logprobs")
    top = None if body.get("top_logprobs") is None else number(body, "top_logprobs", 0, int, 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs and body.get("stream"):
        raise BadRequest("logprobs is not available with stream: true; ask without streaming", "logprobs")
    return Scoring(False, (top or 0) if logprobs else None)


def _is_ids(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(type(i) is int for i in value)


def prompts_of(body: dict, tokenizer, vocab: int) -> list[list[int]]:
    """A completion request's prompts as token ids. prompt takes OpenAI's four forms: a string, a list of
    token ids, or a list of either (a harness sends its batch as a list of token lists). An empty text is
    the start token <|endoftext|>, so the model writes a fresh document."""
    prompt = body.get("prompt", "")
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not (isinstance(prompts, list) and 0 < len(prompts) <= MAX_PROMPTS
            and all(isinstance(p, str) or _is_ids(p) for p in prompts)):
        raise BadRequest(f"prompt must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of "
                         "either", "prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(tokenizer.encode(p, add_special_tokens=False) or stop_ids(tokenizer)[:1] or [0])
            continue
        bad = next((i for i in p if not 0 <= i < vocab), None)
        if bad is not None:
            raise BadRequest(f"prompt holds the token id {str(bad)[:40]}, outside "
                             f"the model's ids [0, {vocab - 1}]",
                             "prompt")
        out.append(p)
    return out


# ----------------------------------------------------------------------------- answers

def token_texts(tokenizer):
    """id -> the text of that token alone, special tokens as written (memoised): the strings of `tokens` and
    of top_logprobs' keys, one function for both, so a client comparing a token with the likeliest one
    compares like with like."""
    decode = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
    return functools.lru_cache(maxsize=2**17)(lambda i: decode([i], skip_special_tokens=False))


def token_bytes(tokenizer):
    """id -> the bytes that token stands for (memoised): a byte-level token may hold part of a character,
    whose text alone is only the replacement character; special tokens as written."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    table, added = byte_of_char(), backend.get_added_tokens_decoder()

    def of(i: int) -> bytes:
        token = backend.id_to_token(i) or ""
        byte_level = i not in added and set(token) <= table.keys()
        return bytes(table[c] for c in token) if byte_level else token.encode("utf-8")
    return functools.lru_cache(maxsize=2**17)(of)


def released(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence ("".join is its text): a character whose bytes span
    several tokens counts with the last of them."""
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    if pieces:
        pieces[-1] += stream.flush()
    return pieces


def logprobs_object(text_of, tokenizer, ids: list[int], scores: tuple, start: int, alternatives: int) -> dict:
    """The logprobs of ids[start:] (start 0: the whole echoed prompt; else the prompt's length). scores:
    engine.score()'s for the whole sequence, its entry k for ids[k + 1]; alternatives: how many of its top
    tokens each place lists, besides the chosen one. text_of: token_texts(tokenizer)."""
    chosen, top_ids, top_lps = scores
    offsets = list(itertools.accumulate(map(len, released(tokenizer, ids)), initial=0))
    token_logprobs, top_logprobs = [], []
    for k in range(start, len(ids)):
        if k == 0:  # nothing before it: no prediction
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        tops = {}
        for t, lp in zip(top_ids[k - 1][:alternatives], top_lps[k - 1][:alternatives]):
            tops.setdefault(text_of(t), lp)  # two tokens of the same text: the likelier one's figure
        tops.setdefault(text_of(ids[k]), chosen[k - 1])
        token_logprobs.append(chosen[k - 1])
        top_logprobs.append(tops)
    return {"tokens": [text_of(t) for t in ids[start:]], "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets[start:len(ids)]}


def chat_logprobs_object(text_of, bytes_of, ids: list[int], scores: tuple, start: int,
                         alternatives: int) -> dict:
    """A chat choice's logprobs, as OpenAI's chat API gives them: for each token of the reply (ids[start:],
    the end token left out), its text, log-probability and bytes (which join into the reply's UTF-8 where a
    token holds part of a character), and its `alternatives` likeliest tokens. text_of, bytes_of:
    token_texts(), token_bytes()."""
    chosen, top_ids, top_lps = scores
    entry = lambda i, lp: {"token": text_of(i), "logprob": lp, "bytes": list(bytes_of(i))}  # noqa: E731
    return {"content": [{**entry(ids[k], chosen[k - 1]),
                         "top_logprobs": [entry(t, lp) for t, lp in zip(top_ids[k - 1][:alternatives],
                                                                        top_lps[k - 1][:alternatives])]}
                        for k in range(start, len(ids))], "refusal": None}
