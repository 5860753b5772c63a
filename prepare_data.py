"""The token cache with its loss masks (batches.py reads it).

Takes the documents corpus.py reads from text files, folders, JSONL or chat JSONL (default: this Python's
standard library), trains a byte-level tokenizer (tokenizer.py) on the training split and writes
<cache_dir>/<fingerprint>/ with train.bin, val.bin, meta.json and tokenizer.json; the same settings later
reuse that folder. Build the cache ahead of training, and see how fast that goes, or what a chat set teaches
(--show N: examples with their learned text marked, the share learned, and how full packed windows are):
    python prepare_data.py --sources notes/ chats.jsonl --vocab_size 8192 --max_source_mb 50
    python prepare_data.py --sources chats.jsonl --show 3
"""

import hashlib
import json
import math
import os
import signal
import sys
import sysconfig
import time
from dataclasses import dataclass, fields

if __name__ == "__main__":  # a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

import atomic
from cli import parse_config
from config import ConfigError, DataConfig, DataError
from errors import error_contract
from corpus import PIECE_BYTES, ReadStats, corpus_bytes, documents, scan, source_files
from device import machine, pick_device
from packing import packs, plan
from sizing import fill_automatic
from tokenizer import (EOT_TOKEN, IM_START, MIN_VOCAB, SPECIAL_TOKENS, TOKENIZER_FILE, chat_segments, chat_text,
                       encode_segments, existing_tokenizer, marked_text, tokenizer_file, train_tokenizer)

ENCODE_BATCH_BYTES = 4 * 2**20  # text per encode_batch call: keeps every core busy, bounds memory
TOKENIZER_SAMPLE_BYTES = 32 * 2**20  # tokenizer training text; more changes the merges little, costs time
CACHE_FORMAT = 2  # bump when the cache's contents change for the same inputs (2: Alpaca lines became chats)
META_FIELDS = {"vocab_size": int, "dtype": str, "has_masks": bool, "eot_id": int, "train_tokens": int,
               "val_tokens": int, "train_documents": int, "val_documents": int, "val_bytes_per_token": (int, float)}
BATCH_TIME_FIELDS = ("cache_dir", "packing")  # settings that do not change the cache's contents
ID_CHUNK = 2**26  # token ids per max() when a cache is checked: bounds the memory one chunk maps


@dataclass
class PreparedData:
    """A finished cache folder and its meta.json."""
    path: str
    meta: dict

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.path, TOKENIZER_FILE)

    def texts(self, split: str) -> list[str]:
        """The split's documents as text, decoded from the cache (special tokens of chats kept)."""
        tokens = np.fromfile(os.path.join(self.path, f"{split}.bin"), dtype=self.meta["dtype"]).tolist()
        tok, eot = Tokenizer.from_file(self.tokenizer_path), self.meta["eot_id"]
        cuts = [i for i, t in enumerate(tokens) if t == eot]
        return [tok.decode(tokens[a + 1:b], skip_special_tokens=False) for a, b in zip([-1] + cuts, cuts)]


def _val_mask(n_docs: int, seed: int, val_fraction: float) -> np.ndarray:
    """Which documents are validation: a seeded choice of round(n * val_fraction), at least one."""
    k = max(1, round(n_docs * val_fraction))
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).choice(n_docs, size=k, replace=False)] = True
    return is_val


def split_texts(cfg: DataConfig, split: str | None = "val") -> list[str]:
    """The documents of a split ("train", "val"; None: all) as text, read from the sources with the split the
    cache of these settings has (no tokenizer, no cache), so any model can be measured on the same bytes.
    Chats come as their template text."""
    files = source_files(cfg)
    is_val = None if split is None else _val_mask(scan(files, cfg, lambda *a: None).documents, cfg.data_seed,
                                                  cfg.val_fraction)
    texts, last = [], None
    for i, (doc_id, piece, doc) in enumerate(documents(files, cfg, ReadStats())):
        if is_val is not None and is_val[i] != (split == "val"):
            continue
        text = doc if isinstance(doc, str) else chat_text(doc)
        if last == (doc_id, piece - 1):
            texts[-1] += text  # the next piece of the same file: the cache joins them too
        else:
            texts.append(text)
        last = (doc_id, piece)
    if not texts:
        raise DataError(f"no text found in {', '.join(cfg.sources) or 'the default corpus'}, pass files that hold text")
    return texts


