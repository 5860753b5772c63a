"""The checked Hugging Face Hub client that datasets (hf_datasets.py) and models (hf_hub.py) download through:
what the Hub sends (a listed name, an ETag, a commit, a size) is checked here before it names a file in the
cache, a download cut short resumes from its .partial file and is checked against the Hub's hash, and the
Hub's failures (a gated or private repository, a refused token) become one line naming the source."""

import errno
import hashlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from urllib.parse import urlparse

from tqdm import tqdm

from llm.base import atomic
from llm.base.errors import CheckpointError, DataError, RunFailure

COMMIT = re.compile(r"[0-9a-f]{40}")
ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a file's git blob id (sha1), or a large file's sha256
DRIVE = re.compile(r"[A-Za-z]:")  # a path part that Windows reads as a drive
HOSTILE = ("refused before it named a file; check that HF_ENDPOINT points at the Hugging Face Hub "
           "or a faithful mirror")
TOKEN = "the token given (HF_TOKEN, or the one `hf auth login` saved)"
REFUSED = (f"the Hub refused {TOKEN} as invalid; check it (`hf auth whoami`), or log in again with "
           "`hf auth login`")
FORBIDDEN = f"the Hub refused {TOKEN} access (403); check that it may read the repository (`hf auth whoami`)"


def say_once(line: str):
    """A line from one process: under torchrun every rank fetches, and the first says what it found."""
    if os.environ.get("RANK", "0") == "0":
        tqdm.write(line)  # above a training bar, when files come while a run trains


@dataclass(frozen=True)
class Repo:
    """A Hub repository as the checks and downloads here name it: OWNER/NAME, its kind ("dataset" or "model")
    and `where`, the words its error lines start with (the source as written)."""
    id: str
    kind: str
    where: str

    @property
    def storage(self) -> str:
        """Its folder in huggingface_hub's cache (HF_HOME as huggingface_hub read it), named as it names them.
        """
        from huggingface_hub import constants
        return os.path.join(constants.HF_HUB_CACHE, f"{self.kind}s--{self.id.replace('/', '--')}")

    @property
    def error(self) -> type:
        return DataError if self.kind == "dataset" else CheckpointError


def token_given() -> bool:
    """Whether huggingface_hub sends a token: a refusal then means that token is wrong, not that a login is
    missing."""
    from huggingface_hub import get_token
    return bool(get_token())


def refused_token(e) -> str:
    """Why the Hub refused the token given ("" if none or not the token): a 401 that is no repository's (those
    are RepositoryNotFoundError) means a token it never issued, a 403 one without the rights."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    return {401: REFUSED, 403: FORBIDDEN}.get(status, "") if token_given() else ""


def offline(constants) -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import (its constants), or as it is set now."""
    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or now


def safe_relative(path, what: str, repo: Repo, todo: str = "") -> str:
    """A name from the Hub (or the URL) that becomes a path under the cache: no `..`, root, drive, backslash,
    NUL or empty segment, which would name a file outside it."""
    parts = path.split("/") if isinstance(path, str) else [""]
    if any(part in ("", ".", "..") or "\\" in part or "\0" in part or DRIVE.match(part) for part in parts):
        raise repo.error(f"{repo.where}: {what} {str(path)[:200]!r} is not a path inside the {repo.kind} (it "
                         f"has a `..`, root, drive, backslash or empty part); {todo or HOSTILE}")
    return path


