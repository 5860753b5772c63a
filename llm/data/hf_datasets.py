"""Hugging Face Hub datasets as data sources, in huggingface_hub's URL form, alone or weighted like any
source:

    python gpu_training_optimized.py --sources "hf://datasets/OWNER/NAME/data/*.parquet" \\
        --max_tokens 200000000
    python prepare_data.py --sources "hf://datasets/OWNER/NAME@v1.0/train/*.jsonl.zst:0.7" notes/:0.3
Files only (parquet, Arrow, JSONL, text, their .gz and .zst), never a dataset script. They come one by one in
name order into huggingface_hub's cache (HF_HOME), only as many as the run's token target needs; a download
cut by a kill resumes where it stopped and is checked against the Hub's hash. With HF_HUB_OFFLINE=1, or when
the Hub cannot be reached, the cached files of the pattern are read. A gated or private dataset uses the token
`hf auth login` saved.
Every name and hash the Hub sends is checked before it names a file, by the Hub client both this file and
hf_hub.py (models) download through (hub_client.py).
"""

import fnmatch
import functools
import math
import os
import re
from contextlib import contextmanager, suppress
from urllib.parse import unquote

from llm.base.errors import DataError, RunFailure
from llm.base.sizing import BYTES_PER_TOKEN
from llm.data import readers
from llm.hub.hub_client import (Repo, cached_commit, download, listing, lost, not_shown, offline,
                                refused_token, remember, safe_relative, say_once, snapshot_path, unreachable)

PREFIX = "hf://datasets/"
URL = re.compile(r"hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^/]+))?(?:/(?P<pattern>.*))?")
DATA_FILES = ("*.parquet", "*.arrow", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.txt", "*.txt.gz",
              "*.txt.zst")
# a token target is met at BYTES_PER_TOKEN; a larger vocabulary packs more bytes in a token
FETCH_MARGIN = 1.5
# how their streams start: zstd's with a frame, or a skippable one (pzstd's)
MAGIC = {".gz": ("gzip", b"\x1f\x8b"),
         ".zst": ("zstd", (b"\x28\xb5\x2f\xfd", *(bytes([0x50 + i]) + b"\x2a\x4d\x18" for i in range(16))))}
_fetched = {}  # (url, target, cache, offline) -> local paths: sources() is asked several times a run
commits = {}  # url -> the commit its files came from, once listed: names a corpus read as it arrives


def is_hub_dataset(source: str) -> bool:
    return source.startswith(PREFIX)


def target_bytes(tokens: int, max_mb: float = 0.0) -> float:
    """The text to fetch for a target of `tokens` (0: all) and at most max_mb MB of text (0: no limit)."""
    wanted = tokens * BYTES_PER_TOKEN * FETCH_MARGIN if tokens else math.inf
    return min(wanted, max_mb * 1e6) if max_mb else wanted


def parse(url: str) -> tuple[str, str, str]:
    """hf://datasets/OWNER/NAME[@REVISION][/GLOB] -> (OWNER/NAME, revision, glob); DataError if not that form.
    """
    m = URL.fullmatch(url)
    if not m or ".." in m["repo"]:
        raise DataError(f"data source {url} is not a Hub dataset URL, write hf://datasets/OWNER/NAME/GLOB "
                        "(hf://datasets/OWNER/NAME@main/data/*.parquet)")
    revision = safe_relative(unquote(m["revision"] or "main"), "the revision", Repo(m["repo"], "dataset",
                              f"data source {url}"), "write a branch, tag or commit after @ "
                              "(refs%2Fconvert%2Fparquet for one with slashes)")
    return m["repo"], revision, (m["pattern"] or "").strip("/")


def matches(path: str, pattern: str) -> bool:
    """A repository path against a glob as a shell reads it: `*` within a folder, `**` across folders; a
    pattern without wildcards names a file or every file under that folder; an empty one the whole repository.
    """
    if not pattern:
        return True
    if not _wild(pattern):
        return path == pattern or path.startswith(pattern + "/")
    return _match(path.split("/"), pattern.split("/"))