# ----------------------------------------------------------------------------- tokenizer

def _tokenizer_sample(files, cfg: DataConfig, is_val, total_bytes: int):
    """Training-split texts, about TOKENIZER_SAMPLE_BYTES of them, spread over the whole corpus."""
    stride = max(1, math.ceil(total_bytes / TOKENIZER_SAMPLE_BYTES))
    for i, ((_, _, doc), val) in enumerate(zip(documents(files, cfg, ReadStats()), is_val)):
        if i % stride == 0 and not val:
            # A conversation trains as its template text without the special tokens.
            yield doc if isinstance(doc, str) else "".join(f"{m['role']}\n{m['content']}\n" for m in doc)


def _make_tokenizer(files, cfg: DataConfig, vocab_size: int, is_val, total_bytes: int, log) -> Tokenizer:
    """The configured local tokenizer, or a new one trained on the training split."""
    start = time.perf_counter()
    if cfg.tokenizer:
        tok = existing_tokenizer(cfg.tokenizer, vocab_size)
        log(f"data: using tokenizer {cfg.tokenizer} ({tok.get_vocab_size()} tokens)")
        return tok
    tok = train_tokenizer(_tokenizer_sample(files, cfg, is_val, total_bytes), cfg.tokenizer_type, vocab_size)
    log(f"data: trained a {cfg.tokenizer_type} tokenizer of {tok.get_vocab_size()} tokens "
        f"in {time.perf_counter() - start:.1f}s")
    return tok


# ----------------------------------------------------------------------------- token cache

class _SplitWriter:
    """Appends a split's documents to <split>.bin and <split>_mask.bin, EOT wherever the text breaks off."""

    def __init__(self, folder: str, split: str, dtype, eot: int):
        self.paths = [os.path.join(folder, f"{split}.bin"), os.path.join(folder, f"{split}_mask.bin")]
        self.files = [open(p, "wb") for p in self.paths]
        self.dtype, self.eot = dtype, eot
        self.tokens = self.documents = self.bytes = 0
        self.last = None  # (doc_id, piece, is its last token learned) of the piece written last
        self.pending = []

    def add(self, doc_id: int, piece: int, ids: list, mask: list, nbytes: int):
        """Append one piece; an EOT (learned like the end before it) first if it doesn't continue the last."""
        if self.last and self.last[:2] != (doc_id, piece - 1):
            self._append([self.eot], [self.last[2]])
        self._append(ids, mask)
        self.last = (doc_id, piece, bool(mask and mask[-1]))
        self.documents += 1
        self.bytes += nbytes

    def _append(self, ids: list, mask: list):
        self.pending.append((np.asarray(ids, self.dtype), np.asarray(mask, np.uint8)))
        self.tokens += len(ids)

    def flush(self):
        """Write what add() collected."""
        for f, parts in zip(self.files, zip(*self.pending)):
            np.concatenate(parts).tofile(f)
        self.pending = []

    def close(self, keep_masks: bool):
        """End the last document with EOT, flush to disk, and drop the mask file when no chat needs it."""
        if self.last:
            self._append([self.eot], [self.last[2]])
        self.flush()
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if not keep_masks:
            os.remove(self.paths[1])


