"""Hostile files and file systems, each met the way a user meets it: a real full disk, a damaged token cache,
a preparation killed half-way, two trainers on one folder, a YAML alias bomb, an export aimed at a run folder.
Every one ends in one `error:` line (exit 2 for bad input, 1 for a runtime failure) or a repair said in one
line, never a traceback, never half-written output, never lost work."""

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpu_training_optimized as trainer
import prepare_data as pd
from conftest import one_error_line
from llm.base import atomic
from llm.data import token_cache as tc
from llm.formats import checkpoint as ckpt_io
from llm.formats.loading import read_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- a real full disk

@pytest.fixture
def small_disk(tmp_path):
    """mount(free): a fresh file system with `free` bytes left, tmpfs or else an ext4 image on a loop device;
    the test is skipped where neither can be mounted (it needs root)."""
    if sys.platform != "linux" or not shutil.which("mount"):
        pytest.skip("mounting a small file system needs Linux's mount")
    mounts = []

    def mount(free: int):
        where, image = tmp_path / f"disk{len(mounts)}", tmp_path / f"disk{len(mounts)}.img"
        where.mkdir()
        loop = f"truncate -s 8M '{image}' && mkfs.ext4 -q '{image}' && mount -o loop '{image}' '{where}'"
        tries = [["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], ["sh", "-c", loop]]
        if not any(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in tries):
            pytest.skip("could mount neither a tmpfs nor a loop device here (needs root)")
        mounts.append(where)
        with open(where / "ballast", "wb") as f:  # fills the disk up to the room asked for
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(where).free - free)
        return where
    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# The tiny model's checkpoint: 0.63 MB of weights, then 0.78 MB of trainer state, and from the run's second
# half (here its first checkpoint) 0.63 MB more of weight average in it; 2.06 MB in all.
@pytest.mark.parametrize("free,failing", [(300_000, 1), (1_000_000, 1), (3_000_000, 2)],
                         ids=["weights-safetensors", "trainer-state-torch-zip", "second-checkpoint-and-resume"])
def test_a_real_full_disk_at_a_checkpoint_is_one_line(corpus, argv_for, small_disk, capsys, free, failing):
    """On a real full disk safetensors raised SafetensorError '... No space left on device (os error 28)' and
    torch's zip writer RuntimeError '[enforce fail at inline_container.cc] unexpected pos': tracebacks, in a
    new run and under --resume. Now one line, exit 1, no temporary folder, the previous checkpoint and LATEST
    kept."""
    run = small_disk(free) / "run"
    runs = [argv_for(corpus, run, "--max_steps", 2, "--save_interval", 1, "--eval_interval", 2)]
    if failing == 2:
        runs.append(runs[0] + ["--resume"])  # resuming from step 1 meets the same full disk at step 2
    for argv in runs:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            trainer.run(argv)
        line = one_error_line(capsys, 1, e)
        assert f"writing checkpoint step_{failing:06d}" in line and "No space left on device" in line, line
        assert "free some space and run again" in line
        assert not [d for d in os.listdir(run / "checkpoints") if d.startswith(".")]  # nothing half-written
        if failing == 1:
            assert not ckpt_io.holds_checkpoints(str(run))
        else:
            assert "step_000001 is intact" in line
            assert ckpt_io.latest_checkpoint(str(run)) == str(run / "checkpoints" / "step_000001")
            assert read_model(str(run)).path.endswith("step_000001")


# The corpus fixture's token cache: a 22 kB tokenizer.json, then one part of 89 kB of tokens.
@pytest.mark.parametrize("free,what", [(8_000, "writing the token cache "), (40_000, "writing the token cache part ")],
                         ids=["tokenizer", "token-shards"])
def test_a_real_full_disk_while_preparing_data_is_one_line_exit_1(corpus, data_argv_for, small_disk, capsys, free,
                                                                  what):
    """On a full disk the tokenizer's save raised tokenizers' bare Exception 'No space left on device (os
    error 28)' (a traceback), and numpy's tofile an OSError without its errno ('N requested and M written'),
    which read as a folder we may not write to: "choose a folder you can write to", exit 2. A full disk is a
    runtime failure: one line, exit 1, the room needed against the room free, and no temporary folder left."""
    cache = small_disk(free) / "cache"
    with pytest.raises(SystemExit) as e:
        pd.main(data_argv_for(corpus, "--cache_dir", cache))
    line = one_error_line(capsys, 1, e)
    assert what in line and "No space left on device" in line and "free some space and run again" in line, line
    assert "choose a folder" not in line
    if what.endswith("part "):
        assert "it needs about" in line and "are free in" in line, line
    leftovers = [p for p in cache.rglob(".*") if p.name.startswith((".tmp_", ".old_"))]
    assert not leftovers, leftovers


def test_a_full_disk_while_the_tokenizer_is_saved_is_one_line_exit_1(corpus, data_argv_for, tmp_path, capsys,
                                                                   monkeypatch):
    """The same full disk where no file system can be mounted: tokenizers' save raising what it raises for one
    (a bare Exception naming the OS error) once ended in a traceback; now one line, exit 1."""
    from llm.data import preparation
    make = preparation._make_tokenizer

    class FullDisk:  # the trained tokenizer, but a disk with no room for its file
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def save(self, path, pretty=True):
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002 - as tokenizers raises it
    monkeypatch.setattr(preparation, "_make_tokenizer", lambda *a: FullDisk(make(*a)))
    with pytest.raises(SystemExit) as e:
        pd.main(data_argv_for(corpus, "--cache_dir", tmp_path / "cache"))
    line = one_error_line(capsys, 1, e)
    assert f"writing the token cache {tmp_path / 'cache'}" in line and "No space left on device" in line, line
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------------------- a damaged token cache

def edit_meta(change):
    def damage(cache):
        (cache / "meta.json").write_text(json.dumps(change(json.loads((cache / "meta.json").read_text()))))
    return damage


def first_part(cache) -> Path:
    return Path(sorted(glob.glob(str(cache / "shards" / "*-00000")))[0])


def ids_past_the_vocabulary(cache):
    ids = np.fromfile(first_part(cache) / "train.bin", dtype=np.uint16)
    ids[::10] = 60000  # the tiny model's vocabulary is 512
    ids.tofile(first_part(cache) / "train.bin")


DAMAGED_CACHES = {  # the folder's tokenizer record, then one part's tokens
    "meta-garbage-bytes": lambda c: (c / "meta.json").write_bytes(b"\x8f\xff\x00 garbage"),
    "meta-a-list": lambda c: (c / "meta.json").write_text("[1, 2, 3]"),
    "meta-missing-keys": edit_meta(lambda m: {k: v for k, v in m.items() if k not in ("vocab_size", "dtype")}),
    "meta-bad-dtype": edit_meta(lambda m: {**m, "dtype": "nonsense"}),
    "train-truncated": lambda c: os.truncate(first_part(c) / "train.bin", 7),
    "train-empty": lambda c: (first_part(c) / "train.bin").write_bytes(b""),
    "part-record-garbage": lambda c: (first_part(c) / "part.json").write_bytes(b"\x8f\xff"),
    # nested past the JSON parser's recursion limit: once a RecursionError traceback
    "meta-nested-deep": lambda c: (c / "meta.json").write_text("[" * 100_000),
    "part-record-nested-deep": lambda c: (first_part(c) / "part.json").write_text("{\"a\": " * 100_000),
    "ids-past-the-vocabulary": ids_past_the_vocabulary,
}


@pytest.fixture(scope="module")
def pristine_cache(corpus, data_argv_for, tmp_path_factory):
    """The corpus's token cache folder, prepared once, to copy and damage."""
    base = tmp_path_factory.mktemp("pristine")
    pd.main(data_argv_for(corpus, "--cache_dir", base / "cache"))
    (folder,) = [d for d in (base / "cache").iterdir() if not d.name.startswith(".")]
    return folder


@pytest.mark.parametrize("script", ["trainer", "prepare_data"])
@pytest.mark.parametrize("damage", list(DAMAGED_CACHES))
def test_a_damaged_token_cache_is_rebuilt_with_one_line(corpus, argv_for, data_argv_for, pristine_cache, tmp_path,
                                                        capsys, damage, script):
    """meta.json of garbage bytes, a list, missing keys or an unknown dtype; a part's train.bin cut short,
    emptied or holding ids past the vocabulary, its part.json garbage: once seven tracebacks
    (UnicodeDecodeError, TypeError, KeyError, ValueError, an IndexError from the embedding mid-run). A cache
    is derived data: what is damaged is rebuilt (the whole folder for its tokenizer's record, else the part),
    and one line says so."""
    cache = tmp_path / "cache" / pristine_cache.name
    shutil.copytree(pristine_cache, cache)
    DAMAGED_CACHES[damage](cache)
    argv = argv_for(corpus, tmp_path / "run", "--max_steps", 1, "--cache_dir", tmp_path / "cache") \
        if script == "trainer" else data_argv_for(corpus, "--cache_dir", tmp_path / "cache")
    assert (trainer.run if script == "trainer" else pd.main)(argv) in (0, None)
    out, err = capsys.readouterr()
    what = f"the token cache {cache}" if damage.startswith("meta") else f"the token cache part {first_part(cache)}"
    assert "Traceback" not in err and f"data: {what} is damaged (" in out, (err, out)
    for name in ("train.bin", "val.bin"):
        assert (first_part(cache) / name).read_bytes() == (first_part(pristine_cache) / name).read_bytes()
    counts = [{k: v for k, v in json.loads((first_part(c) / "part.json").read_text()).items() if k != "written"}
              for c in (cache, pristine_cache)]  # the same but for when its files were written
    assert counts[0] == counts[1]
    assert tc.folder_problem(str(cache)) is None and os.listdir(cache.parent) == [cache.name]
    assert tc.part_problem(str(first_part(cache)), 512, "uint16") is None


def test_ids_changed_behind_a_kept_size_and_time_are_named_at_first_read(corpus, argv_for, pristine_cache, tmp_path,
                                                                         capsys):
    """A part's train.bin rewritten with ids past the vocabulary, its size and modification time put back,
    passed the cache's stamp check and reached the embedding (IndexError mid-run; on a GPU a device-side
    assert): the first read of the file in a process now finds it, and one line names the file and what to
    delete."""
    cache = tmp_path / "cache" / pristine_cache.name
    shutil.copytree(pristine_cache, cache)
    path = first_part(cache) / "train.bin"
    before = os.stat(path)
    ids_past_the_vocabulary(cache)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    argv = argv_for(corpus, tmp_path / "run", "--max_steps", 2, "--cache_dir", tmp_path / "cache")
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(argv)
    line = one_error_line(capsys, 2, exit_info)
    assert f"{path} holds token id 60000, past the vocabulary of 512" in line and f"delete {path.parent}" in line


# ----------------------------------------------------------------------------- killed during start-up

@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """About 2 MB of the standard library's Python: preparing it takes a few seconds, time to interrupt it."""
    import sysconfig
    src, size = tmp_path_factory.mktemp("big") / "src", 0
    src.mkdir()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size > 2e6:
            break
        (src / path.name).write_bytes(path.read_bytes())
        size += path.stat().st_size
    return src


def leftovers(cache) -> list[str]:
    """Temporary folders of a writer, in the cache or among a corpus folder's shards."""
    return [d for folder in [cache, *glob.glob(os.path.join(cache, "*", "shards"))] if os.path.isdir(folder)
            for d in os.listdir(folder) if d.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_preparation_killed_half_way_leaves_nothing_the_next_run_keeps(big_corpus, argv_for, tmp_path, sig):
    """kill -9 or SIGTERM while the trainer prepared its data left a .tmp_ folder in the cache that no later
    run removed; the next preparation must clear it (its writer is dead). Ctrl-C must end with status 130,
    quietly, and leave nothing behind itself."""
    cache = tmp_path / "cache"
    argv = argv_for({"src": str(big_corpus), "cache": str(cache)}, tmp_path / "run", "--max_steps", 1)
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), *argv],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    while not leftovers(cache):  # the cache's temporary folder: tokenizing has begun
        assert child.poll() is None, "preparation ended before it could be interrupted: use a larger corpus"
        time.sleep(0.01)
    child.send_signal(getattr(signal, sig))
    err = child.communicate(timeout=120)[1].decode()
    assert "Traceback" not in err, err
    if sig == "SIGINT":
        assert child.returncode == 130 and not leftovers(cache), err
    else:
        assert child.returncode == -getattr(signal, sig) and leftovers(cache)  # what the next run must clear
    assert pd.main([w for flag, value in zip(argv[::2], argv[1::2]) if flag[2:] in pd.CACHE_FLAGS
                    for w in (flag, value)]) is None  # the data settings of the trainer's command
    assert not leftovers(cache) and len(os.listdir(cache)) == 1


