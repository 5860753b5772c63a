"""Hostile inputs met at load, listing, resume and evaluation, each reproduced as a user meets it: JSON nested
past the parser's depth, a context of 10^12 positions, a tokenizer larger than its model, bytes that are not
UTF-8 on the command line, stray files beside runs, a model folder given to --resume, garbage in
metrics.jsonl, a one-line file of megabytes to evaluate, a named pipe as data. Each ends in one `error:` line
and exit 2, or in the run going on."""

import json
import math
import os
import re
import shutil
import tracemalloc

import pytest
import torch

import export_hf
import gpu_training_optimized as trainer
import text_generator as tg
from config import DataConfig
from conftest import one_error_line, save_model
from llm.data.corpus import PIECE_BYTES, source_files
from llm.data.preparation import split_texts
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from modern_llm import Transformer

DEEP = "[" * 100_000  # past the JSON parser's recursion limit: RecursionError, not JSONDecodeError


def refused(capsys, main, argv) -> str:
    """The error line of main(argv), which must exit 2 with exactly one."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return one_error_line(capsys, 2, e)


@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export_hf.export(tiny_checkpoint, str(out))
    return out


def copy_checkpoint(tiny_checkpoint, tmp_path):
    """The tiny checkpoint's run folder copied, and its checkpoint's path in the copy."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    return run, run / "checkpoints" / os.path.basename(tiny_checkpoint)


# ----------------------------------------------------------------------------- JSON nested past the parser

def test_nested_model_config_is_one_line_naming_it(tiny_checkpoint, tmp_path, capsys):
    """A model_config.json of 100,000 '[' (in a checkpoint from before manifests) was a RecursionError
    traceback."""
    _, ckpt = copy_checkpoint(tiny_checkpoint, tmp_path)
    (ckpt / "manifest.json").unlink()
    (ckpt / "model_config.json").write_text(DEEP)
    line = refused(capsys, tg.main, [str(ckpt), "--prompt", "x"])
    assert f"{ckpt / 'model_config.json'} is not a valid model config (JSON nested too deeply" in line


def test_nested_manifests_are_one_line_for_the_generator_and_resume(trained, corpus, argv_for, tmp_path, capsys):
    """manifest.json nested too deeply was a RecursionError traceback in the generator, --list and --resume; a
    checkpoint whose manifest cannot be read is incomplete, and --list shows the others."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").write_text(DEEP)
    assert "manifest.json is unreadable" in refused(capsys, tg.main, [str(run), "--prompt", "x"])
    assert "manifest.json is unreadable" in refused(capsys, trainer.run, argv_for(corpus, run, "--resume"))
    shutil.copytree(trained, tmp_path / "good")
    assert tg.main(["--list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^good +2 ", out, re.M) and re.search(r"^good +4 ", out, re.M) and "\nrun " not in out


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_nested_hugging_face_files_are_one_line(hf_folder, tmp_path, capsys, file):
    """A Hugging Face config.json or weight index nested too deeply was a RecursionError traceback from the
    importer and the generator."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    (folder / file).write_text(DEEP)
    for main, argv in ((export_hf.main, ["--import", str(folder), str(tmp_path / "run")]),
                       (tg.main, [str(folder), "--prompt", "x"])):
        assert f"{folder / file} is not a " in refused(capsys, main, argv)
    assert not (tmp_path / "run").exists()


def test_a_nested_run_config_given_to_the_trainer_is_one_line(tmp_path, capsys):
    """A run's config.json read back with --config: cli.py's reader already makes this one line; kept with its
    siblings so that every JSON the project reads is covered."""
    (tmp_path / "config.json").write_text(DEEP)
    assert "config.json is not valid" in refused(capsys, trainer.run, ["--config", str(tmp_path / "config.json")])


# ----------------------------------------------------------------------------- sizes a model cannot have

