"""tools/bench_prepare.py's corpus: the files it writes read back as the same documents, of the size asked,
the same for the same seed. The timings are not tested."""

import io
import json
import os

import bench_prepare

KB200 = 200_000


def test_texts_have_the_size_asked_and_follow_the_seed():
    docs = list(bench_prepare.texts(KB200, seed=3))
    assert abs(sum(len(d.encode("utf-8")) for d in docs) - KB200) <= KB200 // 10
    assert len(docs) > 10 and all(docs)
    assert docs == list(bench_prepare.texts(KB200, seed=3))
    assert docs != list(bench_prepare.texts(KB200, seed=4))
    assert any(c.isdigit() for c in "".join(docs)) and ". " in docs[0] and docs[0][0].isupper()


def test_parquet_reads_back_in_row_groups(tmp_path):
    import pyarrow.parquet as pq
    docs = list(bench_prepare.texts(KB200, seed=0))
    path = str(tmp_path / "c.parquet")
    written = bench_prepare.write_parquet(path, docs, group_bytes=50_000)
    assert abs(written - KB200) <= KB200 // 10
    assert pq.ParquetFile(path).num_row_groups >= 3
    assert pq.read_table(path).column("text").to_pylist() == docs


def read_jsonl_zst(path) -> list[str]:
    import zstandard
    with open(path, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    return [json.loads(line)["text"] for line in io.StringIO(data.decode("utf-8"))]


def test_jsonl_zst_reads_back(tmp_path):
    docs = list(bench_prepare.texts(KB200, seed=1))
    path = str(tmp_path / "c.jsonl.zst")
    assert abs(bench_prepare.write_jsonl_zst(path, docs) - KB200) <= KB200 // 10
    assert read_jsonl_zst(path) == docs


def test_corpus_folder_is_split_into_files_and_reused(tmp_path):
    folder = str(tmp_path / "corpus")
    bench_prepare.corpus_folder(folder, KB200, seed=2, file_bytes=60_000)
    files = sorted(os.listdir(folder))
    assert len(files) >= 3 and all(f.endswith(".jsonl.zst") for f in files)
    docs = [d for f in files for d in read_jsonl_zst(os.path.join(folder, f))]
    assert abs(sum(len(d.encode("utf-8")) for d in docs) - KB200) <= KB200 // 10
    assert docs == list(bench_prepare.texts(KB200, seed=2))  # the same stream, cut into files
    stamps = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in files}
    bench_prepare.corpus_folder(folder, KB200, seed=2, file_bytes=60_000)
    assert {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)} == stamps  # not rewritten
    bench_prepare.corpus_folder(folder, KB200 // 2, seed=2, file_bytes=60_000)  # other settings: generated anew
    assert sum(len(d) for f in os.listdir(folder) for d in read_jsonl_zst(os.path.join(folder, f))) == KB200 // 2
