"""What a model has learned, measured on text: bits per byte, Python function bodies that parse, samples.

- bits_per_byte(): the model's loss over the whole of some texts, in bits per UTF-8 byte, so models with
  different tokenizers compare on the same bytes; files stream through it a bounded part at a time.
- code_parse_rate(): N function signatures with docstrings taken from the texts; the model writes each
  body (fixed, seeded sampling), the body ends at the first line that dedents back to the signature, and
  the share that `ast.parse` accepts is the metric. A body needs one statement besides the docstring.
- sample_texts(): continuations of a few fixed prompts, to read what the model writes.
The trainer runs validation_loss() and, through a Probe, the last two at every evaluation; `text_generator.py
--eval` runs the first two on any files.
"""

import ast
import itertools
import math
import re
import textwrap
import time
from dataclasses import replace

import torch

from config import DataConfig, SampleConfig
from llm.base.distributed import Ranks
from llm.base.errors import ConfigError, DataError
from llm.data.corpus import ReadStats, documents, source_files
from llm.data.pairs import as_messages
from llm.generate.engine import generate_text
from llm.scores import tasks as benchmarks
from llm.scores.scoring import TaskScore, chance, score_items
from llm.tokens.tokenizer import IM_START, chat_text, stop_ids

# per automatic evaluation, whatever the micro-batch: 20 micro-batches of the tiny preset
EVAL_TOKENS = 81_920
AUTO_EVALS = 6  # evaluations per run when eval_interval is automatic
# automatic evaluations (val loss, code metric, samples) take at most this share of the time
EVAL_SHARE = 0.05
GPU_TASK_ITEMS = 500  # items of each benchmark task a GPU run scores at a full evaluation when left automatic
CODE_PROMPTS = 16  # bodies per measurement: a few seconds on a CPU for the tiny model
# Eager (the training model is never set to compile generation): a few dozen tokens during training do not pay
# back compiling a decode step (and its CUDA graphs).
CODE_SETTINGS = SampleConfig(max_new_tokens=96, temperature=0.7, top_k=40, top_p=1.0, seed=0)
SAMPLE_SETTINGS = SampleConfig(max_new_tokens=48, temperature=0.8, top_k=50, top_p=0.95, seed=0)
# No trailing space or newline: BPE merges whitespace with what follows, so a prompt ending in it ends on a
# token the model rarely saw there (it went on with the codec tables' runs of spaces instead of a name).
PYTHON_PROMPTS = ["def", "class", "import"]  # the default corpus is Python
# Characters per tokenizer call in bits_per_byte: shorter documents are encoded whole, longer ones in parts.
ENCODE_CHARS = 256 * 1024
SIGNATURE = re.compile(r"( *)(?:async )?def \w+\(.*\)(?: -> .+)?:\s*")  # a one-line signature


def function_prompts(texts: list[str], n: int = CODE_PROMPTS) -> list[tuple[str, int]]:
    """The first n (signature + docstring, indent of the signature) found in the texts, in their order. A
    prompt ends at the closing quotes, without the newline: the model writes the newline and the body's indent
    (unless the tokenizer joins the newline to the quotes: on_token_boundary)."""
    found = []
    for text in texts:
        lines = text.split("\n")
        for i, line in enumerate(lines[:-1]):
            match = SIGNATURE.fullmatch(line)
            if not match:
                continue
            indent, doc = len(match.group(1)), lines[i + 1].strip()
            if len(lines[i + 1]) - len(lines[i + 1].lstrip()) <= indent or doc[:3] not in ('"""', "'''"):
                continue
            quote = doc[:3]
            end = i + 1 if len(doc) >= 6 and doc.endswith(quote) else next(
                (j for j in range(i + 2, len(lines)) if quote in lines[j]), None)
            if end is None:
                continue
            found.append(("\n".join(lines[i:end + 1]), indent))
            if len(found) == n:
                return found
    return found


