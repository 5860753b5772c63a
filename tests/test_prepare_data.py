"""Tests of prepare_data.py: sources, cache, splits, batches, chat masks and bad input.

Run: python -m pytest -q tests/test_prepare_data.py
"""

import glob
import json
import os
import random
import re
import subprocess
import sys
import threading
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import prepare_data as pd  # noqa: E402
from config import DataConfig  # noqa: E402
from conftest import DATA_SEQ, DATA_VOCAB, prepare  # noqa: E402
from llm.data import batches  # noqa: E402
from llm.data import corpus  # noqa: E402
from llm.data import preparation  # noqa: E402
from llm.data import token_cache as tc  # noqa: E402
from llm.tokens.tokenizer import IM_END, IM_START, KINDS  # noqa: E402

WORDS = ("the a river stone light green code data model token läuft 日本 quick brown fox jumps over lazy "
         "dog, and. (x) = 42; if else return").split()
VOCAB, SEQ = DATA_VOCAB, DATA_SEQ


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_corpus(folder, n_docs=12, n_words=150, seed=0) -> dict:
    """Write n_docs text files of random words (one nested); return {path: text}."""
    rng = random.Random(seed)
    texts = {}
    for i in range(n_docs):
        path = folder / ("sub" if i % 3 == 0 else "") / f"doc{i}.{'md' if i % 2 else 'txt'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        texts[str(path)] = "\n".join(words(rng, n_words // 5) for _ in range(5)) + "\n"
        path.write_text(texts[str(path)], encoding="utf-8")
    return texts


