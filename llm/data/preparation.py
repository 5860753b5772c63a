"""Preparing the token cache (token_cache.py owns its format; batches.py reads it; prepare_data.py is its
script).

Takes the documents corpus.py reads from the sources (default: this Python's standard library), trains a
byte-level tokenizer (tokenizer.py) on a sample of the training split across the sources, and streams every
document through the tokenizer (batched: every core) into the cache's parts: <cache_dir>/<corpus key>/ with
tokenizer.json, meta.json and shards/. The same settings later reuse that folder; a source file added, removed
or touched redoes only its own shard. A bar shows MB read, tokens and the rate, and a table the tokens per
source."""

import itertools
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields, replace

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from config import Config, DataConfig
from llm.base import atomic
from llm.base.distributed import Ranks
from llm.base.errors import ConfigError, DataError
from llm.data import arrival, hf_datasets
from llm.data import corpus_totals as totals
from llm.data import token_cache as tc
from llm.data.batches import check_windows
from llm.data.corpus import (PIECE_BYTES, ReadStats, check_read, documents, file_bytes, files_read,
                             in_arrival_order, sources, split_weight)
from llm.data.pairs import as_messages, is_pair, pair_segments
from llm.data.token_cache import PreparedData
from llm.tokens.tiktoken_bpe import Encoder, encoder_for
from llm.tokens.tokenizer import (EOT_TOKEN, MIN_VOCAB, SPECIAL_TOKENS, TOKENIZER_FILE, chat_segments,
                                  chat_text, encode_segments, existing_tokenizer, save_tokenizer,
                                  tokenizer_file, train_tokenizer)

ENCODE_BATCH_BYTES = 4 * 2**20  # text per encode_batch call: keeps every core busy, bounds memory
TOKENIZER_SAMPLE_BYTES = 32 * 2**20  # tokenizer training text; more changes the merges little, costs time
CACHE_FORMAT = 3  # bump when the cache's contents change for the same inputs (3: shards, split by content)
BATCH_TIME_FIELDS = ("cache_dir", "packing", "max_tokens")  # settings that do not change the cache's contents


def _budget(cfg: DataConfig) -> float:
    return cfg.max_source_mb * 1e6 or float("inf")


def _shards(cfg: DataConfig, found):
    """Yield (source index, its files, shard key, its ReadStats, its documents split into parts) in order; the
    key carries the text budget left at the shard's start (a shard ends where max_source_mb does), so the
    shards are read in order."""
    budget = _budget(cfg)
    for s, source in enumerate(found):
        for files in tc.group_files(source.files):
            if budget <= 0:
                return
            stats = ReadStats()
            key = tc.shard_key(files, budget)
            yield s, files, key, stats, tc.split_parts(documents(files, cfg, stats, budget), stats,
                                                       cfg.data_seed, cfg.val_fraction)
            budget -= stats.bytes  # what the caller read of it (all, unless it stopped early)


def split_texts(cfg: DataConfig, split: str | None = "val") -> list[str]:
    """The documents of a split ("train", "val"; None: all) as text, read from the sources with the split the
    cache of these settings has (no tokenizer, no cache), so any model can be measured on the same bytes.
    Chats come as their template text."""
    texts, last = [], None
    for *_, docs in _shards(cfg, sources(cfg)):
        for part, doc_id, piece, doc, _, is_val in docs:
            if split is not None and is_val != (split == "val"):
                continue
            text = doc if isinstance(doc, str) else chat_text(as_messages(doc))
            if last == (part, doc_id, piece - 1):
                texts[-1] += text  # the next piece of the same file: the cache joins them too
            else:
                texts.append(text)
            last = (part, doc_id, piece)
        last = None
    if not texts:
        raise DataError(f"no text found in {', '.join(cfg.sources) or 'the default corpus'}, "
                        "pass files that hold text")
    return texts


# ----------------------------------------------------------------------------- tokenizer

