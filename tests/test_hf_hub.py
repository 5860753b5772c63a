"""Tests of hf_hub.py: hf:ORG/NAME read from the Hugging Face cache, offline, by the importer, the trainer's
--init_from, the generator and the server alike; a model missing from the cache is one error line saying how to
fetch it; online, config.json is checked before any weight is asked for; and what a hostile Hub sends (an ETag, a
commit, a listed name) never reaches a file outside the cache. The network is never reached: the cache is filled
here in huggingface_hub's own layout, and the online tests download from a stand-in Hub on 127.0.0.1
(hub_stand_in.py)."""

import hashlib
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants
from hub_stand_in import COMMIT as HUB_COMMIT
from hub_stand_in import Hub
from test_hf_datasets import point_at
from test_hf_families import TOLERANCE, hf_model, load_ours, max_diff

import export_hf
from config import Config, TrainConfig
from llm.base.errors import CheckpointError
from llm.formats import checkpoint as ckpt_io
from llm.formats import hf_hub
from llm.formats.loading import read_model
from llm.generate.inference import load_for_inference
from llm.train.resume import apply_init_from

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO, COMMIT = "tiny-org/tiny-qwen2", "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache, repo: str, folder):
    """folder's files in the cache as a download lays them out: blobs named by hash, a snapshot of links to
    them named by commit, and refs/main naming the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    (root / "blobs").mkdir()
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_checkpoint):
    """An offline Hugging Face home in tmp_path holding REPO (a random Qwen2 model); (its cache, the model).
    """
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read both at import: its constants are what it consults when called.
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    model = hf_model(tmp_path / "src", os.path.join(tiny_checkpoint, "tokenizer.json"), "qwen2")
    snapshot = fill_cache(home / "hub", REPO, tmp_path / "src")
    # The layout is the library's own: it finds the files where a download would have put them.
    assert huggingface_hub.try_to_load_from_cache(REPO, "config.json") == str(snapshot / "config.json")
    return home / "hub", model


def test_a_cached_hub_model_is_read_by_every_command_offline(hub, tmp_path):
    """hf:ORG/NAME must give the cached model, with transformers' logits, to export_hf.py --import, the trainer's
    --init_from and the generator, with HF_HUB_OFFLINE=1 and no network."""
    _, theirs = hub
    assert export_hf.main(["--import", f"hf:{REPO}", str(tmp_path / "run")]) == 0
    ours = load_ours(str(tmp_path / "run"))
    assert ours.config.qkv_bias and max_diff(ours, theirs) < TOLERANCE
    assert ckpt_io.load_trainer_state(ckpt_io.latest_checkpoint(str(tmp_path / "run")))["imported_from"] == \
        f"hf:{REPO}"

    # The shape and tokenizer of the cached model; its weights come through read_model too.
    cfg, _ = apply_init_from(Config(train=TrainConfig(init_from=f"hf:{REPO}")))
    assert cfg.model == ours.config and cfg.data.tokenizer == os.path.join(read_model(f"hf:{REPO}").path,
                                                                            "tokenizer.json")

    model, _, config, path = load_for_inference(f"hf:{REPO}", "cpu")
    assert config == ours.config and path.endswith(COMMIT)
    assert max_diff(model.float().eval(), theirs) < TOLERANCE
    from serve import model_name
    assert model_name(f"hf:{REPO}") == REPO  # the server's API names it as the Hub does, not by its cache folder


@pytest.mark.parametrize("name,words", [
    ("hf:tiny-org/not-cached", ["hf:tiny-org/not-cached is not in the Hugging Face cache", "HF_HUB_OFFLINE=1",
                                "hf download tiny-org/not-cached"]),
    ("hf:no-slash", ["'hf:no-slash' is not a Hub model name, write hf:ORG/NAME"]),
    ("hf:../../etc", ["is not a Hub model name"]),
    # Our pattern took these; huggingface_hub's validator raised HFValidationError, a traceback.
    ("hf:org/name-", ["is not a Hub model name (Repo id must"]),
    ("hf:org/a--b", ["is not a Hub model name (Cannot have -- or .."]),
    ("hf:org/" + "x" * 300, ["is not a Hub model name"]),
], ids=["not-cached", "no-org", "path", "trailing-dash", "double-dash", "too-long"])
def test_a_missing_or_misspelt_hub_model_is_one_error_line(hub, tmp_path, capsys, name, words):
    """Offline, a model not in the cache must say so and how to fetch it in one line, exit 2, and write
    nothing; a name that is not ORG/NAME is refused before huggingface_hub sees it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", name, str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def online(tmp_path, monkeypatch, tiny_checkpoint):
    """A stand-in Hub on 127.0.0.1 serving REPO (a random Qwen2 model) and an empty Hugging Face home in
    tmp_path; (the Hub, the model)."""
    model = hf_model(tmp_path / "src", os.path.join(tiny_checkpoint, "tokenizer.json"), "qwen2")
    server = Hub({REPO: {name: (tmp_path / "src" / name).read_bytes() for name in os.listdir(tmp_path / "src")}})
    point_at(monkeypatch, tmp_path / "hf_home", server.url)
    yield server, model
    server.stop()


