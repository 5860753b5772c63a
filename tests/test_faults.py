"""Faults a careless or hostile user meets, each reproduced: lost pointers, full and read-only disks, hostile
files and folders, odd bytes. Every one ends in one `error:` line (exit 2 for bad input, 1 for a runtime
failure), never a traceback, and never loses a checkpoint."""

import errno
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

import export_hf
import gpu_training_optimized as trainer
import text_generator as tg
from conftest import one_error_line
from llm.base import atomic
from llm.formats import checkpoint as ckpt_io
from llm.formats.loading import read_model
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.train import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------- lost pointers, kept checkpoints

@pytest.mark.parametrize("pointer", [None, b"\x8f\x00\xff garbage", b"../../etc\n", b"/etc/passwd\n",
                                     b"step_000009\n"], ids=["missing", "random-bytes", "relative-escape",
                                                            "absolute-escape", "names-nothing"])
def test_a_lost_or_hostile_latest_never_loses_checkpoints(corpus, trained, tmp_path, capsys, argv_for, pointer):
    """A kill -9 between a checkpoint's rename and LATEST's write leaves complete checkpoints and no LATEST:
    --resume once said 'no checkpoint yet', and the new run it advised overwrote them. --resume must find the
    newest complete one by scanning, a pointer must never be followed out of the run folder, and a new run
    must refuse the folder."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    latest = run / "checkpoints" / "LATEST"
    latest.unlink()
    if pointer is not None:
        latest.write_bytes(pointer)
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, run, "--max_steps", 6))
    assert "already holds checkpoints" in one_error_line(capsys, 2, e)
    assert trainer.main(argv_for(corpus, run, "--max_steps", 6, "--resume")) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in out and "note: " in out
    assert [r["step"] for r in read_metrics(run, "train")][-2:] == [5, 6]


def test_a_run_folder_with_only_an_incomplete_checkpoint_is_refused_by_name(tmp_path):
    run = tmp_path / "run" / "checkpoints" / "step_000002"
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"")
    with pytest.raises(ckpt_io.CheckpointError, match="holds no complete checkpoint "
                                                      ".*step_000002 is incomplete"):
        read_model(str(tmp_path / "run"))


# ----------------------------------------------------------------------------- full and read-only disks

def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model.safetensors")


@pytest.mark.parametrize("at_step", [4, 2], ids=["final-save", "mid-run-save"])
def test_a_full_disk_at_a_save_keeps_the_previous_checkpoint(corpus, trained, tmp_path, capsys, monkeypatch,
                                                             argv_for, at_step):
    """torch once raised 'unexpected pos' from deep inside, left the partial folder behind, and a run that
    filled the disk at its final save lost its last steps without a word. Now: one line saying what failed,
    how much room the checkpoint needs and what is free, exit 1, no partial folder, LATEST intact."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    original = ckpt_io.save_file

    def full_at(state, path, **kwargs):
        if f"step_{at_step + 4:06d}" in os.path.dirname(path):
            disk_full()
        return original(state, path, **kwargs)
    monkeypatch.setattr(ckpt_io, "save_file", full_at)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, run, "--max_steps", 8, "--save_interval", 2, "--eval_interval", 8, "--resume"))
    err = one_error_line(capsys, 1, e)
    assert f"writing checkpoint step_{at_step + 4:06d}" in err and "No space left on device" in err
    assert "it needs about" in err and "are free in" in err and "is intact" in err
    assert not [d for d in os.listdir(run / "checkpoints") if d.startswith(".")]  # no partial folder
    assert ckpt_io.latest_checkpoint(str(run)) == str(run / "checkpoints" / f"step_{at_step + 2:06d}")
    read_model(str(run))  # the previous checkpoint still loads


@pytest.mark.parametrize("fault,code,words", [
    ("file", 2, ["--run_dir", "is a file, name a folder"]),
    ("read-only", 2, ["Read-only file system", "choose a folder you can write to"]),
    ("full", 1, ["No space left on device", "free in"]),
])
def test_a_run_folder_that_cannot_be_written_is_one_line_before_any_work(corpus, tmp_path, capsys, monkeypatch,
                                                                          argv_for, fault, code, words):
    """--run_dir naming a file, a read-only folder or a full disk gave tracebacks (after the data was
    prepared); now one line, before the data."""
    run = tmp_path / "run"
    if fault == "file":
        run.write_text("not a folder")
    else:
        number = errno.EROFS if fault == "read-only" else errno.ENOSPC

        def refuse(path, *args, **kwargs):  # the probe's write, as a read-only or full file system answers
            raise OSError(number, os.strerror(number), path)
        monkeypatch.setattr(atomic, "open", refuse, raising=False)
    monkeypatch.setattr(startup, "prepare_once", lambda *a: pytest.fail("prepared the data first"))
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, run, "--max_steps", 2))
    err = one_error_line(capsys, code, e)
    assert all(w in err for w in words), err


