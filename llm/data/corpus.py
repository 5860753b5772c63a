"""The corpus: the documents that text files, folders, JSONL and chat JSONL files, parquet and Arrow tables
hold (text and JSONL also gzip- or zstd-compressed; readers.py opens each container), read in a fixed order.

Sources are files, folders, glob patterns or Hub datasets (hf_datasets.py fetches their files). Folders are
walked recursively (hidden files, caches, installed packages and pipes skipped; binary files skipped and
counted; a `datasets` save_to_disk folder gives its Arrow files); long text files are cut at line ends into
documents of about 32 KiB (a line longer than 256 KiB at a character boundary); a JSONL line or a table row is
one document, its chat messages (in any shape chat_formats.py reads) or its text. Nothing here tokenizes:
preparation.py does, from documents()."""

import codecs
import functools
import glob
import json
import math
import os
import sysconfig
from dataclasses import dataclass

from config import DEFAULT_TEXT_FIELDS, DataConfig
from llm.base.errors import DataError
from llm.data import hf_datasets, readers
from llm.data.chat_formats import SHAPE_FIELDS, SHAPES, chat_messages
from llm.data.pairs import PAIR_FIELDS, PAIR_SHAPE, as_messages, is_pair, pair_document

PIECE_BYTES = 32 * 1024  # long text files are cut at a line end into documents of about this size
# a line longer than this (minified code, a one-line dump) is cut inside: bounded pieces
LINE_BYTES = 256 * 1024
BINARY_PROBE_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it binary (as git decides)
SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# The bundled corpus: the installed Python's standard library sources, asked for by no --sources (on a CPU) or
# by --sources stdlib (anywhere; a path named stdlib that exists is read instead). Without the test suites
# (Lib/test, idlelib/idle_test, tkinter/test, lib2to3/tests, ...), which some installs leave out and others
# ship, it is about the same text on every install of Python 3.10-3.13.
BUNDLED = "stdlib"
TEST_DIRS = {"test", "tests", "idle_test"}
# The GPU default, asked for by no --sources on CUDA: FineWeb-Edu's 10B-token sample (educational web text,
# what the anchors' speedruns train on), fetched only as far as the run's token target; the bundled corpus
# when neither the Hub nor the cache has it.
GPU_CORPUS = "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"


@dataclass
class ReadStats:
    """What one pass over the sources saw."""
    files: int = 0
    empty: int = 0  # files of no bytes: nothing to read
    documents: int = 0
    bytes: int = 0
    chats: int = 0
    binary_skipped: int = 0
    first_binary: str = ""
    bad_lines: int = 0  # JSONL lines and table rows (an empty parquet row group counts as one)
    bad_rows: int = 0  # of which table rows
    first_bad: str = ""
    invalid_utf8: int = 0
    first_invalid: str = ""


def files_read(stats: ReadStats) -> str:
    """The files a pass read, the empty ones said apart (a count that differs from the sources' says why)."""
    return f"{stats.files} files" + (f" and {stats.empty} empty, left out" if stats.empty else "")


def _walk(root: str, suffix=None, skipped=SKIPPED_DIRS) -> list[str]:
    """Files under root, sorted, without hidden files and the folders skipped (caches and installed packages);
    of a `datasets` save_to_disk folder its Arrow files only (its JSON files describe them, they are no text
    to learn)."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skipped]
        if suffix is None and (arrow := readers.dataset_files(folder, names)) is not None:
            dirs[:] = []
            found += arrow
            continue
        found += [os.path.join(folder, n) for n in names  # isfile: a pipe in a folder would block the reader
                  if not n.startswith(".") and (suffix is None or n.endswith(suffix))
                  and n != readers.DATASET_DICT and os.path.isfile(os.path.join(folder, n))]
    return sorted(found)


@dataclass
class Source:
    """One entry of --sources: what was given, its mixture weight (None: by size) and the files it stands for.
    """
    given: str
    weight: float | None
    files: list  # (path, came from a folder)


def split_weight(source: str) -> tuple[str, float | None]:
    """`web/*.parquet:0.7` -> ("web/*.parquet", 0.7); a path that exists as written keeps its colon, and so
    does hf://datasets/... (what follows its colon is no number)."""
    path, colon, tail = source.rpartition(":")
    if not colon or os.path.exists(source):
        return source, None
    try:
        weight = float(tail)
    except ValueError:
        return source, None  # a colon inside a path, not a weight
    if not (weight > 0 and math.isfinite(weight)):
        raise DataError(f"data source {source} has weight {tail}, pass a number > 0 after the colon")
    return path, weight


def bundled_files() -> list[tuple[str, bool]]:
    """The bundled corpus's files: the standard library's .py files without its test suites (BUNDLED)."""
    return [(p, True) for p in _walk(sysconfig.get_paths()["stdlib"], ".py", SKIPPED_DIRS | TEST_DIRS)]