def _write_splits(folder: str, files, cfg: DataConfig, tok: Tokenizer, is_val, total_bytes: int) -> dict:
    """Tokenize every document in parallel batches, streaming each to its split; returns the counts."""
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    writers = {s: _SplitWriter(folder, s, dtype, tok.token_to_id(EOT_TOKEN)) for s in ("train", "val")}
    stats, batch = ReadStats(), []

    def flush():
        segments = [[(doc, True, False)] if isinstance(doc, str) else chat_segments(doc) for *_, doc in batch]
        for (writer, doc_id, piece, _), segs, (ids, mask) in zip(batch, segments, encode_segments(tok, segments)):
            writer.add(doc_id, piece, ids, mask, sum(len(text.encode("utf-8")) for text, _, _ in segs))
        for writer in writers.values():
            writer.flush()
        batch.clear()

    done = 0  # bytes encoded so far (tqdm's own count stays 0 when the bar is off)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None) as bar:
        # zip reads one document past the split's end if the sources grew, and the check below sees it.
        for (doc_id, piece, doc), val in zip(documents(files, cfg, stats), is_val):
            batch.append((writers["val" if val else "train"], doc_id, piece, doc))
            if stats.bytes - done >= ENCODE_BATCH_BYTES:
                flush()
                bar.update(stats.bytes - done)
                done = stats.bytes
        flush()
        bar.update(stats.bytes - done)
    if stats.documents != len(is_val):
        raise DataError("the sources changed while they were being prepared, run again")
    for writer in writers.values():
        writer.close(keep_masks=stats.chats > 0)
    meta = {"vocab_size": vocab, "dtype": np.dtype(dtype).name, "has_masks": stats.chats > 0,
            "eot_id": tok.token_to_id(EOT_TOKEN)}
    for split, w in writers.items():
        meta.update({f"{split}_tokens": w.tokens, f"{split}_documents": w.documents, f"{split}_bytes": w.bytes})
    meta["val_bytes_per_token"] = writers["val"].bytes / max(1, writers["val"].tokens)
    return meta


def check_window(split: str, tokens: int, seq_len: int):
    """A split must hold one training window of seq_len + 1 tokens."""
    if tokens < seq_len + 1:
        raise DataError(f"the {split} split holds {tokens} tokens, fewer than one window of max_seq_len + 1 = "
                        f"{seq_len + 1}; add text, raise --val_fraction or lower --max_seq_len")


def check_windows(meta: dict, packing: str, seq_len: int):
    """Both splits hold a training window, where windows are random slices (packed ones fit any example)."""
    if not packs(packing, meta):
        for split in ("train", "val"):
            check_window(split, meta[f"{split}_tokens"], seq_len)


def _fingerprint(files, cfg: DataConfig, vocab_size: int) -> str:
    """Hash of everything the cache depends on: files (path, size, mtime) and every data setting but the cache's
    place and how batches are cut from it, so a field added to DataConfig takes part without being listed here."""
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in BATCH_TIME_FIELDS}
    settings.update(vocab_size=vocab_size, format=CACHE_FORMAT, piece_bytes=PIECE_BYTES)
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    paths = [p for p, _ in files] + ([tokenizer_file(cfg.tokenizer)] if cfg.tokenizer else [])
    for path in paths:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build(path: str, files, cfg: DataConfig, vocab_size: int, seq_len: int, log):
    """Scan, split, train the tokenizer and write the cache under a temporary name, renamed when complete."""
    start = time.perf_counter()
    stats = scan(files, cfg, log)
    log(f"data: {stats.files} files, {stats.documents} documents, {stats.bytes / 1e6:.1f} MB "
        f"(scanned in {time.perf_counter() - start:.1f}s)")
    is_val = _val_mask(stats.documents, cfg.data_seed, cfg.val_fraction)
    tok = _make_tokenizer(files, cfg, vocab_size, is_val, stats.bytes, log)
    # Under a temporary name, never read as a cache: only a folder named <fingerprint> with meta.json is.
    with atomic.folder(path, f"writing the token cache {path}", need=4 * stats.bytes) as tmp:
        tok.save(os.path.join(tmp, TOKENIZER_FILE))
        meta = _write_splits(tmp, files, cfg, tok, is_val, stats.bytes)
        check_windows(meta, cfg.packing, seq_len)
        seconds = time.perf_counter() - start
        meta.update(sources=cfg.sources or [sysconfig.get_paths()["stdlib"]], files=stats.files,
                    source_bytes=stats.bytes, binary_files_skipped=stats.binary_skipped,
                    bad_lines_skipped=stats.bad_lines, invalid_utf8_replaced=stats.invalid_utf8,
                    tokenizer=cfg.tokenizer or cfg.tokenizer_type, seconds=round(seconds, 2),
                    mb_per_second=round(stats.bytes / 1e6 / seconds, 2), format=CACHE_FORMAT)
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
    log(f"data: prepared {stats.bytes / 1e6:.1f} MB in {seconds:.1f}s ({meta['mb_per_second']} MB/s), "
        f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens, "
        f"{meta['val_bytes_per_token']:.2f} bytes per token")