def test_every_checkpoint_file_has_one_mode(tiny_checkpoint):
    """model.safetensors was written 0600 and the other files 0644: one mode, from the umask."""
    modes = {stat.S_IMODE(os.stat(os.path.join(tiny_checkpoint, f)).st_mode) for f in os.listdir(tiny_checkpoint)}
    mask = os.umask(0)
    os.umask(mask)
    assert modes == {0o666 & ~mask}


# ----------------------------------------------------------------------- resume on other data or past the end

def test_resuming_on_other_data_is_refused_with_what_differs(corpus, trained, tmp_path, capsys, argv_for):
    """Another --sources once swapped the tokenizer under a resumed run without a word."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    other = tmp_path / "other"
    shutil.copytree(corpus["src"], other)
    (other / "d.py").write_text("x = 1\n" * 5000)
    argv = argv_for(corpus, run, "--max_steps", 6, "--resume")
    argv[argv.index("--sources") + 1] = str(other)
    with pytest.raises(SystemExit) as e:
        trainer.run(argv)
    err = one_error_line(capsys, 2, e)
    assert "cannot resume on other data (sources:" in err and "--init_from" in err
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, run, "--max_steps", 3, "--resume"))
    assert "already at step 4 and max_steps=3 leaves nothing to train" in one_error_line(capsys, 2, e)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "run.json"
    bad.write_bytes(b'{"max_steps": 3, "run_dir": "caf\xe9"}')
    with pytest.raises(SystemExit) as e:
        trainer.run(["--config", str(bad)])
    assert "run.json is not UTF-8 text (byte 32)" in one_error_line(capsys, 2, e)


# ----------------------------------------------------------------------------- hostile model folders

@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export_hf.export(tiny_checkpoint, str(out))
    return out


def edit(folder, name, change):
    path = folder / name
    value = json.loads(path.read_text())
    path.write_text(json.dumps(change(value)))


def sharded(folder):
    """The folder with its weights in two shards and an index, as save_pretrained writes large models."""
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, folder / file)
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


HOSTILE = {
    "config is a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "holds a list, not a config object"),
    "size is a string": (lambda f: edit(f, "config.json", lambda c: {**c, "hidden_size": "wide"}),
                         "is not a valid transformers config"),
    "size is a float": (lambda f: edit(f, "config.json", lambda c: {**c, "num_hidden_layers": 2.5}),
                        "is not a valid transformers config"),
    "10^7 layers": (lambda f: edit(f, "config.json", lambda c: {**c, "num_hidden_layers": 10**7}),
                    "num_hidden_layers=10000000 is invalid: must be from 0 to 4096"),
    "10^12 vocabulary": (lambda f: edit(f, "config.json", lambda c: {**c, "vocab_size": 10**12}),
                         "vocab_size=1000000000000 is invalid"),
    "index is not json": (lambda f: (sharded(f), (f / "model.safetensors.index.json").write_text("{oops"))[1],
                          "is not a weight index"),
    "index without weight_map": (lambda f: (sharded(f), edit(f, "model.safetensors.index.json",
                                                             lambda i: {"metadata": {}})), "is not a weight index"),
    "missing shard": (lambda f: (sharded(f), (f / "b.safetensors").unlink()), "lacks 1 shard(s) its index lists"),
    "shard outside the folder": (lambda f: (sharded(f), edit(f, "model.safetensors.index.json", lambda i: {
        "weight_map": {k: "../../etc/x.safetensors" for k in i["weight_map"]}})), "shards must be .safetensors files"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_hugging_face_folders_are_one_line(hf_folder, tmp_path, capsys, case):
    """Each once ended in a traceback, or (absurd sizes) in a hang while memory grew: --import and the
    generator must refuse with one line, quickly, before building anything."""
    import time
    damage, words = HOSTILE[case]
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    damage(folder)
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        export_hf.main(["--import", str(folder), str(tmp_path / "run")])
    assert words in one_error_line(capsys, 2, e) and not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as e:
        tg.main([str(folder), "--prompt", "x"])
    assert words in one_error_line(capsys, 2, e)
    assert time.monotonic() - start < 30


def test_a_checkpoint_holding_nan_is_refused_by_tensor(tiny_checkpoint, tmp_path, capsys):
    """It once loaded silently and generated 0 tokens with exit 0."""
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    os.remove(bad / "manifest.json")  # edited by hand: no longer the checkpoint its manifest describes
    state = load_file(bad / "model.safetensors")
    state["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, bad / "model.safetensors")
    with pytest.raises(SystemExit) as e:
        tg.main([str(bad), "--prompt", "x"])
    assert "layers.1.mlp.up_proj.weight hold NaN or Inf" in one_error_line(capsys, 2, e)


# ----------------------------------------------------------------------------- odd bytes

@pytest.mark.slow
def test_the_generator_takes_bytes_that_are_not_utf8_and_bounds_batches(tiny_checkpoint, tmp_path):
    """Non-UTF-8 bytes on stdin or typed into the REPL once raised UnicodeDecodeError; `set
    num_return_sequences 1000000` then `batch hi` tried to allocate it all."""
    cmd = [sys.executable, os.path.join(ROOT, "text_generator.py"), tiny_checkpoint, "--max_new_tokens", "3"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    one = subprocess.run(cmd, input=b"caf\xe9 def\n", capture_output=True, env=env, timeout=120)
    assert one.returncode == 0 and b"Traceback" not in one.stderr, one.stderr
    repl = subprocess.run(cmd + ["--interactive"], env=env, capture_output=True, timeout=120,
                          input=b"greedy \xff\xfe x\nset num_return_sequences 1000000\nbatch hi\nquit\n")
    err = repl.stderr.decode()
    assert repl.returncode == 0 and "Traceback" not in err, err
    assert "error: num_return_sequences=1000000 is invalid: must be from 1 to 1024" in err
    assert "tokens/s" in err  # the greedy line ran, with its bytes replaced


def test_a_batch_larger_than_memory_is_refused_before_allocating(tiny_checkpoint, monkeypatch):
    import psutil

    from config import SampleConfig
    from llm.generate import engine
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 10**6})())
    with pytest.raises(ValueError, match="need about .* GiB, more than the .* GiB "
                                         "free; lower num_return_sequences"):
        engine.generate(model, [[1, 2, 3]], SampleConfig(num_return_sequences=1000, max_new_tokens=50))


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 byte-order mark at the start of a JSONL file made its first line 'not valid JSON'; at the start
    of a text file it became part of the first document."""
    from config import DataConfig
    from llm.data.corpus import ReadStats, documents, source_files
    rows = [json.dumps({"text": f"document number {i}"}) for i in range(3)]
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode())
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfplain text\n")
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    stats = ReadStats()
    docs = [doc for *_, doc in documents(source_files(cfg), cfg, stats)]
    assert docs == [f"document number {i}" for i in range(3)] + ["plain text\n"] and stats.bad_lines == 0


