"""Tests of the growing token cache (token_cache.py, prepare_data.py): shards per file, parts, mixtures, caps.

Run: python -m pytest -q tests/test_token_cache.py
"""

import json
import os
import random

import numpy as np
import pytest

import prepare_data as pd
from config import DataConfig
from conftest import DATA_SEQ, DATA_VOCAB, prepare
from llm.base.errors import DataError
from llm.data import batches, preparation
from llm.data import token_cache as tc

VOCAB, SEQ = DATA_VOCAB, DATA_SEQ


def write_texts(folder, names, seed=0, lines=40):
    """JSONL files of `lines` documents of made-up words each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = "river stone cloud apple window garden letter music paper winter".split()
    for name in names:
        (folder / name).write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(9))}) + "\n"
                                           for _ in range(lines)))
    return folder


def texts_of(path) -> set:
    return {json.loads(line)["text"] for line in path.read_text().splitlines()}



def config(tmp_path, sources, **kw):
    return DataConfig(sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"), val_fraction=0.1, **kw)


def encoded_texts(monkeypatch) -> list:
    """Every text the tokenizer encodes from now on, recorded."""
    seen, real = [], preparation.encode_segments

    def spy(tok, docs, encode=None):
        seen.extend(text for segs in docs for text, _, special in
                    ([(segs, True, False)] if isinstance(segs, str) else segs) if not special)
        return real(tok, docs, encode)
    monkeypatch.setattr(preparation, "encode_segments", spy)
    return seen


def test_adding_a_file_tokenizes_only_its_shard_and_leaves_the_others_bytes(tmp_path, monkeypatch):
    """The point of shards: a grown corpus costs the new file. Small files share a shard with their neighbours
    (a run that ends where a name hashes to 0), so a file added redoes at most its own run, never all of them.
    """
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)  # every file a shard of its own, as big files are
    src = write_texts(tmp_path / "src", [f"f{i}.jsonl" for i in range(4)])
    cfg = config(tmp_path, [src])
    first = prepare(cfg)
    before = {p["folder"]: open(os.path.join(p["folder"], "train.bin"), "rb").read() for p in first.parts}
    write_texts(src, ["f9.jsonl"], seed=9)
    seen = encoded_texts(monkeypatch)
    grown = prepare(cfg)
    assert seen and set(seen) <= texts_of(src / "f9.jsonl")
    assert len(grown.parts) == len(first.parts) + 1
    for folder, data in before.items():
        assert open(os.path.join(folder, "train.bin"), "rb").read() == data  # untouched
    # Removing a file drops its shard; what is left reads exactly as before the file came.
    os.remove(src / "f9.jsonl")
    shrunk = prepare(cfg)
    assert shrunk.parts == first.parts and not os.path.exists(grown.parts[-1]["folder"])


def test_a_run_of_small_files_is_one_shard_and_the_split_is_stable_by_document(tmp_path):
    """Small files group; the same documents land in the same split however the files are grouped."""
    src = write_texts(tmp_path / "src", [f"f{i:03d}.jsonl" for i in range(150)], lines=3)
    groups = list(tc.group_files([(str(p), True) for p in sorted(src.iterdir())]))
    assert 1 < len(groups) < 50 and sum(map(len, groups)) == 150
    for sources in ([src], [src / "f003.jsonl", src / "f007.jsonl", src / "f011.jsonl"]):
        data = prepare(config(tmp_path, sources))
        val = [text.strip() for text in data.texts("val")]
        drawn = [text.strip() for text in data.texts("train") + data.texts("val") if tc.is_val(text, 1234, 0.1)]
        assert set(drawn) <= set(val)  # a document's own hash puts it in val, wherever it lies
        assert len(set(val) - set(drawn)) <= len(data.parts)  # and at most one per part besides (none drew val)


def test_a_kill_mid_preparation_keeps_finished_parts_and_the_next_run_reuses_them(tmp_path, monkeypatch):
    """Only complete parts stay: the interrupted part is redone, the finished ones are read past, not
    re-tokenized."""
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)
    src = write_texts(tmp_path / "src", [f"f{i}.jsonl" for i in range(3)])
    cfg = config(tmp_path, [src])
    real, calls = tc.SplitWriter.close, []

    def dies_on_the_third_part(self, keep_masks):
        calls.append(1)
        if len(calls) > 4:  # two splits per part: the third part dies
            raise KeyboardInterrupt
        real(self, keep_masks)
    monkeypatch.setattr(tc.SplitWriter, "close", dies_on_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    monkeypatch.setattr(tc.SplitWriter, "close", real)
    shards = [d for d in os.listdir(next((tmp_path / "cache").iterdir()) / "shards")]
    assert len([d for d in shards if not d.endswith(".json")]) == 2 and not [d for d in shards if d[0] == "."]
    seen = encoded_texts(monkeypatch)
    data = prepare(cfg)
    assert len(data.parts) == 3 and seen and set(seen) <= texts_of(src / "f2.jsonl")


def test_weights_draw_windows_by_source_and_max_tokens_caps_each_source(tmp_path):
    """`a:0.8 b:0.2`: training windows come from each source in that share whatever their sizes; with
    --max_tokens each source gives its share of the cap; the table reports the mixture reached."""
    a = write_texts(tmp_path / "a", ["a.jsonl"], seed=1, lines=400)
    b = write_texts(tmp_path / "b", ["b.jsonl"], seed=2, lines=100)
    cfg = config(tmp_path, [f"{a}:0.8", f"{b}:0.2"])
    logs = []
    data = prepare(cfg, logs)
    (ra, rb) = data.source_ranges()
    assert data.weights == pytest.approx([0.8, 0.2]) and ra[1] == rb[0]
    loader = batches.Batches(data, "train", batch_size=64, seq_len=SEQ, seed=0)
    starts = np.concatenate([loader.starts(step, 0) for step in range(40)])
    in_b = np.mean((starts >= rb[0]) & (starts < rb[1]))
    assert 0.15 < in_b < 0.25 and starts.max() <= rb[1] - SEQ - 1
    capped = prepare(config(tmp_path, [f"{a}:0.8", f"{b}:0.2"], max_tokens=2000), logs)
    assert [s["train_tokens"] for s in capped.meta["sources"]] == [1600, 400]
    assert capped.meta["train_tokens"] == 2000 and len(capped.stream("train")) == 2000
    assert any("train tokens" in line for line in logs) and any("80.0%" in line for line in logs)
    with pytest.raises(DataError, match="no weight while"):
        prepare(config(tmp_path, [f"{a}:0.8", b]))
    with pytest.raises(DataError, match="weight -1"):
        prepare(config(tmp_path, [f"{a}:-1"]))


def test_max_tokens_without_weights_stops_preparing_and_reads_the_first_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)
    src = write_texts(tmp_path / "src", [f"f{i}.jsonl" for i in range(4)], lines=200)
    full = prepare(config(tmp_path / "full", [src]))
    seen = encoded_texts(monkeypatch)
    capped = prepare(config(tmp_path, [src], max_tokens=500))
    assert capped.meta["train_tokens"] == 500 and len(capped.parts) == 1 < len(full.parts)
    assert seen and set(seen) <= texts_of(src / "f0.jsonl")  # the later files were not tokenized
    assert capped.stream("train")[:].tolist() == full.stream("train")[:500].tolist()


def test_resume_refuses_a_corpus_that_changed_and_names_the_change(tmp_path, monkeypatch):
    """A checkpoint records its data; a resume after a file was added says which, instead of training on other
    tokens under the same schedule."""
    from config import Config
    from llm.formats.trainer_state import parse
    from llm.train.resume import check_same_data
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)
    src = write_texts(tmp_path / "src", ["a.jsonl", "b.jsonl"])
    cfg = config(tmp_path, [src])
    data = prepare(cfg)
    state = parse({"step": 3, "tokens": 30, "best_val_loss": 1.0, "data_fingerprint": data.fingerprint,
                   "data_files": [list(f) for f in data.files], "config": json.dumps(Config(data=cfg).to_dict())})
    check_same_data(Config(data=cfg), state, prepare(cfg))  # unchanged: resumes
    write_texts(src, ["c.jsonl"], seed=3)
    with pytest.raises(Exception, match=r"added .*c\.jsonl"):
        check_same_data(Config(data=cfg), state, prepare(cfg))


def test_the_progress_bar_and_old_caches_are_reported(tmp_path, capsys):
    (tmp_path / "cache" / "0123456789abcdef").mkdir(parents=True)
    (tmp_path / "cache" / "0123456789abcdef" / "train.bin").write_bytes(b"\0\0")
    src = write_texts(tmp_path / "src", ["a.jsonl", "b.jsonl"])
    logs = []
    prepare(config(tmp_path, [src]), logs)
    assert any("earlier format, no longer read; delete it" in line for line in logs)
    pd.main(["--sources", str(src), "--cache_dir", str(tmp_path / "cache"), "--vocab_size", str(VOCAB),
             "--max_seq_len", str(SEQ), "--val_fraction", "0.1"])
    out = capsys.readouterr().out
    assert "train tokens" in out and "100.0%" in out  # the table of sources


def test_a_bad_file_after_good_ones_keeps_their_parts_and_a_fixed_one_redoes_only_itself(tmp_path, monkeypatch):
    """A truncated .gz added to a prepared folder: one line naming it, no partial part; the other files' parts
    stay, and once the file is fixed the next run tokenizes only it. (In a first preparation the tokenizer's
    sample meets it first: then nothing is left at all.)"""
    import gzip
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)
    src = write_texts(tmp_path / "src", ["a.jsonl", "b.jsonl"])
    cfg = config(tmp_path, [src])
    prepare(cfg)
    whole = gzip.compress((src / "b.jsonl").read_bytes())
    (src / "c.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=r"c\.jsonl\.gz"):
        prepare(cfg)
    (folder,) = os.listdir(tmp_path / "cache")
    shards = os.listdir(tmp_path / "cache" / folder / "shards")
    assert len([s for s in shards if s.endswith("-00000")]) == 2 and not [s for s in shards if s[0] == "."]
    (src / "c.jsonl.gz").write_bytes(whole)
    seen = encoded_texts(monkeypatch)
    data = prepare(cfg)
    assert len(data.parts) == 3 and seen and set(seen) <= texts_of(src / "b.jsonl")


def test_a_resume_after_a_file_was_added_is_refused_naming_it(tmp_path, corpus, argv_for, capsys):
    """End to end through the trainer: the same data resumes; a file added to the source folder is named."""
    import shutil

    import gpu_training_optimized as trainer
    src = tmp_path / "src"
    shutil.copytree(corpus["src"], src)
    mine = dict(corpus, src=str(src), cache=str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert trainer.main(argv_for(mine, run, "--max_steps", 2)) == 0
    assert trainer.main(argv_for(mine, run, "--max_steps", 3, "--resume")) == 0
    (src / "new.py").write_text("def added():\n    return 'a file that came later'\n" * 40)
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(mine, run, "--max_steps", 4, "--resume"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot resume on other data (added " in err and "new.py" in err, err


def test_a_part_whose_tokens_changed_within_the_vocabulary_is_rebuilt(tmp_path, monkeypatch):
    """A token file rewritten with other ids of the same size and within the vocabulary once trained as it
    was: only its size and time were compared, and its largest id. part.json now keeps each file's sha256 as
    written; a touched file whose bytes differ is rebuilt from its sources (they are at hand), one line saying
    so, and a file merely touched (copied, its bytes the same) is kept without a word."""
    src = write_texts(tmp_path / "src", ["a.jsonl"])
    cfg = config(tmp_path, [src])
    first = prepare(cfg)
    folder = first.parts[0]["folder"]
    path = os.path.join(folder, "train.bin")
    written = open(path, "rb").read()
    assert json.load(open(os.path.join(folder, "part.json")))["sha256"]["train.bin"] == tc.file_digest(path)
    os.utime(path, ns=(1, 1))  # touched, the same bytes
    seen = encoded_texts(monkeypatch)
    assert prepare(cfg).parts == first.parts and not seen
    ids = np.fromfile(path, dtype=first.meta["dtype"])
    np.roll(ids, 1).tofile(path)  # the same ids in another order: same size, same largest id
    said = []
    again = preparation.prepare(cfg, VOCAB, SEQ, log=said.append)
    assert any("train.bin's bytes are not those written" in line and "rebuilding it" in line for line in said)
    assert seen and open(again.parts[0]["folder"] + "/train.bin", "rb").read() == written
