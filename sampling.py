"""Sampling and the generation engine: token ids in, token ids and printable text out.

sample_next() is one pure function, (B, V) logits to (B, 1) ids, with temperature, top-k and top-p;
generate() runs one right-padded prefill and then one cached decode step per token for a whole batch;
TextStream turns the ids into text that never splits a character or shows a stop string. Used by
text_generator.py (REPL and one-shot) and by the tools on top of it.
"""

import weakref

import psutil
import torch
import torch.nn.functional as F

from config import SampleConfig
from tokenizer import stop_ids


# ----------------------------------------------------------------------------- sampling

def _check_sampling(temperature: float, top_k: int, top_p: float):
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 turns it off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 turns it off)")


def filtered_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) probabilities after temperature, top-k and top-p; filtered tokens are 0."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        # Nucleus (Holtzman et al. 2019): drop a token when the tokens ranked above it already reach p;
        # the most likely token has nothing above it, so at least one is always kept.
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, generator=None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids; temperature 0 is argmax. ValueError on out-of-range arguments."""
    if temperature == 0:
        _check_sampling(temperature, top_k, top_p)
        return logits.argmax(-1, keepdim=True)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    # argmax(p / E) with E ~ Exp(1) picks token i with probability p_i and, unlike torch.multinomial on CUDA,
    # needs no host sync (gpt-fast's trick). Exp(1) can draw 0, and the 0/0 = NaN of a filtered token would
    # win the argmax: hence the clamp.
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(-1, keepdim=True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) on (B, V) logits where seen (B, V bool): positive / p, negative * p."""
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


# ----------------------------------------------------------------------------- streaming text

class TextStream:
    """Token ids in, printable text out: never splits a UTF-8 character, and never emits a stop string.

    Byte-level BPE can cut a multi-byte character across tokens; its decoded prefix then ends in U+FFFD,
    so such text waits for the next token. Text that could be the start of a stop string waits too.
    """

    def __init__(self, tokenizer, stops=()):
        # The Rust tokenizer inside a transformers one decodes several times faster, and never tidies spaces.
        self.tokenizer, self.stops = getattr(tokenizer, "backend_tokenizer", tokenizer), [s for s in stops if s]
        self.ids, self.start, self.read = [], 0, 0  # ids[start:read] is decoded context already emitted
        self.pending, self.stopped = "", False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _tail(self) -> str:
        """Text of the ids after `read`, decoded with a little context (text-generation-inference's method)."""
        before, now = self._decode(self.ids[self.start:self.read]), self._decode(self.ids[self.start:])
        return now[len(before):] if len(now) > len(before) else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to print."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        new = self._tail()
        if not new or new.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return ""
        self.start, self.read = self.read, len(self.ids)
        return self._release(self.pending + new)

    def flush(self) -> str:
        """The text still held back, at the end of a generation; an incomplete last character is dropped."""
        if self.stopped:
            return ""
        out = self._release(self.pending + self._tail().rstrip("\ufffd"))
        out, self.pending = out + ("" if self.stopped else self.pending), ""
        return out

    def _release(self, text: str) -> str:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)]
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


# ----------------------------------------------------------------------------- generation

_STATIC = weakref.WeakKeyDictionary()  # model -> {batch size: (full-context cache, compiled step)}


def _forward_last(model, ids, cache):
    """(B, 1) ids -> (B, V) logits of the next token; advances every row of the cache by one position."""
    return model(ids, kv_cache=cache)[0][:, -1]


def _decode_step(model, batch: int, max_len: int, compile: bool):
    """A KV cache for `batch` rows and a step function (B, 1) ids -> (B, V) logits that advances it."""
    if not compile:
        cache = model.make_kv_cache(batch, max_len)
        return cache, lambda ids: _forward_last(model, ids, cache)
    steps = _STATIC.setdefault(model, {})
    if batch not in steps:
        cache = model.make_kv_cache(batch)  # always the full context: one graph serves every prompt length
        if cache.k.device.type != "cuda":  # no CUDA graphs off CUDA: the default mode is the useful one
            steps[batch] = cache, torch.compile(_forward_last, dynamic=False)
        else:
            for t in (cache.k, cache.v, cache.pos):
                torch._dynamo.mark_static_address(t)  # updated in place by the graph; addresses never change
            graph = torch.compile(_forward_last, mode="reduce-overhead", dynamic=False, fullgraph=True)
            steps[batch] = cache, graph
    cache, graph = steps[batch]
    cache.reset()  # stale keys past each row's position are masked out, so nothing else needs clearing
    if cache.k.device.type != "cuda":
        return cache, lambda ids: graph(model, ids, cache)

    def replay(ids):
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's logits were sampled from already
        return graph(model, ids, cache)
    return cache, replay


