"""The generation engine: prompts in, each sequence's new tokens (and printable text) out, at the speed of
reading the weights.

One right-padded prefill, its length rounded up to a bucket so that a compiled prefill serves every prompt of
that bucket; then one decode step per token that runs the forward, the repetition penalty, temperature, top-k
and top-p sampling, the end-of-sequence checks and the KV-cache update on the device (decode.py), compiled (a
CUDA graph on CUDA) when the model was set to at load (decode_compile.py). The host reads the new tokens back
every CHUNK steps, not every token: streaming stays smooth and the device never waits for Python. Sampling
settings are tensors, one row each, so one compiled step serves every setting and a batch may mix them (the
server does). score() reads sequences that are already there: each token's log-probability and the likeliest
tokens in its place."""

import contextlib
from dataclasses import dataclass

import psutil
import torch

from config import SampleConfig
from llm.base.errors import ConfigError
from llm.generate.decode import Slot, State, batch_bucket, bucket, eager_slot, prefill_step
from llm.generate.decode_compile import compile_limits, compiled_slot, compiles, compiling, rows_to_reuse
from llm.generate.sampling import UNRANKED, TextStream, candidates, exp_noise, exp_noise_
from llm.tokens.tokenizer import stop_ids

CHUNK = 8  # decode steps between two reads of the new tokens by the host
SCORE_ROWS = 8  # sequences score() runs together
SCORE_LOGITS = 2**25  # logits score() holds at once (rows x positions x vocabulary): 128 MiB in float32
GREEDY_ONE = SampleConfig(temperature=0.0, max_new_tokens=1)  # the settings of a row that pads a batch
# An eager decode step reads the cache this many places at a time: each new width is a new shape, for which a
# CPU's matmul library compiles and keeps a kernel (70 widths held 60 MB more).
SPAN_STEP = 64


def check_memory(model, batch: int, max_len: int):
    """Refuse a batch whose KV cache and logits would not fit in the memory free now (ValueError, a message).
    """
    c, w = model.config, model.embed_tokens.weight
    cache = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * max_len * c.head_dim * w.element_size()
    # sampling, activations
    need = cache + 6 * batch * c.vocab_size * 4 + batch * max_len * c.hidden_size * 16
    free = torch.cuda.mem_get_info(w.device)[0] if w.is_cuda else psutil.virtual_memory().available
    if need > 0.9 * free:
        raise ConfigError(f"{batch} sequences of up to {max_len} tokens need about {need / 2**30:.1f} GiB, "
                          f"more than the {free / 2**30:.1f} GiB free; lower num_return_sequences, the "
                          "prompts or max_new_tokens")


def check_prompt(length: int, ctx: int):
    """A prompt needs at least one token and room for one new token in the model's context (ConfigError)."""
    if not 0 < length < ctx:
        raise ConfigError(f"a prompt has {length} tokens, it needs 1 to {ctx - 1} (the "
                          f"model's context is {ctx}), shorten it")


# ----------------------------------------------------------------------------- the API

def generate(model, prompts: list[list[int]], settings: SampleConfig | list[SampleConfig], eos_ids=(),
             tokenizer=None, on_text=None, cancelled=None, on_end=None) -> list[list[int]]:
    """Continue each prompt (token ids) num_return_sequences times; return the new ids of each sequence.

    Sequences come grouped by prompt: [p0 s0, p0 s1, ..., p1 s0, ...]. settings may also be a list, one per
    prompt (num_return_sequences 1 each): every row samples with its own. A sequence ends at an id of eos_ids
    (not returned), after max_new_tokens, when it fills the model's context, or, given a tokenizer, at a
    string of its stop list (its ids then end with the token that completed the stop string). With a
    tokenizer, on_text(i, text) receives sequence i's printable text as it grows, without the stop string.
    on_end(i, reason, end) hears why sequence i ended: "stop" (an end id or a stop string) or "length"
    (max_new_tokens or the context), and end, the end id that ended it (None for any other reason).
    cancelled(i), asked at each read, ends sequence i where it is (a client gone, say), with no on_end."""
    per_prompt = settings if isinstance(settings, list) else [settings] * len(prompts)
    rows = [(list(p), s) for p, s in zip(prompts, per_prompt) for _ in range(s.num_return_sequences)]
    ctx = model.config.max_seq_len
    for p, _ in rows:
        check_prompt(len(p), ctx)
    if len(eos_ids) > 4:
        raise ConfigError(f"at most 4 end ids, got {len(eos_ids)}")
    width, limits = (bucket(max(len(p) for p, _ in rows), ctx),
                     [min(s.max_new_tokens, ctx - len(p)) for p, s in rows])
    compiled, real = compiles(model) and not compiling(model), len(rows)
    if compiled:  # padding rows: greedy copies of the first prompt, one token each, never read
        padding = batch_bucket(real) - real
        rows, limits = rows + [(rows[0][0], GREEDY_ONE)] * padding, limits + [1] * padding
    max_len = min(ctx, width + max(limits))
    check_memory(model, len(rows), ctx if compiled else max_len)
    with torch.no_grad(), compile_limits():
        slot = compiled_slot(model, len(rows)) if compiled else eager_slot(model, len(rows), max_len)
        streams = [TextStream(tokenizer, s.stop) for _, s in rows] if tokenizer is not None else None
        outputs = Outputs([[] for _ in rows], set(range(real)), limits, eos_ids, streams, slot.state, on_text,
                          on_end, cancelled)
        return _run(model, slot, rows, width, outputs, real)


