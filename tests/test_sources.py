"""Tests of the source containers (readers.py, corpus.py): gzip and zstd text and JSONL, parquet, Arrow files
and streams, save_to_disk folders, glob patterns; the same documents in any container give the same token
cache.

Run: python -m pytest -q tests/test_sources.py"""

import gzip
import json
import os
import random
import sys
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import prepare_data as pd  # noqa: E402
from config import DataConfig  # noqa: E402
from conftest import DATA_SEQ, DATA_VOCAB, prepare  # noqa: E402
from llm.base.errors import DataError
from llm.data import corpus  # noqa: E402
from llm.data import readers  # noqa: E402
from llm.data import token_cache  # noqa: E402

WORDS = "the a river stone light green code data model token läuft 日本 quick brown fox jumps over lazy dog".split()
VOCAB, SEQ = DATA_VOCAB, DATA_SEQ


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def rows(n=24, seed=0) -> list[dict]:
    """Documents of every shape a row may take: text, messages, Alpaca with and without input."""
    rng, out = random.Random(seed), []
    for i in range(n):
        if i % 4 == 0:
            out.append({"messages": [{"role": "user", "content": words(rng, 6) + "?"},
                                     {"role": "assistant", "content": words(rng, 9) + "."}]})
        elif i % 4 == 1:
            out.append({"instruction": words(rng, 5), "output": words(rng, 7)} | ({"input": words(rng, 4)} if i % 8
                                                                                     else {}))
        else:
            out.append({"text": words(rng, 40)})
    return out


def jsonl_bytes(docs) -> bytes:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()


def write_table(path, docs, group=5, stream=False):
    """docs as a parquet file (row groups of `group` rows) or an Arrow IPC file or stream (batches of
    `group`)."""
    keys = list(dict.fromkeys(k for d in docs for k in d))  # from_pylist would take the first row's keys only
    table = pa.Table.from_pydict({k: [d.get(k) for d in docs] for k in keys})
    if str(path).endswith(".parquet"):
        pq.write_table(table, path, row_group_size=group)
    else:
        with (pa.ipc.new_stream if stream else pa.ipc.new_file)(str(path), table.schema) as w:
            for batch in table.to_batches(max_chunksize=group):
                w.write_batch(batch)
    return path


def write_dataset(folder, docs):
    """A folder shaped as datasets' save_to_disk writes it: two Arrow stream shards and their JSON notes."""
    folder.mkdir(parents=True)
    half = len(docs) // 2
    for i, part in enumerate([docs[:half], docs[half:]]):
        write_table(folder / f"data-0000{i}-of-00002.arrow", part, stream=True)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"}
                                                                   for i in range(2)]}))
    (folder / "dataset_info.json").write_text(json.dumps({"description": "not text to learn"}))
    return folder


def zstd_frames(data: bytes, frames=2) -> bytes:
    """data as several zstd frames one after another (as zstd -T or cat a.zst b.zst make)."""
    cut = len(data) // frames
    parts = [data[i * cut:(i + 1) * cut if i < frames - 1 else len(data)] for i in range(frames)]
    return b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(p) for p in parts)


CONTAINERS = {
    "jsonl.gz": lambda p, d: (p / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(d))) and p / "d.jsonl.gz",
    "jsonl.zst": lambda p, d: (p / "d.jsonl.zst").write_bytes(zstd_frames(jsonl_bytes(d))) and p / "d.jsonl.zst",
    "parquet": lambda p, d: write_table(p / "d.parquet", d),
    "arrow file": lambda p, d: write_table(p / "d.arrow", d),
    "arrow stream": lambda p, d: write_table(p / "d.arrow", d, stream=True),
    "save_to_disk": lambda p, d: write_dataset(p / "saved", d),
}