def conversations(n=12, seed=0) -> list:
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You are terse."}] if i % 2 else []
        for _ in range(1 + i % 3):
            msgs += [{"role": "user", "content": words(rng, 8) + "?"},
                     {"role": "assistant", "content": words(rng, 10) + "."}]
        convs.append(msgs)
    return convs


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def config(tmp_path, sources, **kw) -> DataConfig:
    return DataConfig(sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"), **kw)



def split_arrays(data, split):
    tokens = data.stream(split)[:]
    return tokens, (data.stream(split, masks=True)[:] if data.meta["has_masks"] else None)


def documents(data) -> list[str]:
    """Decode both splits back into their documents (split at EOT)."""
    tok = Tokenizer.from_file(data.tokenizer_path)
    docs = []
    for split in ("train", "val"):
        tokens = split_arrays(data, split)[0].tolist()
        cuts = [i for i, t in enumerate(tokens) if t == data.meta["eot_id"]]
        docs += [tok.decode(tokens[a + 1:b], skip_special_tokens=False) for a, b in zip([-1] + cuts, cuts)]
    return docs


def cache_entries(cfg) -> list:
    return os.listdir(cfg.cache_dir) if os.path.isdir(cfg.cache_dir) else []


# ----------------------------------------------------------------------------- sources

def test_folder_is_read_recursively_skips_binary_and_keeps_text_exact(tmp_path):
    """Prevents lost or altered files in a folder source, binary files tokenized as text, and special-token
    strings inside ordinary text being turned into real document boundaries."""
    texts = text_corpus(tmp_path / "corpus")
    forged = tmp_path / "corpus" / "forged.txt"
    forged.write_text("before <|endoftext|> after <|im_end|>\n", encoding="utf-8")
    texts[str(forged)] = forged.read_text(encoding="utf-8")
    (tmp_path / "corpus" / "image.bin").write_bytes(b"\x89PNG\0\0\x01\x02" * 64)
    (tmp_path / "corpus" / ".hidden").mkdir()
    (tmp_path / "corpus" / ".hidden" / "secret.txt").write_text("not corpus text\n")
    data = prepare(config(tmp_path, [tmp_path / "corpus"]))
    assert data.meta["files"] == len(texts)
    assert data.meta["binary_files_skipped"] == 1
    assert sorted(documents(data)) == sorted(texts.values())
    assert data.meta["train_documents"] + data.meta["val_documents"] == len(texts)
    assert not data.meta["has_masks"] and not glob.glob(os.path.join(data.path, "shards", "*", "train_mask.bin"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_tokenizer_type_prepares_ordinary_text_losslessly(tmp_path, kind):
    """Every tokenizer type README names must prepare real-looking text, lines of box-drawing characters and
    long runs of spaces included (wordpiece once failed on any piece over 100 characters, with a raw
    'Missing [UNK] token' traceback), and give every document back exactly."""
    texts = text_corpus(tmp_path / "corpus", n_docs=6)
    odd = tmp_path / "corpus" / "table.txt"
    odd.write_text("\u250c" + "\u2500" * 300 + "\u2510\n" + " " * 250 + "indented\n\ttab " + "=" * 180 + "\n",
                   encoding="utf-8")
    texts[str(odd)] = odd.read_text(encoding="utf-8")
    data = prepare(config(tmp_path, [tmp_path / "corpus"], tokenizer_type=kind))
    assert sorted(documents(data)) == sorted(texts.values())


def test_long_text_file_is_cut_at_line_ends_into_documents(tmp_path):
    """Prevents a single long file (a book) from being one document that cannot be split, or being cut
    inside a line or a multi-byte character."""
    rng = random.Random(1)
    text = "".join(f"{i} {words(rng, 12)}\n" for i in range(3000))  # about 220 KB
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    data = prepare(config(tmp_path, [tmp_path / "book.txt"]))
    assert data.meta["train_documents"] + data.meta["val_documents"] >= len(text.encode()) // corpus.PIECE_BYTES
    assert data.meta["val_documents"] >= 1
    # Pieces that follow each other in one split stay joined; EOT marks only where the text breaks off.
    docs = documents(data)
    assert len(docs) >= 2 and sum(map(len, docs)) == len(text)
    for doc in docs:
        assert doc.endswith("\n") and ("\n" + doc) in ("\n" + text)


def test_text_without_whitespace_trains_a_tokenizer_quickly_and_round_trips(tmp_path):
    """Prevents tokenizer training that stalls with no message on text without a space or a newline: the file
    was one pre-tokenized word, whose cost grows faster than its length (64 KB took 32 s, 512 KB ran on for
    minutes); and a cut of that word which would lose or change text."""
    texts = text_corpus(tmp_path / "corpus", n_docs=6)
    blob = tmp_path / "corpus" / "invalid_utf8.txt"
    blob.write_bytes(bytes(range(0x80, 0x100)) * 2000)  # 256 KB, every byte invalid UTF-8: one run of U+FFFD
    texts[str(blob)] = "\ufffd" * 256000
    outcome = []  # the prepared data or the error, from a thread that a stall cannot hold past the bound

    def run():
        try:
            outcome.append(prepare(config(tmp_path, [tmp_path / "corpus"]), vocab_size=512))
        except Exception as e:  # noqa: BLE001 - handed to the test below
            outcome.append(e)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)  # a generous bound: it takes about a second
    assert outcome, "preparing 256 KB without whitespace took over 30 s"
    assert not isinstance(outcome[0], Exception), outcome[0]
    assert sorted(documents(outcome[0])) == sorted(texts.values())


def test_jsonl_takes_the_first_known_text_field_or_the_configured_one(tmp_path):
    """Prevents JSONL documents being dropped or read from the wrong field."""
    rng = random.Random(2)
    fields = ["text", "content", "message", "body", "output"]
    rows = [{"id": i, fields[i % 5]: words(rng, 30), "title": f"title {i} " + words(rng, 20)} for i in range(10)]
    path = write_jsonl(tmp_path / "docs.jsonl", rows[:5] + [""] + rows[5:])  # a blank line is ignored
    data = prepare(config(tmp_path, [path]))
    assert sorted(documents(data)) == sorted(r[fields[r["id"] % 5]] for r in rows)
    titled = prepare(config(tmp_path, [path], text_field="title"))
    assert sorted(documents(titled)) == sorted(r["title"] for r in rows)


def test_default_corpus_is_the_standard_library(tmp_path):
    """Prevents the default corpus from picking up installed packages, changing order between runs, or
    ignoring max_source_mb."""
    files = [p for p, _ in corpus.source_files(DataConfig())]
    assert files == sorted(files) and len(files) > 100
    assert all(p.endswith(".py") and "site-packages" not in p and "dist-packages" not in p for p in files)
    assert not any({"test", "tests", "idle_test"} & set(p.split(os.sep)) for p in files)  # the same on any install
    data = prepare(DataConfig(cache_dir=str(tmp_path / "cache"), max_source_mb=0.2))
    assert 0.2e6 <= data.meta["source_bytes"] < 0.2e6 + 2 * corpus.PIECE_BYTES
    assert data.meta["val_tokens"] > SEQ and data.meta["train_tokens"] > data.meta["val_tokens"]


# ----------------------------------------------------------------------------- chat and masks

def test_chat_jsonl_masks_cover_exactly_the_assistant_tokens(tmp_path):
    """Prevents training on system/user text or template headers, and forgetting the closing <|im_end|>."""
    convs = conversations()
    data = prepare(config(tmp_path, [write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])]))
    assert data.meta["has_masks"]
    tok = Tokenizer.from_file(data.tokenizer_path)
    im_end = tok.token_to_id(IM_END)
    # Independently: each assistant turn is its content's tokens followed by <|im_end|>.
    expected = [tuple(tok.encode(m["content"], add_special_tokens=False).ids + [im_end])
                for c in convs for m in c if m["role"] == "assistant"]
    runs = []
    for split in ("train", "val"):
        tokens, mask = split_arrays(data, split)
        assert mask is not None and len(mask) == len(tokens) and set(np.unique(mask)) <= {0, 1}
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        runs += [tuple(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert sorted(runs) == sorted(expected)


def test_batch_labels_are_next_tokens_masked_where_not_learned(tmp_path):
    """Prevents off-by-one labels and masks applied to the wrong position of a window."""
    data = prepare(config(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations()])]))
    tokens, mask = split_arrays(data, "train")
    loader = batches.Batches(data, "train", batch_size=4, seq_len=SEQ, seed=7)
    x, y, _ = loader.get(3, 1)
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    for row, s in enumerate(loader.starts(3, 1)):
        nxt = tokens[s + 1:s + SEQ + 1].astype(np.int64)
        assert x[row].tolist() == tokens[s:s + SEQ].tolist()
        assert y[row].tolist() == np.where(mask[s + 1:s + SEQ + 1] == 1, nxt, -100).tolist()


