"""Tests of checkpoint.py: atomic writes, LATEST, read_model (loading.py) over every kind of folder, one-line
refusals of broken files, and loading without unpickling."""

import json
import os
import shutil

import pytest
import torch
from tokenizers import Tokenizer

import export_hf
import gpu_training_optimized as trainer
from conftest import CODE
from llm.base.errors import CheckpointError
from llm.formats import checkpoint as ckpt_io
from llm.formats.loading import Kind, Source, detect, read_model
from modern_llm import Transformer


def test_read_model_opens_checkpoint_run_and_hugging_face_folders_alike(tiny_checkpoint, tmp_path):
    """The same weights, shape and tokenizer must come back whichever folder names the model."""
    run = os.path.dirname(os.path.dirname(tiny_checkpoint))
    export_hf.export(tiny_checkpoint, str(tmp_path / "hf"))
    found = [read_model(p) for p in (tiny_checkpoint, run, str(tmp_path / "hf"))]
    assert [f.path for f in found] == [tiny_checkpoint, tiny_checkpoint, str(tmp_path / "hf")]
    for f in found[1:]:
        assert f.config == found[0].config
        assert f.state.keys() == found[0].state.keys() and "lm_head.weight" not in f.state  # tied: stored once
        for k in f.state:
            assert torch.equal(f.state[k], found[0].state[k]), k
        theirs, ours = (Tokenizer.from_file(x.tokenizer_path) for x in (f, found[0]))
        assert theirs.get_vocab() == ours.get_vocab()
        assert theirs.encode(CODE).ids == ours.encode(CODE).ids
    assert read_model(tiny_checkpoint, max_seq_len=32).config.max_seq_len == 32