def config(tmp_path, sources, **kw) -> DataConfig:
    return DataConfig(sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"), **kw)



def read_all(cfg) -> corpus.ReadStats:
    """What one pass over the sources counts."""
    stats = corpus.ReadStats()
    for _ in corpus.documents(corpus.source_files(cfg), cfg, stats):
        pass
    return stats


def cache_files(data) -> dict:
    """Every token and mask file of a cache, as bytes."""
    return {(split, masks): data.stream(split, masks)[:].tobytes() for split in ("train", "val")
            for masks in (False, True)}


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_every_container_gives_the_tokens_of_plain_jsonl(tmp_path, container):
    """Prevents a container from losing, reordering or altering documents (a null column read as a field, a
    chat row read as text, a second zstd frame or Arrow shard dropped): the cache must equal plain JSONL's."""
    docs = rows()
    (tmp_path / "ref").mkdir()
    reference = prepare(config(tmp_path, [(tmp_path / "ref" / "d.jsonl").write_bytes(jsonl_bytes(docs)) and
                                          tmp_path / "ref" / "d.jsonl"]))
    (tmp_path / "in").mkdir()
    data = prepare(config(tmp_path, [CONTAINERS[container](tmp_path / "in", docs)]))
    assert data.path != reference.path and data.meta["has_masks"]
    assert cache_files(data) == cache_files(reference)
    for key in ("train_documents", "val_documents", "train_tokens", "val_tokens"):
        assert data.meta[key] == reference.meta[key]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_text_files_give_the_tokens_of_plain_ones(tmp_path, suffix):
    """Prevents compressed text from being cut into other pieces than the plain file (readline inside a
    decompressing stream) or read as binary; one file is long enough to be cut in pieces and lines."""
    rng = random.Random(1)
    texts = {f"doc{i}.{'md' if i % 2 else 'txt'}": "\n".join(words(rng, 12) for _ in range(8 + 900 * (i == 2)))
             for i in range(6)}
    for name, folder in [("plain", tmp_path / "plain"), ("packed", tmp_path / "packed")]:
        folder.mkdir()
        for file, text in texts.items():
            if name == "plain":
                (folder / file).write_text(text, encoding="utf-8")
            else:
                data = text.encode()
                (folder / (file + suffix)).write_bytes(gzip.compress(data) if suffix == ".gz" else zstd_frames(data))
    plain, packed = (prepare(config(tmp_path, [tmp_path / n])) for n in ("plain", "packed"))
    assert cache_files(packed) == cache_files(plain) and packed.meta["source_bytes"] == plain.meta["source_bytes"]
    assert plain.meta["train_documents"] + plain.meta["val_documents"] > len(texts)  # the long file was cut


def test_folders_and_globs_find_every_kind_in_a_fixed_order(tmp_path):
    """Prevents a folder walk from skipping the new kinds as binary, reading a save_to_disk folder's JSON
    notes as text, or a glob giving its matches in the file system's order."""
    web = tmp_path / "web"
    docs = rows(40)
    write_table((web / "sub").mkdir(parents=True) or web / "sub" / "b.parquet", docs[:10])
    write_table(web / "a.parquet", docs[10:20])
    (web / "c.jsonl.zst").write_bytes(zstd_frames(jsonl_bytes(docs[20:25])))
    (web / "d.md.gz").write_bytes(gzip.compress(b"a plain note\n"))
    (web / "e.bin").write_bytes(b"\x89PNG\0\0" * 32)
    write_dataset(web / "saved" / "train", docs[25:])
    (web / "saved" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    found = [os.path.relpath(p, web) for p, _ in corpus.source_files(config(tmp_path, [web]))]
    assert found == ["a.parquet", "c.jsonl.zst", "d.md.gz", "e.bin", "saved/train/data-00000-of-00002.arrow",
                     "saved/train/data-00001-of-00002.arrow", "sub/b.parquet"]
    data = prepare(config(tmp_path, [web]))
    assert data.meta["binary_files_skipped"] == 1 and data.meta["files"] == 6
    assert data.meta["train_documents"] + data.meta["val_documents"] == len(docs) + 1
    globbed = corpus.source_files(config(tmp_path, [web / "**" / "*.parquet", web / "*.zst"]))
    assert [(os.path.relpath(p, web), in_folder) for p, in_folder in globbed] == \
        [("a.parquet", False), ("sub/b.parquet", False), ("c.jsonl.zst", False)]


def test_the_shards_follow_files_found_by_glob_and_in_folders(tmp_path):
    """Prevents a stale cache: a file a glob or a folder finds must take part in its shard's key by path, size
    and time, so adding one makes a new shard beside the others and rewriting one makes a new shard for it."""
    (tmp_path / "web").mkdir()
    write_table(tmp_path / "web" / "a.parquet", rows(10))
    cfgs = [config(tmp_path, [tmp_path / "web" / "*.parquet"]), config(tmp_path, [tmp_path / "web"])]

    def shards():
        return [[token_cache.shard_key(files, float("inf")) for files in token_cache.group_files(
            corpus.source_files(c))] for c in cfgs]
    before = shards()
    write_table(tmp_path / "web" / "b.parquet", rows(10, seed=1))
    added = shards()
    write_table(tmp_path / "web" / "a.parquet", rows(12))
    rewritten = shards()
    for b, a, r in zip(before, added, rewritten):
        assert len(b) == 1 and len(a) in (1, 2) and len(set(b) | set(a) | set(r)) >= 3


def _truncated_gz(p):
    data = gzip.compress(jsonl_bytes(rows(200)))
    (p / "d.jsonl.gz").write_bytes(data[:len(data) // 2])
    return [p / "d.jsonl.gz"]


def _zst(p, data, name="d.txt.zst"):
    (p / name).write_bytes(data)
    return [p / name]


def _parquet(p, docs, **kw):
    return [write_table(p / "d.parquet", docs, **kw)]


def _empty_group(p):
    table = pa.Table.from_pydict({"text": [r.get("text", "") for r in rows(10)]})
    with pq.ParquetWriter(p / "d.parquet", table.schema) as w:
        w.write_table(table)
        w.write_table(table.slice(0, 0))
    return [p / "d.parquet"]


def _corrupt_group(p):
    """A parquet file whose third row group's page header is overwritten: the footer reads, that group does
    not."""
    pq.write_table(pa.table({"text": [words(random.Random(i), 30) for i in range(40)]}), p / "d.parquet",
                   row_group_size=10)
    column = pq.ParquetFile(p / "d.parquet").metadata.row_group(2).column(0)
    data = bytearray((p / "d.parquet").read_bytes())
    data[column.data_page_offset:column.data_page_offset + 8] = b"\xff" * 8
    (p / "d.parquet").write_bytes(data)
    return [p / "d.parquet"]


def _bad_utf8_page(p):
    """An uncompressed parquet file whose second row group's text bytes are flipped: its pages decode, to
    strings that are not UTF-8 (once blamed on the tokenizer: "try another --tokenizer_type")."""
    texts = [words(random.Random(i), 30) for i in range(40)]
    pq.write_table(pa.table({"text": texts}), p / "d.parquet", row_group_size=20, compression="none",
                   use_dictionary=False)
    data = bytearray((p / "d.parquet").read_bytes())
    start = data.index(texts[25].encode()) + 4  # inside a string of the second group, not its length
    data[start:start + 4] = b"\xff\xfe\xc3\x28"
    (p / "d.parquet").write_bytes(data)
    return [p / "d.parquet"]


def _dataset_missing_a_file(p):
    """A save_to_disk folder with one of its two data files gone: it once trained on the other without a word.
    """
    folder = write_dataset(p / "saved", rows(20))
    os.remove(folder / "data-00001-of-00002.arrow")
    return [folder]


TEXT = jsonl_bytes(rows(4000))
STREAM_BROKEN = r"d\.{}: the {} stream is cut short or corrupt {} \({}"
BAD_INPUTS = {
    "corrupt parquet": (lambda p: [(p / "d.parquet", (p / "d.parquet").write_bytes(b"PAR1" + os.urandom(64)))[0]],
                        r"d\.parquet is not a readable parquet file \(.*\), write it again"),
    "truncated parquet": (lambda p: [(p / "d.parquet", (p / "d.parquet").write_bytes(
        write_table(p / "x.parquet", rows(20)).read_bytes()[:300]))[0]], r"d\.parquet is not a readable parquet"),
    "corrupt row group": (_corrupt_group, r"d\.parquet row group 2 cannot be read \(.*\), the file is corrupt"),
    "numbers in an arrow column": (lambda p: [write_table(p / "d.arrow", [{"content": 1.5}] * 3)],
                                   r"3 bad table row\(s\), the first is .*d\.arrow record batch 0 row 0: content "
                                   r"holds float, not text"),
    "truncated gz": (_truncated_gz, STREAM_BROKEN.format(r"jsonl\.gz", "gzip", r"after line \d+", "")),
    "not gzip": (lambda p: _zst(p, b"plain text, not gzip\n" * 4, "d.txt.gz"),
                 STREAM_BROKEN.format(r"txt\.gz", "gzip", "at its start", "Not a gzip")),
    "truncated zst": (lambda p: _zst(p, (lambda c: c[:len(c) // 2])(zstandard.ZstdCompressor().compress(TEXT))),
                      STREAM_BROKEN.format(r"txt\.zst", "zstd", r"after line \d+", "the file ends inside a frame")),
    "bad zstd frame": (lambda p: _zst(p, zstandard.ZstdCompressor().compress(TEXT) + b"not a frame at all"),
                       STREAM_BROKEN.format(r"txt\.zst", "zstd", r"after line \d+", ".*Unknown frame descriptor")),
    "numbers in the text column": (lambda p: _parquet(p, [{"text": i} for i in range(10)]),
                                   r"10 bad table row\(s\), the first is .*d\.parquet row group 0 row 0: text holds "
                                   r"int, not text.*--skip_bad_lines"),
    "empty row group": (_empty_group, r"1 bad table row\(s\), the first is .*d\.parquet row group 1: it holds no rows"),
    "no text column": (lambda p: _parquet(p, [{"id": i, "title": "x"} for i in range(4)]),
                       r"d\.parquet has no column a document can come from \(it has id, title; looked for text"),
    "corrupt arrow": (lambda p: [(p / "d.arrow", (p / "d.arrow").write_bytes(b"ARROW1" + os.urandom(64)))[0]],
                      r"d\.arrow is not a readable arrow file"),
    "glob matching nothing": (lambda p: [p / "web" / "*.parquet"], r"data source pattern .*web/\*\.parquet matches no"),
    "not utf-8 in a page": (_bad_utf8_page, r"d\.parquet row group 1, rows 0 to 19: a string is not UTF-8 \(.*\), "
                                            r"the file is corrupt"),
    "a line nested too deeply": (lambda p: [(p / "d.jsonl", (p / "d.jsonl").write_bytes(
        jsonl_bytes(rows(5)) + b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n"))[0]],
        r"1 bad JSONL line\(s\), the first is .*d\.jsonl line 6: nested too deeply"),
    "saved dataset missing a file": (_dataset_missing_a_file, r"saved is a saved dataset without "
                                                              r"data-00001-of-00002\.arrow of the data files it lists"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_containers_give_one_line_naming_file_and_place_and_no_cache(tmp_path, case):
    """Prevents a traceback from pyarrow, gzip or zstandard, a truncated stream read as a shorter corpus
    (zstd's own reader ends quietly), and an error that does not say which row group or line."""
    make, pattern = BAD_INPUTS[case]
    cfg = config(tmp_path, make(tmp_path))
    with pytest.raises(DataError, match=pattern) as err:
        prepare(cfg)
    assert "\n" not in str(err.value)
    assert not os.path.isdir(cfg.cache_dir) or os.listdir(cfg.cache_dir) == []


def test_the_command_line_refuses_a_truncated_stream_with_exit_2(tmp_path, capsys):
    """Prevents the error contract from breaking on a container error: exit 2 and one `error:` line."""
    with pytest.raises(SystemExit) as exit_:
        pd.main(["--sources", str(_truncated_gz(tmp_path)[0]), "--cache_dir", str(tmp_path / "c"), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "d.jsonl.gz: the gzip stream is cut short or corrupt after line" in err


def test_skip_bad_lines_skips_and_counts_bad_rows_but_not_broken_containers(tmp_path):
    """Prevents skip_bad_lines from failing on a bad row, skipping rows silently, or hiding a cut-short file.
    """
    docs = rows(20)
    bad = [{"title": "no text"}, {"messages": [{"role": "bot", "content": "x"}]},
           {"conversations": [{"from": "alien", "value": "x"}]}]
    path = _parquet(tmp_path, docs[:5] + bad + docs[5:], group=4)[0]
    logs = []
    data = prepare(config(tmp_path, [path], skip_bad_lines=True), logs=logs)
    assert data.meta["bad_lines_skipped"] == 3
    assert data.meta["train_documents"] + data.meta["val_documents"] == len(docs)
    assert any("skipped 3 bad table row(s), the first is " in m and "d.parquet row group 1 "
                                                                    "row 1: no text field" in m
               for m in logs)
    with pytest.raises(DataError, match="gzip stream is cut short"):
        prepare(config(tmp_path, _truncated_gz(tmp_path), skip_bad_lines=True))


def test_a_jsonl_line_past_the_bound_is_refused_by_number_in_bounded_memory(tmp_path, monkeypatch):
    """A 2 GB one-line JSONL of zero bytes peaked at 5.1 GiB before its error: the line was read whole, then
    decoded. A line longer than readers.MAX_LINE_BYTES (made small here) is read through in pieces and never
    held: the Python memory at the peak stays far under the line (before: about twice it), and the file is
    refused in one line naming its line number, or that line is skipped and counted under --skip_bad_lines."""
    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 64 * 1024)
    monkeypatch.setattr(readers, "SKIP_BYTES", 16 * 1024)
    docs = rows(6)
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(jsonl_bytes(docs[:3]) + b"\0" * 20_000_000 + b"\n" + jsonl_bytes(docs[3:]))
    stats = corpus.ReadStats()
    tracemalloc.start()
    try:
        read = list(corpus.documents([(str(path), False)], config(tmp_path, [path], skip_bad_lines=True), stats))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2e6, f"peak {peak / 1e6:.1f} MB for a line of 20 MB"
    assert len(read) == len(docs) and stats.bad_lines == 1
    with pytest.raises(DataError, match=r"1 bad JSONL line\(s\), the first is .*d\.jsonl line 4: longer than 65,536 "
                                        r"bytes .*--skip_bad_lines") as err:
        prepare(config(tmp_path, [path]))
    assert "\n" not in str(err.value)


def test_bytes_count_the_text_and_corpus_bytes_estimates_them(tmp_path):
    """Prevents max_source_mb and the automatic sizing from counting compressed bytes for some files and text
    bytes for others: reading counts text after decompression, corpus_bytes estimates the same from headers.
    """
    rng = random.Random(2)
    text = "\n".join(words(rng, 12) for _ in range(4000)).encode()
    files = {"a.txt.gz": gzip.compress(text), "b.txt.zst": zstandard.ZstdCompressor().compress(text), "c.txt": text}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        cfg = config(tmp_path, [tmp_path / name])
        stats = read_all(cfg)
        assert stats.bytes == len(text) == corpus.corpus_bytes(cfg), name
        assert corpus.corpus_bytes(config(tmp_path, [tmp_path / name], max_source_mb=0.01)) == 10_000
    streamed = zstandard.ZstdCompressor().compressobj()
    (tmp_path / "d.txt.zst").write_bytes(streamed.compress(text) + streamed.flush())  # no size in its header
    assert corpus.corpus_bytes(config(tmp_path, [tmp_path / "d.txt.zst"])) > len(files["b.txt.zst"])
    parquet = write_table(tmp_path / "e.parquet", [{"text": line, "id": i} for i, line in
                                                   enumerate(text.decode().splitlines(keepends=True))], group=500)
    cfg = config(tmp_path, [parquet])
    read = read_all(cfg).bytes
    assert read == len(text) and 0.8 * read < corpus.corpus_bytes(cfg) < 1.5 * read
    cfg = config(tmp_path, [tmp_path / "a.txt.gz"], max_source_mb=0.05)
    stats = corpus.ReadStats()
    for _ in corpus.documents(corpus.source_files(cfg), cfg, stats):
        pass
    assert 50_000 <= stats.bytes < 50_000 + corpus.PIECE_BYTES + corpus.LINE_BYTES
    assert np.isclose(corpus.corpus_bytes(cfg), 50_000)


def test_a_pipe_matched_by_a_glob_is_refused_by_name(tmp_path):
    """Prevents a glob from handing the reader a FIFO, which blocks it for ever, and the refusal from hiding
    which match it was."""
    (tmp_path / "web").mkdir()
    write_table(tmp_path / "web" / "a.parquet", rows(4))
    os.mkfifo(tmp_path / "web" / "b.parquet")
    with pytest.raises(DataError, match=r"web/\*\.parquet \(its match .*b\.parquet\) is not a regular file"):
        corpus.source_files(config(tmp_path, [tmp_path / "web" / "*.parquet"]))


def fake_stdlib(root) -> str:
    """A standard library as an install lays it out, its test suites included (some installs leave them out).
    """
    files = {"os.py": "import sys\n", "json/__init__.py": "def dumps(obj):\n    return str(obj)\n",
             "json/tests/test_dump.py": "assert True\n", "test/test_os.py": "import os\n",
             "idlelib/editor.py": "class Editor:\n    pass\n", "idlelib/idle_test/test_editor.py": "x = 1\n",
             "tkinter/test/test_widgets.py": "y = 2\n", "lib2to3/tests/data/bom.py": "z = 3\n",
             "site-packages/numpy/core.py": "w = 4\n", "__pycache__/os.cpython-311.py": "v = 5\n",
             "LICENSE.txt": "text\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text * 40)
    return str(root)


def test_the_bundled_corpus_leaves_out_the_standard_librarys_tests(tmp_path, monkeypatch):
    """The bundled corpus once read Lib/test where an install ships it (31.5 MB of 1,790 files on one machine,
    10.7 MB of 569 on another): the same command trained on different text. It is the library's own sources
    alone."""
    import sysconfig
    root = fake_stdlib(tmp_path / "lib" / "python3.11")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {"stdlib": root})
    found = [os.path.relpath(p, root) for p, _ in corpus.source_files(DataConfig())]
    assert found == ["idlelib/editor.py", "json/__init__.py", "os.py"]
    assert corpus.is_bundled(DataConfig())


def test_sources_stdlib_names_the_bundled_corpus_unless_a_path_of_that_name_exists(tmp_path, monkeypatch):
    """--sources stdlib asks for the bundled corpus on any device (a GPU's default is another), alone or in a
    mixture, and prepares the same tokens as no --sources; a folder named stdlib in the working directory is
    read instead, as every path given is."""
    import sysconfig
    root = fake_stdlib(tmp_path / "lib" / "python3.11")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {"stdlib": root})
    monkeypatch.chdir(tmp_path)
    assert corpus.source_files(DataConfig(sources=["stdlib"])) == corpus.source_files(DataConfig())
    assert corpus.is_bundled(DataConfig(sources=["stdlib"]))
    named = prepare(DataConfig(sources=["stdlib"], cache_dir=str(tmp_path / "a")))
    default = prepare(DataConfig(cache_dir=str(tmp_path / "b")))
    assert named.meta["train_tokens"] == default.meta["train_tokens"] > 0 and named.meta["files"] == 3
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("a note\n")
    mixed = corpus.sources(DataConfig(sources=["stdlib:0.9", "notes:0.1"]))
    assert [len(s.files) for s in mixed] == [3, 1] and not corpus.is_bundled(DataConfig(sources=["stdlib", "notes"]))
    (tmp_path / "stdlib").mkdir()
    (tmp_path / "stdlib" / "mine.txt").write_text("my own text\n")
    assert corpus.source_files(DataConfig(sources=["stdlib"])) == [(str(tmp_path / "stdlib" / "mine.txt"), True)]
    assert not corpus.is_bundled(DataConfig(sources=["stdlib"]))


def test_the_start_report_names_the_bundled_corpus_and_its_size(tmp_path, monkeypatch):
    import sysconfig

    from config import Config
    from llm.train.startup import bundled_report
    root = fake_stdlib(tmp_path / "lib" / "python3.11")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {"stdlib": root})
    size = corpus.corpus_bytes(DataConfig())
    assert size == sum(os.path.getsize(p) for p, _ in corpus.source_files(DataConfig()))
    (line,) = bundled_report(Config(), size)
    assert "standard library without its tests: 3 files" in line and f"{size / 1e6:.1f} MB" in line
    assert bundled_report(Config(data=DataConfig(sources=[root])), size) == []  # a path given: no such line


def test_empty_files_are_counted_apart_so_the_counts_agree(tmp_path):
    """The start report said 734 files, the data line 731: three empty files were read as nothing and counted
    nowhere. They are now said apart."""
    from config import DataConfig
    from llm.data.corpus import ReadStats, documents, files_read, source_files
    (tmp_path / "a.py").write_text("print('a')\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.py").write_text("x = 1\n")
    cfg = DataConfig(sources=[str(tmp_path)])
    stats = ReadStats()
    list(documents(source_files(cfg), cfg, stats))
    assert len(source_files(cfg)) == 3 and files_read(stats) == "2 files and 1 empty, left out"