def test_show_marks_exactly_the_assistant_replies_and_the_share_learned(tmp_path, capsys):
    """--show, piped: the [[...]] spans of each example must be its assistant replies with their <|im_end|>
    and nothing else (a mask off by one token, or a learned prompt, shows), and the share must count those
    tokens."""
    convs = conversations()
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    pd.main(["--sources", path, "--cache_dir", str(tmp_path / "cache"), "--preset", "tiny", "--vocab_size",
             str(VOCAB), "--max_seq_len", str(SEQ), "--show", "3"])
    shown, share = capsys.readouterr().out.rsplit("learned: ", 1)
    shown = re.split(r"^--- example \d+, learned text in \[\[ \]\] ---\n", shown, flags=re.M)[1:]
    render = ["".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in c) for c in convs]
    order = [render.index(text.replace("[[", "").replace("]]", "")) for text in shown]
    assert len(order) == 3 and order == sorted(order)  # the train split's first three, in file order
    for text, i in zip(shown, order):
        assert re.findall(r"\[\[(.*?)\]\]", text, re.S) == [m["content"] + IM_END for m in convs[i]
                                                            if m["role"] == "assistant"]
    data = prepare(config(tmp_path, [path]))
    tok, val = Tokenizer.from_file(data.tokenizer_path), data.texts("val")
    taught = sum(len(tok.encode(m["content"], add_special_tokens=False).ids) + 1 for c, text in zip(convs, render)
                 if text not in val for m in c if m["role"] == "assistant")
    total = data.meta["train_tokens"]
    share, packed = share.split("\npacking: ")
    assert share.strip() == f"{taught / total:.1%} of the train split's {total:,} tokens ({taught:,})"
    assert packed.startswith(f"{data.meta['train_documents']} examples in ")  # chats are packed whole
    pd.show_examples(data, 1, colour=True)  # on a terminal: the same spans in green
    coloured = capsys.readouterr().out.split("\n", 1)[1]
    assert coloured.replace("\033[32m", "[[").replace("\033[0m", "]]").startswith(shown[0])


# ----------------------------------------------------------------------------- cache