def storage(tmp_path):
    return tmp_path / "hf_home" / "hub" / f"models--{REPO.replace('/', '--')}"


def gets(hub) -> list:
    """The files downloaded, in order."""
    return [p.rsplit("/resolve/", 1)[1].split("/", 1)[1] for method, p, _ in hub.requests
            if method == "GET" and "/resolve/" in p]


def test_online_the_config_is_checked_before_the_weights_are_asked_for(online, tmp_path, monkeypatch, capsys):
    """Online, config.json comes first: a model our architecture cannot compute (here SmolLM3 with NoPE
    layers) is refused before the weights, gigabytes for a real model, are downloaded; one that fits is
    fetched with only the files the reader uses, into huggingface_hub's cache layout, and read again from it
    offline."""
    hub, theirs = online
    hub.repos[REPO]["pytorch_model.bin"] = b"pickled weights are never read"
    assert export_hf.main(["--import", f"hf:{REPO}", str(tmp_path / "run")]) == 0
    assert gets(hub)[0] == "config.json" and "model.safetensors" in gets(hub)
    assert "pytorch_model.bin" not in gets(hub)
    assert max_diff(load_ours(str(tmp_path / "run")), theirs) < TOLERANCE
    assert (storage(tmp_path) / "refs" / "main").read_text() == HUB_COMMIT
    assert os.path.islink(storage(tmp_path) / "snapshots" / HUB_COMMIT / "model.safetensors")

    hub.private[REPO] = "hf_someoneElse"  # the Hub refuses it now: the whole cached copy serves, as it always did
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hf_hub.resolve(f"hf:{REPO}") == str(storage(tmp_path) / "snapshots" / HUB_COMMIT)
    hub.stop()
    point_at(monkeypatch, tmp_path / "hf_home", hub.url, offline=True)
    assert hf_hub.resolve(f"hf:{REPO}") == str(storage(tmp_path) / "snapshots" / HUB_COMMIT)

    config = json.loads(hub.repos[REPO]["config.json"])
    config.update(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], no_rope_layer_interval=2)
    other = Hub({"tiny-org/nope": dict(hub.repos[REPO], **{"config.json": json.dumps(config).encode()})})
    point_at(monkeypatch, tmp_path / "hf_home", other.url)
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            export_hf.main(["--import", "hf:tiny-org/nope", str(tmp_path / "run2")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "no_rope_layers=[1, 0]" in err and err.count("\n") == 1, err
        assert gets(other) == ["config.json"]  # refused before the weights were asked for
    finally:
        other.stop()


def one_error_line(capsys, tmp_path) -> str:
    """export_hf.py --import hf:REPO, which must fail with one error line and exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", f"hf:{REPO}", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: hf:{REPO}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    return err


def test_a_hostile_etag_on_a_model_file_is_refused(online, tmp_path, capsys):
    """The ETag named the blob and its lock: with `../` in it huggingface_hub wrote the weights and a .lock
    outside HF_HOME. It must be a sha1 or sha256 in hex, refused in one line before any path is built."""
    hub, _ = online
    victim = tmp_path / "victim" / "created_by_hub"
    hub.etags["model.safetensors"] = os.path.relpath(victim, storage(tmp_path) / "blobs")
    err = one_error_line(capsys, tmp_path)
    assert "the ETag the Hub sent for model.safetensors '../" in err and "HF_ENDPOINT" in err, err
    assert not victim.parent.exists()


def test_a_hostile_commit_is_refused_online_and_in_the_cache(online, tmp_path, capsys, monkeypatch):
    """The commit the repository's info names became snapshots/COMMIT, trees/COMMIT.json and refs/main: with
    `../` huggingface_hub wrote the listing outside HF_HOME, returned a folder outside it and kept the commit
    in refs/main. It must be 40 hex digits; so must the commit a cached refs/main names, which an offline run
    reads."""
    hub, _ = online
    victim = tmp_path / "victim" / "snapshot"
    hub.commit = os.path.relpath(victim, storage(tmp_path) / "snapshots")
    hub.revisions.add(hub.commit)
    err = one_error_line(capsys, tmp_path)
    assert f"the commit the Hub sent '{hub.commit}' is not a hash" in err, err
    assert not victim.parent.exists() and not (storage(tmp_path) / "refs").exists()

    (storage(tmp_path) / "refs").mkdir(parents=True)
    (storage(tmp_path) / "refs" / "main").write_text(hub.commit)
    for offline in (True, False):  # HF_HUB_OFFLINE=1, and a Hub out of reach: both read the cache
        point_at(monkeypatch, tmp_path / "hf_home", hub.url if offline else "http://127.0.0.1:9", offline)
        with pytest.raises(CheckpointError, match=f"refs/main names '{hub.commit}' is not a hash"):
            hf_hub.resolve(f"hf:{REPO}")
    assert not victim.parent.exists()


def test_a_listed_name_outside_the_snapshot_is_refused(online, tmp_path, capsys):
    """A listing entry model-/../../(...).safetensors matches model-*.safetensors as huggingface_hub's
    patterns read (`*` crosses folders) and named a file outside the snapshot. A name that is fetched must
    stay inside it: one line, exit 2, and nothing written outside HF_HOME."""
    hub, _ = online
    victim = tmp_path / "victim" / "x.safetensors"
    name = "model-/" + os.path.relpath(victim, storage(tmp_path) / "snapshots" / HUB_COMMIT / "model-")
    hub.repos[REPO][name] = b"hostile"
    hub.listed.append({"type": "file", "path": name, "size": 7, "oid": "0" * 40})
    err = one_error_line(capsys, tmp_path)
    assert f"the file name the Hub listed '{name}' is not a path inside the model" in err, err
    assert not victim.parent.exists()


def test_a_private_model_says_to_log_in_or_that_the_token_was_refused(online, tmp_path, capsys, monkeypatch):
    """Without a token, a model the Hub does not show needs `hf auth login`; with one the Hub refuses, the
    line says the token was refused and to check it, not to log in (nor, as a 401 or 403 did, to try again
    later)."""
    hub, _ = online
    hub.private[REPO] = "hf_rightToken"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert "no such model on the Hub (a private one needs `hf auth login`)" in one_error_line(capsys, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_misTyped")
    err = one_error_line(capsys, tmp_path)
    assert "the Hub refused the token given (HF_TOKEN, or the one `hf auth login` saved) as invalid" in err, err
    hub.forbidden.add("hf_noReadAccess")  # known, without the rights to this model (a fine-grained token): 403
    monkeypatch.setenv("HF_TOKEN", "hf_noReadAccess")
    err = one_error_line(capsys, tmp_path)
    assert "the Hub refused the token given (HF_TOKEN, or the one `hf auth login` saved) access (403)" in err, err
    assert "noReadAccess" not in err and "try again later" not in err, err


@pytest.mark.slow
def test_the_environment_alone_points_the_scripts_at_the_cache(hub, tmp_path):
    """A user sets HF_HOME and HF_HUB_OFFLINE=1 and runs the script: huggingface_hub reads them at import, so
    this runs it in a fresh process, as users do."""
    cache, _ = hub
    env = {**os.environ, "HF_HOME": str(cache.parent), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "export_hf.py", "--import", f"hf:{REPO}", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported hf:tiny-org/tiny-qwen2" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "text_generator.py", "hf:tiny-org/other", "--prompt", "x"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: hf:tiny-org/other is not in the "
                                                           f"Hugging Face cache ({cache})"), done.stderr
