"""The token cache's format: a corpus's tokens in parts, each written once and read as one array per split.

    <cache_dir>/<corpus key>/   tokenizer.json   meta.json (vocabulary, token dtype, end-of-text id)
        shards/<shard key>.json     the shard's files, parts and what reading them saw; written last
        shards/<shard key>-<part>/  train.bin val.bin (token ids), train_mask.bin val_mask.bin (chats only:
                                    1 where learned), part.json (tokens, documents and text bytes per split)

A shard is one source file, or a run of small neighbouring files: a run ends after a file whose name hashes to
0 mod GROUP_EVERY, so adding a file redoes only its own run. Its key hashes its files' paths, sizes and
modification times. A shard is cut into parts of about PART_BYTES of text, each written under a temporary name
and renamed when complete: a kill loses at most the part being written. Each document goes to train or val by
a keyed hash of its content, so the split is stable per document whatever file or container holds it.
preparation.py writes the cache; batches.py reads the parts through TokenStream.
"""

import contextlib
import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from tokenizers import Tokenizer

from llm.base.atomic import file_digest, stamp
from llm.base.errors import DataError
from llm.tokens.tokenizer import TOKENIZER_FILE, load_tokenizer

GROUP_FILE_BYTES = 2**20  # files smaller than this on disk share a shard with their neighbours
GROUP_EVERY = 32  # a run of small files ends where a path hashes to 0 mod this: about 32 files per shard
PART_BYTES = 64 * 2**20  # text per part: what a kill can lose, and how far --max_tokens may read past its cap
ID_CHUNK = 2**26  # token ids per max() when a part is checked: bounds the memory one chunk maps
META_FIELDS = {"vocab_size": int, "dtype": str, "eot_id": int}  # meta.json: the folder's tokenizer
# a corpus read as it arrives validates on its first parts' val tokens, at least these
ARRIVAL_VAL_TOKENS = 2**18
PART_FIELDS = ("train_tokens", "val_tokens", "train_documents", "val_documents", "train_bytes", "val_bytes")


def digest(*parts) -> str:
    """A short stable hash of JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def file_identity(path: str) -> list:
    """What says a file changed: its path, size and modification time."""
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def group_files(files):
    """A source's files (path, came from a folder) as shards, yielded as soon as each is complete (files may
    still be arriving): a file of GROUP_FILE_BYTES or more on its own, smaller ones in runs that end where a
    path's hash says (never where a count or a size says, which an added file would shift for every run after
    it)."""
    run = []
    for path, in_folder in files:
        if os.path.getsize(path) >= GROUP_FILE_BYTES:
            if run:
                yield run
            yield [(path, in_folder)]
            run = []
            continue
        run.append((path, in_folder))
        # By the file's name, not its folder or compression: the same files group alike wherever they lie.
        if (zlib.crc32(os.path.basename(path).removesuffix(".gz").removesuffix(".zst").encode())
            % GROUP_EVERY == 0):
            yield run
            run = []
    if run:
        yield run


def shard_key(files: list, budget: float) -> str:
    """A shard's name: its files as they are now, and the text budget left at its start when one applies."""
    return digest([file_identity(p) + [f] for p, f in files], None if budget == float("inf") else int(budget))


def is_val(doc, seed: int, val_fraction: float) -> bool:
    """Whether a document (text, or chat messages) is held out: a keyed hash of its content, so the split
    stays the same whatever holds the document (file, container, shard) and a duplicate never straddles the
    two."""
    text = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True)
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") < val_fraction * 2**64


def split_parts(docs, stats, seed: int, val_fraction: float):
    """Yield (part, doc_id, piece, document, text bytes, is_val) over a shard's documents, cut into parts of
    about PART_BYTES. In a part of two or more documents none of which is val, the last one is (a small corpus
    keeps a validation split)."""
    part, held, size, drawn = 0, None, 0, []
    before = stats.bytes
    for doc_id, piece, doc in docs:
        nbytes, before = stats.bytes - before, stats.bytes
        if held:
            yield part, *held  # not its part's last: its draw is final
        drawn.append(is_val(doc, seed, val_fraction))
        held, size = (doc_id, piece, doc, nbytes, drawn[-1]), size + nbytes
        if size >= PART_BYTES:
            yield part, *held[:4], held[4] or (len(drawn) > 1 and not any(drawn))
            part, held, size, drawn = part + 1, None, 0, []
    if held:
        yield part, *held[:4], held[4] or (len(drawn) > 1 and not any(drawn))


