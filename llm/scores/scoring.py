"""Multiple-choice scores through the model: each choice's log-likelihood as lm-eval's `hf` backend computes
it, in fewer forwards.

A request is (context, continuation) text. It is tokenized as lm-eval does (the context's trailing spaces move
to the continuation; the continuation's tokens are what encoding both together adds past the context's own),
cut from the left to the model's context plus one, and scored as the sum of the continuation tokens'
log-probabilities. The choices of one item share the start of their tokens: that prefix runs once, into a KV
cache whose rows are then copied to each choice, and the choices' own tokens run together after it. Items go
in batches of similar length, longest first (an out-of-memory shows at once)."""

import math
import re
import time
from dataclasses import dataclass, field

import torch

from config import SampleConfig
from llm.generate.engine import generate_all
from llm.scores.samples import answer_line, choice_line
from llm.scores.tasks import Item
from llm.tokens.tokenizer import stop_ids

BATCH_TOKENS = 2048  # prefix tokens in one forward (items x their padded width): more adds padding, not speed
LOGIT_ROWS = 2**25  # logits held at once (rows x positions x vocabulary): 128 MiB in float32


@dataclass
class Encoded:
    """An item's requests as tokens: each whole sequence, where its continuation starts, and the prefix length
    all of them share (at most the shortest context: the first continuation token is predicted past it)."""
    sequences: list[list[int]]
    starts: list[int]
    shared: int
    cut: bool  # some sequence lost tokens on the left to fit the context


def prefix_id(tokenizer) -> int:
    """lm-eval's prefix token, what a request with nothing to condition on starts from: the end-of-text token
    (0 for a tokenizer without one)."""
    return tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else 0


def encode_item(tokenizer, item: Item, max_len: int, prefix: int) -> Encoded:
    """lm-eval's tokenization of each request (HFLM._encode_pair), then its cut to max_len + 1 tokens."""
    sequences, starts, cut = [], [], False
    for context, continuation in item.requests:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if context:
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            start = len(tokenizer.encode(context, add_special_tokens=False))
        else:  # nothing to condition on: lm-eval's prefix token stands in
            whole, start = [prefix] + tokenizer.encode(continuation, add_special_tokens=False), 1
        if len(whole) > max_len + 1:
            whole, start, cut = whole[-(max_len + 1):], max(1, start - (len(whole) - max_len - 1)), True
        sequences.append(whole)
        starts.append(start)
    common = min(len(s) for s in sequences)
    for i in range(common):
        if any(s[i] != sequences[0][i] for s in sequences):
            common = i
            break
    # 0: nothing shared (Winogrande's blank first)
    return Encoded(sequences, starts, min(common, *starts), cut)