def _fill(state: State, rows, limits, padded: torch.Tensor, eos_ids, vocab: int):
    """Load a batch's settings and prompts into the (reused) state tensors, in place."""
    as_col = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype)[:, None]  # noqa: E731
    state.temperature.copy_(as_col([s.temperature for _, s in rows]))
    state.top_k.copy_(as_col([s.top_k or vocab for _, s in rows], torch.long))
    state.top_p.copy_(as_col([s.top_p for _, s in rows]))
    state.penalty.copy_(as_col([s.repetition_penalty for _, s in rows]))
    state.limit.copy_(torch.tensor(limits))
    state.eos.copy_(torch.tensor((list(eos_ids) + [-1] * 4)[:4]))  # -1 matches no token
    state.done.zero_()
    state.count.zero_()
    state.seen.zero_().scatter_(1, padded, True)
    state.noise.fill_(1.0)


def _noise(state: State, generators: list, real: int):
    """This step's Exp(1) draws, each row from its own seeded generator (rows sharing a seed share a draw
    call), or none at all when every row is greedy. Rows past `real` pad the batch and draw nothing, so a
    padded batch draws what the unpadded one would."""
    for gen, rows in generators:
        if rows is None:
            exp_noise_(state.noise[:real], gen)
        else:
            state.noise[rows] = exp_noise((len(rows), state.noise.size(1)), state.noise.device, gen)


def _generators(rows, device) -> list:
    """(generator, row indices or None for all rows) for the rows that sample: one per seed, the global RNG
    for unseeded rows; empty when every row is greedy."""
    sampling = [i for i, (_, s) in enumerate(rows) if s.temperature > 0]
    if not sampling:
        return []
    seeds = {rows[i][1].seed for i in sampling}
    if len(seeds) == 1 and sampling == list(range(len(sampling))):  # every row but the padding samples
        seed = seeds.pop()
        return [(torch.Generator(device).manual_seed(seed) if seed >= 0 else None, None)]
    return [(torch.Generator(device).manual_seed(seed) if seed >= 0 else None,
             [i for i in sampling if rows[i][1].seed == seed]) for seed in sorted(seeds)]