def _tokenizer_sample(cfg: DataConfig, found):
    """Training-split texts, about TOKENIZER_SAMPLE_BYTES: each source's share by its weight (or size), taken
    from the head of each of its shards in proportion to the shard's size."""
    sizes = [sum(file_bytes(p, cfg) for p, _ in source.files) for source in found]
    shares = [source.weight for source in found] if found[0].weight else sizes
    shares = shares if sum(shares) > 0 else [1] * len(found)  # sizes unknown (empty files): alike
    whole = _budget(cfg) == float("inf")
    for s, files, _, _, docs in _shards(cfg, found):
        size = sum(file_bytes(p, cfg) for p, _ in files)
        want, taken = TOKENIZER_SAMPLE_BYTES * shares[s] / sum(shares) * size / max(1, sizes[s]), 0
        for _, _, _, doc, nbytes, is_val in docs:
            if taken >= want and whole:
                break  # under max_source_mb the shard is read on: where the budget ends names the next shards
            if taken < want and not is_val:
                taken += nbytes  # a conversation trains as its template text without the special tokens
                yield doc if isinstance(doc, str) else "".join(f"{m['role']}\n{m['content']}\n"
                                                               for m in as_messages(doc))


def _make_tokenizer(cfg: DataConfig, found, vocab_size: int, log) -> Tokenizer:
    """The configured local tokenizer, or a new one trained on a sample of the training split."""
    start = time.perf_counter()
    if cfg.tokenizer:
        tok = existing_tokenizer(cfg.tokenizer, vocab_size)
        log(f"data: using tokenizer {cfg.tokenizer} ({tok.get_vocab_size()} tokens)")
        return tok
    tok = train_tokenizer(_tokenizer_sample(cfg, found), cfg.tokenizer_type, vocab_size)
    log(f"data: trained a {cfg.tokenizer_type} tokenizer of {tok.get_vocab_size()} tokens "
        f"in {time.perf_counter() - start:.1f}s")
    return tok


# ----------------------------------------------------------------------------- token cache

def _corpus_key(cfg: DataConfig, vocab_size: int) -> str:
    """The cache folder's name: every data setting but the cache's place and how batches are cut from it (a
    field added to DataConfig takes part without being listed here), the sources as given (not their files,
    whose changes redo only their own shards; not their weights) and the tokenizer file by its contents: a
    GGUF's tokenizer is written to a new temporary path by each process, and by its path no run from one could
    resume."""
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in BATCH_TIME_FIELDS}
    settings.update(sources=[_source_key(split_weight(g)[0]) for g in cfg.sources], vocab_size=vocab_size,
                    format=CACHE_FORMAT, piece_bytes=PIECE_BYTES, part_bytes=tc.PART_BYTES,
                    tokenizer=tc.file_digest(tokenizer_file(cfg.tokenizer)) if cfg.tokenizer else "")
    if in_arrival_order(cfg):  # its tokenizer and validation split come from its first file and parts
        settings.update(arrival=True)
    return tc.digest(settings)


def _source_key(source: str) -> str:
    """A source as the cache key names it: a path made absolute (the same folder from any directory), a Hub
    URL as written (its revision and pattern say which files)."""
    return source if hf_datasets.is_hub_dataset(source) else os.path.abspath(source)


def _open_folder(path: str, cfg: DataConfig, found, vocab_size: int, log) -> tuple[Tokenizer, dict]:
    """The cache folder's tokenizer and meta.json, made (tokenizer trained) when absent or damaged."""
    problem = tc.folder_problem(path) if os.path.isdir(path) else "absent"
    if problem is None:
        return (Tokenizer.from_file(os.path.join(path, TOKENIZER_FILE)),
                tc.read_json(os.path.join(path, "meta.json")))
    if problem != "absent":  # a cache is derived data: rebuilt, not refused
        log(f"data: the token cache {path} is damaged ({problem}), rebuilding it")
    tok = _make_tokenizer(cfg, found, vocab_size, log)
    vocab = tok.get_vocab_size()
    meta = {"vocab_size": vocab, "dtype": "uint16" if vocab <= 2**16 else "uint32",
            "eot_id": tok.token_to_id(EOT_TOKEN), "tokenizer": cfg.tokenizer or cfg.tokenizer_type,
            "format": CACHE_FORMAT}
    # Under a temporary name, then renamed over the damaged folder: its parts were tokenized by another
    # tokenizer.
    with atomic.folder(path, f"writing the token cache {path}") as tmp:
        save_tokenizer(tok, os.path.join(tmp, TOKENIZER_FILE))
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
    return tok, meta