@pytest.mark.slow
def test_ctrl_c_while_the_trainer_imports_is_quiet(tmp_path):
    """Ctrl-C in the first second, while torch was importing and before main's error contract, printed a
    KeyboardInterrupt traceback from deep inside torch."""
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), "--run_dir",
                              str(tmp_path / "run")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    maps, deadline = f"/proc/{child.pid}/maps", time.monotonic() + 60
    if os.path.exists(maps):  # past Python's own start-up (on a busy machine 0.3 s fell inside it): torch loading
        while child.poll() is None and time.monotonic() < deadline and "torch" not in open(maps).read():
            time.sleep(0.01)
    else:
        time.sleep(0.3)  # torch alone takes longer to import
    child.send_signal(signal.SIGINT)
    err = child.communicate(timeout=60)[1].decode()
    # The shell shows 130 for both: an exit with 130, or (in the imports) the default action of SIGINT.
    assert child.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err


def test_only_the_leftovers_of_dead_writers_on_this_machine_are_cleared(tmp_path):
    """Clearing stale temporary folders must never take one that a live process is still writing (nor one
    another machine's process writes into a shared folder), and must put back a previous folder that a writer
    killed between its two renames had set aside."""
    writing = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    names = [f".tmp_a_{writing.pid}@{host}", f".tmp_a_{dead.pid}@{host}", f".old_b_{dead.pid}@{host}",
             f".tmp_c_{dead.pid}@another-machine"]
    try:
        for name in names:
            (tmp_path / name).mkdir()
        atomic.remove_leftovers(str(tmp_path))
        assert sorted(os.listdir(tmp_path)) == sorted([names[0], "b", names[3]])
    finally:
        writing.kill()