def _run(model, slot: Slot, rows, width: int, outputs: "Outputs", real: int) -> list[list[int]]:
    """The batch's rows through prefill and decode; the first `real` rows' new ids (the rest pad the batch).
    """
    device, B, limits = model.embed_tokens.weight.device, len(rows), outputs.limits
    # Padding repeats each row's last token: the cache ignores it, and the penalty's `seen` stays exact.
    padded = torch.tensor([p + p[-1:] * (width - len(p)) for p, _ in rows], device=device)
    lengths = torch.tensor([len(p) for p, _ in rows], device=device)
    state, cache = slot.state, slot.cache
    _fill(state, rows, limits, padded, outputs.eos_ids, model.config.vocab_size)
    cache.reset()  # stale keys past each row's position are masked out, so nothing else needs clearing
    generators = _generators(rows, device)
    chunk = torch.empty((B, CHUNK), dtype=torch.long, device=device)
    host = torch.empty((B, CHUNK), dtype=torch.long, pin_memory=device.type == "cuda")
    ranked = candidates([s for _, s in rows], model.config.vocab_size)
    _noise(state, generators, real)
    slot.prefill(model, padded, lengths, cache, state, ranked)
    chunk[:, 0] = state.tokens[:, 0]
    with contextlib.ExitStack() as unguarded:
        for step in range(1, max(limits) + 1):
            if step % CHUNK == 0 or step == max(limits):
                outputs.read(_sync(chunk[:, :step % CHUNK or CHUNK], host))
                if not outputs.active:
                    break
            _noise(state, generators, real)
            if not slot.compiled:  # no row has reached past width + step: attention reads that far
                cache.span = span(width + step, cache.max_len)
            slot.decode(model, cache, state, ranked)
            if step == 1 and slot.compiled:
                # Its guards passed (or it compiled) once; the other steps repeat the same arguments exactly.
                unguarded.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
            chunk[:, step % CHUNK] = state.tokens[:, 0]
    for i in sorted(outputs.active):
        outputs.finish(i, "length")
    return outputs.out[:real]


def _sync(chunk: torch.Tensor, host: torch.Tensor) -> list[list[int]]:
    """The new tokens of the last steps on the host: the one sync of CHUNK steps."""
    host = host[:, :chunk.size(1)]
    host.copy_(chunk, non_blocking=True)
    if chunk.is_cuda:
        torch.cuda.current_stream(chunk.device).synchronize()
    return host.tolist()


@dataclass
class Outputs:
    """The host's side of one generation: each row's new ids and text, the rows still going, and the caller's
    hooks (generate()'s on_text, on_end and cancelled)."""
    out: list  # each row's new ids
    active: set  # rows still generating
    limits: list  # each row's max new tokens
    eos_ids: tuple
    streams: list | None  # each row's TextStream, given a tokenizer
    state: State  # the device's side: a row ended here ends there too
    on_text: object = None
    on_end: object = None
    cancelled: object = None

    def read(self, block: list[list[int]]):
        """The host's share of CHUNK steps: rows a caller cancelled end where they are; each active row's new
        ids, its text, its stops."""
        for i in [i for i in self.active if self.cancelled and self.cancelled(i)]:
            self.active.discard(i)
            self.state.done[i] = True
        for i in sorted(self.active):
            for token in block[i]:
                if token in self.eos_ids:
                    self.finish(i, "stop", token)
                    break
                self.out[i].append(token)
                text = self.streams[i].push(token) if self.streams else ""
                if text and self.on_text:
                    self.on_text(i, text)
                stopped = bool(self.streams and self.streams[i].stopped)
                if stopped or len(self.out[i]) >= self.limits[i]:
                    self.finish(i, "stop" if stopped else "length")
                    # a stop string, seen by the host only: the row stops on the device too
                    self.state.done[i] = True
                    break

    def finish(self, i: int, reason: str, end: int | None = None):
        """Row i has ended: its held-back text out, then why it ended (and at which end id, if one)."""
        text = self.streams[i].flush() if self.streams else ""
        self.active.discard(i)
        if text and self.on_text:
            self.on_text(i, text)
        if self.on_end:
            self.on_end(i, reason, end)