def is_bundled(cfg: DataConfig) -> bool:
    """Whether the sources are the bundled corpus alone: none given, or BUNDLED where no such path exists."""
    return not cfg.sources or all(split_weight(g)[0] == BUNDLED and not os.path.exists(BUNDLED)
                                  for g in cfg.sources)


def in_arrival_order(cfg: DataConfig) -> bool:
    """Whether the corpus is read in the order its files arrive: one Hub dataset without a weight. Its
    tokenizer learns from its first file, its validation split is its first parts' and its first epoch reads
    the parts in fetch order (batches.py), so a run can train while the rest downloads (arrival.py) and read
    the same batches as a run that waited."""
    return (len(cfg.sources) == 1 and hf_datasets.is_hub_dataset(cfg.sources[0])
            and split_weight(cfg.sources[0])[1] is None)


def sources(cfg: DataConfig, lazy: bool = False) -> list[Source]:
    """Every source with its files in a fixed order; weights given to every source or to none. lazy: a Hub
    dataset's files are an iterator that downloads each as it is reached."""
    if not cfg.sources:
        return [Source("", None, bundled_files())]
    found, weights = [], [split_weight(given)[1] for given in cfg.sources]
    for given in cfg.sources:
        source, weight = split_weight(given)
        path = os.path.abspath(source)
        files = []
        if hf_datasets.is_hub_dataset(source):
            target, measure = _hub_bytes(cfg, weight, weights), functools.partial(file_bytes, cfg=cfg)
            if lazy:  # fetched as the reader reaches them, a line per file rather than a bar beside the run's
                files = ((p, False) for p in hf_datasets.arriving(source, target, measure, bars=False))
            else:
                files = [(p, False) for p in hf_datasets.fetch(source, target, measure)]
        elif source == BUNDLED and not os.path.exists(path):
            files = bundled_files()
        elif not os.path.exists(path) and any(c in source for c in "*?["):  # a glob pattern
            matches = sorted(glob.glob(path, recursive=True))  # like the shell: hidden files only when named
            if not matches:
                raise DataError(f"data source pattern {source} matches no file, check "
                                "the pattern given to --sources")
            for match in matches:
                files += _files(match, f"{source} (its match {match})")
        else:
            files += _files(path, source)
        found.append(Source(given, weight, files))
    weighted = [s.given for s in found if s.weight is not None]
    if weighted and len(weighted) < len(found):
        unweighted = next(s.given for s in found if s.weight is None)
        raise DataError(f"data source {unweighted} has no weight while {weighted[0]} has one; give every "
                        "source a weight (path:0.3) or none")
    return found


def _hub_bytes(cfg: DataConfig, weight: float | None, weights: list) -> float:
    """The text a Hub dataset brings: its share of --max_tokens (with weights, by its weight), or all of it.
    """
    share = weight / sum(weights) if weight is not None and None not in weights else 1.0
    return hf_datasets.target_bytes(round(cfg.max_tokens * share), cfg.max_source_mb)


def source_files(cfg: DataConfig) -> list[tuple[str, bool]]:
    """Every file to read, in a fixed order, each with whether it came from a folder."""
    return [f for source in sources(cfg) for f in source.files]


def _files(path: str, source: str) -> list[tuple[str, bool]]:
    """The files one path stands for: a folder's files (in_folder True), or the file itself."""
    if os.path.isdir(path):
        return [(p, True) for p in _walk(path)]
    if os.path.isfile(path):
        return [(path, False)]
    if os.path.exists(path):
        raise DataError(f"data source {source} is not a regular file or folder (a pipe, socket or device), "
                        "pass files or folders: they are read twice")
    raise DataError(f"data source {source} does not exist, check the path given to --sources")


def corpus_bytes(cfg: DataConfig) -> int:
    """About how many bytes of text the sources hold (within max_source_mb), from the file sizes and the sizes
    compressed files and tables record (readers.text_bytes): no reading of the data. documents() counts the
    same bytes: text after decompression, a table row's strings."""
    total = sum(file_bytes(path, cfg) for path, _ in source_files(cfg))
    return min(total, int(cfg.max_source_mb * 1e6)) if cfg.max_source_mb else total


def file_bytes(path: str, cfg: DataConfig) -> int:
    """About how many bytes of text one file holds (readers.text_bytes), without reading its data."""
    st = os.stat(path)
    return _text_bytes(path, st.st_size, st.st_mtime_ns, _text_fields(cfg) + SHAPE_FIELDS + PAIR_FIELDS)