def test_every_data_setting_but_the_cache_folder_changes_the_fingerprint(tmp_path):
    """A data setting left out of the cache key (system_prompt, when it came) would reuse a cache built with
    another value: every DataConfig field but cache_dir, packing and max_tokens (how batches are cut from the
    cache) must change the folder's key; source weights do not."""
    text_corpus(tmp_path / "corpus", n_docs=2)
    (tmp_path / "tok.json").write_text("{}")
    other = {"sources": [str(tmp_path / "corpus")] * 2, "text_field": "body", "system_prompt": "Be brief.",
             "skip_bad_lines": True, "max_source_mb": 1.0, "tokenizer": str(tmp_path / "tok.json"),
             "tokenizer_type": "unigram", "val_fraction": 0.1, "data_seed": 7}
    assert set(other) == {f.name for f in fields(DataConfig)} - {"cache_dir", "packing", "max_tokens"}  # new: here
    base = config(tmp_path, [tmp_path / "corpus"])
    key = lambda cfg: preparation._corpus_key(cfg, VOCAB)  # noqa: E731
    assert key(replace(base, cache_dir=str(tmp_path / "elsewhere"))) == key(base)
    assert key(replace(base, packing="off")) == key(replace(base, packing="documents")) == key(base)
    weighted = replace(base, sources=[f"{tmp_path / 'corpus'}:0.5"])
    assert key(replace(base, max_tokens=1000)) == key(weighted) == key(base)
    for name, value in other.items():
        assert key(replace(base, **{name: value})) != key(base), name


def test_second_prepare_reuses_the_cache_and_a_touched_file_rebuilds(tmp_path, monkeypatch):
    """Prevents re-tokenizing an unchanged corpus on every run, and serving a stale cache after an edit: a
    touched file redoes its own shard, with the same tokenizer, and no other."""
    text_corpus(tmp_path / "corpus")
    cfg = config(tmp_path, [tmp_path / "corpus"])
    first = prepare(cfg)

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(preparation, "encode_segments", no_tokenizing)
        m.setattr(preparation, "train_tokenizer", no_tokenizing)
        again = prepare(cfg)
    timing = ("seconds", "mb_per_second")
    assert again.path == first.path and again.parts == first.parts
    assert {k: v for k, v in again.meta.items() if k not in timing} == \
        {k: v for k, v in first.meta.items() if k not in timing}
    tokens = first.stream("train")[:].tolist()
    path = tmp_path / "corpus" / "doc1.md"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with monkeypatch.context() as m:
        m.setattr(preparation, "train_tokenizer", no_tokenizing)
        rebuilt = prepare(cfg)
    assert rebuilt.path == first.path and rebuilt.fingerprint != first.fingerprint
    changed = [p["folder"] for p in rebuilt.parts if p not in first.parts]
    assert changed and all(any(f[0] == str(path) for f in p["files"]) for p in rebuilt.parts if p["folder"] in changed)
    assert rebuilt.stream("train")[:].tolist() == tokens  # the same text: the same tokens
    assert sorted(os.listdir(os.path.join(first.path, "shards"))) == sorted(
        [os.path.basename(p["folder"]) for p in rebuilt.parts] + [os.path.basename(p["folder"])[:16] + ".json"
                                                                  for p in rebuilt.parts])  # the stale one went


def test_existing_tokenizer_is_used_not_trained(tmp_path, monkeypatch):
    """Prevents --tokenizer being ignored (a silently retrained vocabulary) or a tokenizer larger than the
    model's embedding being accepted."""
    text_corpus(tmp_path / "corpus")
    trained = prepare(config(tmp_path, [tmp_path / "corpus"]))
    monkeypatch.setattr(preparation, "train_tokenizer", lambda *a: pytest.fail("trained a tokenizer"))
    cfg = config(tmp_path, [tmp_path / "corpus"], tokenizer=os.path.dirname(trained.tokenizer_path))
    reused = prepare(cfg)
    assert reused.path != trained.path
    assert open(reused.tokenizer_path).read() == open(trained.tokenizer_path).read()
    with pytest.raises(preparation.DataError, match="more than vocab_size=290"):
        prepare(cfg, vocab_size=290)


def test_interrupted_preparation_leaves_no_part(tmp_path, monkeypatch):
    """Prevents a Ctrl-C during tokenizing from leaving a part that a later run would take as complete."""
    text_corpus(tmp_path / "corpus")
    cfg = config(tmp_path, [tmp_path / "corpus"])

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation.tc.SplitWriter, "close", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    (folder,) = cache_entries(cfg)
    assert sorted(os.listdir(os.path.join(cfg.cache_dir, folder))) == ["meta.json", "shards", "tokenizer.json"]
    assert os.listdir(os.path.join(cfg.cache_dir, folder, "shards")) == []


