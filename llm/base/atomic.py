"""Writing files and folders so that a crash, a kill -9 or a full disk never leaves half of one behind.

Everything that persists work goes through here: checkpoints, the data cache, Hugging Face exports, the
pointer files. A folder is written under a temporary name beside its place, every file flushed to disk,
then renamed into place (a previous folder of that name moves aside first and goes only once the new one
is in). A write that fails removes its partial copy and raises one line: what failed, where, and for a
full disk how much room the write needs against what is free. What a killed writer left, remove_leftovers()
clears once that process is gone. read_json() is the one guarded reader of the small JSON files beside them
(manifests, model configs, Hugging Face configs and indexes).
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket

from llm.base.errors import CheckpointError, ConfigError, WriteError

try:
    import fcntl
except ImportError:  # Windows: run folders go unlocked there
    fcntl = None

FILE_MODE = 0o666  # what open() gives a new file, before the umask: one mode for every file written
LOCK_FILE = ".lock"  # in a locked folder: flock'ed by its holder, and holding the holder's pid
# folder -> its open lock file: the lock lasts as long as the descriptor, so as long as the process
_held = {}
LEFTOVER = re.compile(r"\.(?P<kind>tmp|old)_(?P<name>.+)_(?P<pid>\d+)@(?P<host>[^@]*)")  # folder()'s names


def fsync_dir(path: str):
    """Make a rename in this folder durable (directories cannot be opened for fsync on Windows)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_digest(path: str) -> str:
    """A short sha256 of a file's bytes: what says, later, that a file written here holds what was written."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def stamp(path: str) -> list:
    """A file's size and modification time: when both are as written, nobody has touched it (no need to
    hash)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def write_text(path: str, text: str):
    """Replace a small text file atomically (a pointer such as LATEST)."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str, data: bytes):
    """Replace a file atomically: written beside it under a temporary name, flushed, then renamed over it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_error(e, f"writing {path}") from None


def read_json(path: str, what: str, remedy: str, error: type = CheckpointError):
    """The value a small JSON file holds; `error` naming the file, what it should be and the remedy when it is
    missing, unreadable, not UTF-8, not JSON, or nested too deeply for the parser (RecursionError otherwise).
    """
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8-sig"))
    except FileNotFoundError:
        raise error(f"{path} is missing, {remedy}") from None
    except OSError as e:
        why = e.strerror or str(e)
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text, byte {e.start}"
    except ValueError as e:
        why = f"not JSON: {e}"
    except RecursionError:
        why = "JSON nested too deeply to read"
    raise error(f"{path} is not {what} ({why}), {remedy}")


def write_error(e: OSError, what: str, need: int = 0, where: str = "") -> Exception:
    """One line for a failed write: WriteError (a runtime failure, exit 1) for a full disk or an I/O error,
    ConfigError (a bad path, exit 2) for a folder that cannot be written or a file where a folder belongs."""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        folder = where or os.path.dirname(e.filename or "") or "."
        room = ""
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(_existing(folder)).free
            room = f": it needs about {_mb(need)} and {_mb(free)} are free in {folder}" if need else \
                f" ({_mb(free)} free in {folder})"
        return WriteError(f"{what} failed ({reason}){room}; free some space and run again")
    return ConfigError(f"{what} failed ({reason}, {e.filename or where}), choose a folder you can write to")


def _mb(n: int) -> str:
    if n < 1e6:
        return f"{n / 1e3:,.0f} kB"
    # a tenth: 1.4 MB needed is not 1 MB free
    return f"{n / 1e6:,.1f} MB" if n < 1e7 else f"{n / 1e6:,.0f} MB"


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


@contextlib.contextmanager
def folder(final: str, what: str, need: int = 0):
    """Yield a temporary folder beside `final`; when the block ends, its files are flushed and it is renamed
    to `final` (replacing a folder of that name only then). If the block fails, the temporary folder goes and
    `final` is as it was; an OSError becomes write_error's one line. need: the bytes expected, for the message
    of a full disk."""
    parent, name = os.path.split(os.path.abspath(final))
    # it was once set aside as a hidden .old_ file, unsaid
    if os.path.lexists(final) and not os.path.isdir(final):
        raise ConfigError(f"{os.path.abspath(final)} is a file, not a folder; {what} needs a folder there, "
                          "choose another path (nothing was written)")
    # remove_leftovers() judges by it whether the writer is gone
    owner = f"{os.getpid()}@{socket.gethostname()}"
    tmp, aside = (os.path.join(parent, f".{kind}_{name}_{owner}") for kind in ("tmp", "old"))
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed process of the same pid
        os.makedirs(tmp)
        yield tmp
        mode = FILE_MODE & ~_umask()
        for file in os.listdir(tmp):
            path = os.path.join(tmp, file)
            os.chmod(path, mode)  # some writers (safetensors) create their files 0600
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.exists(final):
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(aside) and not os.path.exists(final):
            os.rename(aside, final)  # put the previous one back
        raise write_error(e, what, need, parent) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(aside) and not os.path.exists(final):
            os.rename(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(parent: str):
    """Clear what folder() left in `parent` when its process died mid-write (kill -9, SIGTERM, a crash): its
    temporary folders go, and a previous folder it had set aside goes back in place if nothing replaced it.
    Only this machine's dead processes are judged: another's pid means nothing here."""
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        found = LEFTOVER.fullmatch(entry)
        if not found or found["host"] != socket.gethostname() or _alive(int(found["pid"])):
            continue
        path, final = os.path.join(parent, entry), os.path.join(parent, found["name"])
        if found["kind"] == "old" and not os.path.exists(final):
            with contextlib.suppress(OSError):  # best effort: clearing never stops the work that called it
                os.rename(path, final)  # it died between its two renames: the previous folder is the only one
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a process of this pid runs here (on Windows always assumed: its os.kill(pid, 0) sends Ctrl-C).
    """
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def writable_folder(path: str, what: str) -> bool:
    """Check that `path` is, or can become, a folder this process writes to, by writing a small file in it;
    returns whether the folder had to be created (so a caller refusing later can remove it again)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a file, name a folder")
    existed = os.path.isdir(path)
    probe = os.path.join(path, f".write_test_{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(probe)
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
        raise write_error(e, f"writing in {what} {path}", where=path) from None
    return not existed


def lock_folder(path: str, what: str):
    """Lock the folder `path` for the rest of this process's life; one another process holds is refused with
    one line naming it and that process. Two trainers on one run folder once mixed their steps in one
    metrics.jsonl. Without fcntl (Windows), or on a file system without locks, nothing is locked."""
    key = os.path.realpath(path)
    if fcntl is None or key in _held:
        return
    lock = open(os.path.join(path, LOCK_FILE), "a+", encoding="utf-8")  # a+: the holder's pid stays readable
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read(20).strip()
        lock.close()
        by = f"process {holder}" if holder.isdigit() else "another process"
        raise ConfigError(f"{what} {path} is in use by {by}, wait for it to "
                          "finish or choose another folder") \
            from None
    except OSError:
        lock.close()
        return  # a file system without locks (some network ones): train unlocked rather than not at all
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _held[key] = lock