def _has(value, kind) -> bool:
    """isinstance, without True passing for an int."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _cache_problem(path: str) -> str | None:
    """What is wrong with a cache folder, in a few words; None when meta.json's fields, the split files' sizes
    and token ids, and the tokenizer agree. A cache damaged by hand, by a disk or by a copy cut short once
    ended in one of seven tracebacks (the last an IndexError from the embedding, mid-training)."""
    try:
        with open(os.path.join(path, "meta.json"), "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"meta.json is unreadable: {str(e).splitlines()[0][:80]}"
    if not isinstance(meta, dict):
        return f"meta.json holds a {type(meta).__name__}, not an object"
    for key, kind in META_FIELDS.items():
        if not _has(meta.get(key), kind) or (kind is int and meta[key] < 0):
            return f"meta.json's {key} is {meta.get(key)!r}"
    if meta["dtype"] not in ("uint16", "uint32") or meta["eot_id"] >= meta["vocab_size"]:
        return f"meta.json's dtype {meta['dtype']!r} or eot_id {meta['eot_id']} does not fit its vocabulary"
    for split in ("train", "val"):
        tokens, width = meta[f"{split}_tokens"], np.dtype(meta["dtype"]).itemsize
        for file, need in [(f"{split}.bin", tokens * width)] + [(f"{split}_mask.bin", tokens)] * meta["has_masks"]:
            where = os.path.join(path, file)
            if not os.path.isfile(where) or os.path.getsize(where) != need:
                return f"{file} is missing or not the {need:,} bytes that meta.json's {split}_tokens needs"
        bin_path = os.path.join(path, f"{split}.bin")
        ids = np.memmap(bin_path, dtype=meta["dtype"], mode="r") if tokens else []  # np.memmap refuses empty files
        # Every id, in chunks: the time of reading the file once, against an IndexError hours into a run.
        top = max((int(ids[i:i + ID_CHUNK].max()) for i in range(0, len(ids), ID_CHUNK)), default=0)
        if top >= meta["vocab_size"]:
            return f"{split}.bin holds token id {top}, past the vocabulary of {meta['vocab_size']}"
    try:
        vocab = Tokenizer.from_file(os.path.join(path, TOKENIZER_FILE)).get_vocab_size()
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        return f"{TOKENIZER_FILE} is unreadable: {str(e).splitlines()[0][:80]}"
    if vocab != meta["vocab_size"]:
        return f"{TOKENIZER_FILE} has {vocab} tokens, meta.json's vocab_size {meta['vocab_size']}"
    return None


def prepare(cfg: DataConfig, vocab_size: int, seq_len: int, log=print) -> PreparedData:
    """Build the token cache for these settings, or reuse the finished one; raises DataError on bad input."""
    if cfg.data_seed < 0:
        raise DataError(f"data_seed={cfg.data_seed} is invalid, pass a seed >= 0")
    if not cfg.tokenizer and vocab_size < MIN_VOCAB:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level {cfg.tokenizer_type} tokenizer, "
                        f"which needs {MIN_VOCAB} (256 bytes and {len(SPECIAL_TOKENS)} special tokens); "
                        f"pass --vocab_size {MIN_VOCAB} or more")
    files = source_files(cfg)
    path = os.path.join(cfg.cache_dir, _fingerprint(files, cfg, vocab_size))
    atomic.remove_leftovers(cfg.cache_dir)  # of preparations killed (kill -9, SIGTERM) before they finished
    problem = _cache_problem(path) if os.path.isdir(path) else "absent"
    if problem is None:
        log(f"data: reusing {path}")
    else:
        if problem != "absent":  # a cache is derived data: rebuilt, not refused
            log(f"data: the token cache {path} is damaged ({problem}), rebuilding it")
        _build(path, files, cfg, vocab_size, seq_len, log)
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        data = PreparedData(path, json.load(f))
    check_windows(data.meta, cfg.packing, seq_len)
    return data


# ----------------------------------------------------------------------------- command line

def show_examples(data: PreparedData, n: int, colour: bool, packing: str = "auto", seq_len: int = 256):
    """Print the train split's first n documents with their learned tokens marked (ANSI green, or [[...]] when
    colour is off), then the share of the split's tokens that are learned and how full packed windows are."""
    tokens = np.memmap(os.path.join(data.path, "train.bin"), dtype=data.meta["dtype"], mode="r")
    masks = np.memmap(os.path.join(data.path, "train_mask.bin"), dtype=np.uint8, mode="r") \
        if data.meta["has_masks"] else None  # without chats every token is learned
    cuts, start = [], 0
    while len(cuts) < n and start < len(tokens):  # chunks: the first documents need not read the whole split
        cuts += (start + np.flatnonzero(tokens[start:start + ID_CHUNK] == data.meta["eot_id"])).tolist()
        start += ID_CHUNK
    tok, marks = Tokenizer.from_file(data.tokenizer_path), ("\033[32m", "\033[0m") if colour else ("[[", "]]")
    for i, (a, b) in enumerate(zip([-1] + cuts, cuts[:n]), 1):
        ids = tokens[a + 1:b].tolist()
        learned = masks[a + 1:b].astype(bool).tolist() if masks is not None else [True] * len(ids)
        print(f"--- example {i}, learned text {'in green' if colour else 'in [[ ]]'} ---")
        text = marked_text(tok, ids, learned, marks)
        print(text, end="" if text.endswith("\n") else "\n")
    total = len(tokens)
    taught = total if masks is None else sum(int(masks[i:i + ID_CHUNK].sum()) for i in range(0, total, ID_CHUNK))
    print(f"learned: {taught / max(1, total):.1%} of the train split's {total:,} tokens ({taught:,})")
    if packs(packing, data.meta):
        p = plan(tokens, data.meta["eot_id"], tok.token_to_id(IM_START), seq_len, seed=0)
        print(f"packing: {p.examples:,} examples in {p.windows:,} windows of {seq_len} tokens, {p.fill_rate:.1%} "
              f"of positions filled; {p.cut:,} examples longer than a window were cut at a turn start")
    else:
        print(f"packing: off ({'--packing off' if packing == 'off' else 'no chats'}), windows are random slices")


