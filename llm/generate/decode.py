"""The generation steps: one prefill and one decode step, each running the forward, the sampling and the
end-of-sequence checks on the device, in place, over a State of static tensors. engine.py runs them; compiled
(decode_compile.py) or eager, they are the same functions.
"""

from dataclasses import dataclass

import torch

from llm.generate.sampling import pick

MIN_BUCKET = 16


def bucket(length: int, ctx: int) -> int:
    """The padded prefill length of a prompt: the next power of two from 16, at most the context."""
    return min(ctx, max(MIN_BUCKET, 1 << (length - 1).bit_length()))


def batch_bucket(rows: int) -> int:
    """The batch a compiled step runs: the next power of two, so a server's changing batch sizes reuse a few
    compiled graphs instead of compiling (and stalling every request) for each new size."""
    return 1 << (rows - 1).bit_length()


@dataclass
class State:
    """The tensors a decode step reads and writes in place, one row per sequence: static addresses, so a CUDA
    graph can replay over them."""
    tokens: torch.Tensor  # (B, 1) the last token of each row
    seen: torch.Tensor  # (B, V) bool: tokens in the prompt or generated, for the repetition penalty
    done: torch.Tensor  # (B,) bool
    count: torch.Tensor  # (B,) tokens generated
    noise: torch.Tensor  # (B, V) the Exp(1) draws of this step
    temperature: torch.Tensor  # (B, 1), and the same for the other settings
    top_k: torch.Tensor
    top_p: torch.Tensor
    penalty: torch.Tensor
    limit: torch.Tensor  # (B,) max new tokens of each row
    eos: torch.Tensor  # (E,) ids that end a row

    @classmethod
    def empty(cls, batch: int, vocab: int, device, eos_slots: int = 4) -> "State":
        z = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(batch, 1, dtype=torch.long), z(batch, vocab, dtype=torch.bool),
                   z(batch, dtype=torch.bool), z(batch, dtype=torch.long), z(batch, vocab), z(batch, 1),
                   z(batch, 1, dtype=torch.long), z(batch, 1), z(batch, 1), z(batch, dtype=torch.long),
                   z(eos_slots, dtype=torch.long))

    def sampling(self):
        return self.temperature, self.top_k, self.top_p, self.penalty


def advance(state: State, nxt: torch.Tensor):
    """Write the picked ids into the state; a finished row keeps its token (its steps are thrown away)."""
    nxt = torch.where(state.done, state.tokens[:, 0], nxt)
    state.tokens.copy_(nxt[:, None])
    state.seen.scatter_(1, nxt[:, None], True)
    state.count.add_((~state.done).long())
    state.done.logical_or_(torch.isin(nxt, state.eos) | (state.count >= state.limit))


def prefill_step(model, ids, lengths, cache, state: State, ranked: int, of: torch.Tensor | None = None):
    """The prompts into the cache, and the first new token of each row into the state. of: the prompt (a row
    of ids) each of the state's rows continues, where several rows continue one prompt; else row for row."""
    logits = model(ids, kv_cache=cache, input_lengths=lengths, last_only=True)[0][:, 0].float()
    logits = logits if of is None else logits[of]
    advance(state, pick(logits, state.seen, state.noise, *state.sampling(), ranked))


def decode_step(model, cache, state: State, ranked: int):
    """One token for every row: the forward, sampling and checks, all on the device, all in place. ranked:
    sampling.candidates() of the batch, a constant of the compiled step."""
    logits = model(state.tokens, kv_cache=cache)[0][:, -1].float()
    advance(state, pick(logits, state.seen, state.noise, *state.sampling(), ranked))


@dataclass
class Slot:
    """A batch size's cache, state and prefill and decode steps. A compiled slot is kept for the model's life,
    with the full context, so one graph serves every length; an eager one is sized to its call."""
    cache: object
    state: State
    prefill: object
    decode: object
    compiled: bool = False


def eager_slot(model, batch: int, max_len: int) -> Slot:
    """A slot of plain steps, its cache sized to this call."""
    device, vocab = model.embed_tokens.weight.device, model.config.vocab_size
    return Slot(model.make_kv_cache(batch, max_len), State.empty(batch, vocab, device),
                prefill_step, decode_step)