def test_a_context_of_a_trillion_positions_is_refused_with_the_way_out(hf_folder, tmp_path, capsys):
    """max_position_embeddings=10**12 made the generator ask the allocator for 4 TB of RoPE table (a RuntimeError
    traceback) and the importer write a checkpoint nothing could load. One line names the field and
    --max_seq_len, which then imports it."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**12}))
    for main, argv in ((export_hf.main, ["--import", str(folder), str(tmp_path / "run")]),
                       (tg.main, [str(folder), "--prompt", "x"])):
        line = refused(capsys, main, argv)
        assert "config.json" in line and "max_seq_len=1000000000000 is invalid: must be from 0 to 4,194,304" in line
        assert "--max_seq_len N" in line
    assert not (tmp_path / "run").exists()
    assert export_hf.main(["--import", str(folder), str(tmp_path / "run"), "--max_seq_len", "64"]) == 0


def test_a_context_of_no_positions_is_refused_naming_the_field(hf_folder, tmp_path, capsys):
    """max_position_embeddings=0 read as the automatic context and reached the generator, which refused every
    prompt with "it needs 1 to -1" tokens (the GGUF reader's context_length=0 did the same): one line names
    the file and the field."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    line = refused(capsys, tg.main, [str(folder), "--prompt", "x"])
    assert f"{folder}/config.json" in line and "max_position_embeddings=0 is not a positive" in line, line


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_at_load(tiny_checkpoint, tmp_path, capsys):
    """A tokenizer.json whose ids go past the embedding's rows (same count of tokens, one id moved to 5000)
    passed the load and hit an index error in the middle of generating."""
    _, ckpt = copy_checkpoint(tiny_checkpoint, tmp_path)
    (ckpt / "manifest.json").unlink()
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    rows = max(vocab.values()) + 1
    vocab["listdir"] = 5000
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    line = refused(capsys, tg.main, [str(ckpt), "--prompt", "os.listdir", "--max_new_tokens", "2"])
    assert f"the tokenizer's ids reach 5000 (5001 rows needed) but the model's embedding has {rows} rows" in line


# --------------------------------------------------------------------------- the command line and run folders

def test_a_prompt_with_bytes_that_are_not_utf8_is_generated_from(tiny_checkpoint, capsys):
    """`--prompt $'caf\\xe9'` arrives as a surrogate (surrogateescape) and the tokenizer raised TypeError; the
    byte now becomes U+FFFD, as on stdin."""
    assert tg.main([tiny_checkpoint, "--prompt", "caf\udce9", "--max_new_tokens", "2", "--temperature", "0"]) == 0
    assert "tokens/s" in capsys.readouterr().err
    assert tg.parse_args(["--prompt", "caf\udce9", "--stop", "\udcff"])[2].prompt == "caf\ufffd"


def test_list_skips_plain_files_beside_the_runs(tiny_checkpoint, tmp_path, capsys):
    """A notes.txt in runs/ made --list fail with NotADirectoryError."""
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), tmp_path / "run1")
    (tmp_path / "notes.txt").write_text("lr 3e-3 was better\n")
    assert tg.main(["--list", str(tmp_path)]) == 0
    assert re.search(r"^run1 +10 ", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("what", ["hugging-face", "renamed-copy"])
def test_resume_from_a_folder_that_is_not_a_run_says_what_it_takes(tiny_checkpoint, hf_folder, corpus, argv_for,
                                                                  tmp_path, capsys, what):
    """--resume naming a Hugging Face folder or a checkpoint copied under another name died with
    "'NoneType' object has no attribute 'group'"."""
    folder = tmp_path / "weights"
    shutil.copytree(hf_folder if what == "hugging-face" else tiny_checkpoint, folder)
    line = refused(capsys, trainer.run, argv_for(corpus, tmp_path / "run", "--resume", folder))
    assert "--resume takes a run folder or a step_N checkpoint folder in one" in line
    assert f"pass --init_from {folder}" in line


GARBAGE = ["not json at all", "[1, 2]", '{"kind": "train", "step": "3", "loss": 1.0}',
           '{"kind": "eval", "step": 2, "val_loss": "low"}', '{"kind": "train", "step": 1}',
           '{"kind": "eval", "step": 4, "val_loss": 1.0, "code_ok": "most"}', DEEP]


def test_garbage_lines_in_metrics_are_skipped_by_resume_and_list(trained, corpus, argv_for, tmp_path, capsys):
    """A metrics.jsonl line that is not a record (not JSON, not an object, a step or loss of the wrong type,
    nested past the parser) stopped --resume with a TypeError and --list with a RecursionError. Reading
    metrics is best-effort: such lines are skipped, and the resumed run rewrites the file without them."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n".join(GARBAGE) + "\n")
    good = read_metrics(trained)
    assert tg.main(["--list", str(run)]) == 0
    assert re.search(rf"^run +4 .* {good[-1]['val_loss']:.4f} ", capsys.readouterr().out, re.M)
    assert trainer.run(argv_for(corpus, run, "--max_steps", 5, "--resume")) == 0
    after = read_metrics(run)
    assert after[:len(good)] == good and {r["step"] for r in after[len(good):]} == {5}
    assert not [line for line in open(run / "metrics.jsonl") if line.strip() in GARBAGE]


# ----------------------------------------------------------------------------- evaluating large files

@pytest.fixture(scope="module")
def long_context(tiny_checkpoint, tmp_path_factory):
    """A one-layer model with a context of 1024 on the tiny tokenizer: few windows per megabyte, so a file of
    megabytes is scored in seconds."""
    from config import ModelConfig
    tokenizer = os.path.join(tiny_checkpoint, "tokenizer.json")
    vocab = len(json.load(open(tokenizer))["model"]["vocab"])
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_seq_len=1024)
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("long") / "run"
    return save_model(run, 1, Transformer(cfg), tokenizer)


def written_out_bits_per_byte(model, tok, texts, batch_size=8) -> tuple[float, int]:
    """bits per byte and tokens as --eval computed them before streaming: every document encoded whole, joined
    with <|endoftext|>, cut into windows of the context, scored batch by batch."""
    ids = []
    for text in texts:
        ids += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    window, total = model.config.max_seq_len, 0.0
    starts = list(range(0, len(ids) - 1, window))
    with torch.no_grad():
        for i in range(0, len(starts), batch_size):
            chunk = [ids[s:s + window + 1] for s in starts[i:i + batch_size]]
            width = max(map(len, chunk))
            batch = torch.tensor([c + [0] * (width - len(c)) for c in chunk])
            labels = torch.tensor([c[1:] + [-100] * (width - len(c)) for c in chunk])
            logits = model(batch[:, :-1])[0].float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                       reduction="sum").item()
    return total / math.log(2) / sum(len(t.encode()) for t in texts), len(ids) - 1


def eval_line(capsys, ckpt, files) -> tuple[float, int, str]:
    """(bits per byte, tokens, stderr) that `text_generator.py CKPT --eval --eval_files FILES` prints."""
    assert tg.main([ckpt, "--eval", "--eval_files", *files]) == 0
    out, err = capsys.readouterr()
    found = re.search(r": ([\d.]+) bits per byte on .* \(([\d,]+) bytes, ([\d,]+) tokens", out)
    return float(found.group(1)), int(found.group(3).replace(",", "")), err


def test_streamed_evaluation_equals_the_whole_file_one(long_context, tmp_path, capsys):
    """Streaming must not change the figure: on files of several read pieces (joined into one document, as
    before), bits per byte and tokens are those of encoding each document whole."""
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("".join(f"line {i} of a file longer than one piece\n" for i in range(1000)))
    files[1].write_text("caf\u00e9 \u65e5\u672c\n" * 500)
    bpb, tokens, err = eval_line(capsys, long_context, [str(f) for f in files])
    model, tok, *_ = load_for_inference(long_context, "cpu")
    texts = split_texts(DataConfig(sources=[str(f) for f in files]), split=None)
    assert len(texts) == 2 and len(texts[0]) > PIECE_BYTES  # two documents, the first read in pieces
    expected, expected_tokens = written_out_bits_per_byte(model, tok, texts)
    assert tokens == expected_tokens and bpb == pytest.approx(expected, abs=1e-4)
    assert "bits per byte: 100%" in err  # the progress bar, on stderr


def test_a_one_line_file_of_megabytes_is_evaluated_in_bounded_memory(long_context, tmp_path, capsys):
    """A one-line file of 20 MB took --eval past ten minutes and one of 30 MB took 3.8 GB: the whole file was
    one string, encoded at once into one list of ids. Now it is read, encoded and scored a bounded part at a
    time: the Python memory at its peak stays well under the file's size (before: about six times it)."""
    path = tmp_path / "one_line.txt"
    path.write_text(" fibonacci" * 300_000)  # 3 MB, no newline; about 10 bytes per token, so few windows
    tracemalloc.start()
    try:
        bpb, tokens, _ = eval_line(capsys, long_context, [str(path)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tokens > 250_000 and math.isfinite(bpb)
    assert peak < 8e6, f"peak {peak / 1e6:.1f} MB for a 3 MB file"


# ----------------------------------------------------------------------------- pipes

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_as_data_is_not_called_missing(tiny_checkpoint, corpus, argv_for, tmp_path, capsys):
    """A FIFO given to --sources or --eval_files was reported as 'does not exist'; inside a folder it would
    block the reader for ever."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = argv_for(corpus, tmp_path / "run", "--max_steps", 1)
    argv[argv.index("--sources") + 1] = str(fifo)
    for main, args in ((trainer.run, argv), (tg.main, [tiny_checkpoint, "--eval", "--eval_files", str(fifo)])):
        assert f"data source {fifo} is not a regular file or folder" in refused(capsys, main, args)
    (tmp_path / "a.py").write_text("x = 1\n")
    assert [p for p, _ in source_files(DataConfig(sources=[str(tmp_path)]))] == [str(tmp_path / "a.py")]


def test_a_nested_config_inside_the_trainer_state_is_one_line(trained, corpus, argv_for, tmp_path, capsys):
    """trainer_state.pt keeps the run's config as JSON text, which --resume parsed unguarded: nested past the
    parser's depth it was a RecursionError traceback."""
    from llm.formats import checkpoint as ckpt_io
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpt = ckpt_io.latest_checkpoint(str(run))
    state = ckpt_io.load_trainer_state(ckpt)
    path = os.path.join(ckpt, "trainer_state.pt")
    torch.save({**state, "config": DEEP}, path)
    manifest = json.loads(open(os.path.join(ckpt, "manifest.json")).read())
    manifest["files"]["trainer_state.pt"] = os.path.getsize(path)  # complete, as a writer would have made it
    open(os.path.join(ckpt, "manifest.json"), "w").write(json.dumps(manifest))
    line = refused(capsys, trainer.run, argv_for(corpus, run, "--resume", "--max_steps", 6))
    assert "trainer_state.pt" in line and "use an earlier checkpoint" in line


@pytest.mark.parametrize("kind", [[], ["--gguf", "f16"]])
def test_an_export_onto_an_existing_file_is_refused_and_the_file_kept(tiny_checkpoint, tmp_path, capsys, kind):
    """`export_hf.py RUN FILE` onto a regular file once renamed the user's file to a hidden .old_FILE_PID@HOST
    and said nothing; it is refused by name now, the file as it was and nothing beside it."""
    target = tmp_path / "notes.txt"
    target.write_text("my notes\n")
    line = refused(capsys, export_hf.main, [tiny_checkpoint, str(target), *kind])
    assert str(target) in line and "is a file, not a folder" in line
    assert target.read_text() == "my notes\n" and os.listdir(tmp_path) == ["notes.txt"]
