"""Whole conversations per window against random slices of the token stream: how full the windows are, and what
a small model learns from each at equal tokens.

    python tools/bench_packing.py fill        # fill rates on a long-tailed set of generated conversations
    python tools/bench_packing.py learn       # assistant-token loss after the same steps, packed and sliced

fill: window positions holding an example's token with all of that example's earlier tokens in the window
(what a reply can be learned from); packing loses only padding, slicing loses each window's head, the tail of
a conversation whose question lies before the window. learn: the tiny model trained from scratch on
arithmetic chats (answers follow a rule) for the same steps and tokens with --packing auto and --packing off,
several seeds; both are then measured on the same thing, the loss of the assistant tokens of every
validation conversation whole.
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import numpy as np
import torch

import gpu_training_optimized as trainer
from config import DataConfig
from llm.base.errors import error_contract
from llm.data.batches import Batches, PackedBatches
from llm.data.preparation import prepare
from llm.formats.loading import read_model
from modern_llm import Transformer

WORDS = "the a model data token window reply answer question learns packs whole slice long short".split()


def long_tailed_chats(n: int, seed: int) -> list[list[dict]]:
    """Conversations whose turn counts and reply lengths follow heavy-tailed laws, as real chat sets do: most
    short, a few far longer than a window."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        turns = min(12, int(rng.paretovariate(1.5)))
        msgs = []
        for _ in range(turns):
            msgs += [{"role": "user",
                      "content": " ".join(rng.choices(WORDS, k=int(rng.lognormvariate(2.5, 0.8))))},
                     {"role": "assistant",
                      "content": " ".join(rng.choices(WORDS, k=int(rng.lognormvariate(3.5, 1))))}]
        chats.append(msgs)
    return chats


def arithmetic_chats(n: int, seed: int) -> list[list[dict]]:
    """Questions whose answers follow a rule: sums, in conversations of one to four turns."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        msgs = []
        for _ in range(rng.randint(1, 4)):
            a, b = rng.randrange(50), rng.randrange(50)
            msgs += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        chats.append(msgs)
    return chats


def write_chats(folder: str, chats) -> str:
    path = os.path.join(folder, "chats.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in chats)
    return path


def context_share_of_slices(loader: Batches, eot: int, windows: int = 2000) -> float:
    """Share of positions in random windows whose example started inside the window."""
    tokens = loader.tokens  # the split's token stream, as the loader reads it
    kept = 0
    for step in range(windows // loader.batch_size):
        for s in loader.starts(step, 0):
            ends = np.flatnonzero(tokens[s:s + loader.seq_len] == eot)
            kept += loader.seq_len - (ends[0] + 1 if len(ends) else loader.seq_len)
    return kept / (windows // loader.batch_size * loader.batch_size * loader.seq_len)


def fill(args):
    with tempfile.TemporaryDirectory() as tmp:
        source = write_chats(tmp, long_tailed_chats(args.chats, 0))
        data = prepare(DataConfig(sources=[source], cache_dir=tmp), vocab_size=1024, seq_len=64,
                       log=lambda *a: None)
        print(f"{data.meta['train_documents']:,} conversations, {data.meta['train_tokens']:,} tokens; median "
              f"{np.median(lengths(data)):.0f} tokens, 99th percentile "
              f"{np.percentile(lengths(data), 99):.0f}")
        print("| window | packed: positions filled | examples cut | random slices: "
              "positions with their context |")
        print("| --- | --- | --- | --- |")
        for seq_len in args.seq_lens:
            packed = PackedBatches(data, "train", 8, seq_len, seed=0)
            sliced = context_share_of_slices(Batches(data, "train", 8, seq_len, seed=0), data.meta["eot_id"])
            print(f"| {seq_len} | {packed.plan.fill_rate:.1%} | "
                  f"{packed.plan.cut / packed.plan.examples:.1%} | {sliced:.1%} |")


def lengths(data) -> np.ndarray:
    tokens = data.stream("train")[:]
    return np.diff(np.concatenate([[-1], np.flatnonzero(tokens == data.meta["eot_id"])]))


@torch.no_grad()
def assistant_loss(run: str, data, seq_len: int) -> float:
    """Mean loss of the assistant tokens of every validation conversation, each whole in its own window rows.
    """
    found = read_model(run)
    with torch.device("meta"):  # no random draws for weights the checkpoint replaces
        model = Transformer(found.config)
    model.materialize(torch.device("cpu")).load_stored(found.state)
    model.eval()
    val = PackedBatches(data, "val", 8, seq_len, seed=0)
    total, count = 0.0, 0
    for i in range(math.ceil(val.plan.windows / 8)):
        x, y, pos = val.get(0, i)
        keep = slice(None) if (i + 1) * 8 <= val.plan.windows else slice(0, val.plan.windows - i * 8)
        logits, _ = model(x[keep], positions=pos[keep])
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y[keep].flatten(),
                                                   ignore_index=-100, reduction="sum").item()
        count += (y[keep] != -100).sum().item()
    return total / count


def learn(args):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = write_chats(tmp, arithmetic_chats(args.chats, 0))
        common = ["--preset", "tiny", "--sources", source, "--cache_dir", os.path.join(tmp, "cache"),
                  "--max_seq_len", str(args.seq_len), "--max_steps", str(args.steps), "--compile", "off",
                  "--eval_interval", str(args.steps)]
        for seed in range(args.seeds):
            row = {}
            for mode in ("auto", "off"):
                run = os.path.join(tmp, f"{mode}{seed}")
                trainer.main([*common, "--packing", mode, "--seed", str(seed), "--run_dir", run])
                data = prepare(DataConfig(sources=[source], cache_dir=os.path.join(tmp, "cache")),
                               vocab_size=4096, seq_len=args.seq_len, log=lambda *a: None)
                row[mode] = assistant_loss(run, data, args.seq_len)
            rows.append(row)
            print(f"seed {seed}: whole conversations {row['auto']:.4f}, random slices "
                  f"{row['off']:.4f} nats per assistant token", flush=True)
    packed, sliced = (np.array([r[m] for r in rows]) for m in ("auto", "off"))
    print(f"mean over {args.seeds} seeds: whole conversations {packed.mean():.4f} ± {packed.std():.4f}, "
          f"random slices {sliced.mean():.4f} ± {sliced.std():.4f}; packed lower in "
          f"{(packed < sliced).sum()} of {args.seeds}")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["fill", "learn"])
    p.add_argument("--chats", type=int, default=0, help="conversations generated (fill: 20000, learn: 3000)")
    p.add_argument("--seq_lens", type=int, nargs="*", default=[512, 1024, 2048], help="fill: window lengths")
    p.add_argument("--seq_len", type=int, default=256, help="learn: the context")
    p.add_argument("--steps", type=int, default=300, help="learn: optimizer steps per run")
    p.add_argument("--seeds", type=int, default=3, help="learn: seeds (weights and batch order)")
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    args.chats = args.chats or (20000 if args.what == "fill" else 3000)
    (fill if args.what == "fill" else learn)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
