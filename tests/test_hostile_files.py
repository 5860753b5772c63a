"""Hostile files and file systems, each met the way a user meets it: a real full disk, a damaged token cache, a
preparation killed half-way, two trainers on one folder, a YAML alias bomb, an export aimed at a run folder.
Every one ends in one `error:` line (exit 2 for bad input, 1 for a runtime failure) or a repair said in one
line, never a traceback, never half-written output, never lost work."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import checkpoint as ckpt_io
import gpu_training_optimized as trainer
import prepare_data as pd
from test_faults import one_error_line

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


# The tiny model's checkpoint: 0.63 MB of weights, then 0.78 MB of trainer state; 1.43 MB in all.
@pytest.mark.parametrize("free,failing", [(300_000, 1), (1_000_000, 1), (2_000_000, 2)],
                         ids=["weights-safetensors", "trainer-state-torch-zip", "second-checkpoint-and-resume"])
def test_a_real_full_disk_at_a_checkpoint_is_one_line(corpus, argv_for, small_disk, capsys, free, failing):
    """On a real full disk safetensors raised SafetensorError '... No space left on device (os error 28)' and
    torch's zip writer RuntimeError '[enforce fail at inline_container.cc] unexpected pos': tracebacks, in a new
    run and under --resume. Now one line, exit 1, no temporary folder, the previous checkpoint and LATEST kept."""
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
            assert ckpt_io.read_model(str(run)).path.endswith("step_000001")


# ----------------------------------------------------------------------------- a damaged token cache

def edit_meta(change):
    def damage(cache):
        (cache / "meta.json").write_text(json.dumps(change(json.loads((cache / "meta.json").read_text()))))
    return damage


def ids_past_the_vocabulary(cache):
    ids = np.fromfile(cache / "train.bin", dtype=np.uint16)
    ids[::10] = 60000  # the tiny model's vocabulary is 512
    ids.tofile(cache / "train.bin")


DAMAGED_CACHES = {
    "meta-garbage-bytes": lambda c: (c / "meta.json").write_bytes(b"\x8f\xff\x00 garbage"),
    "meta-a-list": lambda c: (c / "meta.json").write_text("[1, 2, 3]"),
    "meta-missing-keys": edit_meta(lambda m: {k: v for k, v in m.items() if k not in ("train_tokens", "dtype")}),
    "meta-bad-dtype": edit_meta(lambda m: {**m, "dtype": "nonsense"}),
    "train-truncated": lambda c: os.truncate(c / "train.bin", os.path.getsize(c / "train.bin") // 2),
    "train-empty": lambda c: (c / "train.bin").write_bytes(b""),
    "ids-past-the-vocabulary": ids_past_the_vocabulary,
}


@pytest.fixture(scope="module")
def pristine_cache(corpus, argv_for, tmp_path_factory):
    """The corpus's token cache folder, prepared once, to copy and damage."""
    base = tmp_path_factory.mktemp("pristine")
    pd.main(argv_for(corpus, base / "run", "--cache_dir", base / "cache"))
    (folder,) = [d for d in (base / "cache").iterdir() if not d.name.startswith(".")]
    return folder


@pytest.mark.parametrize("script", ["trainer", "prepare_data"])
@pytest.mark.parametrize("damage", list(DAMAGED_CACHES))
def test_a_damaged_token_cache_is_rebuilt_with_one_line(corpus, argv_for, pristine_cache, tmp_path, capsys, damage,
                                                       script):
    """meta.json of garbage bytes, a list, missing keys or an unknown dtype; train.bin cut short, emptied or
    holding ids past the vocabulary: seven tracebacks (UnicodeDecodeError, TypeError, KeyError, ValueError, an
    IndexError from the embedding mid-run). A cache is derived data: it is rebuilt, and one line says so."""
    cache = tmp_path / "cache" / pristine_cache.name
    shutil.copytree(pristine_cache, cache)
    DAMAGED_CACHES[damage](cache)
    argv = argv_for(corpus, tmp_path / "run", "--max_steps", 1, "--cache_dir", tmp_path / "cache")
    assert (trainer.run if script == "trainer" else pd.main)(argv) in (0, None)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and f"data: the token cache {cache} is damaged (" in out, err
    assert (cache / "train.bin").read_bytes() == (pristine_cache / "train.bin").read_bytes()
    assert pd._cache_problem(str(cache)) is None and os.listdir(cache.parent) == [cache.name]