class SplitWriter:
    """Appends a split's documents to <split>.bin and <split>_mask.bin, EOT wherever the text breaks off."""

    def __init__(self, folder: str, split: str, dtype, eot: int):
        self.paths = [os.path.join(folder, f"{split}.bin"), os.path.join(folder, f"{split}_mask.bin")]
        self.files = [open(p, "wb") for p in self.paths]
        self.sums = [hashlib.sha256(), hashlib.sha256()]  # of what is written: a later read can tell a change
        self.dtype, self.eot = dtype, eot
        self.tokens = self.documents = self.bytes = 0
        self.last = None  # (doc_id, piece, is its last token learned) of the piece written last
        # Until flush: ids as one Python list, masks as runs (a number: that many learned tokens) or lists, so
        # a batch is converted to arrays in one call, and plain text never builds a list of flags.
        self.ids, self.masks = [], []

    def add(self, doc_id: int, piece: int, ids: list, mask, nbytes: int):
        """Append one piece (mask: a list of flags, or True when every token is learned); an EOT (learned like
        the end before it) first if it doesn't continue the last."""
        if self.last and self.last[:2] != (doc_id, piece - 1):
            self.ids.append(self.eot)
            self.masks.append([self.last[2]])
        self.ids += ids
        self.masks.append(len(ids) if mask is True else mask)
        self.last = (doc_id, piece, True if mask is True else bool(mask and mask[-1]))
        self.documents += 1
        self.bytes += nbytes

    def flush(self):
        """Write what add() collected."""
        self.tokens += len(self.ids)
        # file.write, not ndarray.tofile: on a full disk tofile raises OSError('N requested and M written')
        # without its errno, which then read as a folder we may not write to (exit 2) rather than a full disk
        # (exit 1).
        ids = np.fromiter(self.ids, self.dtype, len(self.ids))
        self.files[0].write(ids)
        self.sums[0].update(ids)
        if self.masks:
            masks = np.concatenate([np.ones(m, np.uint8) if isinstance(m, int) else np.array(m, np.uint8)
                                    for m in self.masks])
            self.files[1].write(masks)
            self.sums[1].update(masks)
        self.ids, self.masks = [], []

    def close(self, keep_masks: bool):
        """End the last document with EOT, flush to disk, and drop the mask file when no chat needs it."""
        if self.last:
            self.ids.append(self.eot)
            self.masks.append([self.last[2]])
        self.flush()
        for f in self.files:
            f.close()
        if not keep_masks:
            os.remove(self.paths[1])

    def counts(self, split: str) -> dict:
        return {f"{split}_tokens": self.tokens, f"{split}_documents": self.documents,
                f"{split}_bytes": self.bytes}

    def digests(self) -> dict:
        """Each file kept, by name: the short sha256 of its bytes as written (file_digest's form)."""
        return {os.path.basename(p): h.hexdigest()[:16] for p, h in zip(self.paths, self.sums)
                if os.path.exists(p)}


