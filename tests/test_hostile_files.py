"""Hostile files and file systems, each met the way a user meets it: a real full disk, a damaged token cache, a
preparation killed half-way, two trainers on one folder, a YAML alias bomb, an export aimed at a run folder.
Every one ends in one `error:` line (exit 2 for bad input, 1 for a runtime failure) or a repair said in one
line, never a traceback, never half-written output, never lost work."""

import os
import shutil
import subprocess
import sys

import pytest

import checkpoint as ckpt_io
import gpu_training_optimized as trainer
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
