"""A new user's first hour: edit config.py by hand, run the scripts with no settings, and the run is the one
written there. Each test copies the project into a temporary folder and edits the copy's config.py."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from llm.reports.monitor import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def project_copy(tmp_path, edits: dict) -> str:
    """The project's scripts and package in tmp_path/project, with config.py's `name: type = arg(VALUE, ...)`
    lines rewritten by text substitution, as a user would in an editor; edits maps a field name to its new
    value."""
    dst = tmp_path / "project"
    dst.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), dst / name)
    shutil.copytree(os.path.join(ROOT, "llm"), dst / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    text = (dst / "config.py").read_text(encoding="utf-8")
    for field, value in edits.items():
        text, n = re.subn(rf"(\n    {field}: [^=]+= arg\()[^,]+,", rf"\g<1>{value},", text, count=1)
        assert n == 1, f"no line for {field} in config.py"
    (dst / "config.py").write_text(text, encoding="utf-8")
    return str(dst)


def run(project: str, script: str, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy's modules, not the checkout's
    return subprocess.run([sys.executable, script, *args], cwd=project, capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_values_written_in_config_py_are_the_ones_the_run_uses(corpus, tmp_path):
    """Editing a step count, a model width and a learning rate in config.py must change the run, with no
    flags: the automatic sizing once overwrote such edits, so a run trained 450 steps whatever max_steps said.
    """
    project = project_copy(tmp_path, {"max_steps": 7, "hidden_size": 96, "learning_rate": 0.004,
                                      # and, to keep the test fast: a small vocabulary, no compile
                                      "vocab_size": 512, "compile": '"off"'})
    r = run(project, "gpu_training_optimized.py", "--sources", corpus["src"], "--cache_dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = os.path.join(project, "runs", "default")
    train = read_metrics(run_dir, "train")
    assert [rec["step"] for rec in train] == [1, 2, 7]  # the first two steps, then every 10 and the last
    assert all(rec["lr_adamw"] == pytest.approx(0.004 * rec["lr_scale"]) for rec in train)
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    assert (saved["train"]["max_steps"], saved["model"]["hidden_size"], saved["train"]["learning_rate"],
            saved["model"]["vocab_size"], saved["train"]["compile"]) == (7, 96, 0.004, 512, "off")
    ckpt = os.path.join(run_dir, "checkpoints", "step_000007")
    model = json.load(open(os.path.join(ckpt, "model_config.json")))
    assert (model["hidden_size"], model["vocab_size"]) == (96, 512)
    # The fields left automatic were filled, and the report says with what and why.
    assert "automatic: num_hidden_layers=4" in r.stdout and "the tiny preset: no CUDA device" in r.stdout
    assert "max_steps" not in r.stdout.split("automatic:")[1].split("(")[0]  # written, so never sized


def test_the_generator_never_reads_training_settings(tiny_checkpoint, tmp_path):
    """An invalid training value in config.py must not stop text generation (it once failed with
    'warmup_steps=50 is invalid' after an edit of max_steps)."""
    project = project_copy(tmp_path, {"max_steps": 10, "learning_rate": -1.0, "micro_batch_size": -4})
    r = run(project, "text_generator.py", tiny_checkpoint, "--prompt", "def", "--max_new_tokens", "3")
    assert r.returncode == 0, r.stderr
    t = run(project, "gpu_training_optimized.py", "--max_steps", "3")  # the trainer does read them, and says so
    assert t.returncode == 2 and t.stderr.startswith("error: micro_batch_size=-4 is invalid")
    assert t.stderr.strip().endswith("(as written in config.py)")
