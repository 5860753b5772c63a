"""What a token cache holds, per source and in all: the train tokens each source may give under --max_tokens,
the cut of what was read past them, the totals meta.json records, the table of sources the start report
prints, and the line of a corpus short of its target. preparation.py writes the cache; this counts it."""

import sysconfig

from config import DataConfig
from llm.base.errors import DataError
from llm.data import token_cache as tc
from llm.data.corpus import ReadStats

SHORT_OF_TARGET = 0.98  # sources this close to the token target are not worth a line
STAT_FIELDS = ("files", "documents", "bytes", "chats", "binary_skipped", "bad_lines", "bad_rows",
               "invalid_utf8")


def caps(cfg: DataConfig, found) -> list:
    """The train tokens each source may give under --max_tokens (inf: no cap); without weights, one cap for
    all."""
    if not cfg.max_tokens:
        return [float("inf")] * len(found)
    if not found[0].weight:
        return [cfg.max_tokens] * len(found)  # checked against every source's tokens together
    total = sum(source.weight for source in found)
    return [round(cfg.max_tokens * source.weight / total) for source in found]


def taken(parts: list, s: int, weighted: bool) -> int:
    return sum(p["train_tokens"] for p in parts if p["source"] == s or not weighted)


def room(total: int, parts: list, itemsize: int) -> int:
    """About the bytes the rest of the token cache takes: the text not yet in a part, at the tokens per byte
    of the parts so far (before any, one per byte: the most a byte-level tokenizer gives)."""
    text = sum(p["train_bytes"] + p["val_bytes"] for p in parts)
    tokens = sum(p["train_tokens"] + p["val_tokens"] for p in parts)
    return int(max(0, total - text) * (tokens / text if text else 1) * itemsize)


def merge(seen: ReadStats, counts: dict):
    """Add a shard's reading counts to the corpus's."""
    for name in STAT_FIELDS:
        setattr(seen, name, getattr(seen, name) + int(counts.get(name, 0)))
    for name in ("first_binary", "first_bad", "first_invalid"):
        setattr(seen, name, getattr(seen, name) or str(counts.get(name, "")))


def apply_caps(parts: list, caps: list, weighted: bool):
    """Cut the train tokens read past each cap (the last part of a source, or of the corpus, read in part)."""
    left = list(caps) if weighted else caps[:1] * len(caps)
    for p in parts:
        at = p["source"] if weighted else 0
        p["train_tokens"] = int(min(p["train_tokens"], left[at]))
        left[at] -= p["train_tokens"]


def summed(meta: dict, parts: list, found, weights, arrival: bool = False) -> dict:
    """meta.json's fields with the parts' sums (the validation split's from its parts), and the mixture per
    source."""
    out = dict(meta, has_masks=any(p["has_masks"] for p in parts),
               has_pairs=any(p.get("pairs") for p in parts))
    if out["has_pairs"] and any(p.get("others", 1) for p in parts):
        raise DataError("the sources hold preference pairs (chosen, rejected) and other "
                        "documents: pairs train by preference, the others by next-token loss; "
                        "train on each in a run of its own")
    for key in tc.PART_FIELDS:
        out[key] = sum(p[key] for p in (tc.val_parts(parts, arrival) if key.startswith("val") else parts))
    out["val_bytes_per_token"] = out["val_bytes"] / max(1, out["val_tokens"])
    out["sources"] = []
    for s, source in enumerate(found):
        mine = [p for p in parts if p["source"] == s]
        files = source.files if isinstance(source.files, list) else {f[0] for p in mine for f in p["files"]}
        out["sources"].append({"source": source.given or sysconfig.get_paths()["stdlib"],
                               "weight": weights[s] if weights else None, "files": len(files),
                               "bytes": sum(p["train_bytes"] + p["val_bytes"] for p in mine),
                               "train_tokens": sum(p["train_tokens"] for p in mine)})
    return out


def source_table(meta: dict) -> list[str]:
    """Per source: files, MB, train tokens and their share of the corpus, the share of training windows drawn
    from it (its weight; without weights, its share), and how much more often than once per pass over the
    corpus its tokens are seen (a small source with a large weight is repeated)."""
    width = max(len(s["source"]) for s in meta["sources"])
    rows = [f"{'source':<{width}}  {'files':>6}  {'MB':>9}  {'train tokens':>14} "
            f" {'share':>6}  {'windows':>7}  {'seen':>6}"]
    for s in meta["sources"]:
        share = s["train_tokens"] / max(1, meta["train_tokens"])
        windows = share if s["weight"] is None else s["weight"]
        rows.append(f"{s['source']:<{width}}  {s['files']:>6}  {s['bytes'] / 1e6:>9.1f} "
                    f" {s['train_tokens']:>14,}  {share:>6.1%}  {windows:>7.1%} "
                    f" {windows / max(share, 1e-12):>5.2f}x")
    return rows


def short_of_target(cfg: DataConfig, meta: dict) -> str:
    """One line where the sources hold fewer training tokens than --max_tokens asks for ("" otherwise): a Hub
    dataset offline or out of reach gives only its cached files, and a dataset can be smaller than the target.
    """
    target, have = cfg.max_tokens, meta["train_tokens"]
    if not target or have >= SHORT_OF_TARGET * target:
        return ""
    return (f"data: the sources hold {have:,} training tokens, {have / target:.0%} of the "
            f"--max_tokens target of {target:,}: the run trains on those (a Hub dataset offline or "
            "out of reach gives only its cached files)")
