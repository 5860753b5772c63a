"""One reader per container a source file may come in: plain bytes, gzip and zstd streams, parquet row groups,
Arrow IPC record batches, and the Arrow files of a `datasets` save_to_disk folder.

Streams are decompressed as they are read, never whole; tables are read one row group (or record batch) at a
time, only the columns a document may come from, as rows of dicts. A container that cannot be read (not the
format, cut short, a corrupt frame or page) is a DataError naming the file and the line or row group; what a
row or line means is corpus.py's business.
"""

import gzip
import io
import itertools
import json
import os
import re
import zlib
from contextlib import contextmanager

from llm.base.errors import DataError

COMPRESSED = (".gz", ".zst")  # text and JSONL files may come compressed: notes.txt.gz, web.jsonl.zst
TABLES = (".parquet", ".arrow")
ROWS_PER_CHUNK = 1024  # rows turned into Python dicts at once: bounds memory within a large row group
# compressed bytes per step: even a 30000:1 zstd block then yields about 64 MiB at once
ZSTD_INPUT_BYTES = 2048
COMPRESSION_RATIO = 4  # text bytes per compressed byte, for a size estimate where the file records none
DATASET_MARKERS = ("state.json", "dataset_info.json")  # beside data-*.arrow files: a save_to_disk folder
DATASET_DICT = "dataset_dict.json"  # the index of a saved DatasetDict, whose splits are subfolders
# A JSONL line longer than this is never held whole (a 2 GB one-line file peaked at 5.1 GiB): it is read
# through in SKIP_BYTES pieces and refused as a bad line. Generous: one document of a quarter gigabyte still
# reads.
MAX_LINE_BYTES = 256 * 2**20
SKIP_BYTES = 2**20
# How an error line about a file that cannot be read ends; hf_datasets.py removes such a file from the Hub's
# cache.
REWRITE = "write it again, or leave it out"


def kind(path: str) -> str:
    """"table" (parquet, Arrow), "jsonl" or "text", by the name without its compression suffix."""
    if path.endswith(TABLES):
        return "table"
    name = path[:-len(_compression(path))] if _compression(path) else path
    return "jsonl" if name.endswith(".jsonl") else "text"


def _compression(path: str) -> str:
    return next((s for s in COMPRESSED if path.endswith(s)), "")


def _module(name: str, path: str):
    """Import an optional package (pyarrow, zstandard) when a file needs it; a DataError says how to get it.
    """
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        raise DataError(f"{path} needs the {name.split('.')[0]} package: "
                        "pip install -r requirements.txt") from None


# ----------------------------------------------------------------------------- streams

@contextmanager
def open_stream(path: str):
    """The file's bytes, decompressed as they are read (.gz, .zst): read(n), readline(n) and lines."""
    suffix = _compression(path)
    with open(path, "rb") as raw:
        if not suffix:
            yield raw
        elif suffix == ".gz":
            yield _Checked(gzip.GzipFile(fileobj=raw), path, "gzip", (EOFError, zlib.error, gzip.BadGzipFile))
        else:
            zstd = _module("zstandard", path)
            yield _Checked(io.BufferedReader(_ZstdFrames(raw, zstd)), path, "zstd",
                           (EOFError, zstd.ZstdError))