def hex_hash(value, what: str, repo: Repo, pattern=ETAG, todo: str = "") -> str:
    """A hash the Hub sends, checked before it names a file in the cache (anything else could reach outside
    it)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        digits = "40" if pattern is COMMIT else "40 or 64"
        raise repo.error(f"{repo.where}: {what} {str(value)[:200]!r} is not a hash ({digits} lowercase hex "
                         f"digits); {todo or HOSTILE}")
    return value


def listing(hub, repo: Repo, revision: str, wanted, folder: str = "") -> tuple[list, str] | None:
    """(the names of the files under folder that wanted(name) takes, the revision's commit) from the Hub, or
    None when it cannot be reached; both checked before they become paths in the cache."""
    api = hub.HfApi()
    try:  # one request that fails at once when the Hub is out of reach, before the listing's retries
        commit = api.repo_info(repo.id, revision=revision, repo_type=repo.kind,
                               timeout=hub.constants.HF_HUB_ETAG_TIMEOUT).sha
    except unreachable():
        return None
    commit = hex_hash(commit, "the commit the Hub sent", repo, COMMIT)
    tree = api.list_repo_tree(repo.id, folder or None, recursive=True, revision=commit, repo_type=repo.kind)
    return sorted(safe_relative(f.path, "the file name the Hub listed", repo)
                  for f in tree if hasattr(f, "size") and wanted(f.path)), commit


def cached_commit(repo: Repo, revision: str) -> str:
    """The commit of revision's snapshot in the cache ("" when no refs/ file names one): checked, as it names
    a folder."""
    return revision if COMMIT.fullmatch(revision) else ref(os.path.join(repo.storage, "refs", revision), repo)


def snapshot_path(repo: Repo, commit: str, name: str = "") -> str:
    """Where a checked name of a checked commit lies in the cache (the snapshot's folder when no name)."""
    return os.path.join(repo.storage, "snapshots", commit, *filter(None, name.split("/")))


def ref(path: str, repo: Repo) -> str:
    """The commit a cached refs/ file names, or "" when there is none; checked, as it names the snapshot's
    folder."""
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        commit = f.read().strip()
    return commit and hex_hash(commit, f"the commit {path} names", repo, COMMIT,
                                "delete that file and run again with the Hub in reach")


def download(hub, repo: Repo, name: str, commit: str, bars: bool = True):
    """One file (a checked name of a checked commit) into the cache: to a .partial file beside the blobs that
    a later run continues, checked against the Hub's hash, renamed to its blob and linked as huggingface_hub
    lays them out. Not its hf_hub_download: in 2.4 that asks for the ETag again, takes it unchecked and starts
    a cut file over."""
    # huggingface_hub's own lock package, as its WeakFileLock is not its public API
    from filelock import FileLock
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.utils import build_hf_headers
    storage, path = repo.storage, snapshot_path(repo, commit, name)
    try:
        meta = hub.get_hf_file_metadata(hub.hf_hub_url(repo.id, name, repo_type=repo.kind, revision=commit))
    except EntryNotFoundError:  # not the pattern's fault: the Hub listed the file a moment ago
        raise RunFailure(f"{repo.where}: the Hub listed {name} but answers 404 for it (the dataset changed "
                         "while this run read it?); run again") from None
    etag = hex_hash(meta.etag, f"the ETag the Hub sent for {name}", repo)
    if meta.size is not None and (not isinstance(meta.size, int) or meta.size < 0):
        raise repo.error(f"{repo.where}: the size the Hub sent for {name} "
                         f"({str(meta.size)[:40]!r}) is not a size; {HOSTILE}")
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
                                     f"bytes) into {os.path.dirname(storage)}; free that much room, or point "
                                     "HF_HOME at a larger disk, and run again") from None
                raise
            _check_hash(partial, etag, name, repo)
            os.replace(partial, blob)
        _link(blob, path)


def _transfer(url: str, partial: str, size, headers: dict, where: str, bars: bool, tries: int = 5):
    """The bytes at url added to partial from its length on (a Range), on huggingface_hub's public session
    (its offline mode and client settings hold), resumed at most `tries` times when a connection breaks after
    some bytes. Hand-written: huggingface_hub's public downloads keep no cut file to resume (its http_get is
    not public API)."""
    from huggingface_hub import constants, get_session, hf_raise_for_status
    from huggingface_hub.utils import are_progress_bars_disabled
    with open(partial, "ab") as f, tqdm(total=size, unit="B", unit_scale=True, desc=where.rsplit(": ", 1)[-1],
                                        disable=(True if not bars or are_progress_bars_disabled()
                                                 else None)) as bar:
        if size is not None and f.tell() > size:
            f.truncate(0)  # longer than the file: not a start of it
        bar.update(f.seek(0, os.SEEK_END))
        while size is None or f.tell() < size:
            start = f.tell()
            try:
                with get_session().stream("GET", url, headers=(dict(headers, Range=f"bytes={start}-")
                                                               if start else headers),
                                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
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
                say_once(f"{where}: the connection broke after {f.tell():,} bytes "
                         f"({type(e).__name__}); resuming")


def _link(blob: str, path: str):
    """The snapshot's name for a blob: a relative link, as huggingface_hub makes (the blob itself where links
    are refused, as it does too). Made here: its hf_hub_download would ask the Hub for the blob's name again,
    unchecked."""
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


def remember(repo: Repo, revision: str, commit: str):
    """refs/REVISION names the commit, as huggingface_hub writes it: an offline run finds the snapshot by it.
    """
    os.makedirs(os.path.join(repo.storage, "refs", os.path.dirname(revision)), exist_ok=True)
    atomic.write_text(os.path.join(repo.storage, "refs", revision), commit)


# The HTTP parser's words for an answer no HTTP server sends (a NUL in an ETag, say): a Hub or mirror that
# sends it again on the next run, not a connection cut, which the same errors name otherwise ("Server
# disconnected ...").
MALFORMED = ("illegal header", "illegal status line", "invalid header")


def malformed(e: Exception) -> str:
    """One line's worth of why a transport error is a malformed answer ("" for a connection lost or
    refused)."""
    said = str(e).splitlines()[0] if str(e) else ""
    return said[:120] if any(word in said.lower() for word in MALFORMED) else ""


def lost(repo: Repo, e: Exception) -> Exception:
    """The one line of a transport error: a malformed answer is the Hub's (refused as hostile, exit 2),
    anything else a connection lost, which a later run resumes."""
    if malformed(e):
        return repo.error(f"{repo.where}: the Hub's answer is not valid HTTP ({malformed(e)}); {HOSTILE}")
    return RunFailure(f"{repo.where}: the Hub stopped answering ({type(e).__name__}); run again, the "
                      "download resumes where it stopped")


def unreachable() -> tuple:
    """What huggingface_hub raises when it cannot reach the Hub: its HTTP client's transport errors (httpx2
    for huggingface_hub 2.x, httpx for 1.x) and its offline mode."""
    from huggingface_hub.errors import OfflineModeIsEnabled
    clients = [importlib.import_module(name) for name in ("httpx2", "httpx")
               if importlib.util.find_spec(name)]
    return (OfflineModeIsEnabled, *(client.TransportError for client in clients))


def not_shown(repo: Repo, gated: bool, missing: str, page: str) -> str:
    """The line for a repository the Hub would not show: how to get in, or, with a token given, that it
    refused it."""
    token = token_given()
    if gated:
        way = (f"with the account of {TOKEN}, or check that token" if token
               else "and log in with `hf auth login`")
        return f"{repo.where}: the {repo.kind} is gated, accept its terms on {page} {way}"
    if token:
        return f"{repo.where}: {missing} on the Hub that {TOKEN} can read; check the name, and the token " \
            "(`hf auth whoami`)"
    return f"{repo.where}: {missing} on the Hub (a private one needs `hf auth login`), check the name"