def _land(batch: list, encoded, writers: dict, bar):
    """Append a tokenized batch of (split, doc_id, piece, document, bytes) to its splits' writers."""
    for (split, doc_id, piece, _, nbytes), (ids, mask) in zip(batch, encoded):
        writers[split].add(doc_id, piece, ids, mask, nbytes)
    for writer in writers.values():
        writer.flush()
    _advance(bar, sum(item[4] for item in batch), sum(len(ids) for ids, _ in encoded))


def _advance(bar, nbytes: int, tokens: int):
    """The bar's MB read (tqdm derives the rate and the ETA), and the tokens so far beside them."""
    bar.tokens = getattr(bar, "tokens", 0) + tokens
    bar.set_postfix_str(f"{bar.tokens:,} tokens", refresh=False)
    bar.update(nbytes)


def _write_part(folder: str, items, files: list, tok: Tokenizer, encoder: Encoder, meta: dict, bar,
                need: int = 0) -> dict:
    """Tokenize one part's documents into a folder written under a temporary name; returns its part.json. A
    batch is tokenized in a thread (the encoder releases the GIL and uses every core) while the next is read.
    need: about the bytes the rest of the cache takes, for the message of a full disk."""
    with (atomic.folder(folder, f"writing the token cache part {folder}", need) as tmp,
          ThreadPoolExecutor(1) as pool):
        writers = {s: tc.SplitWriter(tmp, s, meta["dtype"], meta["eot_id"]) for s in ("train", "val")}
        batch, size, chats, running, kinds = [], 0, False, None, {"pairs": 0, "others": 0}
        for _, doc_id, piece, doc, nbytes, is_val in itertools.chain(items, [(None,) * 6]):  # None: the end
            if doc_id is not None:
                batch.append(("val" if is_val else "train", doc_id, piece, doc, nbytes))
                chats |= not isinstance(doc, str)
                kinds["pairs" if is_pair(doc) else "others"] += 1
                size += nbytes
                if size < ENCODE_BATCH_BYTES:
                    continue
            if running:
                _land(running[0], running[1].result(), writers, bar)
            segments = [d if isinstance(d, str) else pair_segments(d) if is_pair(d) else chat_segments(d)
                        for _, _, _, d, _ in batch]
            running, batch, size = (batch, pool.submit(encode_segments, tok, segments, encoder)), [], 0
        _land(running[0], running[1].result(), writers, bar)
        record = {"has_masks": chats, "files": [tc.file_identity(p) for p, _ in files], **kinds}
        for split, writer in writers.items():
            writer.close(keep_masks=chats)
            record.update(writer.counts(split))
            record.setdefault("sha256", {}).update(writer.digests())
        # Ids come from this tokenizer (below its vocabulary); the stamps let later runs skip re-reading them.
        record["written"] = {f"{s}.bin": tc.stamp(os.path.join(tmp, f"{s}.bin")) for s in writers}
        with open(os.path.join(tmp, "part.json"), "w", encoding="utf-8") as f:
            json.dump(record, f)
    return record


