"""The token cache's preparation (prepare_data.py): its speed against the tokenizers library's own encode_batch,
its peak memory as the corpus grows, and the time of a re-preparation after one file is added.

    python tools/bench_prepare.py speed --mb 40 --repeats 3      # MB/s end to end, parquet and .jsonl.zst, vs the peer
    python tools/bench_prepare.py memory --gb 2 --dir /data/bench     # peak resident memory, 2 GB against 0.2 GB
    python tools/bench_prepare.py grow --gb 1 --add_mb 10 --dir /data/bench --cache_dir /data/bench/cache

The corpus is generated (made-up words, Zipf-ranked, with capitals, punctuation, numbers, paragraphs and long-tailed
document lengths; the same for a seed) and tokenized by one BPE tokenizer of 8192 tokens trained first. speed: the
peer encodes the same texts from memory in 4 MiB batches; variants alternate, ours into a fresh cache each time.
memory, grow: each preparation runs in a process of its own, its peak the tree's resident size sampled every 0.2 s
and its ru_maxrss. --dir keeps the corpora (.jsonl.zst folders, a marker beside each) and tokenizer for next time.
"""

import argparse
import contextlib
import functools
import importlib
import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import numpy as np

from llm.base.errors import ConfigError, RunFailure, error_contract

VOCAB, SEQ_LEN = 8192, 256
# text per peer encode_batch call: parallel across cores, as prepare_data's batches are
BATCH_BYTES = 4 * 2**20
FILE_BYTES = 64 * 2**20  # text per .jsonl.zst file of a generated corpus folder
TOKENIZER_SAMPLE = 8 * 2**20  # text the benchmark's tokenizer is trained on
DOCS_PER_CHUNK = 256  # documents drawn per numpy call: about 0.4 MB of text
SEPARATORS = [" ", ", ", ". ", "? ", "! ", ".\n\n", ": ", "; "]
SEPARATOR_P = np.array([0.83, 0.07, 0.065, 0.004, 0.003, 0.012, 0.003, 0.003])
SENTENCE_ENDS = [2, 3, 4, 5]  # separators a capital follows
ONSETS = ["", *"b c d f g h k l m n p r s t v w th st br ch sh gr pl".split()]
VOWELS, CODAS = "a e i o u ou ea ai y".split(), ["", "", "", *"n s t r nd ng ck st l".split()]


@functools.lru_cache(maxsize=1)
def vocabulary(n: int = 4000):
    """The word table (n words, them capitalized, the numbers 0-9999) and the words' cumulative Zipf weights.
    """
    rng, words = np.random.default_rng(12345), {}
    while len(words) < n:
        syllables = rng.choice(4, p=[0.3, 0.4, 0.2, 0.1]) + 1
        words.setdefault("".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables))
                         + rng.choice(CODAS), None)
    ranked = sorted(words, key=len)  # short words are the common ones, as in English
    table = np.array(ranked + [w.capitalize() for w in ranked] + [str(i) for i in range(10000)], dtype=object)
    weights = 1 / (np.arange(n) + 2.7)  # Zipf-Mandelbrot
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0  # searchsorted never runs past the words
    return table, cdf, n


