"""The corpus: the documents that text files, folders, JSONL and chat JSONL files hold, read in a fixed order.

Folders are walked recursively (hidden files, caches, installed packages and pipes skipped; binary files
skipped and counted); long text files are cut at line ends into documents of about 32 KiB (a line longer than
256 KiB at a character boundary); a JSONL line is one document, its chat messages (in any shape chat_formats.py
reads) or its text. Nothing here tokenizes: prepare_data.py does, from documents().
"""

import codecs
import json
import math
import os
import sysconfig
from dataclasses import dataclass

from chat_formats import SHAPES, chat_messages
from config import DEFAULT_TEXT_FIELDS, DataConfig, DataError

PIECE_BYTES = 32 * 1024  # long text files are cut at a line end into documents of about this size
LINE_BYTES = 256 * 1024  # a line longer than this (minified code, a one-line dump) is cut inside: bounded pieces
BINARY_PROBE_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it binary (as git decides)
SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass
class ReadStats:
    """What one pass over the sources saw."""
    files: int = 0
    documents: int = 0
    bytes: int = 0
    chats: int = 0
    binary_skipped: int = 0
    first_binary: str = ""
    bad_lines: int = 0
    first_bad: str = ""
    invalid_utf8: int = 0
    first_invalid: str = ""


def _walk(root: str, suffix=None) -> list[str]:
    """Files under root, sorted, without hidden files, caches and installed packages."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [os.path.join(folder, n) for n in names  # isfile: a pipe in a folder would block the reader
                  if not n.startswith(".") and (suffix is None or n.endswith(suffix))
                  and os.path.isfile(os.path.join(folder, n))]
    return sorted(found)


def source_files(cfg: DataConfig) -> list[tuple[str, bool]]:
    """Every file to read, in a fixed order, each with whether it came from a folder."""
    if not cfg.sources:
        return [(p, True) for p in _walk(sysconfig.get_paths()["stdlib"], ".py")]
    files = []
    for source in cfg.sources:
        path = os.path.abspath(source)
        if os.path.isdir(path):
            files += [(p, True) for p in _walk(path)]
        elif os.path.isfile(path):
            files.append((path, False))
        elif os.path.exists(path):
            raise DataError(f"data source {source} is not a regular file or folder (a pipe, socket or device), "
                            "pass files or folders: they are read twice")
        else:
            raise DataError(f"data source {source} does not exist, check the path given to --sources")
    return files


def corpus_bytes(cfg: DataConfig) -> int:
    """The size of the text the sources hold (within max_source_mb), from the file sizes: no reading."""
    total = sum(os.path.getsize(path) for path, _ in source_files(cfg))
    return min(total, int(cfg.max_source_mb * 1e6)) if cfg.max_source_mb else total


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
    """Blocks of about PIECE_BYTES that end at a line end, or inside a line of over LINE_BYTES at a character end."""
    rest = b""
    while block := rest + f.read(PIECE_BYTES):
        tail = f.readline(LINE_BYTES)  # finish the line, so no piece ends inside a word or a character
        block += tail
        cut = _whole_chars(block) if len(tail) == LINE_BYTES and not tail.endswith(b"\n") else len(block)
        block, rest = block[:cut], block[cut:]
        yield block


def _whole_chars(data: bytes) -> int:
    """The length of data without the UTF-8 character its end cuts in two (data is left whole if not UTF-8)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # ASCII, or the first byte of a character of 2, 3 or 4 bytes
            size = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= size else len(data) - back
    return len(data)


def _text_pieces(path: str, in_folder: bool, stats: ReadStats):
    """Yield (piece, text, bytes read) of a text file, cut at line ends; binary files are skipped or refused."""
    with open(path, "rb") as f:
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


def _parse_line(line: str, text_fields, system_prompt: str):
    """A JSONL line's document: its list of chat messages (any shape chat_formats.py reads), or its text;
    DataError says why neither."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    messages = chat_messages(obj, system_prompt) if isinstance(obj, dict) else None
    if messages is not None:
        return messages
    for name in text_fields:
        if isinstance(obj, dict) and isinstance(obj.get(name), str):
            return obj[name]
    raise DataError(f"no text field (looked for {', '.join(text_fields)}) and no chat shape (accepted: {SHAPES})")


def _jsonl_documents(path: str, cfg: DataConfig, stats: ReadStats):
    """Yield (0, document, bytes read) per non-empty line; bad lines are counted and left out."""
    text_fields = (cfg.text_field,) if cfg.text_field else DEFAULT_TEXT_FIELDS
    stats.files += 1
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark is not JSON
            if not raw.strip():
                continue
            try:
                doc = _parse_line(_decode(raw, path, stats), text_fields, cfg.system_prompt)
            except DataError as e:
                stats.bad_lines += 1
                stats.first_bad = stats.first_bad or f"{path} line {number}: {e}"
                continue
            stats.chats += not isinstance(doc, str)
            if doc:
                yield 0, doc, len(raw)


def documents(files, cfg: DataConfig, stats: ReadStats):
    """Yield (doc_id, piece, text or messages) in a fixed order, stopping after max_source_mb."""
    budget = cfg.max_source_mb * 1e6 or math.inf
    doc_id = -1
    for path, in_folder in files:
        reader = _jsonl_documents(path, cfg, stats) if path.endswith(".jsonl") else \
            _text_pieces(path, in_folder, stats)
        for piece, doc, size in reader:
            if piece == 0:
                doc_id += 1
            stats.documents += 1
            stats.bytes += size
            yield doc_id, piece, doc
            if stats.bytes >= budget:
                return


def scan(files, cfg: DataConfig, log) -> ReadStats:
    """Read the sources once to count documents and to refuse bad input before anything is written."""
    stats = ReadStats()
    for _ in documents(files, cfg, stats):
        pass
    where = ", ".join(cfg.sources) or "the Python standard library"
    if stats.bad_lines and not cfg.skip_bad_lines:
        raise DataError(f"{stats.bad_lines} bad JSONL line(s), the first is {stats.first_bad}; fix them, "
                        "or pass --skip_bad_lines true to leave them out")
    found = _findings(stats)
    also = f" ({'; '.join(found)})" if found else ""
    if stats.documents == 0:
        raise DataError(f"no text found in {where} (files empty, binary, or every line skipped){also}, "
                        "pass files that hold text")
    if stats.documents == 1:
        raise DataError(f"{where} holds a single document, so the validation split would be empty{also}; add "
                        f"documents (more files, JSONL lines, or text longer than {PIECE_BYTES // 1024} KiB)")
    for finding in found:
        log(f"data: {finding}")
    return stats


def _findings(stats: ReadStats) -> list[str]:
    """What reading skipped or repaired, in words."""
    found = []
    if stats.bad_lines:
        found.append(f"skipped {stats.bad_lines} bad JSONL line(s), the first is {stats.first_bad}")
    if stats.binary_skipped:
        found.append(f"skipped {stats.binary_skipped} binary file(s) in folders, the first is {stats.first_binary}")
    if stats.invalid_utf8:
        found.append(f"replaced {stats.invalid_utf8} invalid UTF-8 sequence(s) with U+FFFD, the first in "
                     f"{stats.first_invalid}")
    return found