def test_detect_recognises_each_kind_once_and_resolves_a_run_to_its_checkpoint(tiny_checkpoint, tmp_path):
    """Each kind has its own reader, so a name taken for the wrong kind is read by the wrong one: a run folder
    comes back as its newest checkpoint, an export as a Hugging Face folder, a Hub name with nothing fetched.
    """
    run = os.path.dirname(os.path.dirname(tiny_checkpoint))
    export_hf.export(tiny_checkpoint, str(tmp_path / "hf"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # recognised by its name; its reader checks the contents
    assert detect(run) == detect(tiny_checkpoint) == Source(Kind.RUN, tiny_checkpoint)
    assert detect(str(tmp_path / "hf"), max_seq_len=32) == Source(Kind.HF, str(tmp_path / "hf"), 32)
    assert detect("hf:Org/Name").kind is Kind.HUB  # nothing is fetched to recognise it
    assert detect(str(tmp_path / "model.gguf")).kind is Kind.GGUF
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        detect(str(tmp_path / "nothing"))


@pytest.mark.parametrize("damage,words", [
    ("truncate", ["model.safetensors", "incomplete", "holds"]),
    ("no_weights", ["model.safetensors", "is missing"]),
    ("garbage", ["model.safetensors", "corrupt"]),
    ("bad_config", ["model_config.json", "not a valid model config"]),
    ("other_shape", ["declares", "parameters", "does not belong to these weights"]),
], ids=["truncated", "no-weights", "garbage", "bad-config", "other-shape"])
def test_broken_checkpoints_are_refused_naming_the_file(tiny_checkpoint, tmp_path, damage, words):
    """Every way a checkpoint breaks gives a CheckpointError naming the file, never a raw traceback from
    safetensors, json or load_state_dict (read through the run folder, as the generator does by default)."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    ckpt = ckpt_io.latest_checkpoint(str(run))
    weights, config = os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, "model_config.json")
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif damage == "no_weights":
        os.remove(weights)
    elif damage == "garbage":  # damaged in place: the size still matches the manifest
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 16)
    elif damage == "bad_config":
        size = os.path.getsize(config)
        with open(config, "w") as f:
            f.write("{not json".ljust(size))
    else:  # a checkpoint from before manifests, whose config was edited by hand
        os.remove(os.path.join(ckpt, "manifest.json"))
        values = json.load(open(config))
        with open(config, "w") as f:
            json.dump({**values, "hidden_size": 128, "head_dim": 0, "intermediate_size": 0}, f)
    with pytest.raises(CheckpointError) as e:
        read_model(str(run))
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_corrupt_init_from_is_one_error_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    """--init_from with corrupt weights once ended in a safetensors traceback (it read the file itself)."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(SystemExit) as e:
        trainer.run(["--preset", "tiny", "--init_from", str(bad), "--run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert "model.safetensors" in err[0] and "corrupt" in err[0]
    assert not (tmp_path / "run").exists()


def test_save_is_atomic_latest_moves_last_and_pruning_keeps_the_newest(tiny_checkpoint, tmp_path):
    """LATEST must always name a complete folder; leftovers of an interrupted write are cleared; only the
    newest `keep` checkpoints stay."""
    found = read_model(tiny_checkpoint)
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "checkpoints", ".tmp_step_000001"))  # an interrupted earlier write
    for step in (1, 2, 3):
        path = ckpt_io.save_checkpoint(run, step, found.state, model_config=found.config,
                                       tokenizer_path=found.tokenizer_path, trainer_state={"step": step}, keep=2)
        assert ckpt_io.latest_checkpoint(run) == path
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["LATEST", "step_000002", "step_000003"]
    assert [os.path.basename(c) for c in ckpt_io.list_checkpoints(run)] == ["step_000002", "step_000003"]
    model = Transformer(found.config)
    ckpt_io.load_weights(ckpt_io.latest_checkpoint(run), model)
    assert torch.equal(model.embed_tokens.weight, found.state["embed_tokens.weight"])


class Payload:
    """An object whose unpickling would run code: torch.load(weights_only=True) must refuse it."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_trainer_state_is_read_without_unpickling_code(tiny_checkpoint, tmp_path):
    """A hostile trainer_state.pt must be refused with a CheckpointError, not executed."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    torch.save({"step": 1, "evil": Payload()}, ckpt / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        ckpt_io.load_trainer_state(str(ckpt))


def test_a_trainer_state_without_its_counters_is_refused_in_one_line():
    """trainer_state.pt's reader once indexed its counters blindly: a damaged or hand-written state without
    them ended a resume in a KeyError traceback instead of the checkpoint error line."""
    from llm.base.errors import CheckpointError
    from llm.formats.trainer_state import parse
    with pytest.raises(CheckpointError, match="lacks step, best_val_loss"):
        parse({"tokens": 3, "optimizer": {}})
    assert parse({"step": 2, "tokens": 3, "best_val_loss": 1.5}).step == 2


def test_a_checkpoint_file_changed_since_it_was_written_is_refused_in_one_line(tiny_checkpoint, tmp_path):
    """A checkpoint's weights or trainer state rewritten in place (the same size, other values: a bit flipped
    on disk, a hand edit) once loaded as they were. The manifest now keeps each file's sha256 as written: a
    file whose size or time moved is hashed when read and refused, naming the file and what to do, where a
    file merely touched (copied, its bytes the same) loads."""
    ckpt = str(tmp_path / "step_000010")
    shutil.copytree(tiny_checkpoint, ckpt)  # copytree keeps the times: nothing to hash
    want = ckpt_io.read_checkpoint(ckpt)[1]
    weights = os.path.join(ckpt, ckpt_io.WEIGHTS)
    os.utime(weights, ns=(1, 1))  # touched, the same bytes: hashed, and loads
    got = ckpt_io.read_checkpoint(ckpt)[1]
    assert all(torch.equal(got[k], want[k]) for k in want)
    data = bytearray(open(weights, "rb").read())
    data[-5] ^= 0x01  # one bit of the last tensor's values: the header and the size as they were
    open(weights, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors is not the file written at step 10 \(its sha256 "
                                              r"differs\).*use an earlier checkpoint"):
        ckpt_io.read_checkpoint(ckpt)
    state = os.path.join(ckpt, ckpt_io.TRAINER_STATE)
    ckpt_io.load_trainer_state(ckpt)
    with open(state, "r+b") as f:
        f.seek(os.path.getsize(state) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match="trainer_state.pt is not the file written"):
        ckpt_io.load_trainer_state(ckpt)