def _chunk(rng) -> list[str]:
    """DOCS_PER_CHUNK documents, drawn with a few numpy calls over all their words, then joined."""
    table, cdf, n = vocabulary()
    # words: long tail
    lengths = np.minimum(rng.lognormal(5.3, 1.1, DOCS_PER_CHUNK).astype(np.int64) + 8, 60000)
    total, ends = int(lengths.sum()), np.cumsum(lengths) - 1
    ids = np.searchsorted(cdf, rng.random(total))
    seps = rng.choice(len(SEPARATORS), total, p=SEPARATOR_P / SEPARATOR_P.sum())
    seps[ends] = SENTENCE_ENDS[0]  # a document ends with a full stop, and the next one starts with a capital
    capital = np.concatenate([[True], np.isin(seps[:-1], SENTENCE_ENDS)])
    ids += n * capital
    numbers = rng.random(total) < 0.02
    ids[numbers] = 2 * n + np.minimum(rng.lognormal(2.5, 1.8, int(numbers.sum())), 9999).astype(np.int64)
    pieces = np.empty(2 * total, dtype=object)
    pieces[0::2], pieces[1::2] = table[ids], np.array(SEPARATORS, dtype=object)[seps]
    pieces[2 * ends + 1] = "."  # no space after the last stop
    bounds = np.concatenate([[0], 2 * (ends + 1)])
    return ["".join(pieces[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]


def texts(total_bytes: int, seed: int = 0):
    """Documents of exactly total_bytes of text (the last one cut short), the same for the same seed."""
    rng, left = np.random.default_rng(seed), total_bytes
    while left > 0:
        for doc in _chunk(rng):
            doc = doc[:left]  # ASCII: a character is a byte
            yield doc
            left -= len(doc)
            if left <= 0:
                return


def _take(docs, n_bytes: int):
    """Documents from a shared iterator until n_bytes of text have passed; the next one stays in it."""
    got = 0
    for doc in docs:
        yield doc
        got += len(doc.encode("utf-8"))
        if got >= n_bytes:
            return


def _groups(docs, n_bytes: int):
    """Lists of documents of about n_bytes of text each."""
    docs = iter(docs)
    while group := list(_take(docs, n_bytes)):
        yield group


def write_parquet(path: str, docs, group_bytes: int = BATCH_BYTES) -> int:
    """A parquet file of one "text" column, a row group per group_bytes of text; returns the bytes of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema, total = pa.schema([("text", pa.string())]), 0
    with pq.ParquetWriter(path, schema) as writer:
        for group in _groups(docs, group_bytes):
            writer.write_table(pa.table({"text": group}, schema=schema))
            total += sum(len(t.encode("utf-8")) for t in group)
    return total


def write_jsonl_zst(path: str, docs) -> int:
    """A zstd-compressed file of {"text": ...} lines, written as the documents come; returns the bytes of
    text."""
    import zstandard
    total = 0
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as z:
        for group in _groups(docs, 2**20):
            z.write("".join(json.dumps({"text": t}) + "\n" for t in group).encode("utf-8"))
            total += sum(len(t.encode("utf-8")) for t in group)
    return total


def corpus_folder(folder: str, total_bytes: int, seed: int = 0, file_bytes: int = FILE_BYTES) -> str:
    """A folder of .jsonl.zst files of total_bytes of text, streamed to disk, generated once: the marker
    beside it (in it, it would be read as a source) records a complete folder, and the same settings later
    reuse it."""
    marker, want = folder.rstrip(os.sep) + ".done", {"bytes": total_bytes, "seed": seed,
                                                     "file_bytes": file_bytes}
    if os.path.isfile(marker) and pathlib.Path(marker).read_text(encoding="utf-8") == json.dumps(want):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    docs = texts(total_bytes, seed)
    for i in range(total_bytes // file_bytes + 2):
        path = os.path.join(folder, f"part-{i:05d}.jsonl.zst")
        if not write_jsonl_zst(path, _take(docs, file_bytes)):
            os.remove(path)  # the documents ran out with the file before
            break
    pathlib.Path(marker).write_text(json.dumps(want), encoding="utf-8")
    return folder


def bench_tokenizer(path: str, docs) -> str:
    """The benchmark's BPE tokenizer of VOCAB tokens at path, trained on docs unless it is already there."""
    if not os.path.isfile(path):
        from llm.tokens.tokenizer import train_tokenizer
        train_tokenizer(_take(iter(docs), TOKENIZER_SAMPLE), "bpe", VOCAB).save(path)
    return path


def describe_machine(when: str):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine {when}: {os.cpu_count()} CPUs ({cores} usable), "
          f"load average {load} (1, 5, 15 min)", flush=True)


def prepare_seconds(sources: list[str], cache_dir: str, tokenizer: str, log=lambda *a: None) -> float:
    """Wall time of prepare() in this process."""
    from config import DataConfig
    from llm.data.preparation import prepare
    start = time.perf_counter()
    prepare(DataConfig(sources=sources, cache_dir=cache_dir, tokenizer=tokenizer), vocab_size=VOCAB,
            seq_len=SEQ_LEN, log=log)
    return time.perf_counter() - start


def peer_seconds(tokenizer: str, batches: list[list[str]]) -> float:
    """Wall time of the tokenizers library's encode_batch over texts already in memory."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    start = time.perf_counter()
    for batch in batches:
        tok.encode_batch(batch, add_special_tokens=False)
    return time.perf_counter() - start


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def speed(args):
    describe_machine("before")
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        docs = list(texts(int(args.mb * 1e6)))
        files = {"parquet": os.path.join(tmp, "corpus.parquet"),
                 "jsonl.zst": os.path.join(tmp, "corpus.jsonl.zst")}
        mb = write_parquet(files["parquet"], docs) / 1e6
        write_jsonl_zst(files["jsonl.zst"], docs)
        tok, batches = (bench_tokenizer(os.path.join(tmp, "tokenizer.json"), docs),
                        list(_groups(docs, BATCH_BYTES)))
        print(f"corpus: {len(docs):,} documents, {mb:.1f} MB of "
              f"text; a tokenizer of {VOCAB} tokens", flush=True)
        rates = {"peer": [], **{kind: [] for kind in files}}
        for r in range(args.repeats):
            for name in (list(rates) if r % 2 == 0 else reversed(rates)):  # ABC CBA: drift hits every variant
                if name == "peer":
                    seconds = peer_seconds(tok, batches)
                else:
                    cache = tempfile.mkdtemp(dir=tmp)  # a fresh cache: every repeat really tokenizes
                    seconds = prepare_seconds([files[name]], cache, tok)
                    shutil.rmtree(cache)
                rates[name].append(mb / seconds)
                print(f"repeat {r}: {name} {mb / seconds:.2f} MB/s", flush=True)
    print("| kind | ours MB/s (median, range) | peer encode_batch MB/s (median, range) "
          "| ours / peer (median, range) |")
    print("| --- | --- | --- | --- |")
    for kind in files:
        ratios = [ours / peer for ours, peer in zip(rates[kind], rates["peer"])]  # of the same repeat
        print(f"| {kind} | {spread(rates[kind])} | {spread(rates['peer'])} | {spread(ratios)} |")
    describe_machine("after")


def _maxrss_mb(who) -> float:
    # bytes on macOS
    return resource.getrusage(who).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def child(sources: list[str], cache_dir: str, tokenizer: str):
    """In a process of its own: prepare, then print a JSON line of the time and the resident peaks."""
    importlib.import_module("llm.data.preparation")  # the baseline holds the imports
    imports, lines = _maxrss_mb(resource.RUSAGE_SELF), []
    seconds = prepare_seconds(sources, cache_dir, tokenizer, log=lines.append)
    print(json.dumps({"seconds": seconds, "imports_mb": imports,
                      "reused": any("reusing" in str(x) for x in lines),
                      "maxrss_mb": max(_maxrss_mb(resource.RUSAGE_SELF),
                                       _maxrss_mb(resource.RUSAGE_CHILDREN))}))


def measured(sources: list[str], cache_dir: str, tokenizer: str) -> dict:
    """child() in a fresh process, its tree's resident size (worker processes included) sampled every 0.2 s.
    """
    import psutil
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import "
            f"bench_prepare; bench_prepare.child({sources!r}, {cache_dir!r}, {tokenizer!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak, tree = 0, psutil.Process(proc.pid)
    while proc.poll() is None:  # the pipes hold the child's few lines: it never blocks on them
        with contextlib.suppress(psutil.Error):  # a process ended while it was read
            peak = max(peak, sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)]))
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode:
        raise RunFailure(f"preparing {' '.join(sources)} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "tree_mb": peak / 2**20}


def shared_inputs(args, gb: float) -> tuple[str, str]:
    """The tokenizer and the corpus folder of gb GB under --dir, made when absent."""
    os.makedirs(args.dir, exist_ok=True)
    tok = bench_tokenizer(os.path.join(args.dir, f"tokenizer-{VOCAB}.json"), texts(TOKENIZER_SAMPLE, seed=7))
    return tok, corpus_folder(os.path.join(args.dir, f"corpus-{gb:g}GB"), int(gb * 1e9))


def memory(args):
    describe_machine("before")
    rows = []
    for gb in (args.gb / args.small_ratio, args.gb):
        tok, folder = shared_inputs(args, gb)
        # fresh: the preparation tokenizes everything
        with tempfile.TemporaryDirectory(dir=args.dir) as cache:
            rows.append((gb, measured([folder], cache, tok)))
        print(f"{gb:g} GB: {rows[-1][1]}", flush=True)
    print("| corpus GB | prepare s | MB/s | peak resident MB (tree, sampled) | "
          "ru_maxrss MB | after imports MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gb, r in rows:
        print(f"| {gb:g} | {r['seconds']:.1f} | {gb * 1e3 / r['seconds']:.1f} | {r['tree_mb']:.0f} | "
              f"{r['maxrss_mb']:.0f} | {r['imports_mb']:.0f} |")
    (_, small), (_, big) = rows
    above = (big["maxrss_mb"] - big["imports_mb"]) / max(1.0, small["maxrss_mb"] - small["imports_mb"])
    print(f"peaks, {args.small_ratio:g}x the text: {big['tree_mb'] / small['tree_mb']:.2f}x "
          f"(tree), {big['maxrss_mb'] / small['maxrss_mb']:.2f}x (ru_maxrss), {above:.2f}x "
          "(ru_maxrss above the imports)")
    describe_machine("after")


def grow(args):
    describe_machine("before")
    tok, folder = shared_inputs(args, args.gb)
    cache_dir = args.cache_dir or os.path.join(args.dir, "cache")
    full = measured([folder], cache_dir, tok)
    print(f"full corpus: {full}", flush=True)
    before, added = set(os.listdir(cache_dir)), os.path.join(folder, "added.jsonl.zst")
    try:
        mb = write_jsonl_zst(added, texts(int(args.add_mb * 1e6), seed=99)) / 1e6
        again = measured([folder], cache_dir, tok)
        with tempfile.TemporaryDirectory(dir=args.dir) as fresh:
            alone = measured([added], fresh, tok)
    finally:
        pathlib.Path(added).unlink(missing_ok=True)  # the folder is again the corpus its marker describes
        # the grown corpus's cache: the next call measures anew
        for name in set(os.listdir(cache_dir)) - before:
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
    print(f"| preparation | seconds |\n| --- | --- |\n| the corpus, {args.gb:g} GB "
          f"({'cache reused' if full['reused'] else 'built'}) | {full['seconds']:.2f} |\n"
          f"| the corpus with one file of {mb:.1f} MB added | {again['seconds']:.2f} |\n"
          f"| that file alone, fresh cache | {alone['seconds']:.2f} |")
    print(f"re-prepare / file alone: {again['seconds'] / alone['seconds']:.1f}x")
    describe_machine("after")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["speed", "memory", "grow"])
    p.add_argument("--mb", type=float, default=40, help="speed: MB of text generated")
    p.add_argument("--repeats", type=int, default=3, help="speed: rounds of the three variants")
    p.add_argument("--gb", type=float, default=0, help="memory: the larger corpus (2); grow: the corpus (1)")
    p.add_argument("--small_ratio", type=float, default=10, help="memory: the smaller corpus is --gb / this")
    p.add_argument("--add_mb", type=float, default=10, help="grow: MB of text of the file added")
    p.add_argument("--dir", default="",
                   help="folder of the generated corpora and tokenizer, kept for the next call; "
                        "default: a temporary folder, removed at the end")
    p.add_argument("--cache_dir", default="", help="grow: the corpus's token cache, "
                                                   "kept; default: cache in --dir")
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    args.gb = args.gb or (2 if args.what == "memory" else 1)
    if min(args.mb, args.repeats, args.gb, args.add_mb) <= 0 or args.small_ratio <= 1:
        raise ConfigError("--mb, --repeats, --gb and --add_mb must be > 0, --small_ratio > 1")
    if args.what == "speed":
        speed(args)
        return 0
    with contextlib.nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory() as args.dir:
        (memory if args.what == "memory" else grow)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