@functools.lru_cache(maxsize=2**16)
def _text_bytes(path: str, size: int, mtime_ns: int, columns: tuple) -> int:
    # Asked several times a run (sizing, the bar, the tokenizer's sample): a table's footer is read once.
    return readers.text_bytes(path, columns)


def _decode(data: bytes, path: str, stats: ReadStats) -> str:
    """UTF-8 text; invalid bytes become U+FFFD and are counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # A U+FFFD that was already in the file is valid UTF-8; only the new ones are replacements.
        stats.invalid_utf8 += text.count("\ufffd") - data.count("\ufffd".encode())
        stats.first_invalid = stats.first_invalid or path
        return text


def _blocks(f):
    """Blocks of about PIECE_BYTES that end at a line end, or inside a line of over LINE_BYTES at a character
    end."""
    rest = b""
    while block := rest + f.read(PIECE_BYTES):
        tail = f.readline(LINE_BYTES)  # finish the line, so no piece ends inside a word or a character
        block += tail
        cut = _whole_chars(block) if len(tail) == LINE_BYTES and not tail.endswith(b"\n") else len(block)
        block, rest = block[:cut], block[cut:]
        yield block


def _whole_chars(data: bytes) -> int:
    """The length of data without the UTF-8 character its end cuts in two (data is left whole if not UTF-8).
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # ASCII, or the first byte of a character of 2, 3 or 4 bytes
            size = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= size else len(data) - back
    return len(data)


def _text_pieces(path: str, in_folder: bool, stats: ReadStats):
    """Yield (piece, text, bytes read) of a text file, cut at line ends; binary files are skipped or refused.
    """
    with readers.open_stream(path) as f:
        piece = -1
        for piece, block in enumerate(_blocks(f)):
            if piece == 0 and b"\0" in block[:BINARY_PROBE_BYTES]:
                if not in_folder:
                    raise DataError(f"{path} looks binary (it holds NUL bytes), pass text files, .jsonl "
                                    "files or folders (where binary files are skipped)")
                stats.binary_skipped += 1
                stats.first_binary = stats.first_binary or path
                return
            if piece == 0:
                stats.files += 1
                block = block.removeprefix(codecs.BOM_UTF8)  # a byte-order mark is not text
            yield piece, _decode(block, path, stats), len(block)
        stats.empty += piece < 0


def _parse_line(line: str, text_fields, system_prompt: str):
    """A JSONL line's document: its list of chat messages (any shape chat_formats.py reads), or its text;
    DataError says why neither."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise DataError("nested too deeply to read as JSON") from None
    if "\\u" in line and has_lone_surrogate(obj):  # only an escape can make one: a cheap test first
        raise DataError("a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which no "
                        "tokenizer encodes; remove it, or fix what wrote the file")
    return _document(obj if isinstance(obj, dict) else {}, text_fields, system_prompt)


def has_lone_surrogate(value) -> bool:
    """Whether any string in a JSON value holds a lone surrogate (json.loads keeps "\\ud800" as one)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(has_lone_surrogate(v) for v in value)


def _document(obj: dict, text_fields, system_prompt: str):
    """An object's (a JSONL line's, a table row's) preference pair, chat messages, or text; DataError says why
    none."""
    pair = pair_document(obj, system_prompt)
    if pair is not None:
        return pair
    messages = chat_messages(obj, system_prompt)
    if messages is not None:
        return messages
    for name in text_fields:
        if isinstance(obj.get(name), str):
            return obj[name]
    if wrong := next((name for name in text_fields if name in obj), None):
        raise DataError(f"{wrong} holds {type(obj[wrong]).__name__}, not text; pass --text_field NAME for "
                        "the field that holds it")
    raise DataError(f"no text field (looked for {', '.join(text_fields)}) and no chat shape (accepted: "
                    f"{SHAPES}) or preference pair ({PAIR_SHAPE})")


def _one_kind(doc, first: bool | None) -> bool:
    """Whether the file's documents are preference pairs, as its first one says; DataError for a document of
    the other kind (pairs train by preference, anything else by next-token loss: one source holds one kind).
    """
    pair = is_pair(doc)
    if first is not None and pair != first:
        row = "preference row (chosen, rejected)" if pair else "row without chosen and rejected"
        others = "plain rows" if pair else "preference rows"
        raise DataError(f"a {row} among {others}: a source holds pairs or none")
    return pair


def _text_fields(cfg: DataConfig) -> tuple:
    return (cfg.text_field,) if cfg.text_field else DEFAULT_TEXT_FIELDS


def _bad(stats: ReadStats, where: str, row: bool = False):
    """Count a bad line or row, keeping the first's place and reason."""
    stats.bad_lines += 1
    stats.bad_rows += row
    stats.first_bad = stats.first_bad or where