def test_a_single_document_error_also_reports_what_was_skipped(tmp_path):
    """The one-document error once hid the binary files skipped and the bytes replaced on the way."""
    from config import DataConfig
    from llm.base.errors import DataError
    from llm.data.preparation import prepare
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.txt").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "src" / "pic.png").write_bytes(b"\x89PNG\0\0")
    cfg = DataConfig(sources=[str(tmp_path / "src")], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"single document.*skipped 1 binary file.*replaced 1 invalid UTF-8"):
        prepare(cfg, vocab_size=300, seq_len=8, log=lambda *a: None)


def test_resume_with_another_optimizer_is_one_line(corpus, trained, tmp_path, capsys, argv_for):
    """--resume with another --optimizer once reached a plain ValueError in MuonAdamW.load_state_dict: a
    traceback. It is bad input: one line naming the optimizer the checkpoint was trained with."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    saved = json.loads((run / "config.json").read_text())["train"]["optimizer"]
    other = "adamw" if saved == "muon" else "muon"
    with pytest.raises(SystemExit) as e:
        trainer.run(argv_for(corpus, run, "--resume", "--max_steps", 6, "--optimizer", other))
    line = one_error_line(capsys, 2, e)
    assert f"--optimizer {saved}" in line


def test_a_resume_takes_the_optimizer_its_checkpoint_was_trained_with(corpus, argv_for, tmp_path, capsys):
    """--optimizer auto is Muon from scratch and AdamW when fine-tuning; a run trained with AdamW and resumed
    with the optimizer left automatic continues with AdamW, whose state its checkpoint holds."""
    run = tmp_path / "run"
    assert trainer.run(argv_for(corpus, run, "--max_steps", 2, "--optimizer", "adamw")) == 0
    assert trainer.run(argv_for(corpus, run, "--resume", "--max_steps", 4)) == 0
    assert json.loads((run / "config.json").read_text())["train"]["optimizer"] == "adamw"
    assert "optimizer=adamw" in capsys.readouterr().out
