"""Hugging Face Hub datasets as data sources, in huggingface_hub's URL form, alone or weighted like any source:

    python gpu_training_optimized.py --sources "hf://datasets/OWNER/NAME/data/*.parquet" --max_tokens 200000000
    python prepare_data.py --sources "hf://datasets/OWNER/NAME@v1.0/train/*.jsonl.zst:0.7" notes/:0.3
Files only (parquet, Arrow, JSONL, text, their .gz and .zst), never a dataset script. They come one by one in name
order into huggingface_hub's cache (HF_HOME), only as many as the run's token target needs; a download cut by a
kill resumes where it stopped and is checked against the Hub's hash. With HF_HUB_OFFLINE=1, or when the Hub cannot
be reached, the cached files of the pattern are read. A gated or private dataset uses the token `hf auth login` saved.
Every name and hash the Hub sends is checked here before it names a file; hf_hub.py downloads models through the same
checks (Repo, listing, download).
"""

import errno
import fnmatch
import functools
import hashlib
import importlib
import importlib.util
import math
import os
import re
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from tqdm import tqdm

from llm import atomic, readers
from llm.errors import CheckpointError, DataError, RunFailure
from llm.sizing import BYTES_PER_TOKEN

PREFIX = "hf://datasets/"
URL = re.compile(r"hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^/]+))?(?:/(?P<pattern>.*))?")
DATA_FILES = ("*.parquet", "*.arrow", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.txt", "*.txt.gz", "*.txt.zst")
FETCH_MARGIN = 1.5  # a token target is met at BYTES_PER_TOKEN; a larger vocabulary packs more bytes in a token
COMMIT = re.compile(r"[0-9a-f]{40}")
ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a file's git blob id (sha1), or a large file's sha256
DRIVE = re.compile(r"[A-Za-z]:")  # a path part that Windows reads as a drive
MAGIC = {".gz": ("gzip", b"\x1f\x8b"),  # how their streams start: zstd's with a frame, or a skippable one (pzstd's)
         ".zst": ("zstd", (b"\x28\xb5\x2f\xfd", *(bytes([0x50 + i]) + b"\x2a\x4d\x18" for i in range(16))))}
HOSTILE = "refused before it named a file; check that HF_ENDPOINT points at the Hugging Face Hub or a faithful mirror"
TOKEN = "the token given (HF_TOKEN, or the one `hf auth login` saved)"
REFUSED = f"the Hub refused {TOKEN} as invalid; check it (`hf auth whoami`), or log in again with `hf auth login`"
FORBIDDEN = f"the Hub refused {TOKEN} access (403); check that it may read the repository (`hf auth whoami`)"
_fetched = {}  # (url, target, cache, offline) -> local paths: sources() is asked several times a run
commits = {}  # url -> the commit its files came from, once listed: names a corpus read as it arrives


@dataclass(frozen=True)
class Repo:
    """A Hub repository as the checks and downloads here name it: OWNER/NAME, its kind ("dataset" or "model") and
    `where`, the words its error lines start with (the source as written)."""
    id: str
    kind: str
    where: str

    @property
    def storage(self) -> str:
        """Its folder in huggingface_hub's cache (HF_HOME as huggingface_hub read it), named as it names them."""
        from huggingface_hub import constants
        return os.path.join(constants.HF_HUB_CACHE, f"{self.kind}s--{self.id.replace('/', '--')}")

    @property
    def error(self) -> type:
        return DataError if self.kind == "dataset" else CheckpointError


def is_hub_dataset(source: str) -> bool:
    return source.startswith(PREFIX)


def token_given() -> bool:
    """Whether huggingface_hub sends a token: a refusal then means that token is wrong, not that a login is missing."""
    from huggingface_hub import get_token
    return bool(get_token())


def refused_token(e) -> str:
    """Why the Hub refused the token given ("" if none or not the token): a 401 that is no repository's (those are
    RepositoryNotFoundError) means a token it never issued, a 403 one without the rights."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    return {401: REFUSED, 403: FORBIDDEN}.get(status, "") if token_given() else ""


def offline(constants) -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import (its constants), or as it is set now."""
    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or now


def target_bytes(tokens: int, max_mb: float = 0.0) -> float:
    """The text to fetch for a target of `tokens` (0: all) and at most max_mb MB of text (0: no limit)."""
    wanted = tokens * BYTES_PER_TOKEN * FETCH_MARGIN if tokens else math.inf
    return min(wanted, max_mb * 1e6) if max_mb else wanted


def parse(url: str) -> tuple[str, str, str]:
    """hf://datasets/OWNER/NAME[@REVISION][/GLOB] -> (OWNER/NAME, revision, glob); DataError if not that form."""
    m = URL.fullmatch(url)
    if not m or ".." in m["repo"]:
        raise DataError(f"data source {url} is not a Hub dataset URL, write hf://datasets/OWNER/NAME/GLOB "
                        "(hf://datasets/OWNER/NAME@main/data/*.parquet)")
    revision = _safe_relative(unquote(m["revision"] or "main"), "the revision", Repo(m["repo"], "dataset",
                              f"data source {url}"), "write a branch, tag or commit after @ (refs%2Fconvert%2Fparquet "
                              "for one with slashes)")
    return m["repo"], revision, (m["pattern"] or "").strip("/")


def _safe_relative(path, what: str, repo: Repo, todo: str = "") -> str:
    """A name from the Hub (or the URL) that becomes a path under the cache: no `..`, root, drive, backslash, NUL or
    empty segment, which would name a file outside it."""
    parts = path.split("/") if isinstance(path, str) else [""]
    if any(part in ("", ".", "..") or "\\" in part or "\0" in part or DRIVE.match(part) for part in parts):
        raise repo.error(f"{repo.where}: {what} {str(path)[:200]!r} is not a path inside the {repo.kind} (it has a "
                         f"`..`, root, drive, backslash or empty part); {todo or HOSTILE}")
    return path


def _hex_hash(value, what: str, repo: Repo, pattern=ETAG, todo: str = "") -> str:
    """A hash the Hub sends, checked before it names a file in the cache (anything else could reach outside it)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        digits = "40" if pattern is COMMIT else "40 or 64"
        raise repo.error(f"{repo.where}: {what} {str(value)[:200]!r} is not a hash ({digits} lowercase hex "
                         f"digits); {todo or HOSTILE}")
    return value


def matches(path: str, pattern: str) -> bool:
    """A repository path against a glob as a shell reads it: `*` within a folder, `**` across folders; a pattern
    without wildcards names a file or every file under that folder; an empty one the whole repository."""
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


def _print_once(line: str):
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fetches; the first says what it found
        tqdm.write(line)  # above a training bar, when files come while a run trains


def fetch(url: str, max_bytes: float = math.inf, measure=os.path.getsize, log=_print_once) -> list[str]:
    """Local paths of the dataset's files that match, in name order: enough of them that `measure` (bytes of text a
    file holds) sums to max_bytes, downloaded where missing; offline, or with the Hub out of reach, the cached ones."""
    from huggingface_hub import constants
    key = (url, max_bytes, constants.HF_HUB_CACHE, offline(constants))
    if key not in _fetched:
        _fetched[key] = list(arriving(url, max_bytes, measure, log))
    return _fetched[key]


def arriving(url: str, max_bytes: float = math.inf, measure=os.path.getsize, log=_print_once, bars: bool = True):
    """fetch(url)'s paths one by one, each as soon as it is on disk: a reader starts on the first file while the
    next downloads. The commit the files come from is in commits[url] before the first is yielded. bars: a bar of
    bytes per file (else a line once each is in, for files that come while a run trains)."""
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
                    log(f"data: {name} came down ({os.path.getsize(path) / 1e6:,.1f} MB), file {count + 1} of at "
                        f"most {len(data)}")
            count, total = count + 1, total + _readable(measure, path, repo)
            yield path
        if listed is not None and revision != commit and os.path.isdir(os.path.join(storage, "snapshots", commit)):
            remember(repo, revision, commit)
    why = "HF_HUB_OFFLINE is set" if offline(constants) else "the Hub is out of reach"
    where = f"{fetched} downloaded into {os.path.dirname(storage)}" if listed else f"from the cache: {why}"
    log(f"data: {url}: {count} of its {len(data)} {'' if listed else 'cached '}data file(s) at commit "
        f"{commit[:8]}, {where}")


def unavailable(url: str) -> str:
    """Why fetch(url) could give no file (the error's line), or "" when the Hub lists it or the cache holds some."""
    try:
        fetch(url, 0, log=lambda line: None)
    except (DataError, RunFailure) as e:
        return str(e)
    return ""


def listing(hub, repo: Repo, revision: str, wanted, folder: str = "") -> tuple[list, str] | None:
    """(the names of the files under folder that wanted(name) takes, the revision's commit) from the Hub, or None
    when it cannot be reached; both checked before they become paths in the cache."""
    api = hub.HfApi()
    try:  # one request that fails at once when the Hub is out of reach, before the listing's retries
        commit = api.repo_info(repo.id, revision=revision, repo_type=repo.kind,
                               timeout=hub.constants.HF_HUB_ETAG_TIMEOUT).sha
    except unreachable():
        return None
    commit = _hex_hash(commit, "the commit the Hub sent", repo, COMMIT)
    tree = api.list_repo_tree(repo.id, folder or None, recursive=True, revision=commit, repo_type=repo.kind)
    return sorted(_safe_relative(f.path, "the file name the Hub listed", repo)
                  for f in tree if hasattr(f, "size") and wanted(f.path)), commit


def cached_commit(repo: Repo, revision: str) -> str:
    """The commit of revision's snapshot in the cache ("" when no refs/ file names one): checked, as it names a
    folder."""
    return revision if COMMIT.fullmatch(revision) else _ref(os.path.join(repo.storage, "refs", revision), repo)


def snapshot_path(repo: Repo, commit: str, name: str = "") -> str:
    """Where a checked name of a checked commit lies in the cache (the snapshot's folder when no name)."""
    return os.path.join(repo.storage, "snapshots", commit, *filter(None, name.split("/")))


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
        raise error(f"{repo.where}: no file of it is in the Hugging Face cache ({os.path.dirname(storage)}) and "
                    f"{why}, then run again")
    return names, commit


def _ref(path: str, repo: Repo) -> str:
    """The commit a cached refs/ file names, or "" when there is none; checked, as it names the snapshot's folder."""
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        commit = f.read().strip()
    return commit and _hex_hash(commit, f"the commit {path} names", repo, COMMIT,
                                "delete that file and run again with the Hub in reach")


def _data_files(names: list, url: str) -> list:
    """The names of the kinds the readers take; an error line when the pattern matches none (or only others)."""
    data = [n for n in names if any(fnmatch.fnmatchcase(n.lower(), kind) for kind in DATA_FILES)]
    if not data:
        what = f"only {len(names)} file(s) of other kinds ({names[0]})" if names else "no file"
        raise DataError(f"data source {url} matches {what}; the files read are {', '.join(DATA_FILES)}, check the "
                        "pattern after the dataset's name")
    return data


def download(hub, repo: Repo, name: str, commit: str, bars: bool = True):
    """One file (a checked name of a checked commit) into the cache: to a .partial file beside the blobs that a later
    run continues, checked against the Hub's hash, renamed to its blob and linked as huggingface_hub lays them out.
    Not its hf_hub_download: in 2.4 that asks for the ETag again, takes it unchecked and starts a cut file over."""
    from filelock import FileLock  # huggingface_hub's own lock package, as its WeakFileLock is not its public API
    from huggingface_hub.utils import build_hf_headers
    storage, path = repo.storage, snapshot_path(repo, commit, name)
    meta = hub.get_hf_file_metadata(hub.hf_hub_url(repo.id, name, repo_type=repo.kind, revision=commit))
    etag = _hex_hash(meta.etag, f"the ETag the Hub sent for {name}", repo)
    blob = os.path.join(storage, "blobs", etag)
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    headers = build_hf_headers()
    if urlparse(meta.location).netloc != urlparse(hub.constants.ENDPOINT).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
    lock = os.path.join(os.path.dirname(storage), ".locks", os.path.basename(storage), etag + ".partial.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    with FileLock(lock):  # several ranks of one run fetch the same files
        if os.path.exists(path):  # another rank's, while this one waited
            return
        if not os.path.exists(blob):
            partial = blob + ".partial"
            try:
                _transfer(meta.location, partial, meta.size, headers, f"{repo.where}: {name}", bars)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise RunFailure(f"{repo.where}: the disk is full downloading {name} ({meta.size or 0:,} "
                                     f"bytes) into {os.path.dirname(storage)}; free that much room, or point HF_HOME "
                                     "at a larger disk, and run again") from None
                raise
            _check_hash(partial, etag, name, repo)
            os.replace(partial, blob)
        _link(blob, path)


def _transfer(url: str, partial: str, size, headers: dict, where: str, bars: bool, tries: int = 5):
    """The bytes at url added to partial from its length on (a Range), on huggingface_hub's public session (its
    offline mode and client settings hold), resumed at most `tries` times when a connection breaks after some bytes.
    Hand-written: huggingface_hub's public downloads keep no cut file to resume (its http_get is not public API)."""
    from huggingface_hub import constants, get_session, hf_raise_for_status
    from huggingface_hub.utils import are_progress_bars_disabled
    with open(partial, "ab") as f, tqdm(total=size, unit="B", unit_scale=True, desc=where.rsplit(": ", 1)[-1],
                                        disable=True if not bars or are_progress_bars_disabled() else None) as bar:
        if size is not None and f.tell() > size:
            f.truncate(0)  # longer than the file: not a start of it
        bar.update(f.seek(0, os.SEEK_END))
        while size is None or f.tell() < size:
            start = f.tell()
            try:
                with get_session().stream("GET", url, headers=dict(headers, Range=f"bytes={start}-") if start else
                                          headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                    hf_raise_for_status(response)
                    if start and response.status_code == 200:  # the Range ignored: the whole file comes
                        f.truncate(f.seek(0))
                        bar.update(-start)
                    for chunk in response.iter_bytes():  # as they come: a cut keeps every byte
                        bar.update(f.write(chunk))
                return  # all the server sent; the hash check judges it
            except unreachable() as e:
                if f.tell() == start or tries <= 0:  # nothing came: the Hub is out of reach
                    raise
                tries -= 1
                _print_once(f"{where}: the connection broke after {f.tell():,} bytes ({type(e).__name__}); resuming")


def _link(blob: str, path: str):
    """The snapshot's name for a blob: a relative link, as huggingface_hub makes (the blob itself where links are
    refused, as it does too). Made here: its hf_hub_download would ask the Hub for the blob's name again, unchecked."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)  # a link to a blob that is gone
    try:
        os.symlink(os.path.relpath(blob, os.path.dirname(path)), path)
    except FileExistsError:
        pass  # made by another program meanwhile (huggingface_hub's own download)
    except OSError:
        os.replace(blob, path)


def _check_hash(path: str, etag: str, name: str, repo: Repo):
    """The Hub's ETag is the file's sha256 (large files) or its git blob id: a resumed file must give it."""
    h = hashlib.sha256() if len(etag) == 64 else hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    if h.hexdigest() != etag:
        os.remove(path)
        raise RunFailure(f"{repo.where}: {name} came down different from the Hub's copy (hash mismatch); it "
                         "was removed, run again to download it anew")


def _readable(measure, path: str, repo: Repo) -> int:
    """measure(path); a cached file it cannot read, or whose first bytes cannot start its kind (a web page where
    parquet, JSON lines or a gzip stream should be), leaves the cache, blob and link: the next run fetches it anew."""
    try:
        if wrong := _wrong_start(path):
            raise DataError(f"{path} is not a readable {wrong}, {readers.REWRITE}")
        return measure(path)
    except DataError as e:
        if not str(e).endswith(readers.REWRITE):  # not the file's fault (pyarrow missing): the file stays
            raise
        _forget(path, repo.storage)
        raise DataError(f"{str(e).removesuffix(readers.REWRITE).rstrip(', ')}; it came from {repo.where} and was "
                        "removed from the Hugging Face cache: run again (with the Hub in reach) to fetch it anew, or "
                        "leave it out with a narrower pattern if the Hub's own copy is the same") from None


def _wrong_start(path: str) -> str:
    """What a file's first bytes show it is not (""): a gzip or zstd stream without its magic, or a web page (a
    proxy's sign-in page) where JSON lines or an Arrow table should be."""
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


def remember(repo: Repo, revision: str, commit: str):
    """refs/REVISION names the commit, as huggingface_hub writes it: an offline run finds the snapshot by it."""
    os.makedirs(os.path.join(repo.storage, "refs", os.path.dirname(revision)), exist_ok=True)
    atomic.write_text(os.path.join(repo.storage, "refs", revision), commit)


def unreachable() -> tuple:
    """What huggingface_hub raises when it cannot reach the Hub: its HTTP client's transport errors (httpx2 for
    huggingface_hub 2.x, httpx for 1.x) and its offline mode."""
    from huggingface_hub.errors import OfflineModeIsEnabled
    clients = [importlib.import_module(name) for name in ("httpx2", "httpx") if importlib.util.find_spec(name)]
    return (OfflineModeIsEnabled, *(client.TransportError for client in clients))


@contextmanager
def _failures(repo: Repo, revision: str):
    """huggingface_hub's failures as one line naming the source and what to do."""
    from huggingface_hub import errors
    try:
        yield
    except errors.HFValidationError as e:  # the Hub's naming rule (no '--', at most 96 characters), not ours
        raise DataError(f"{repo.where}: {repo.id!r} is not a Hub dataset name ({str(e).splitlines()[0][:200]}), "
                        "write hf://datasets/OWNER/NAME/GLOB") from None
    except errors.RepositoryNotFoundError as e:  # gated ones too
        raise DataError(not_shown(repo, isinstance(e, errors.GatedRepoError), f"no dataset {repo.id}",
                                  f"https://huggingface.co/datasets/{repo.id}")) from None
    except errors.RevisionNotFoundError:
        raise DataError(f"{repo.where}: the dataset has no revision {revision!r}, check the name after @") from None
    except errors.EntryNotFoundError:
        raise DataError(f"{repo.where} matches no file, check the pattern after the dataset's name") from None
    except errors.HfHubHTTPError as e:
        if refused_token(e):
            raise DataError(f"{repo.where}: {refused_token(e)}") from None
        raise RunFailure(f"{repo.where}: the Hub answered {str(e).splitlines()[0]}; try again later") from None
    except unreachable() as e:
        raise RunFailure(f"{repo.where}: the Hub stopped answering ({type(e).__name__}); run again, the "
                         "download resumes where it stopped") from None


def not_shown(repo: Repo, gated: bool, missing: str, page: str) -> str:
    """The line for a repository the Hub would not show: how to get in, or, with a token given, that it refused it."""
    token = token_given()
    if gated:
        way = f"with the account of {TOKEN}, or check that token" if token else "and log in with `hf auth login`"
        return f"{repo.where}: the {repo.kind} is gated, accept its terms on {page} {way}"
    if token:
        return f"{repo.where}: {missing} on the Hub that {TOKEN} can read; check the name, and the token " \
            "(`hf auth whoami`)"
    return f"{repo.where}: {missing} on the Hub (a private one needs `hf auth login`), check the name"