def _jsonl_documents(path: str, cfg: DataConfig, stats: ReadStats):
    """Yield (0, document, bytes read) per non-empty line; bad lines are counted and left out."""
    text_fields, kind = _text_fields(cfg), None
    stats.files += 1
    with readers.open_stream(path) as f:
        for number, raw in enumerate(readers.lines(f), 1):
            if raw is None:
                _bad(stats, f"{path} line {number}: longer than {readers.MAX_LINE_BYTES:,} bytes "
                            "(one document a line), split it")
                continue
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark is not JSON
            if not raw.strip():
                continue
            try:
                doc = _parse_line(_decode(raw, path, stats), text_fields, cfg.system_prompt)
                kind = _one_kind(doc, kind)
            except DataError as e:
                _bad(stats, f"{path} line {number}: {e}")
                continue
            stats.chats += not isinstance(doc, str)
            if doc:
                yield 0, doc, len(raw)


def _table_documents(path: str, cfg: DataConfig, stats: ReadStats):
    """Yield (0, document, its text's bytes) per row of a parquet or Arrow file, row group by row group; bad
    rows and empty row groups are counted and left out."""
    text_fields, kind = _text_fields(cfg), None
    stats.files += 1
    for label, first, rows in readers.table_chunks(path, text_fields + SHAPE_FIELDS + PAIR_FIELDS):
        if not rows:
            _bad(stats, f"{path} {label}: it holds no rows", row=True)
        for number, row in enumerate(rows, first):
            try:
                doc = _document(row, text_fields, cfg.system_prompt)
                kind = _one_kind(doc, kind)
            except DataError as e:
                _bad(stats, f"{path} {label} row {number}: {e}", row=True)
                continue
            stats.chats += not isinstance(doc, str)
            if doc:
                size = doc if isinstance(doc, str) else "".join(m["content"] for m in as_messages(doc))
                yield 0, doc, len(size.encode("utf-8"))


def documents(files, cfg: DataConfig, stats: ReadStats, budget: float | None = None):
    """Yield (doc_id, piece, text or messages) in a fixed order, stopping after `budget` bytes of text
    (default: max_source_mb). A file with bad lines or rows (unless skip_bad_lines) is read to its end to
    count them, its documents after the first bad one not yielded, and then refused."""
    budget = (cfg.max_source_mb * 1e6 or math.inf) if budget is None else budget
    doc_id = -1
    for path, in_folder in files:
        kind = readers.kind(path)
        reader = _table_documents(path, cfg, stats) if kind == "table" else \
            _jsonl_documents(path, cfg, stats) if kind == "jsonl" else _text_pieces(path, in_folder, stats)
        for piece, doc, size in reader:
            if stats.bad_lines and not cfg.skip_bad_lines:
                continue  # the file will be refused: only counted from here on
            if piece == 0:
                doc_id += 1
            stats.documents += 1
            stats.bytes += size
            yield doc_id, piece, doc
            if stats.bytes >= budget:
                return
        if stats.bad_lines and not cfg.skip_bad_lines:
            raise DataError(f"{stats.bad_lines} {_bad_what(stats)}, the first is {stats.first_bad}; fix "
                            "them, or pass --skip_bad_lines true to leave them out")


def check_read(stats: ReadStats, cfg: DataConfig, log):
    """Refuse a corpus without two documents; log what reading skipped or repaired."""
    where = ", ".join(cfg.sources) or "the Python standard library"
    found = findings(stats)
    also = f" ({'; '.join(found)})" if found else ""
    if stats.documents == 0:
        raise DataError(f"no text found in {where} (files empty, binary, or every line skipped){also}, "
                        "pass files that hold text")
    if stats.documents == 1:
        raise DataError(f"{where} holds a single document, so the validation split would be empty{also}; add "
                        f"documents (more files, JSONL lines, or text longer than {PIECE_BYTES // 1024} KiB)")
    for finding in found:
        log(f"data: {finding}")


def findings(stats: ReadStats) -> list[str]:
    """What reading skipped or repaired, in words."""
    found = []
    if stats.bad_lines:
        found.append(f"skipped {stats.bad_lines} {_bad_what(stats)}, the first is {stats.first_bad}")
    if stats.binary_skipped:
        found.append(f"skipped {stats.binary_skipped} binary file(s) in folders, "
                     f"the first is {stats.first_binary}")
    if stats.invalid_utf8:
        found.append(f"replaced {stats.invalid_utf8} invalid UTF-8 sequence(s) with U+FFFD, the first in "
                     f"{stats.first_invalid}")
    return found


def _bad_what(stats: ReadStats) -> str:
    """What the bad entries were: JSONL lines, table rows, or both."""
    if not stats.bad_rows:
        return "bad JSONL line(s)"
    return "bad table row(s)" if stats.bad_rows == stats.bad_lines else "bad JSONL line(s) and table row(s)"