def _match(parts: list, globs: list) -> bool:
    if not globs:
        return not parts
    if globs[0] == "**":  # zero or more folders
        return any(_match(parts[i:], globs[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], globs[0]) and _match(parts[1:], globs[1:])


def _folder(pattern: str) -> str:
    """The folders before the pattern's first wildcard: the listing need not go above them."""
    parts = pattern.split("/")[:-1]
    return "/".join(parts[:next((i for i, part in enumerate(parts) if _wild(part)), len(parts))])


def _wild(text: str) -> bool:
    return any(c in text for c in "*?[")


def fetch(url: str, max_bytes: float = math.inf, measure=os.path.getsize, log=say_once) -> list[str]:
    """Local paths of the dataset's files that match, in name order: enough of them that `measure` (bytes of
    text a file holds) sums to max_bytes, downloaded where missing; offline, or with the Hub out of reach, the
    cached ones."""
    from huggingface_hub import constants
    key = (url, max_bytes, constants.HF_HUB_CACHE, offline(constants))
    if key not in _fetched:
        _fetched[key] = list(arriving(url, max_bytes, measure, log))
    return _fetched[key]


def arriving(url: str, max_bytes: float = math.inf, measure=os.path.getsize, log=say_once, bars: bool = True):
    """fetch(url)'s paths one by one, each as soon as it is on disk: a reader starts on the first file while
    the next downloads. The commit the files come from is in commits[url] before the first is yielded. bars: a
    bar of bytes per file (else a line once each is in, for files that come while a run trains)."""
    import huggingface_hub as hub
    from huggingface_hub import constants
    repo_id, revision, pattern = parse(url)
    repo = Repo(repo_id, "dataset", f"data source {url}")
    storage = repo.storage
    with _failures(repo, revision):
        wanted = functools.partial(matches, pattern=pattern)
        listed = None if offline(constants) else listing(hub, repo, revision, wanted, _folder(pattern))
        names, commit = listed or _cached(repo, revision, pattern, offline(constants))
        commits[url] = commit
        total, fetched, count, data = 0, 0, 0, _data_files(names, url)
        for name in data:
            if total >= max_bytes:
                break
            path = snapshot_path(repo, commit, name)
            if listed is not None and not os.path.exists(path):
                download(hub, repo, name, commit, bars)
                fetched += 1
                if not bars:
                    log(f"data: {name} came down ({os.path.getsize(path) / 1e6:,.1f} MB), file "
                        f"{count + 1} of at most {len(data)}")
            count, total = count + 1, total + _readable(measure, path, repo)
            yield path
        if (listed is not None and revision != commit
            and os.path.isdir(os.path.join(storage, "snapshots", commit))):
            remember(repo, revision, commit)
    why = "HF_HUB_OFFLINE is set" if offline(constants) else "the Hub is out of reach"
    where = f"{fetched} downloaded into {os.path.dirname(storage)}" if listed else f"from the cache: {why}"
    log(f"data: {url}: {count} of its {len(data)} {'' if listed else 'cached '}data file(s) at commit "
        f"{commit[:8]}, {where}")


def unavailable(url: str) -> str:
    """Why fetch(url) could give no file (the error's line), or "" when the Hub lists it or the cache holds
    some."""
    try:
        fetch(url, 0, log=lambda line: None)
    except (DataError, RunFailure) as e:
        return str(e)
    return ""


def _cached(repo: Repo, revision: str, pattern: str, by_setting: bool) -> tuple[list, str]:
    """(matching file names, commit) of the cached snapshot of revision; an error line when there is none."""
    storage, commit = repo.storage, cached_commit(repo, revision)
    snapshot = snapshot_path(repo, commit)
    names = sorted(os.path.relpath(os.path.join(d, n), snapshot).replace(os.sep, "/")
                   for d, _, files in os.walk(snapshot) for n in files) if commit else []
    names = [n for n in names if matches(n, pattern)]
    if not names:
        why = "HF_HUB_OFFLINE=1 forbids downloading; unset it" if by_setting else \
            "the Hub could not be reached; check the connection (or HF_ENDPOINT)"
        error = DataError if by_setting else RunFailure
        raise error(f"{repo.where}: no file of it is in the Hugging Face cache "
                    f"({os.path.dirname(storage)}) and {why}, then run again")
    return names, commit


def _data_files(names: list, url: str) -> list:
    """The names of the kinds the readers take; an error line when the pattern matches none (or only others).
    """
    data = [n for n in names if any(fnmatch.fnmatchcase(n.lower(), kind) for kind in DATA_FILES)]
    if not data:
        what = f"only {len(names)} file(s) of other kinds ({names[0]})" if names else "no file"
        raise DataError(f"data source {url} matches {what}; the files read are {', '.join(DATA_FILES)}, "
                        "check the pattern after the dataset's name")
    return data


def _readable(measure, path: str, repo: Repo) -> int:
    """measure(path); a cached file it cannot read, or whose first bytes cannot start its kind (a web page
    where parquet, JSON lines or a gzip stream should be), leaves the cache, blob and link: the next run
    fetches it anew."""
    try:
        if wrong := _wrong_start(path):
            raise DataError(f"{path} is not a readable {wrong}, {readers.REWRITE}")
        return measure(path)
    except DataError as e:
        if not str(e).endswith(readers.REWRITE):  # not the file's fault (pyarrow missing): the file stays
            raise
        _forget(path, repo.storage)
        raise DataError(f"{str(e).removesuffix(readers.REWRITE).rstrip(', ')}; it came from "
                        f"{repo.where} and was removed from the Hugging Face cache: run again (with "
                        "the Hub in reach) to fetch it anew, or leave it out with a narrower pattern "
                        "if the Hub's own copy is the same") from None


def _wrong_start(path: str) -> str:
    """What a file's first bytes show it is not (""): a gzip or zstd stream without its magic, or a web page
    (a proxy's sign-in page) where JSON lines or an Arrow table should be."""
    with open(path, "rb") as f:
        head = f.read(64)
    kind = os.path.splitext(path)[1]
    name, magic = MAGIC.get(kind, (kind[1:], b""))
    if head and not head.startswith(magic):
        return f"{name} file (its first bytes are not a {name} stream's)"
    page = head.lstrip().lower().startswith((b"<!doctype html", b"<html"))
    return f"{kind[1:]} file (it is a web page)" if page and kind in (".jsonl", ".arrow") else ""


def _forget(path: str, storage: str):
    """A snapshot's file and the blob it links to (only one of this repository's blobs), removed."""
    blob = os.path.realpath(path)
    with suppress(FileNotFoundError):  # another rank's run was first
        os.remove(path)
        if os.path.dirname(blob) == os.path.realpath(os.path.join(storage, "blobs")):
            os.remove(blob)


@contextmanager
def _failures(repo: Repo, revision: str):
    """huggingface_hub's failures as one line naming the source and what to do."""
    from huggingface_hub import errors
    try:
        yield
    except errors.HFValidationError as e:  # the Hub's naming rule (no '--', at most 96 characters), not ours
        raise DataError(f"{repo.where}: {repo.id!r} is not a Hub dataset name "
                        f"({str(e).splitlines()[0][:200]}), write hf://datasets/OWNER/NAME/GLOB") from None
    except errors.RepositoryNotFoundError as e:  # gated ones too
        raise DataError(not_shown(repo, isinstance(e, errors.GatedRepoError), f"no dataset {repo.id}",
                                  f"https://huggingface.co/datasets/{repo.id}")) from None
    except errors.RevisionNotFoundError:
        raise DataError(f"{repo.where}: the dataset has no revision "
                        f"{revision!r}, check the name after @") from None
    except errors.EntryNotFoundError:
        raise DataError(f"{repo.where} matches no file, check the pattern after the dataset's name") from None
    except errors.HfHubHTTPError as e:
        if refused_token(e):
            raise DataError(f"{repo.where}: {refused_token(e)}") from None
        raise RunFailure(f"{repo.where}: the Hub answered "
                         f"{str(e).splitlines()[0]}; try again later") from None
    except unreachable() as e:
        raise lost(repo, e) from None