def read_json(path: str):
    """A JSON file's object, or None when it is missing or damaged."""
    try:
        with open(path, "rb") as f:
            found = json.loads(f.read().decode("utf-8"))
    # ValueError: bad UTF-8 or JSON; RecursionError: nested 10^5 deep
    except (OSError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def part_problem(folder: str, vocab_size: int, dtype: str) -> str | None:
    """What is wrong with a part, in a few words; None when part.json, its files' sizes and ids agree."""
    part = read_json(os.path.join(folder, "part.json"))
    if part is None:
        return "part.json is missing or unreadable"
    for key in PART_FIELDS:
        if not isinstance(part.get(key), int) or isinstance(part[key], bool) or part[key] < 0:
            return f"part.json's {key} is {part.get(key)!r}"
    if not isinstance(part.get("has_masks"), bool):
        return f"part.json's has_masks is {part.get('has_masks')!r}"
    for split in ("train", "val"):
        tokens = part[f"{split}_tokens"]
        for file, need in [(f"{split}.bin", tokens * np.dtype(dtype).itemsize)] + \
                [(f"{split}_mask.bin", tokens)] * part["has_masks"]:
            where = os.path.join(folder, file)
            if not os.path.isfile(where) or os.path.getsize(where) != need:
                return f"{file} is missing or not the {need:,} bytes that part.json's {split}_tokens needs"
        if part.get("written", {}).get(f"{split}.bin") == stamp(os.path.join(folder, f"{split}.bin")):
            # untouched since written, by its size and time; TokenStream checks its ids at first read
            continue
        if (changed := changed_file(folder, part, split)) is not None:
            return f"{changed}'s bytes are not those written (their sha256 differs)"
        top = largest_id(os.path.join(folder, f"{split}.bin"), dtype) if tokens else 0
        if top >= vocab_size:
            return f"{split}.bin holds token id {top}, past the vocabulary of {vocab_size}"
    return None


def changed_file(folder: str, part: dict, split: str) -> str | None:
    """The first of a split's token and mask files whose bytes differ from the sha256 part.json recorded when
    it was written (a file touched since, by its size and time: the same size with other ids, say); None when
    all agree, or for a part written before sums were kept."""
    sums = part.get("sha256") if isinstance(part.get("sha256"), dict) else {}
    for name in (f"{split}.bin", f"{split}_mask.bin"):
        if name in sums and file_digest(os.path.join(folder, name)) != sums[name]:
            return name
    return None


def largest_id(path: str, dtype) -> int:
    """The largest id of a token file, read in chunks: the time of reading it once, against an IndexError (or
    a device-side assert) hours into a run."""
    ids = np.memmap(path, dtype=dtype, mode="r")
    return max((int(ids[i:i + ID_CHUNK].max()) for i in range(0, len(ids), ID_CHUNK)), default=0)


_ids_checked: set = set()  # (path, size, time) of the token files whose ids this process has read


class TokenStream:
    """One split of several parts read as one array: slices cross from one part's file into the next. Parts
    without a file (masks of parts without chats) read as `fill`. A fresh memmap per read, as nanoGPT does:
    one kept open maps every page it ever touched, and a long run's memory would grow."""

    def __init__(self, paths: list, lengths: list, dtype, fill: int = 0, vocab: int | None = None):
        keep = [i for i, n in enumerate(lengths) if n > 0]  # np.memmap refuses empty files
        self.paths, self.dtype, self.fill, self.vocab = [paths[i] for i in keep], np.dtype(dtype), fill, vocab
        self.ends = np.cumsum([lengths[i] for i in keep], dtype=np.int64)

    def _check_ids(self, path: str):
        """Token ids past the vocabulary in a file whose size and time were kept (part_problem trusts those)
        are found the first time this process reads it, and named, instead of reaching the embedding."""
        key = (path, *stamp(path))
        if self.vocab is None or key in _ids_checked:
            return
        top = largest_id(path, self.dtype)
        if top >= self.vocab:
            raise DataError(f"{path} holds token id {top}, past the vocabulary of {self.vocab}: the "
                            "token cache was changed after it was written; delete "
                            f"{os.path.dirname(path)} and it is rebuilt")
        _ids_checked.add(key)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop, _ = where.indices(len(self))
        out, i = [], int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            begin = int(self.ends[i - 1]) if i else 0
            take = min(stop, int(self.ends[i])) - start
            if self.paths[i] is None:
                out.append(np.full(take, self.fill, self.dtype))
            else:
                self._check_ids(self.paths[i])
                out.append(np.memmap(self.paths[i], dtype=self.dtype,
                                     mode="r")[start - begin:start - begin + take])
            start, i = start + take, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, self.dtype)


def val_parts(parts: list, arrival: bool) -> list:
    """The parts whose val documents make the validation split: all of them, or for a corpus read as it
    arrives (corpus.in_arrival_order) the first ones up to ARRIVAL_VAL_TOKENS, so evaluations are alike while
    files come."""
    if not arrival:
        return parts
    ends = np.cumsum([p["val_tokens"] for p in parts])
    return parts[:int(np.searchsorted(ends, ARRIVAL_VAL_TOKENS)) + 1]