def check_memory(model, batch: int, max_len: int):
    """Refuse a batch whose KV cache and logits would not fit in the memory free now (ValueError, a message)."""
    c, w = model.config, model.embed_tokens.weight
    cache = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * max_len * c.head_dim * w.element_size()
    need = cache + 4 * batch * max_len * c.vocab_size * 4  # the prefill's logits in fp32, and a few copies
    free = torch.cuda.mem_get_info(w.device)[0] if w.is_cuda else psutil.virtual_memory().available
    if need > 0.9 * free:
        raise ValueError(f"{batch} sequences of up to {max_len} tokens need about {need / 2**30:.1f} GiB, more than "
                         f"the {free / 2**30:.1f} GiB free; lower num_return_sequences, the prompts or max_new_tokens")


def generate(model, prompts: list[list[int]], settings: SampleConfig, eos_ids=(), tokenizer=None,
             on_text=None) -> list[list[int]]:
    """Continue each prompt (token ids) num_return_sequences times; return the new ids of each sequence.

    Sequences come grouped by prompt: [p0 s0, p0 s1, ..., p1 s0, ...]. All share one right-padded prefill,
    then one cached decode step per token. A sequence ends at an id of eos_ids (not returned), after
    max_new_tokens, when it fills the model's context, or, given a tokenizer, at a string of settings.stop
    (its ids then end with the token that completed the stop string). With a tokenizer, on_text(i, text)
    receives sequence i's printable text as it grows, without the stop string.
    """
    rows = [list(p) for p in prompts for _ in range(settings.num_return_sequences)]
    ctx = model.config.max_seq_len
    for p in rows:
        if not p or len(p) >= ctx:
            raise ValueError(f"a prompt has {len(p)} tokens, it needs 1 to {ctx - 1} (the model's context is "
                             f"{ctx}), shorten it")
    device, B, longest = model.embed_tokens.weight.device, len(rows), max(map(len, rows))
    limits = [min(settings.max_new_tokens, ctx - len(p)) for p in rows]
    generator = torch.Generator(device).manual_seed(settings.seed) if settings.seed >= 0 else None
    streams = [TextStream(tokenizer, settings.stop) for _ in rows] if tokenizer is not None else None
    out, active = [[] for _ in rows], set(range(B))

    def finish(i):
        active.discard(i)
        text = streams[i].flush() if streams else ""
        if text and on_text:
            on_text(i, text)

    with torch.no_grad():
        lengths = torch.tensor([len(p) for p in rows], device=device)
        # Padding repeats each row's last token: the cache ignores it, and the penalty's `seen` stays exact.
        padded = torch.tensor([p + p[-1:] * (longest - len(p)) for p in rows], device=device)
        check_memory(model, B, min(ctx, longest + settings.max_new_tokens))
        cache, step = _decode_step(model, B, min(ctx, longest + settings.max_new_tokens), settings.compile)
        logits, _ = model(padded, kv_cache=cache, input_lengths=lengths)
        logits = logits[torch.arange(B, device=device), lengths - 1]  # (B, V) after each row's last token
        seen = None
        if settings.repetition_penalty != 1.0:
            seen = torch.zeros(logits.shape, dtype=torch.bool, device=device).scatter_(1, padded, True)
        while True:
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
            next_ids = sample_next(logits.float(), settings.temperature, settings.top_k, settings.top_p,
                                   generator)  # (B, 1)
            if seen is not None:
                seen.scatter_(1, next_ids, True)
            for i, token in enumerate(next_ids[:, 0].tolist()):  # host sync: streaming and stops need the ids
                if i not in active:
                    continue
                if token in eos_ids:
                    finish(i)
                    continue
                out[i].append(token)
                text = streams[i].push(token) if streams else ""
                if text and on_text:
                    on_text(i, text)
                if len(out[i]) >= limits[i] or (streams and streams[i].stopped):
                    finish(i)
            if not active:
                return out
            logits = step(next_ids)


def generate_text(model, tokenizer, prompts: list, settings: SampleConfig, eos_ids=None, on_text=None):
    """Prompts as text (or token ids) -> (completions, new ids), one per sequence, stop strings cut off.

    An empty text prompt starts a fresh document from <|endoftext|>; eos_ids default to stop_ids(tokenizer).
    """
    eos_ids = stop_ids(tokenizer) if eos_ids is None else eos_ids
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) or list(eos_ids[:1])
           for p in prompts]
    texts = [""] * (len(ids) * settings.num_return_sequences)

    def collect(i, text):
        texts[i] += text
        if on_text:
            on_text(i, text)
    return texts, generate(model, ids, settings, eos_ids, tokenizer, collect)
