"""Prepare the token cache ahead of training (the trainer does it too, when the cache is missing), and see
what it holds: the documents of the sources (default: this Python's standard library) tokenized into
<cache_dir>/<corpus key>/ (llm/data/preparation.py does the work; llm/data/token_cache.py owns the format). A
table gives the tokens per source; --show N prints N training examples with their learned text marked, the
share learned, and how full packed windows are.

    python prepare_data.py --sources notes/ chats.jsonl --vocab_size 8192 --max_source_mb 50
    python prepare_data.py --sources "web/*.parquet:0.7" code/:0.3 --max_tokens 2000000000
    python prepare_data.py --sources chats.jsonl --show 3
"""

import signal
import sys
from dataclasses import fields

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import numpy as np
from tokenizers import Tokenizer

from config import DataConfig
from llm.base.cli import parse_config
from llm.base.device import machine, pick_device
from llm.base.errors import ConfigError, error_contract
from llm.data import token_cache as tc
from llm.data.corpus import corpus_bytes
from llm.data.corpus_totals import source_table
from llm.data.packing import packs, pair_plan, plan
from llm.data.preparation import prepare
from llm.data.token_cache import PreparedData
from llm.tokens.tokenizer import IM_START, marked_text
from llm.train.autofill import fill_automatic


def show_examples(data: PreparedData, n: int, colour: bool, packing: str = "auto", seq_len: int = 256):
    """Print the train split's first n documents with their learned tokens marked (ANSI green, or [[...]] when
    colour is off), then the share of the split's tokens that are learned and how full packed windows are."""
    tokens = data.stream("train")
    # else every token is learned
    masks = data.stream("train", masks=True) if data.meta["has_masks"] else None
    cuts, start = [], 0
    while len(cuts) < n and start < len(tokens):  # chunks: the first documents need not read the whole split
        cuts += (start + np.flatnonzero(tokens[start:start + tc.ID_CHUNK] == data.meta["eot_id"])).tolist()
        start += tc.ID_CHUNK
    tok, marks = Tokenizer.from_file(data.tokenizer_path), ("\033[32m", "\033[0m") if colour else ("[[", "]]")
    for i, (a, b) in enumerate(zip([-1] + cuts, cuts[:n]), 1):
        ids = tokens[a + 1:b].tolist()
        learned = masks[a + 1:b].astype(bool).tolist() if masks is not None else [True] * len(ids)
        print(f"--- example {i}, learned text {'in green' if colour else 'in [[ ]]'} ---")
        text = marked_text(tok, ids, learned, marks)
        print(text, end="" if text.endswith("\n") else "\n")
    total = len(tokens)
    taught = total if masks is None else \
        sum(int(masks[i:i + tc.ID_CHUNK].sum()) for i in range(0, total, tc.ID_CHUNK))
    print(f"learned: {taught / max(1, total):.1%} of the train split's {total:,} tokens ({taught:,})")
    if data.meta.get("has_pairs"):
        p = pair_plan(tokens, masks, data.meta["eot_id"], seq_len, seed=0)
        held = int(p.length[p.pair_ids].sum())
        print(f"packing: {p.pairs:,} preference pairs (two examples each) in {p.windows:,} windows of "
              f"{seq_len} tokens, {held / max(1, p.windows * seq_len):.1%} of positions filled; "
              f"{p.cut:,} prompts cut from the left to fit a window, {p.dropped:,} pairs left out "
              "(their replies alone overflow it)")
    elif packs(packing, data.meta):
        p = plan(tokens, data.meta["eot_id"], tok.token_to_id(IM_START), seq_len, seed=0)
        print(f"packing: {p.examples:,} examples in {p.windows:,} windows of {seq_len} "
              f"tokens, {p.fill_rate:.1%} of positions filled; {p.cut:,} examples longer than "
              "a window were cut at a turn start")
    else:
        print(f"packing: off ({'--packing off' if packing == 'off' else 'no chats'}), "
              "windows are random slices")


# What decides the cache: the data's settings, the vocabulary and context (a preset's, or sizing's for
# --device).
CACHE_FLAGS = {f.name for f in fields(DataConfig)} | {"vocab_size", "max_seq_len", "device", "preset",
                                                      "config", "show", "help", "h"}


def parse_args(argv=None):
    """(Config, extras): the data, tokenizer and sizing settings, and --show N; another trainer flag is
    refused by name (it would be ignored here). A --config file may hold any: only those apply."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for word in argv:
        name = word.lstrip("-").split("=")[0].replace("-", "_")
        if word.startswith("-") and not word[1:2].isdigit() and name not in CACHE_FLAGS:
            raise ConfigError(f"{word.split('=')[0]} is the trainer's setting, not the data's: "
                              "prepare_data.py takes the data, tokenizer and sizing settings (--help lists "
                              "them); pass it to gpu_training_optimized.py")

    def show(parser):
        parser.add_argument("--show", type=int, default=0, metavar="N",
                            help="after preparing, print N training examples with their learned tokens "
                                 "marked, and the share of tokens learned")
    cfg, extras = parse_config(argv, show, "Prepare the token cache a training run reads: the data, "
                               "tokenizer and sizing settings below are the trainer's own.",
                               shown=CACHE_FLAGS)
    if extras.show < 0:
        raise ConfigError(f"--show {extras.show} is invalid, pass a number of examples >= 0")
    return cfg, extras


@error_contract
def main(argv=None):
    """Prepare (or find) the cache for the command line's settings and print a summary (and --show examples).
    """
    cfg, extras = parse_args(argv)
    cfg, notes = fill_automatic(cfg, machine(pick_device(cfg.train.device)), corpus_bytes(cfg.data))
    for note in notes:
        print(note)  # the vocabulary and context the trainer would choose here
    data = prepare(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.max_seq_len)
    m = data.meta
    print(f"cache {data.path}: vocab {m['vocab_size']} ({m['dtype']}), train {m['train_tokens']:,} tokens in "
          f"{m['train_documents']} documents, val {m['val_tokens']:,} tokens in {m['val_documents']} "
          f"documents, {m['val_bytes_per_token']:.2f} bytes per token, masks "
          f"{'yes' if m['has_masks'] else 'no'}")
    if len(m["sources"]) == 1 and not cfg.data.max_tokens:
        print("\n".join(source_table(m)))  # prepare() logs it itself for a mixture or a cap
    if extras.show:
        show_examples(data, extras.show, sys.stdout.isatty(), cfg.data.packing, cfg.model.max_seq_len)


if __name__ == "__main__":
    sys.exit(main())
