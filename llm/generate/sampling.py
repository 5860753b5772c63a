"""Sampling: logits in, token ids out; and the text of the ids, streamed.

pick() is the sampling the engine compiles into its decode step: one pure function, (B, V) logits to (B,) ids,
every setting a (B, 1) tensor, so one graph serves any settings and each row its own (SampleConfig checks
their ranges; the tests hold a plain reference of the same distribution). TextStream turns ids into text that
never splits a character or shows a stop string. engine.py runs them; text_generator.py and the server sit
on top.
"""

import torch

# ----------------------------------------------------------------------------- sampling

UNRANKED = -1  # candidates() of rows that sample from the whole softmax: no top-k, no top-p, nothing to rank


def candidates(settings: list, vocab: int) -> int:
    """How many of the most likely tokens pick() must rank for rows of these SampleConfigs: 0 when every row
    is greedy (an argmax, no ranking), UNRANKED when every sampling row keeps every token (GRPO's rollouts: no
    sort of the vocabulary, 7% of their decode step on a CPU), a power of two from 64 covering every row's
    top_k when all have one (a top-k, far cheaper than sorting the vocabulary), else the whole vocabulary. One
    compiled step per value."""
    sampling = [s for s in settings if s.temperature > 0]  # a greedy row ranks nothing, whatever its top_k
    if not sampling:
        return 0
    if all((s.top_k == 0 or s.top_k >= vocab) and s.top_p >= 1 for s in sampling):
        return UNRANKED
    if all(s.top_k > 0 for s in sampling):
        return min(vocab, max(64, 1 << (max(s.top_k for s in sampling) - 1).bit_length()))
    return vocab


def pick(logits, seen, noise, temperature, top_k, top_p, penalty, ranked: int | None = None) -> torch.Tensor:
    """(B,) next ids from (B, V) fp32 logits: the repetition penalty on tokens seen, temperature, top-k and
    nucleus top-p over the `ranked` most likely tokens (candidates(); default all), then argmax(p / E) with E
    ~ Exp(1) in `noise`, which draws from p with no host sync (gpt-fast's trick). Settings are (B, 1) tensors;
    temperature 0 is argmax; top_k >= V, top_p 1 are off."""
    logits = apply_repetition_penalty(logits, seen, penalty)
    if ranked == 0:
        return logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-6)
    if ranked == UNRANKED:  # every token kept: the same draw, each token's noise its own, with no sort
        return torch.where(temperature[:, 0] == 0, logits.argmax(-1), (scaled.softmax(-1) / noise).argmax(-1))
    if ranked is None or ranked >= logits.size(-1):
        ordered, order = scaled.sort(-1, descending=True)
    else:
        ordered, order = scaled.topk(ranked, dim=-1)  # sorted, most likely first
    rank = torch.arange(ordered.size(-1), device=logits.device)
    probs = ordered.masked_fill(rank >= top_k, float("-inf")).softmax(-1)
    # Nucleus (Holtzman et al. 2019): drop a token when those ranked above it already reach p, so the first
    # is always kept.
    probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    sampled = order.gather(-1, (probs / noise.gather(-1, order)).argmax(-1, keepdim=True))[:, 0]
    return torch.where(temperature[:, 0] == 0, logits.argmax(-1), sampled)


def exp_noise(shape, device, generator=None) -> torch.Tensor:
    """Exp(1) draws for pick() (exp_noise_ of a new tensor)."""
    return exp_noise_(torch.empty(shape, device=device), generator)


def exp_noise_(noise: torch.Tensor, generator=None) -> torch.Tensor:
    """Fill noise with Exp(1) draws, -log(1 - U) of uniform U in [0, 1): on a CPU 5x as fast as
    Tensor.exponential_, which draws element by element (0.21 against 0.04 ms for 32 x 449). Clamped, because
    U = 0 draws 0 and p / 0 would win every argmax."""
    noise.uniform_(generator=generator).neg_().log1p_().neg_()
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) on (B, V) logits where seen (B, V bool): positive / p, negative *
    p. penalty is a number or a (B, 1) tensor; 1 leaves the logits as they are."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


# ----------------------------------------------------------------------------- streaming text

class TextStream:
    """Token ids in, printable text out: never splits a UTF-8 character, and never emits a stop string.

    Byte-level BPE can cut a multi-byte character across tokens; its decoded prefix then ends in U+FFFD,
    so such text waits for the next token. Text that could be the start of a stop string waits too.
    """

    def __init__(self, tokenizer, stops=()):
        # The Rust tokenizer inside a transformers one decodes several times faster, and never tidies spaces.
        self.tokenizer, self.stops = (getattr(tokenizer, "backend_tokenizer", tokenizer),
                                      [s for s in stops if s])
        self.ids, self.start, self.read = [], 0, 0  # ids[start:read] is decoded context already emitted
        self.pending, self.stopped = "", False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _tail(self) -> str:
        """Text of the ids after `read`, decoded with a little context (text-generation-inference's method).
        """
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