@torch.no_grad()
def loglikelihoods(model, items: list[Encoded]) -> list[list[float]]:
    """Each item's choices' summed continuation log-probabilities (float32 log-softmax), in the items' order.
    Items go longest prefix first, BATCH_TOKENS of padded prefix at a time: little padding, an OOM at once."""
    order = sorted(range(len(items)), key=lambda i: -items[i].shared)
    out, start = [None] * len(items), 0
    while start < len(order):
        width = items[order[start]].shared  # the batch's widest prefix
        batch = order[start:start + max(1, BATCH_TOKENS // max(width, 1))]
        for i, scores in zip(batch, _score_batch(model, [items[i] for i in batch])):
            out[i] = scores
        start += len(batch)
    return out


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, width) right-padded with each row's last token, lengths (B,))."""
    width = max(1, max(map(len, rows)))
    ids = [r + (r[-1:] or [0]) * (width - len(r)) for r in rows]
    return torch.tensor(ids, device=device), torch.tensor([len(r) for r in rows], device=device)


def _score_batch(model, items: list[Encoded]) -> list[list[float]]:
    """One batch: the shared prefixes in one forward, then every choice's own tokens from a copy of its item's
    cache rows (in groups of rows whose logits fit LOGIT_ROWS)."""
    device, vocab = model.embed_tokens.weight.device, model.config.vocab_size
    prefixes = [e.sequences[0][:e.shared] for e in items]
    seqs = [(b, j) for b, e in enumerate(items) for j in range(len(e.sequences))]  # (item, choice) per row
    # a sequence's last token predicts nothing
    fed = [items[b].sequences[j][items[b].shared:-1] for b, j in seqs]
    cache = model.make_kv_cache(len(items), max(map(len, prefixes)))
    ids, lengths = _padded(prefixes, device)
    first = _LogProbs(model(ids, kv_cache=cache, input_lengths=lengths, last_only=True)[0][:, 0])
    sums = [0.0] * len(seqs)
    shared = [items[b].shared for b, _ in seqs]
    for rows in _groups(fed, shared, vocab, model.config.max_seq_len):
        logp, width = None, len(fed[rows[0]])
        if width:  # longest first: an empty first row means every row's one new token came from `first`
            which = torch.tensor([seqs[r][0] for r in rows], device=device)
            # Each choice continues a copy of its item's prefix, in a cache long enough for every row's
            # padding: a padded position past the end would be clamped onto a real one.
            copy = model.make_kv_cache(len(rows), max(shared[r] for r in rows) + width)
            n = min(copy.max_len, cache.max_len)
            for mine, theirs in zip(copy.k + copy.v, cache.k + cache.v):
                mine[:, :, :n] = theirs[which, :, :n]
            copy.advance(cache.pos[which])
            ids, lengths = _padded([fed[r] for r in rows], device)
            logp = _LogProbs(model(ids, kv_cache=copy, input_lengths=lengths)[0])  # (R, T, V)
        _add_scores(sums, items, seqs, rows, first, logp)
    out, k = [], 0
    for e in items:
        out.append(sums[k:k + len(e.sequences)])
        k += len(e.sequences)
    return out


class _LogProbs:
    """Log-probabilities read at chosen places: logits[i] - logsumexp(logits) in float32, without writing out
    the whole log-softmax (a vocabulary's worth of floats per position)."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.norm = logits, logits.float().logsumexp(-1)

    def __getitem__(self, index):
        return self.logits[index].float() - self.norm[index[:-1]]


def _groups(fed: list[list[int]], shared: list[int], vocab: int, max_len: int) -> list[list[int]]:
    """The rows in groups of similar length, longest first, each holding at most LOGIT_ROWS logits and fitting
    the model's context with every row padded to the group's width."""
    groups, width = [], 0
    for r in sorted(range(len(fed)), key=lambda r: -len(fed[r])):
        if (groups and (len(groups[-1]) + 1) * max(width, 1) * vocab <= LOGIT_ROWS
            and shared[r] + width <= max_len):
            groups[-1].append(r)
        else:
            groups.append([r])
            width = len(fed[r])
    return groups


def _add_scores(sums: list, items: list[Encoded], seqs: list, rows: list[int], first, logp):
    """Add each row's continuation log-probabilities to sums: the token right after the shared prefix from the
    prefix's last logits (first, (items, V)), each later one from the row's own logits (logp, (rows, T, V));
    one host read for each."""
    from_prefix, from_row = [], []
    for i, r in enumerate(rows):
        b, j = seqs[r]
        e = items[b]
        seq, shared, begin = e.sequences[j], e.shared, e.starts[j]
        for position in range(max(begin, shared), len(seq)):  # the continuation's tokens
            if position == shared:
                from_prefix.append((r, b, seq[position]))
            else:
                from_row.append((r, i, position - shared - 1, seq[position]))
    if from_prefix:
        values = first[[b for _, b, _ in from_prefix], [t for _, _, t in from_prefix]].tolist()
        for (r, _, _), v in zip(from_prefix, values):
            sums[r] += v
    if from_row:
        values = logp[[i for _, i, _, _ in from_row], [k for _, _, k, _ in from_row],
                      [t for _, _, _, t in from_row]].tolist()
        for (r, _, _, _), v in zip(from_row, values):
            sums[r] += v


# ----------------------------------------------------------------------------- a task's score

# choice items scored between two looks at the clock (the progress bar, a Ctrl-C's partial table)
CHUNK_ITEMS = 256
GENERATE_ROWS = 64  # generated answers written together (a CPU writes 2x the tokens a second of 16)
# the longest chat answer written (the wheel's oe-eval requests' max_gen_toks), at most half
ANSWER_TOKENS = 512
# the longest answer of a task that follows lm-eval's generate_until (its default max_gen_toks)
LM_EVAL_TOKENS = 256
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# lm-eval's gsm8k_cot: its strict-match and flexible-extract filters, and what exact_match ignores in both
# texts.
STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+).")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [re.compile(p) for p in (",", r"\$", r"(?s).*#### ", r"\.$")]


@dataclass
class TaskScore:
    """A task's result: acc, and acc_norm where lm-eval reports it (None otherwise), over `items` items."""
    task: str
    split: str
    items: int = 0
    correct: float = 0.0
    correct_norm: float = 0.0
    norm: bool = True
    seconds: float = 0.0
    cut: int = 0  # items whose prompt lost tokens on the left to fit the model's context
    partial: bool = False  # stopped before its last item (Ctrl-C)
    shots: int = 0  # solved examples before each question
    # what acc and acc_norm hold: for gsm8k_cot, lm-eval's two extractions
    metrics: tuple = ("acc", "acc_norm")
    predictions: list = field(default_factory=list, repr=False)  # each item's chosen index (acc)
    # each item's line for --log_samples (llm/scores/samples.py)
    samples: list = field(default_factory=list, repr=False)

    @property
    def acc(self) -> float:
        return self.correct / max(self.items, 1)

    @property
    def acc_norm(self) -> float | None:
        return self.correct_norm / max(self.items, 1) if self.norm else None

    @property
    def acc_stderr(self) -> float | None:
        return mean_stderr(self.acc, self.items)

    @property
    def acc_norm_stderr(self) -> float | None:
        return mean_stderr(self.acc_norm, self.items) if self.norm else None


def mean_stderr(p: float, n: int) -> float | None:
    """The standard error of a mean of n right-or-wrong scores whose mean is p, as lm-eval computes it (the
    sample standard deviation, over n - 1, divided by sqrt(n)): sqrt(p (1 - p) / (n - 1)); None for fewer than
    2."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None


def chance(items: list[Item]) -> float | None:
    """The accuracy of a uniform guess: the mean of 1 / choices over the items (None for written answers)."""
    if not items or not items[0].choices:
        return None
    return sum(1 / len(i.choices) for i in items) / len(items)


def first_best(values) -> int:
    """The index of the largest value, the first among equals (numpy's argmax, as lm-eval picks)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def score_items(model, tokenizer, items: list[Item], result: TaskScore, bar=None) -> TaskScore:
    """Score a task's items (llm.scores.tasks.Task.items) on the model into result, as they are answered: a
    Ctrl-C leaves it holding the items scored so far, marked partial."""
    prefix = prefix_id(tokenizer)
    start, result.partial = time.perf_counter(), True
    try:
        if items and not items[0].choices:
            _write_answers(model, tokenizer, items, result, bar)
        else:
            for first in range(0, len(items), CHUNK_ITEMS):
                chunk = items[first:first + CHUNK_ITEMS]
                _choose(model, tokenizer, chunk, result, prefix)
                if bar is not None:
                    bar.update(len(chunk))
        result.partial = False
    finally:
        result.seconds += time.perf_counter() - start
    return result


def _choose(model, tokenizer, chunk: list[Item], result: TaskScore, prefix: int):
    """Multiple choice: the choice of highest log-likelihood (acc), and of highest per character (acc_norm).
    """
    encoded = [encode_item(tokenizer, item, model.config.max_seq_len, prefix) for item in chunk]
    for item, e, lls in zip(chunk, encoded, loglikelihoods(model, encoded)):
        pick = first_best(lls)
        norm = first_best([ll / max(len(c), 1) for ll, c in zip(lls, item.choices)])
        result.items, result.cut = result.items + 1, result.cut + e.cut
        result.correct += pick == item.gold
        result.correct_norm += norm == item.gold
        result.predictions.append(pick)
        result.samples.append(choice_line(result.task, item, lls, pick, norm if result.norm else None))


def _write_answers(model, tokenizer, items: list[Item], result: TaskScore, bar=None):
    """A generated answer: greedy, until the end of the reply, a stop string of the item's or the task's most
    tokens; graded as lm-eval grades it (an item with stop strings: acc the strict match, acc_norm the
    flexible one) or, for a chat reply, right when its last number is the item's answer. GENERATE_ROWS replies
    are written together, a finished one's row taking the next item. A prompt keeps its last tokens where it
    would leave no room for the answer, as lm-eval cuts."""
    ctx, lm_eval = model.config.max_seq_len, bool(items and items[0].until)
    room = min(LM_EVAL_TOKENS if lm_eval else ANSWER_TOKENS, ctx // 2)
    if lm_eval:
        result.metrics = ("strict-match", "flexible-extract")
    prompts = [tokenizer.encode(item.requests[0][0], add_special_tokens=False) for item in items]
    replies, lines = {}, {}

    def answered(i: int, ids: list[int]):
        replies[i] = reply = cut_at(tokenizer.decode(ids, skip_special_tokens=True), items[i].until)
        result.items, result.cut = result.items + 1, result.cut + (len(prompts[i]) > ctx - room)
        if lm_eval:
            strict, flexible = (extract(reply, how) for how in (STRICT, FLEXIBLE))
            right, right_norm = (same_text(x, items[i].answer) for x in (strict, flexible))
            result.correct, result.correct_norm = result.correct + right, result.correct_norm + right_norm
            lines[i] = answer_line(result.task, items[i], reply, strict, right) | {
                "flexible_extract": flexible, "exact_match_flexible": float(right_norm)}
        else:
            said = last_number(reply)
            right = same_number(said, items[i].answer)
            result.correct += right
            lines[i] = answer_line(result.task, items[i], reply, said, right)
        if bar is not None:
            bar.update(1)

    def stopped(i: int, ids: list[int]) -> bool:  # a stop string written: the rest would be cut anyway
        text = tokenizer.decode(ids, skip_special_tokens=True)  # as answered() reads it, and lm-eval
        return cut_at(text, items[i].until) != text
    settings = SampleConfig(temperature=0.0, max_new_tokens=room, top_k=0, top_p=1.0)
    try:
        generate_all(model, [p[-(ctx - room):] for p in prompts], settings, stop_ids(tokenizer),
                     GENERATE_ROWS, answered, until=stopped if lm_eval else None)
    finally:
        result.predictions += [replies[i] for i in sorted(replies)]  # each reply, in the items' order
        result.samples += [lines[i] for i in sorted(lines)]


def cut_at(text: str, stops) -> str:
    """The text before the first of the stop strings it holds, as lm-eval cuts a generate_until reply."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


def extract(reply: str, pattern: re.Pattern) -> str:
    """lm-eval's regex filter then take_first: strict, the first match; flexible, the last; the match's first
    non-empty group, stripped; "[invalid]" where nothing matches."""
    found = pattern.findall(reply)
    if not found:
        return "[invalid]"
    match = found[0] if pattern is STRICT else found[-1]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "[invalid]")
    return match.strip()


def same_text(said: str, answer: str) -> bool:
    """lm-eval's exact_match for GSM8K: equal once both lose what it ignores (commas, dollar signs, a text
    up to "#### ", a final full stop) and their case."""
    for pattern in IGNORED:
        said, answer = pattern.sub("", said), pattern.sub("", answer)
    return said.lower() == answer.lower()


def last_number(text: str) -> str | None:
    """The last number a reply writes (thousands separators dropped), or None."""
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def same_number(said: str | None, answer: str) -> bool:
    try:
        return said is not None and float(said) == float(answer)
    except ValueError:
        return said == answer
