"""The prompts of a GRPO run: rows of JSONL, parquet or Arrow files (--sources, hf:// included) with a
`prompt`, as text or as a list of {"role", "content"} messages (TRL's standard and conversational forms).
Every other column of a row goes to the reward functions, as TRL passes them.

A conversational prompt is rendered through the chat template up to the assistant's turn; a text prompt is
encoded as it is. Rows are read once, at start; a bad row is left out with one line naming its file and line,
and a prompt too long to leave room for a reply is left out and counted. A fixed share of the rows
(val_fraction) is held out, on which evaluations score greedy replies. PromptData offers the trainer what a
token cache's PreparedData does (the tokenizer, a fingerprint of the files, their list, the held-out texts).
"""

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from llm.base.errors import DataError
from llm.data import readers
from llm.data.corpus import has_lone_surrogate, source_files
from llm.data.token_cache import digest
from llm.tokens.tokenizer import (IM_START, check_messages, chat_prompt_ids, encode_batch, load_tokenizer,
                                  stop_ids)

MAX_BAD_LINES = 5  # bad rows named one by one; past these, counted
# which rows are held out does not change with --seed: a resumed or repeated run holds out the same
HOLD_OUT_SEED = 0


@dataclass
class Prompt:
    """One row: its prompt as given (text or messages), its token ids as the model reads it, and its other
    columns."""
    prompt: object
    ids: list[int]
    columns: dict


@dataclass
class PromptData:
    """A GRPO run's prompts, split into train and val, and what the trainer asks of its data."""
    train: list[Prompt]
    val: list[Prompt]
    tokenizer_path: str
    fingerprint: str
    files: list  # [path, size, mtime_ns] of each source file
    lines: list[str] = field(default_factory=list)  # what the start report says of them
    # the prompts' token counts; no bytes per token: a reward is no text's
    meta: dict = field(default_factory=dict)
    arrived: bool = True
    tokenizer: object = field(default=None, repr=False)  # the one the prompts were encoded with, loaded once
    stop_ids: list[int] = field(default_factory=list)  # the tokens that end a reply (tokenizer.stop_ids)

    @property
    def longest(self) -> int:
        """The longest prompt a step samples from, in tokens; with the longest reply, a training row's
        length."""
        return max(len(p.ids) for p in self.train)

    def texts(self, split: str) -> list[str]:
        """The split's prompts as the model reads them (special tokens written out): evaluations sample from
        them."""
        return [self.tokenizer.decode(p.ids, skip_special_tokens=False) for p in getattr(self, split)]


class PromptSplit:
    """A split's prompts as the run's loader holds them: the train split's becomes the run's Rollouts
    (runner.start), the held-out one's is what an evaluation replies to."""

    def __init__(self, prompts: list[Prompt], device):
        self.prompts, self.device = prompts, torch.device(device)


def rows(path: str):
    """Yield (where, row) of a JSONL or table file: where names the file and line or row."""
    if readers.kind(path) == "table":
        for label, first, chunk in readers.table_chunks(path, None):
            for i, row in enumerate(chunk):
                yield f"{path} {label} row {first + i}", row
        return
    with readers.open_stream(path) as f:
        for number, raw in enumerate(readers.lines(f), 1):
            where = f"{path} line {number}"
            if raw is None:
                yield where, DataError(f"longer than {readers.MAX_LINE_BYTES:,} bytes")
                continue
            if not raw.strip():
                continue
            try:
                yield where, json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield where, DataError(f"not JSON ({type(e).__name__})")


def prompt_of(row) -> object:
    """The row's prompt (text, or checked messages), or DataError saying what is wrong."""
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict) or "prompt" not in row:
        raise DataError("no `prompt` (a row is an object with a prompt, as text or as a list of messages)")
    if has_lone_surrogate(row["prompt"]):
        raise DataError("the prompt holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which no "
                        "tokenizer encodes; remove it")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("the prompt is empty")
        return prompt
    messages = check_messages(prompt, need_assistant=False)
    if messages[-1]["role"] == "assistant":
        raise DataError("the prompt's last message is the assistant's; the reply is what is sampled")
    return messages


def read(cfg, room: int) -> PromptData:
    """The prompts of cfg.data's sources, encoded with cfg.data.tokenizer (the --init_from model's), split;
    room: the tokens a prompt may have (the context less the longest reply)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    chat = IM_START in tok.get_vocab()
    found, bad, lines, files = [], [], [], []
    for path, _ in source_files(cfg.data):
        stat = os.stat(path)
        files.append([path, stat.st_size, stat.st_mtime_ns])
        for where, row in rows(path):
            try:
                prompt = prompt_of(row)
                if not isinstance(prompt, str) and not chat:
                    raise DataError("a prompt of messages needs a model with chat tokens (<|im_start|>); "
                                    "give the prompt as text, or start from a chat model")
            except DataError as e:
                bad.append(f"{where}: {e}")
                continue
            found.append(Prompt(prompt, [], {k: v for k, v in row.items() if k != "prompt"}))
    texts = [p.prompt for p in found if isinstance(p.prompt, str)]
    encoded = iter(encode_batch(tok.backend_tokenizer, texts))
    for p in found:
        p.ids = next(encoded) if isinstance(p.prompt, str) else chat_prompt_ids(tok, p.prompt)
    fitting = [p for p in found if 0 < len(p.ids) <= room]
    lines += [f"left out: {line}" for line in bad[:MAX_BAD_LINES]]
    if len(bad) > MAX_BAD_LINES:
        lines.append(f"left out: {len(bad) - MAX_BAD_LINES} more bad rows")
    if len(fitting) < len(found):
        lines.append(f"left out: {len(found) - len(fitting)} prompts longer than {room} tokens (max_seq_len "
                     "less max_completion_length); raise --max_seq_len or lower --max_completion_length")
    if len(fitting) < 2:
        raise DataError(f"the sources hold {len(fitting)} usable prompts (of {len(found) + len(bad)} rows); "
                        "a GRPO run needs rows with a `prompt`, at least one to train on and one held out")
    train, val = split(fitting, cfg.data.val_fraction)
    rendered = "chat-templated" if any(not isinstance(p.prompt, str) for p in fitting) else "as text"
    lines.insert(0, f"prompts: {len(train):,} to train on, {len(val):,} held out, from {len(files)} files; "
                    f"{rendered}, up to {max(len(p.ids) for p in fitting)} tokens")
    key = digest(json.dumps(files), cfg.data.tokenizer, str(room), str(cfg.data.val_fraction))
    meta = {"val_bytes_per_token": None, **{f"{name}_tokens": sum(len(p.ids) for p in part)
                                            for name, part in (("train", train), ("val", val))}}
    return PromptData(train, val, cfg.data.tokenizer, key, files, lines, meta, tokenizer=tok,
                      stop_ids=stop_ids(tok))


def split(prompts: list[Prompt], val_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, val): a fixed draw of about val_fraction of the prompts held out (at least one, never all)."""
    held = min(len(prompts) - 1, max(1, math.ceil(val_fraction * len(prompts))))
    order = np.random.default_rng(HOLD_OUT_SEED).permutation(len(prompts))
    out = set(order[:held].tolist())
    return [p for i, p in enumerate(prompts) if i not in out], [p for i, p in enumerate(prompts) if i in out]