def generate_text(model, tokenizer, prompts: list, settings: SampleConfig | list[SampleConfig], eos_ids=None,
                  on_text=None):
    """Prompts as text (or token ids) -> (completions, new ids), one per sequence, stop strings cut off.

    An empty text prompt starts a fresh document from <|endoftext|>; eos_ids default to stop_ids(tokenizer).
    """
    eos_ids = stop_ids(tokenizer) if eos_ids is None else eos_ids
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) or list(eos_ids[:1])
           for p in prompts]
    per_prompt = settings if isinstance(settings, list) else [settings] * len(prompts)
    texts = [""] * sum(s.num_return_sequences for s in per_prompt)

    def collect(i, text):
        texts[i] += text
        if on_text:
            on_text(i, text)
    return texts, generate(model, ids, settings, eos_ids, tokenizer, collect)


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def score(model, sequences: list[list[int]], top: int = 0) -> list[tuple[list[float], list, list]]:
    """What the model thinks of each sequence's tokens after its first: (log-probabilities, top ids, their
    log-probabilities), one entry per token, the top `top` (most likely first) of the place each token fills.

    The log-softmax of the model's logits in float32, from one forward over each sequence (several rows
    together, through a KV cache in as many parts as keep the logits held under SCORE_LOGITS: a long context
    with a large vocabulary never holds all its logits at once). Raises ConfigError when memory is short.
    """
    device, vocab, out = model.embed_tokens.weight.device, model.config.vocab_size, []
    for first in range(0, len(sequences), SCORE_ROWS):
        group = sequences[first:first + SCORE_ROWS]
        B, width = len(group), max(map(len, group))
        check_memory(model, B, width)
        ids = torch.tensor([s + s[-1:] * (width - len(s)) for s in group], device=device)  # (B, width)
        # The last token is never fed (nothing after it is scored): a sequence of the context plus one fits.
        cache, part = model.make_kv_cache(B, max(width - 1, 1)), max(1, SCORE_LOGITS // (B * vocab))
        chosen, top_lp, top_ids = [], [], []
        for start in range(0, width - 1, part):
            end = min(start + part, width - 1)  # positions start..end-1 predict the ids at start+1..end
            logp = model(ids[:, start:end], kv_cache=cache)[0].float().log_softmax(-1)  # (B, part, V)
            chosen.append(logp.gather(-1, ids[:, start + 1:end + 1, None])[..., 0])
            if top:
                values, indices = logp.topk(min(top, vocab), dim=-1)
                top_lp.append(values)
                top_ids.append(indices)
        join = lambda parts: torch.cat(parts, 1).tolist() if parts else [[] for _ in group]  # noqa: E731
        chosen, top_lp, top_ids = join(chosen), join(top_lp), join(top_ids)  # sync point: once per group
        for i, s in enumerate(group):
            n = len(s) - 1
            out.append((chosen[i][:n], top_ids[i][:n] if top else [[]] * n,
                        top_lp[i][:n] if top else [[]] * n))
    return out


# ---------------------------------------------------------------------------- many prompts through a few rows

def span(reach: int, max_len: int) -> int:
    """How far an eager step's attention reads a cache whose rows reach at most `reach` places: whole
    SPAN_STEPs (the places past a row's reach are masked), within the cache."""
    return min(max_len, -(-reach // SPAN_STEP) * SPAN_STEP)


def generate_all(model, prompts: list[list[int]], settings: SampleConfig, eos_ids=(), rows: int = 64,
                 on_done=None, keep_end: bool = False, until=None) -> list[list[int]]:
    """Continue each prompt (token ids) once, without stop strings; return each one's new ids, in order. The
    decode step is compiled where the model was set to compile (use_compile: a CUDA graph on CUDA), else
    eager. `rows` rows decode together, and a row whose reply ended takes the next prompt at the next read of
    the tokens (continuous batching): a long reply holds up one row, not a batch. A reply ends at an id of
    eos_ids, after max_new_tokens or at the context's end, as in generate(); keep_end: the end id it ended at
    closes its new ids (what a model trained on its replies learns to stop with). on_done(i, ids) hears each
    prompt as its reply ends, in the order they end. until(i, ids), asked at each read of a reply still going,
    ends it where it is when True (a stop string written: the caller cuts the text there)."""
    ctx, device = model.config.max_seq_len, model.embed_tokens.weight.device
    for p in prompts:
        check_prompt(len(p), ctx)
    if not prompts:
        return []
    if len(eos_ids) > 4:
        raise ConfigError(f"at most 4 end ids, got {len(eos_ids)}")
    limits = [min(settings.max_new_tokens, ctx - len(p)) for p in prompts]
    B, max_len = min(rows, len(prompts)), min(ctx, max(len(p) + n for p, n in zip(prompts, limits)))
    compiled = compiles(model) and not compiling(model)
    # A compiled slot's cache: the longest row's reach, rounded to reuse its graph.
    length = bucket(max_len, ctx)
    B = rows_to_reuse(model, B, length) if compiled else B
    check_memory(model, B, length if compiled else max_len)
    out, waiting = [[] for _ in prompts], list(reversed(range(len(prompts))))  # waiting: next prompt last
    prompt_of, reach = [None] * B, [0] * B  # each row's prompt (None: ended, none left) and cache position

    def take(r: int, tokens: list[int]):
        """Row r's new tokens, up to its reply's end, where the row lets its prompt go."""
        i = prompt_of[r]
        for token in tokens:
            if token in eos_ids:
                out[i] += [token] if keep_end else []
                break
            out[i].append(token)
            if len(out[i]) >= limits[i]:
                break
        else:
            if until is None or not until(i, out[i]):
                return
        prompt_of[r] = None
        if on_done:
            on_done(i, out[i])

    def refill():
        """Free rows take the waiting prompts (a reply may end at its first token: its row is free again)."""
        while waiting and None in prompt_of:
            free = [r for r in range(B) if prompt_of[r] is None][:len(waiting)]
            starting = [waiting.pop() for _ in free]
            firsts = _join(model, slot, free, [prompts[i] for i in starting], [limits[i] for i in starting],
                           settings, eos_ids, ranked, generators)
            for r, i, token in zip(free, starting, firsts):
                prompt_of[r], reach[r] = i, len(prompts[i])
                take(r, [token])

    with torch.no_grad(), compile_limits():
        slot = compiled_slot(model, B, length) if compiled else eager_slot(model, B, max_len)
        slot.state.eos.copy_(torch.tensor((list(eos_ids) + [-1] * 4)[:4]))
        slot.state.done.fill_(True)  # until a prompt joins
        generators = _generators([(None, settings)] * B, device)
        ranked = candidates([settings], model.config.vocab_size)
        # Compiled, greedy rows run the graph that sampling compiles (an argmax where the temperature is 0): a
        # GRPO run's held-out evaluation reuses its rollouts' graph.
        ranked = UNRANKED if compiled and ranked == 0 else ranked
        chunk = torch.empty((B, CHUNK), dtype=torch.long, device=device)
        refill()
        while any(i is not None for i in prompt_of):
            for j in range(CHUNK):
                _noise(slot.state, generators, B)
                if not compiled:  # attention reads no further than the longest row: eager shapes may change
                    slot.cache.span = span(1 + max(reach[r] for r in range(B)
                                                   if prompt_of[r] is not None), max_len)
                slot.decode(model, slot.cache, slot.state, ranked)
                reach[:] = [x + 1 for x in reach]
                chunk[:, j] = slot.state.tokens[:, 0]
            block = chunk.tolist()
            for r in range(B):
                if prompt_of[r] is not None:
                    take(r, block[r])
            refill()
    return out


def _join(model, slot: Slot, free: list[int], prompts: list[list[int]], limits: list[int],
          settings: SampleConfig, eos_ids, ranked: int, generators: list) -> list[int]:
    """Prefill prompts into rows `free` of a running slot, through a cache of their own then copied into those
    rows, each distinct prompt once (GRPO's replies continue a prompt 8 at a time: one prefill, not 8); each
    row's first new token, drawn from its own noise, which the call's generators go on drawing (a generator
    seeded again at each join would give every join the same first-token noise)."""
    width, vocab, device = max(map(len, prompts)), model.config.vocab_size, slot.state.tokens.device
    first = {}  # each distinct prompt's place among the distinct ones
    of = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts], device=device)
    distinct = [list(p) for p in first]
    pad = lambda ps: torch.tensor([p + p[-1:] * (width - len(p)) for p in ps], device=device)  # noqa: E731
    state, rows = State.empty(len(prompts), vocab, device), torch.tensor(free, device=device)
    cache = model.make_kv_cache(len(distinct), width)
    _fill(state, [(p, settings) for p in prompts], limits, pad(prompts), eos_ids, vocab)
    _noise(state, generators, len(prompts))
    prefill_step(model, pad(distinct), torch.tensor([len(p) for p in distinct], device=device), cache, state,
                 ranked, of)
    for name, value in vars(state).items():
        if name != "eos":
            getattr(slot.state, name)[rows] = value
    for layer in range(len(cache.k)):
        slot.cache.k[layer][rows, :, :width] = cache.k[layer][of]
        slot.cache.v[layer][rows, :, :width] = cache.v[layer][of]
    slot.cache.pos[rows] = cache.pos[of]
    slot.cache.advance(0)  # the mask of the next step, from the new positions
    return state.tokens[:, 0].tolist()