def _show_flag(parser):
    parser.add_argument("--show", type=int, default=0, metavar="N", help="after preparing, print N training "
                        "examples with their learned tokens marked, and the share of tokens learned")


@error_contract
def main(argv=None):
    """Prepare (or find) the cache for the command line's settings and print a summary (and --show examples)."""
    cfg, extras = parse_config(argv, _show_flag)
    if extras.show < 0:
        raise ConfigError(f"--show {extras.show} is invalid, pass a number of examples >= 0")
    for note in fill_automatic(cfg, machine(pick_device(cfg.train.device)), corpus_bytes(cfg.data)):
        print(note)  # the vocabulary and context the trainer would choose here
    data = prepare(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.max_seq_len)
    m = data.meta
    print(f"cache {data.path}: vocab {m['vocab_size']} ({m['dtype']}), train {m['train_tokens']:,} tokens "
          f"in {m['train_documents']} documents, val {m['val_tokens']:,} tokens in {m['val_documents']} documents, "
          f"{m['val_bytes_per_token']:.2f} bytes per token, masks {'yes' if m['has_masks'] else 'no'}")
    if extras.show:
        show_examples(data, extras.show, sys.stdout.isatty(), cfg.data.packing, cfg.model.max_seq_len)


if __name__ == "__main__":
    sys.exit(main())