# ----------------------------------------------------------------------------- determinism and batches

CHILD = """
import glob
import hashlib, json, sys
sys.path.insert(0, {root!r})
from config import DataConfig
from llm.data import batches, preparation
data = preparation.prepare(DataConfig(sources=[{src!r}], cache_dir={cache!r}), vocab_size=300, seq_len=16,
                           log=lambda m: None)
out = {{s: hashlib.sha256(data.stream(s)[:].tobytes()).hexdigest() for s in ("train", "val")}}
for split, rank, step, micro in [("train", 0, 0, 0), ("train", 0, 5, 1), ("train", 1, 5, 1), ("val", 0, 0, 2)]:
    x, y, _ = batches.Batches(data, split, batch_size=4, seq_len=16, seed=1337, rank=rank).get(step, micro)
    out[f"{{split}} {{rank}} {{step}} {{micro}}"] = x.tolist() + y.tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_split_and_batches_are_identical_across_processes(tmp_path):
    """Prevents a split or batch order that depends on the process (hash seeds, dict or file-system order),
    which would make a resumed run see different data."""
    text_corpus(tmp_path / "corpus", n_docs=30)
    outputs = []
    for i in (1, 2):
        code = CHILD.format(root=ROOT, src=str(tmp_path / "corpus"), cache=str(tmp_path / f"cache{i}"))
        env = dict(os.environ, PYTHONHASHSEED=str(i))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    out = outputs[0]
    assert out["train 0 0 0"] != out["train 0 5 1"] != out["train 1 5 1"]


def test_batches_are_a_pure_function_of_seed_step_micro_step_rank(tmp_path):
    """Prevents loader state (an advancing generator) making a resumed run's batches differ."""
    text_corpus(tmp_path / "corpus")
    data = prepare(config(tmp_path, [tmp_path / "corpus"]))
    a = batches.Batches(data, "train", batch_size=4, seq_len=SEQ, seed=1)
    b = batches.Batches(data, "train", batch_size=4, seq_len=SEQ, seed=1)
    for step in (0, 1, 2):
        a.get(step, 0)
    assert torch.equal(a.get(9, 2)[0], b.get(9, 2)[0])
    assert not torch.equal(b.get(9, 2)[0], b.get(10, 2)[0])
    assert not torch.equal(b.get(9, 2)[0], batches.Batches(data, "train", 4, SEQ, seed=2).get(9, 2)[0])