@dataclass
class PreparedData:
    """The parts of a cache folder that hold these sources, in order, and their totals (meta)."""
    path: str
    meta: dict
    parts: list  # per part: folder, source (index), tokens per split (train after --max_tokens), has_masks
    weights: list | None = None  # per source, summing to 1; None: windows drawn over all tokens alike
    arrival: bool = False  # read in the order its files arrive (corpus.in_arrival_order)
    commit: str = ""  # the Hub commit of such a corpus

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.path, TOKENIZER_FILE)

    @cached_property
    def tokenizer(self):
        """The cache's tokenizer, loaded once for whatever in the run reads text (evaluation, samples)."""
        return load_tokenizer(self.tokenizer_path)

    @property
    def arrived(self) -> bool:
        """Whether every part is in: always, but for a corpus still arriving (arrival.ArrivingData)."""
        return True

    def stream(self, split: str, masks: bool = False) -> TokenStream:
        """A split's tokens (or its masks: 1 where learned) across the parts, as one array."""
        parts = list(self.parts)  # one look: arrival.py appends parts while a run reads them
        parts = val_parts(parts, self.arrival) if split == "val" else parts
        lengths = [p[f"{split}_tokens"] for p in parts]
        if not masks:
            return TokenStream([os.path.join(p["folder"], f"{split}.bin") for p in parts], lengths,
                               self.meta["dtype"], vocab=self.meta["vocab_size"])
        paths = [os.path.join(p["folder"], f"{split}_mask.bin") if p["has_masks"] else None for p in parts]
        return TokenStream(paths, lengths, np.uint8, fill=1)

    def source_ranges(self) -> list[tuple[int, int]]:
        """Where each source's train tokens lie in the train stream: its parts are neighbours."""
        ends = np.cumsum([0] + [p["train_tokens"] for p in self.parts])
        owner = [p["source"] for p in self.parts]
        return [((int(ends[owner.index(s)]), int(ends[len(owner) - owner[::-1].index(s)]))
                 if s in owner else (0, 0))
                for s in range(len(self.meta["sources"]))]  # a source capped at 0 tokens holds none

    @property
    def fingerprint(self) -> str:
        """Names this data exactly: the parts, the tokens read from each, the mixture; for a corpus read as it
        arrives, its folder and commit, which fix every part before it is written."""
        if self.arrival:
            return digest("arrival", os.path.basename(self.path), self.commit)
        return digest([[os.path.basename(p["folder"]), p["train_tokens"]] for p in self.parts], self.weights,
                      os.path.basename(self.path))

    @property
    def files(self) -> list:
        """[path, size, modification time] of every source file the parts were read from."""
        return sorted({tuple(f) for p in self.parts for f in p["files"]})

    def texts(self, split: str) -> list[str]:
        """The split's documents as text, decoded from the cache (special tokens of chats kept)."""
        tokens = self.stream(split)[:].tolist()
        tok, eot = Tokenizer.from_file(self.tokenizer_path), self.meta["eot_id"]
        cuts = [i for i, t in enumerate(tokens) if t == eot]
        return [tok.decode(tokens[a + 1:b], skip_special_tokens=False) for a, b in zip([-1] + cuts, cuts)]


def folder_problem(path: str) -> str | None:
    """What is wrong with a cache folder's meta.json and tokenizer, in a few words; None when they agree."""
    meta = read_json(os.path.join(path, "meta.json"))
    if meta is None:
        return "meta.json is missing, unreadable or not an object"
    for key, kind in META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            return f"meta.json's {key} is {value!r}"
    if meta["dtype"] not in ("uint16", "uint32") or meta["eot_id"] >= meta["vocab_size"]:
        return f"meta.json's dtype {meta['dtype']!r} or eot_id {meta['eot_id']} does not fit its vocabulary"
    try:
        vocab = Tokenizer.from_file(os.path.join(path, TOKENIZER_FILE)).get_vocab_size()
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        return f"{TOKENIZER_FILE} is unreadable: {str(e).splitlines()[0][:80]}"
    if vocab != meta["vocab_size"]:
        return f"{TOKENIZER_FILE} has {vocab} tokens, meta.json's vocab_size {meta['vocab_size']}"
    return None


def drop_stale(shards: str, log):
    """Remove the parts and shard records whose source files changed or went away (nothing reads them again),
    and those too damaged to say which files they hold (rebuilt if still wanted)."""
    for entry in os.listdir(shards):
        where = os.path.join(shards, entry)
        if entry.startswith("."):
            continue  # a writer's temporary folder: atomic.remove_leftovers judges those
        record = read_json(os.path.join(where, "part.json") if os.path.isdir(where) else where)
        files = record.get("files") if record else None
        if isinstance(files, list) and all(_unchanged(f) for f in files):
            continue
        if not isinstance(files, list):
            log(f"data: the token cache part {where} is damaged (its record is unreadable), rebuilding it")
        if os.path.isdir(where):
            shutil.rmtree(where, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(where)


def _unchanged(identity) -> bool:
    try:
        return file_identity(identity[0]) == list(identity)
    except (OSError, TypeError, IndexError):
        return False


def complete_shard(shards: str, key: str, meta: dict) -> list | None:
    """A complete shard's part records, or None when its record is missing or a part is damaged."""
    record = read_json(os.path.join(shards, key + ".json"))
    if not record or not isinstance(record.get("parts"), int) or not isinstance(record.get("stats"), dict):
        return None
    folders = [os.path.join(shards, f"{key}-{i:05d}") for i in range(record["parts"])]
    if any(part_problem(f, meta["vocab_size"], meta["dtype"]) for f in folders):
        return None
    return record["stats"], [dict(read_json(os.path.join(f, "part.json")), folder=f) for f in folders]