def on_token_boundary(tokenizer, prompt: str) -> str:
    """The prompt, or the prompt and the newline after it where the tokenizer joins the two into one token
    (GPT-4's split keeps punctuation with the newlines after it): cut inside a token, a prompt ends on one the
    model rarely saw there, and a model with such a tokenizer wrote no body that parsed (0 of 16, where its
    twin with the default tokenizer wrote 10)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return (prompt if tokenizer.encode(prompt + "\n", add_special_tokens=False)[:len(ids)] == ids
            else prompt + "\n")


def function_body(completion: str, indent: int, complete: bool) -> str:
    """The completion up to the first line that dedents back to the signature's level (its first line goes on
    from the prompt's closing quotes); when generation ran out of tokens before that line, its last line
    (maybe cut mid-way) is left out."""
    lines = completion.split("\n")
    body = []
    for number, line in enumerate(lines):
        if number > 0 and line.strip() and len(line) - len(line.lstrip()) <= indent:
            return "\n".join(body)  # the function ended here
        if number == len(lines) - 1 and not complete:
            break
        body.append(line)
    return "\n".join(body)


def parses(prompt: str, body: str) -> bool:
    """Whether signature + docstring + body is Python with at least one statement after the docstring."""
    if not any(line.strip() and not line.strip().startswith("#") for line in body.split("\n")):
        return False
    try:
        ast.parse(textwrap.dedent(prompt + body))
        return True
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the text
        return False


def fitted(settings: SampleConfig, context: int) -> SampleConfig:
    """settings with at most half the model's context for new tokens, so prompts keep the other half."""
    return replace(settings, max_new_tokens=min(settings.max_new_tokens, context // 2))


@torch.no_grad()
def code_parse_rate(model, tokenizer, texts: list[str],
                    settings: SampleConfig = CODE_SETTINGS) -> tuple[float, int]:
    """(share of bodies that parse, bodies tried); (nan, 0) when the texts hold no function with a docstring.
    """
    room = model.config.max_seq_len - settings.max_new_tokens
    prompts = [(on_token_boundary(tokenizer, p), i) for p, i in function_prompts(texts, 4 * CODE_PROMPTS)]
    prompts = [(p, i) for p, i in prompts if 0 < len(tokenizer.encode(p, add_special_tokens=False)) < room]
    prompts = prompts[:CODE_PROMPTS]
    if not prompts:
        return math.nan, 0
    completions, ids = generate_text(model, tokenizer, [p for p, _ in prompts], settings)
    ok = [parses(p, function_body(text, indent, complete=len(new) < settings.max_new_tokens))
          for (p, indent), text, new in zip(prompts, completions, ids)]
    return sum(ok) / len(ok), len(ok)


def sample_prompts(texts: list[str], python: bool, chars: int = 24, n: int = 3) -> list[str]:
    """Python openings for a Python corpus; for conversations, each one up to its first reply (so a sample is
    the model's answer); else the first characters of the first few texts."""
    if python:
        return list(PYTHON_PROMPTS)
    reply = f"{IM_START}assistant\n"
    chats = [t[:t.index(reply) + len(reply)] for t in texts if t.startswith(IM_START) and reply in t]
    return chats[:n] or [t[:chars].rstrip() for t in texts if t[:chars].strip()][:n]


@torch.no_grad()
def sample_texts(model, tokenizer, prompts: list[str],
                 settings: SampleConfig = SAMPLE_SETTINGS) -> list[dict]:
    """[{"prompt", "text"}] for each prompt, sampled with a fixed seed (so steps differ by training alone); a
    reply to a conversation ends at <|im_end|>."""
    texts, _ = generate_text(model, tokenizer, prompts, replace(settings, num_return_sequences=1),
                             stop_ids(tokenizer))
    return [{"prompt": p, "text": t} for p, t in zip(prompts, texts)]


def file_pieces(files: list[str]):
    """(document number, text) of the files' documents, piece by piece as the data path reads them (chats as
    their template text): what split_texts(split=None) returns, never held whole."""
    cfg, found = DataConfig(sources=files), False
    for number, _, doc in documents(source_files(cfg), cfg, ReadStats()):
        found = True
        yield number, doc if isinstance(doc, str) else chat_text(as_messages(doc))
    if not found:
        raise DataError(f"no text found in {', '.join(files)}, pass files that hold text")


def text_parts(texts, limit: int = ENCODE_CHARS):
    """(document number, text) parts of at most `limit` characters, in order: a shorter document whole, a
    longer one cut at line ends (inside a longer line, anywhere). texts: documents, or (number, piece) pieces
    of them as file_pieces() yields, a document's pieces one after another."""
    held, number = "", None
    for i, item in enumerate(texts):
        key, text = (i, item) if isinstance(item, str) else item
        if key != number and number is not None:
            yield number, held
            held = ""
        number, held = key, held + text
        while len(held) > limit:
            cut = held.rfind("\n", 0, limit) + 1 or limit
            yield number, held[:cut]
            held = held[cut:]
    if number is not None:
        yield number, held


def _loss_sum(model, chunks: list[list[int]]) -> float:
    """Summed loss over windows of ids (each predicting its ids after the first), padded to one batch."""
    width, device = max(map(len, chunks)), next(model.parameters()).device
    batch = torch.tensor([c + [0] * (width - len(c)) for c in chunks], device=device)
    labels = torch.tensor([c[1:] + [-100] * (width - len(c)) for c in chunks], device=device)
    logits, _ = model(batch[:, :-1])
    # sync point: once per batch
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum").item()


@torch.no_grad()
def bits_per_byte(model, tokenizer, texts, batch_size: int = 8, bar=None) -> dict:
    """The model's mean loss over every token of the texts (documents joined with <|endoftext|>, cut into
    windows of its context), as bits per UTF-8 byte of the texts; also the tokens and bytes counted.

    texts as text_parts() takes them; they are encoded a bounded part at a time and scored as their windows
    fill, so memory stays flat however long a file is. bar: a tqdm bar advanced by the bytes read."""
    eos, window, step = (tokenizer.eos_token_id, model.config.max_seq_len,
                         batch_size * model.config.max_seq_len)
    # held: ids not scored; a window's last id opens the next
    held, last, total, seen, nbytes = [], None, 0.0, 0, 0
    for number, text in itertools.chain(text_parts(texts), [(None, "")]):  # None: after the last document
        if number != last and last is not None and eos is not None:
            held.append(eos)  # the end of the document before
            seen += 1
        last, size = number, len(text.encode("utf-8"))
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        held += ids
        seen, nbytes, start = seen + len(ids), nbytes + size, 0
        while len(held) - start > step:  # whole batches of full windows, as soon as they are there
            total += _loss_sum(model,
                               [held[start + s:start + s + window + 1] for s in range(0, step, window)])
            start += step
        del held[:start]
        if bar is not None:
            bar.update(size)
    if seen < 2:
        raise DataError("the texts hold fewer than 2 tokens, there is nothing to measure; pass more text")
    starts = range(0, len(held) - 1, window)
    for i in range(0, len(starts), batch_size):
        total += _loss_sum(model, [held[s:s + window + 1] for s in starts[i:i + batch_size]])
    return {"bits_per_byte": total / math.log(2) / nbytes, "loss": total / (seen - 1), "tokens": seen - 1,
            "bytes": nbytes}


@torch.no_grad()
def validation_loss(model, amp, val_batches, n: int, ranks: Ranks, until: float = math.inf,
                    batch_loss=None) -> tuple[float, int, torch.Tensor | None]:
    """Mean validation loss over n fixed micro-batches (averaged over ranks), the batches it read (fewer once
    time.monotonic() passes `until`; one process only: under FSDP2 every rank must run every forward), and the
    sum of the batches' statistics over ranks (None for next-token loss). batch_loss(model, batch) -> (loss, a
    vector of statistics or None): an objective's own (preference's), else the model's next-token loss. Takes
    the uncompiled model: a compiled one would compile again for inference (no gradients, other guards) in the
    run."""
    batch_loss = batch_loss or next_token_loss
    model.eval()
    total, stats, read = torch.zeros((), device=val_batches.device), None, 0
    while read < n and (read == 0 or time.monotonic() < until):
        with amp:
            loss, got = batch_loss(model, val_batches.get(0, read))
        total += loss.float()
        if got is not None:
            stats = got if stats is None else stats + got
        read += 1
        if until < math.inf:
            total.item()  # the clock is read after the batch is done, not when it is queued
    model.train()
    loss = ranks.mean(total / read).item()  # sync point: once per evaluation
    return loss, read, ranks.mean(stats) if stats is not None else None


def next_token_loss(model, batch) -> tuple[torch.Tensor, None]:
    """A batch's mean next-token loss under the model, with no statistics beside it."""
    x, y, positions = batch
    return model(x, labels=y, positions=positions)[1], None


class Probe:
    """The code metric, the samples and the benchmark scores of a run, ready for each full evaluation: the
    validation texts and the tasks' first items are read once, here."""

    def __init__(self, model_config, data, python: bool, prompts: list[str] | None = None, tasks=(),
                 task_items: int = 0):
        self.tokenizer = data.tokenizer
        self.texts = data.texts("val")
        self.prompts = list(prompts) if prompts else sample_prompts(self.texts, python)
        self.sample_settings = fitted(SAMPLE_SETTINGS, model_config.max_seq_len)
        self.code_settings = fitted(CODE_SETTINGS, model_config.max_seq_len)
        self.tasks, self.tasks_off = benchmark_items(tasks, task_items)
        self.chances = {task.name: chance(items) for task, items in self.tasks}  # None: written answers
        self.last_scores: list[TaskScore] = []  # the newest full evaluation's, for the report card

    def describe(self) -> str:
        """The start report's line on scores."""
        if not self.tasks:
            return f"scores at full evaluations: off ({self.tasks_off})"
        return (f"scores at full evaluations: {', '.join(t.name for t, _ in self.tasks)} (the first "
                f"{max(len(i) for _, i in self.tasks)} items of each)")

    def scores(self, model) -> list[TaskScore]:
        """Each task's acc (and acc_norm) on its first items; kept as last_scores."""
        model.eval()
        try:
            self.last_scores = [score_items(model, self.tokenizer, items, TaskScore(task.name, task.split,
                                                                                   norm=task.norm))
                                for task, items in self.tasks]
        finally:
            model.train()
        return self.last_scores

    def code(self, model) -> tuple[float, int]:
        return self._eval(model, code_parse_rate, self.texts, self.code_settings)

    def samples(self, model) -> list[dict]:
        return self._eval(model, sample_texts, self.prompts, self.sample_settings)

    def _eval(self, model, fn, inputs, settings):
        model.eval()
        try:
            return fn(model, self.tokenizer, inputs, settings)
        finally:
            model.train()


def benchmark_items(names, n: int) -> tuple[list, str]:
    """[(task, its first n items)] of the named tasks, and why there are none ("" when there are): a run
    without the tasks' data trains on, and its start report says so. An unknown name is a ConfigError."""
    chosen = [benchmarks.get(name) for name in names]
    if not chosen:
        return [], "eval_tasks is empty"
    if not n:
        return [], ("automatic on a CPU, where a run that fits scores at chance; "
                    "--eval_task_items N scores N items")
    try:
        return [(task, task.items(n)) for task in chosen], ""
    except ConfigError as e:  # the data is not installed
        return [], str(e)