def test_training_reads_every_window_of_an_epoch_once_and_ranks_split_them(tmp_path):
    """Prevents windows drawn with replacement (after one epoch's worth a third of the split is unread, a
    quarter read twice), windows that overlap or run past the split, the same edges every epoch, and ranks or
    accumulation that change which windows a step reads."""
    text_corpus(tmp_path / "corpus")
    data = prepare(config(tmp_path, [tmp_path / "corpus"]))
    loader = batches.Batches(data, "train", batch_size=4, seq_len=SEQ, seed=1)
    per_epoch, length = loader.epoch_sequences, len(data.stream("train"))
    assert per_epoch == (length - 1) // SEQ - 1 > 8  # all that fit beside a shift of up to one window
    steps = -(-2 * per_epoch // 4)  # two epochs and a little
    read = np.concatenate([loader.starts(step, 0) for step in range(steps)])
    first, second = np.sort(read[:per_epoch]), np.sort(read[per_epoch:2 * per_epoch])
    for epoch in (first, second):  # one epoch: disjoint windows, one after the other, inside the split
        assert np.all(np.diff(epoch) == SEQ) and epoch[0] >= 0 and epoch[-1] + SEQ + 1 <= length
    assert first[0] != second[0]  # another shift: the edges of windows move between epochs
    assert not np.array_equal(read[:per_epoch], np.sort(read[:per_epoch]))  # a shuffled order, not file order
    two_ranks = [batches.Batches(data, "train", 4, SEQ, seed=1, rank=r, world_size=2) for r in (0, 1)]
    accumulating = batches.Batches(data, "train", 4, SEQ, seed=1, accum=2)
    for step in (0, 3, per_epoch // 8):
        assert np.array_equal(np.concatenate([two_ranks[0].starts(step, 0), two_ranks[1].starts(step, 0)]),
                              np.concatenate([accumulating.starts(step, 0), accumulating.starts(step, 1)]))


def test_val_batches_tile_the_split_the_same_way_every_time(tmp_path):
    """Prevents noisy or drifting eval losses from random eval windows."""
    text_corpus(tmp_path / "corpus")
    data = prepare(config(tmp_path, [tmp_path / "corpus"]))
    val = batches.Batches(data, "val", batch_size=2, seq_len=SEQ, seed=1)
    assert val.starts(0, 0).tolist() == [0, SEQ] and val.starts(0, 1).tolist() == [2 * SEQ, 3 * SEQ]
    assert torch.equal(val.get(0, 1)[1], val.get(50, 1)[1])
    second_rank = batches.Batches(data, "val", 2, SEQ, seed=1, rank=1, world_size=2)
    assert second_rank.starts(0, 0).tolist() == [2 * SEQ, 3 * SEQ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_cpu_batches(tmp_path):
    """Prevents the pinned, non-blocking copy path from delivering different or unfinished data."""
    text_corpus(tmp_path / "corpus")
    data = prepare(config(tmp_path, [tmp_path / "corpus"]))
    cpu = batches.Batches(data, "train", 4, SEQ, seed=3).get(2, 1)
    gpu = batches.Batches(data, "train", 4, SEQ, seed=3, device=torch.device("cuda")).get(2, 1)
    assert all(g.is_cuda and torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))


# ----------------------------------------------------------------------------- bad input

def _bad_jsonl(tmp_path, bad_row, good=10):
    rng = random.Random(3)
    rows = [{"text": words(rng, 30)} for _ in range(good)]
    return [write_jsonl(tmp_path / "data.jsonl", rows[:2] + [bad_row] + rows[2:])]


def _strict_wordpiece(tmp_path) -> str:
    """A tokenizer.json from elsewhere: WordPiece with its usual 100-character word limit and no [UNK] token.
    """
    from tokenizers import Tokenizer as Tok
    from tokenizers import models as tok_models
    from tokenizers import pre_tokenizers
    tok = Tok(tok_models.WordPiece({c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "strict.json"))
    return str(tmp_path / "strict.json")


BAD_INPUTS = {
    "missing path": (lambda p: [p / "nope.txt"], {}, r"data source .*nope\.txt does not exist"),
    "empty corpus": (lambda p: [(p / "empty.txt", (p / "empty.txt").write_text(""))[0]], {}, r"no text found"),
    "not json": (lambda p: _bad_jsonl(p, "{not json"), {},
                 r"1 bad JSONL line.*data\.jsonl line 3: not valid JSON.*skip_bad_lines"),
    "no text field": (lambda p: _bad_jsonl(p, {"title": "x"}), {}, r"data\.jsonl line 3: no text field"),
    "unknown role": (lambda p: _bad_jsonl(p, {"messages": [{"role": "bot", "content": "hi"}]}), {},
                     r"data\.jsonl line 3: unknown role 'bot'"),
    "no assistant": (lambda p: _bad_jsonl(p, {"messages": [{"role": "user", "content": "hi"}]}), {},
                     r"data\.jsonl line 3: the conversation has no assistant turn"),
    "binary file": (lambda p: [(p / "x.txt", (p / "x.txt").write_bytes(b"ab\0cd"))[0]], {}, r"x\.txt looks binary"),
    "vocab too small": (lambda p: _bad_jsonl(p, {"text": "fine"}), {"vocab_size": 258}, r"vocab_size=258 is too small"),
    "single document": (lambda p: [(p / "one.txt", (p / "one.txt").write_text("just one\n"))[0]], {},
                        r"one\.txt holds a single document"),
    "shorter than a window": (lambda p: _bad_jsonl(p, {"text": "fine"}), {"seq_len": 5000},
                              r"split holds \d+ tokens, fewer than one window of max_seq_len \+ 1 = 5001"),
    "tokenizer that fails": (lambda p: _bad_jsonl(p, {"text": "x" * 300}), {"tokenizer": _strict_wordpiece},
                             r"the tokenizer cannot encode this text \(.*\[UNK\].*\), pass another --tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_a_clear_error_and_no_cache(tmp_path, case):
    """Prevents tracebacks from deep inside on bad input, messages that don't name the file and line, and
    half-written cache folders: what is left is complete parts only (a corpus refused as a whole keeps the
    parts it read: adding documents reuses them), or nothing."""
    make, kw, pattern = BAD_INPUTS[case]
    data_kw = {"tokenizer": kw.pop("tokenizer")(tmp_path)} if "tokenizer" in kw else {}
    cfg = config(tmp_path, make(tmp_path), **data_kw)
    with pytest.raises(preparation.DataError, match=pattern) as err:
        prepare(cfg, **kw)
    assert "\n" not in str(err.value)
    assert_only_complete_parts(cfg)


def assert_only_complete_parts(cfg):
    for folder, dirs, files in os.walk(cfg.cache_dir):
        assert not [n for n in dirs + files if n.startswith(".")], folder  # no writer's temporary folder or file
    for folder in cache_entries(cfg):
        shards = os.path.join(cfg.cache_dir, folder, "shards")
        parts = [os.path.join(shards, p) for p in os.listdir(shards) if not p.endswith(".json")]
        assert parts and all(tc.part_problem(p, 2**16, "uint16") is None for p in parts), "not a complete part"


def test_skip_bad_lines_skips_and_reports_the_count(tmp_path):
    """Prevents skip_bad_lines from failing anyway, or skipping lines silently."""
    rng = random.Random(4)
    rows = [{"text": words(rng, 30)} for _ in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows[:3] + ["{oops", {"name": "no text"}] + rows[3:])
    logs = []
    data = prepare(config(tmp_path, [path], skip_bad_lines=True), logs=logs)
    assert data.meta["bad_lines_skipped"] == 2
    assert sorted(documents(data)) == sorted(r["text"] for r in rows)
    assert any("skipped 2 bad JSONL line" in m and "d.jsonl line 4" in m for m in logs)


def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path):
    """Prevents a crash on a badly encoded file, and replacements that nobody hears about."""
    texts = text_corpus(tmp_path / "corpus")
    # Two invalid bytes, and one U+FFFD that is valid UTF-8 and must not be counted.
    (tmp_path / "corpus" / "latin1.txt").write_bytes(b"caf\xe9 na\xefve \xef\xbf\xbd ok\n")
    logs = []
    data = prepare(config(tmp_path, [tmp_path / "corpus"]), logs=logs)
    assert data.meta["invalid_utf8_replaced"] == 2
    assert any("replaced 2 invalid UTF-8" in m and "latin1.txt" in m for m in logs)
    assert sorted(documents(data)) == sorted(list(texts.values()) + ["caf\ufffd na\ufffdve \ufffd ok\n"])


@pytest.mark.slow
def test_command_line_prepares_and_reports_errors_in_one_line(tmp_path):
    """Prevents the script from printing a traceback or exiting 0 on bad input."""
    text_corpus(tmp_path / "corpus")
    common = [sys.executable, os.path.join(ROOT, "prepare_data.py"), "--cache_dir", str(tmp_path / "cache"),
              "--vocab_size", "300", "--max_seq_len", "16", "--preset", "tiny"]
    ok = subprocess.run(common + ["--sources", str(tmp_path / "corpus")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "train" in ok.stdout and "val" in ok.stdout
    bad = subprocess.run(common + ["--sources", str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and bad.stderr.startswith("error: data source")
    trainer_flag = subprocess.run(common + ["--sources", str(tmp_path / "corpus"), "--learning-rate", "1e-3"],
                                  capture_output=True, text=True, timeout=120)  # was taken and ignored
    assert trainer_flag.returncode == 2 and trainer_flag.stderr.count("\n") == 1, trainer_flag.stderr
    assert trainer_flag.stderr.startswith("error: --learning-rate is the trainer's setting")


def test_help_lists_the_data_settings_and_not_the_trainers(capsys):
    """prepare_data.py --help once listed every trainer setting (learning rates, LoRA, the server's), none of
    which it reads and each of which it refuses on its command line: --help lists what it takes, and only
    that."""
    import prepare_data
    from config import TrainConfig
    with pytest.raises(SystemExit):
        prepare_data.parse_args(["--help"])
    text = capsys.readouterr().out
    listed = set(re.findall(r"^  --(\w+)", text, re.M))
    assert {"sources", "vocab_size", "max_seq_len", "cache_dir", "show"} <= listed
    trainer_only = {f.name for f in fields(TrainConfig)} - prepare_data.CACHE_FLAGS
    assert not listed & trainer_only, listed & trainer_only