# ----------------------------------------------------------------------------- two trainers, one run folder

HOLD_LOCK = ("import sys, time; from llm.base import atomic; atomic.lock_folder(sys.argv[1], '--run_dir'); "
             "print('locked', flush=True); time.sleep(60)")


def test_a_run_folder_another_process_holds_is_refused_by_name(corpus, argv_for, tmp_path, capsys):
    """The second of two trainers on one run folder stopped with a misleading message and left its step-1 line
    in the first one's metrics.jsonl. Now it stops before any work with one line naming the folder and the
    holder."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SystemExit) as e:
            trainer.run(argv_for(corpus, run, "--max_steps", 2))
        assert f"--run_dir {run} is in use by process {holder.pid}, wait for it" in one_error_line(capsys, 2, e)
        assert sorted(os.listdir(run)) == [atomic.LOCK_FILE]  # no config.json, no metrics.jsonl
    finally:
        holder.kill()
        holder.wait()
    assert trainer.main(argv_for(corpus, run, "--max_steps", 1)) == 0  # the holder is gone: the folder is free


@pytest.mark.slow
def test_two_trainers_started_on_one_run_folder_never_mix_their_steps(corpus, argv_for, tmp_path, capsys):
    """Two real trainers on one folder: the second is refused while the first trains on, alone in
    metrics.jsonl."""
    from llm.reports.monitor import read_metrics
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"),
                              *argv_for(corpus, run, "--max_steps", 100000)], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        while not read_metrics(str(run), "train"):  # the first one trains
            assert first.poll() is None, "the first trainer stopped"
            time.sleep(0.05)
        with pytest.raises(SystemExit) as e:
            trainer.run(argv_for(corpus, run, "--max_steps", 2))
        assert f"{run} is in use by process {first.pid}" in one_error_line(capsys, 2, e)
    finally:
        first.kill()
        first.wait()
    steps = [r["step"] for r in read_metrics(str(run), "train")]
    assert steps == sorted(set(steps))  # the first trainer's steps only, each once


# ----------------------------------------------------------------------------- a YAML alias bomb

def alias_bomb(levels: int) -> str:
    """A 'billion laughs' config: each level lists the one before ten times, 7 * 10**levels bytes written out.
    """
    rows = ["  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    rows += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "sample_prompts:\n" + "\n".join(rows) + "\n"


@pytest.mark.parametrize("text", [alias_bomb(7), "sample_prompts: &me [*me, *me]\n"], ids=["billion-laughs",
                                                                                           "recursive"])
def test_a_yaml_alias_bomb_is_refused_by_name(corpus, argv_for, tmp_path, capsys, text):
    """A ten-line YAML --config whose aliases repeat a list of lists expanded into a 351 MB config.json and a
    native abort; a file whose aliases expand past a config's size is refused, naming it, before it is built.
    """
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(text)
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, tmp_path / "run", "--max_steps", 1, "--config", bomb))
    assert f"config file {bomb} expands past 1,048,576 bytes through its YAML aliases" in one_error_line(capsys, 2, e)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------- exports and imports into run folders

def a_folder_of_notes(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("a week of observations")


def an_export_with_a_readme(folder):
    import export_hf
    assert export_hf.main([str(folder.parent / "source"), str(folder)]) == 0
    (folder / "README.md").write_text("the model card, written by hand")


@pytest.mark.parametrize("victim", ["run-folder", "folder-of-notes", "export-with-a-readme"])
def test_export_overwrite_replaces_only_an_earlier_export(tiny_checkpoint, tmp_path, capsys, victim):
    """`export_hf.py RUN OUT --overwrite` with OUT a training run folder replaced its checkpoints and metrics
    with the export. --overwrite may replace an earlier export, never a folder holding anything an export does
    not."""
    import export_hf
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), tmp_path / "source")
    out = tmp_path / "out"
    if victim == "run-folder":
        shutil.copytree(tmp_path / "source", out)
    else:
        (a_folder_of_notes if victim == "folder-of-notes" else an_export_with_a_readme)(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(tmp_path / "source"), str(out), "--overwrite"])
    assert f"{out} is not an earlier export (" in one_error_line(capsys, 2, e)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # every file as it was
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]  # no temporary folder


@pytest.mark.parametrize("held", ["complete", "incomplete-only"])
def test_import_into_a_run_folder_with_checkpoints_is_refused(tiny_checkpoint, tmp_path, capsys, held):
    """`export_hf.py --import HF RUN` into a folder holding checkpoints added step_000000 beside them and
    moved LATEST to it (at one time it ended in a NameError instead); it is refused as the trainer refuses a
    new run."""
    import export_hf
    assert export_hf.main([tiny_checkpoint, str(tmp_path / "hf")]) == 0
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    if held == "incomplete-only":
        os.remove(run / "checkpoints" / "step_000010" / "manifest.json")  # a write cut short, say
        os.remove(run / "checkpoints" / "step_000010" / "trainer_state.pt")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_hf.main(["--import", str(tmp_path / "hf"), str(run)])
    assert f"{run} already holds checkpoints, choose a new RUN_DIR" in one_error_line(capsys, 2, e)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