def _build_parts(path: str, cfg: DataConfig, found, tok: Tokenizer, meta: dict, log, on_part=None,
                 bar: bool = True) -> tuple[list, ReadStats]:
    """Every shard's parts, reused where complete and intact, written where not; stops a source at its cap.
    on_part(parts): called with the parts so far whenever one is added (a corpus that trains as it arrives).
    """
    shards = os.path.join(path, "shards")
    os.makedirs(shards, exist_ok=True)
    atomic.remove_leftovers(shards)  # of preparations killed before they finished a part
    tc.drop_stale(shards, log)
    caps, weighted, seen, parts, encoder = (totals.caps(cfg, found), bool(found[0].weight),
                                            ReadStats(), [], None)
    total = None  # unknown while files arrive
    if all(isinstance(source.files, list) for source in found):
        total = min(sum(file_bytes(p, cfg) for source in found for p, _ in source.files), _budget(cfg))
    with tqdm(total=total, unit="B", unit_scale=True, desc="preparing", disable=None if bar else True) as bar:
        for s, files, key, stats, docs in _shards(cfg, found):
            if totals.taken(parts, s, weighted) >= caps[s]:
                continue
            if (done := tc.complete_shard(shards, key, meta)) is not None:
                counts, records = done
                stats.bytes = counts.get("bytes", 0)  # for the budget of the shards after it
                totals.merge(seen, counts)
                parts += [dict(r, source=s) for r in records]
                _advance(bar, stats.bytes, sum(r["train_tokens"] + r["val_tokens"] for r in records))
                if on_part:
                    on_part(parts)
                continue
            count = 0
            for part, items in itertools.groupby(docs, key=lambda d: d[0]):
                folder = os.path.join(shards, f"{key}-{part:05d}")
                problem = (tc.part_problem(folder, meta["vocab_size"], meta["dtype"])
                           if os.path.isdir(folder) else "absent")
                if problem is None:  # written by a run that stopped before the shard's end: read past it
                    record = tc.read_json(os.path.join(folder, "part.json"))
                    _advance(bar, sum(n for *_, n, _ in items), record["train_tokens"] + record["val_tokens"])
                else:
                    if problem != "absent":
                        log(f"data: the token cache part {folder} is damaged ({problem}), rebuilding it")
                    encoder = encoder or encoder_for(tok, log)  # said once, when something is encoded
                    record = _write_part(folder, items, files, tok, encoder, meta, bar,
                                         totals.room(total or 0, parts, np.dtype(meta["dtype"]).itemsize))
                parts.append(dict(record, folder=folder, source=s))
                if on_part:
                    on_part(parts)
                count += 1
                if totals.taken(parts, s, weighted) >= caps[s]:
                    break
            else:
                atomic.write_text(os.path.join(shards, key + ".json"), json.dumps(
                    {"files": [tc.file_identity(p) for p, _ in files], "parts": count,
                     "stats": asdict(stats)}))
            totals.merge(seen, asdict(stats))
    return parts, seen


def _old_caches(cache_dir: str) -> list[str]:
    """Cache folders of the single-file format (before shards): no longer read."""
    return sorted(os.path.join(cache_dir, d)
                  for d in (os.listdir(cache_dir) if os.path.isdir(cache_dir) else [])
                  if os.path.isfile(os.path.join(cache_dir, d, "train.bin")))


def prepare(cfg: DataConfig, vocab_size: int, seq_len: int, log=print,
            background: bool = False) -> PreparedData:
    """Build the token cache for these settings, or reuse what of it is finished; raises DataError on bad
    input. background: a corpus read in arrival order (corpus.in_arrival_order) is prepared in a thread, and
    the ArrivingData returned as soon as its first parts hold a validation split and a training window."""
    if cfg.data_seed < 0:
        raise DataError(f"data_seed={cfg.data_seed} is invalid, pass a seed >= 0")
    if not cfg.tokenizer and vocab_size < MIN_VOCAB:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level {cfg.tokenizer_type} "
                        f"tokenizer, which needs {MIN_VOCAB} (256 bytes and {len(SPECIAL_TOKENS)} special "
                        f"tokens); pass --vocab_size {MIN_VOCAB} or more")
    in_order = in_arrival_order(cfg)
    background &= in_order
    # a file downloads while the one before tokenizes
    start, found = time.perf_counter(), sources(cfg, lazy=in_order)
    sample, found = _first_file(found) if in_order else (found, found)
    path = os.path.join(cfg.cache_dir, _corpus_key(cfg, vocab_size))
    atomic.remove_leftovers(cfg.cache_dir)  # of preparations killed (kill -9, SIGTERM) before they finished
    for old in _old_caches(cfg.cache_dir):
        log(f"data: {old} holds a token cache of an earlier format, no longer "
            "read; delete it to free its space")
    created = not os.path.isdir(path)
    try:
        tok, meta = _open_folder(path, cfg, sample, vocab_size, log)
        if background:
            return _in_background(cfg, path, tok, meta, found, seq_len, log)
        parts, seen = _build_parts(path, cfg, found, tok, meta, log)
        check_read(seen, cfg, log)
    except DataError:
        shards = os.path.join(path, "shards")
        if created and not [p for p in (os.listdir(shards) if os.path.isdir(shards) else [])
                            if p[0] != "." and not p.endswith(".json")]:
            shutil.rmtree(path, ignore_errors=True)  # bad input leaves no folder behind, only finished parts
        raise
    data = _prepared(cfg, path, meta, parts, seen, found, time.perf_counter() - start, log)
    check_windows(data, cfg.packing, seq_len)
    return data