def lines(f):
    """Yield each line of the stream f as bytes, or None for a line longer than MAX_LINE_BYTES, whose rest is
    read through in SKIP_BYTES pieces and dropped: memory stays bounded whatever the file holds."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(SKIP_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


class _Checked:
    """A decompressing stream whose failures (cut short, corrupt) are one DataError naming the file and line.
    """

    def __init__(self, f, path: str, name: str, errors: tuple):
        self.f, self.path, self.name, self.errors, self.lines = f, path, name, errors, 0

    def read(self, size: int = -1) -> bytes:
        data = self._call(self.f.read, size)
        self.lines += data.count(b"\n")
        return data

    def readline(self, size: int = -1) -> bytes:
        line = self._call(self.f.readline, size)
        self.lines += line.endswith(b"\n")
        return line

    def __iter__(self):
        while line := self.readline():
            yield line

    def _call(self, method, size: int) -> bytes:
        try:
            return method(size)
        except self.errors as e:
            # Streams read ahead, so the damage is at or after the next line, not always at it.
            where = f"after line {self.lines}" if self.lines else "at its start"
            raise DataError(f"{self.path}: the {self.name} stream is cut short or corrupt {where} ({e}); "
                            "compress the file again, or leave it out") from None


class _ZstdFrames(io.RawIOBase):
    """The frames of a .zst file one after another, decompressed in small steps. zstandard's own stream reader
    ends quietly where a file is cut short; here a frame left unfinished at the end is an EOFError."""

    def __init__(self, f, zstd):
        self.f, self.zstd, self.frame = f, zstd, None
        self.out, self.pos, self.rest = b"", 0, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.pos == len(self.out):
            data, self.rest = self.rest or self.f.read(ZSTD_INPUT_BYTES), b""
            if not data:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a frame")
                return 0
            # a file may hold several frames (zstd -T, concatenation)
            if self.frame is None or self.frame.eof:
                self.frame = self.zstd.ZstdDecompressor().decompressobj()
            self.out, self.pos = self.frame.decompress(data), 0
            if self.frame.eof:
                self.rest = self.frame.unused_data  # the start of the next frame
        n = min(len(buf), len(self.out) - self.pos)
        buf[:n] = memoryview(self.out)[self.pos:self.pos + n]
        self.pos += n
        return n


# ----------------------------------------------------------------------------- tables

def table_chunks(path: str, columns):
    """Yield (label, first row, rows) through a parquet file's row groups or an Arrow file's record batches,
    rows as dicts of the columns named in columns that the table has (None: every column), None values left
    out (as a JSONL line would leave out the key). A parquet row group of no rows comes as (label, 0, [])."""
    pa = _module("pyarrow", path)
    try:
        with (_parquet_groups if path.endswith(".parquet") else _arrow_batches)(path, pa) as (schema, groups):
            names = list(schema.names) if columns is None else [c for c in schema.names if c in columns]
            if not names:
                raise DataError(f"{path} has no column a document can come from (it has "
                                f"{', '.join(schema.names)}; looked for "
                                f"{', '.join(columns)}), pass --text_field NAME")
            for label, table in groups(names):
                if table.num_rows == 0:
                    yield label, 0, []
                for start in range(0, table.num_rows, ROWS_PER_CHUNK):
                    try:
                        rows = table.slice(start, ROWS_PER_CHUNK).to_pylist()
                    # a corrupt page of an uncompressed file decodes to bad text
                    except UnicodeDecodeError as e:
                        last = min(start + ROWS_PER_CHUNK, table.num_rows) - 1
                        raise DataError(f"{path} {label}, rows {start} to {last}: a string is not "
                                        f"UTF-8 ({e.reason} at byte {e.start}), the file is corrupt: "
                                        "write it again, or leave it out") from None
                    yield label, start, [{k: v for k, v in row.items() if v is not None} for row in rows]
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable {path.rsplit('.', 1)[-1]} file ({_first_line(e)}), "
                        "write it again, or leave it out") from None


def _read(path: str, label: str, pa, read):
    """read(), its failure one DataError naming the row group or batch."""
    try:
        return read()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} {label} cannot be read ({_first_line(e)}), the file is corrupt: "
                        "write it again, or leave it out") from None


@contextmanager
def _parquet_groups(path: str, pa):
    """The schema, and groups(columns) yielding (label, table) per row group, each read on its own."""
    with _module("pyarrow.parquet", path).ParquetFile(path) as f:
        def groups(names):
            for g in range(f.num_row_groups):
                label = f"row group {g}"
                yield label, _read(path, label, pa, lambda: f.read_row_group(g, columns=names))
        yield f.schema_arrow, groups


@contextmanager
def _arrow_batches(path: str, pa):
    """The schema, and groups(columns) yielding (label, table) per non-empty record batch of an Arrow IPC file
    or stream (save_to_disk writes streams); the file is memory-mapped, each batch read when it is reached."""
    with open(path, "rb") as f:
        file_format = f.read(6) == b"ARROW1"
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_file(source) if file_format else pa.ipc.open_stream(source)

        def next_batch(i):
            if file_format:
                return reader.get_batch(i) if i < reader.num_record_batches else None
            try:
                return reader.read_next_batch()
            except StopIteration:
                return None

        def groups(names):
            for i in itertools.count():
                label = f"record batch {i}"
                if (batch := _read(path, label, pa, lambda: next_batch(i))) is None:
                    return
                if batch.num_rows:
                    yield label, pa.Table.from_batches([batch.select(names)])
        yield reader.schema, groups


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


# ----------------------------------------------------------------------------- folders and sizes

def dataset_files(folder: str, names) -> list[str] | None:
    """The Arrow files of a `datasets` save_to_disk folder in their order (data-00000-of-00004.arrow, ...);
    None when the folder (whose file names are names) is not one."""
    data = sorted(n for n in names if n.startswith("data-") and n.endswith(".arrow"))
    if not data or not any(m in names for m in DATASET_MARKERS):
        return None
    missing = sorted(_listed_data_files(folder, data) - set(data))
    if missing:
        raise DataError(f"{folder} is a saved dataset without {missing[0]}"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                        + " of the data files it lists; save it again (save_to_disk) or "
                        "copy the missing files, rather than train on part of it")
    return [os.path.join(folder, n) for n in data]


def _listed_data_files(folder: str, data: list[str]) -> set[str]:
    """The data files a saved dataset says it has: those state.json lists (by name, in this folder) and the
    whole series data-0000i-of-0000N.arrow that the names found count."""
    listed = set()
    for name in data:
        if m := re.fullmatch(r"data-(\d+)-of-(\d+)\.arrow", name):
            width, total = len(m.group(1)), int(m.group(2))
            listed |= {f"data-{i:0{width}d}-of-{m.group(2)}.arrow" for i in range(min(total, 100_000))}
    try:
        with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
            files = json.load(f).get("_data_files", [])
        listed |= {os.path.basename(str(e.get("filename", ""))) for e in files if isinstance(e, dict)} - {""}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        pass  # no state.json, or one we cannot read: the series names still say what belongs
    return listed


def text_bytes(path: str, columns) -> int:
    """About how many bytes of text the file holds, without reading its data: the size of a plain file or an
    Arrow file, the size a gzip trailer records, for zstd the larger of its first frame's recorded size and
    COMPRESSION_RATIO times the file (also where nothing is recorded),
    the uncompressed size of a parquet file's columns named in columns."""
    size = os.path.getsize(path)
    if path.endswith(".parquet"):
        pq = _module("pyarrow.parquet", path)
        try:
            with pq.ParquetFile(path) as table:
                meta = table.metadata
        except (_module("pyarrow", path).ArrowException, OSError) as e:
            raise DataError(f"{path} is not a readable parquet file ({_first_line(e)}), {REWRITE}") from None
        return sum(c.total_uncompressed_size for g in range(meta.num_row_groups)
                   for c in map(meta.row_group(g).column, range(meta.row_group(g).num_columns))
                   if c.path_in_schema.split(".")[0] in columns)
    recorded = -1
    with open(path, "rb") as f:
        if path.endswith(".gz") and size >= 18:
            f.seek(-4, os.SEEK_END)
            recorded = int.from_bytes(f.read(4), "little")  # the last member's size, modulo 4 GiB
        elif path.endswith(".zst"):
            try:  # the first frame's size (-1: not recorded); a file of several frames holds more
                recorded = max(_module("zstandard", path).frame_content_size(f.read(18)),
                               COMPRESSION_RATIO * size)
            except Exception:  # not a zstd frame: reading it will say so, with the line
                recorded = -1
    if not _compression(path):
        return size
    return recorded if recorded >= size else COMPRESSION_RATIO * size