def _first_file(found: list) -> tuple[list, list]:
    """(the source with its first file only, from which a corpus read in arrival order trains its tokenizer;
    the source with every file, each fetched while the reader tokenizes the one before)."""
    files = iter(found[0].files)
    first = list(itertools.islice(files, 1))  # downloads it
    return ([replace(found[0], files=first)],
            [replace(found[0], files=arrival.one_ahead(itertools.chain(first, files)))])


def _prepared(cfg: DataConfig, path: str, meta: dict, parts: list, seen: ReadStats, found, seconds: float,
              log) -> PreparedData:
    """The finished cache's data: the parts cut at their caps, the totals, and the lines saying what it holds.
    """
    in_order = in_arrival_order(cfg)
    totals.apply_caps(parts, totals.caps(cfg, found), bool(found[0].weight))
    weights = [source.weight / sum(x.weight for x in found) for source in found] if found[0].weight else None
    data = PreparedData(path, totals.summed(meta, parts, found, weights, in_order), parts, weights,
                        arrival=in_order,
                        commit=hf_datasets.commits.get(cfg.sources[0], "") if in_order else "")
    m = data.meta
    m.update(files=seen.files, source_bytes=seen.bytes, binary_files_skipped=seen.binary_skipped,
             bad_lines_skipped=seen.bad_lines, invalid_utf8_replaced=seen.invalid_utf8,
             seconds=round(seconds, 2), mb_per_second=round(seen.bytes / 1e6 / seconds, 2))
    log(f"data: {files_read(seen)}, {seen.documents} documents, {seen.bytes / 1e6:.1f} MB in {len(parts)} "
        f"parts, ready in {seconds:.1f}s; train {m['train_tokens']:,} tokens, val {m['val_tokens']:,} "
        f"tokens, {m['val_bytes_per_token']:.2f} bytes per token")
    if len(found) > 1 or cfg.max_tokens:
        for row in totals.source_table(m):
            log(f"data: {row}")
    return data


def _in_background(cfg: DataConfig, path: str, tok: Tokenizer, meta: dict, found, seq_len: int,
                   log) -> arrival.ArrivingData:
    """The cache of a corpus read in arrival order, written by a thread while the run trains on its first
    parts."""
    start, caps = time.perf_counter(), totals.caps(cfg, found)
    commit = hf_datasets.commits.get(cfg.sources[0], "")

    def work(data: arrival.ArrivingData):
        def on_part(parts):
            capped = [dict(p) for p in parts]
            totals.apply_caps(capped, caps, False)
            data.publish(capped, totals.summed(meta, capped, found, None, arrival=True))
        parts, seen = _build_parts(path, cfg, found, tok, meta, arrival.say, on_part, bar=False)
        check_read(seen, cfg, arrival.say)
        done = _prepared(cfg, path, meta, parts, seen, found, time.perf_counter() - start, arrival.say)
        data.publish(done.parts, done.meta)
        data.finish(done.meta)
        if line := totals.short_of_target(cfg, done.meta):
            arrival.say(line)

    data = arrival.start(arrival.ArrivingData(path, meta, [], arrival=True, commit=commit), work)
    if not data.wait_to_start(seq_len):
        raise data.error
    m = data.meta
    if not data.complete:  # else the thread said what the whole corpus holds
        log(f"data: training starts on the first {len(data.parts)} part(s) "
            f"({m['train_tokens']:,} train tokens, val {m['val_tokens']:,} tokens) while the "
            f"rest of {cfg.sources[0]} downloads and tokenizes")
    check_windows(data, cfg.packing, seq_len)
    return data


def prepare_once(cfg: Config, ranks: Ranks, background: bool = False) -> PreparedData:
    """The training run's token cache: rank 0 builds it while the other ranks wait, then they find it
    complete. background: prepare a corpus read in arrival order while the run trains (one process only)."""
    m = cfg.model
    data = prepare(cfg.data, m.vocab_size, m.max_seq_len, log=ranks.print, background=background) \
        if ranks.is_main else None
    ranks.barrier()
    data = data or prepare(cfg.data, m.vocab_size, m.max_seq_len, log=lambda *a: None)
    if data.meta["vocab_size"] > m.vocab_size:
        raise ConfigError(f"the tokenizer has {data.meta['vocab_size']} tokens but "
                          f"vocab_size={m.vocab_size}, set --vocab_size {data.meta['vocab_size']} or more")
    return data
