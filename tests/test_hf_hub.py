"""Tests of hf_hub.py: hf:ORG/NAME read from the Hugging Face cache, offline, by the importer, the trainer's
--init_from, the generator and the server alike; a model missing from the cache is one error line saying how to
fetch it; and online, config.json is checked before any weight is asked for. The network is never reached: the
cache is filled here in huggingface_hub's own layout, and where a test plays the online path the two download
functions are replaced by stand-ins that read the local cache."""

import hashlib
import os
import shutil
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants
from test_hf_families import TOLERANCE, hf_model, load_ours, max_diff

import export_hf
from config import Config, TrainConfig
from conftest import edit_json
from llm import checkpoint as ckpt_io
from llm.inference import load_for_inference
from llm.resume import apply_init_from

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO, COMMIT = "tiny-org/tiny-qwen2", "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache, repo: str, folder):
    """folder's files in the cache as a download lays them out: blobs named by hash, a snapshot of links to them
    named by commit, and refs/main naming the commit."""
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
    """An offline Hugging Face home in tmp_path holding REPO (a random Qwen2 model); (its cache, the model)."""
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
    assert cfg.model == ours.config and cfg.data.tokenizer == os.path.join(ckpt_io.read_model(f"hf:{REPO}").path,
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
    """Offline, a model not in the cache must say so and how to fetch it in one line, exit 2, and write nothing;
    a name that is not ORG/NAME is refused before huggingface_hub sees it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", name, str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


def test_online_the_config_is_checked_before_the_weights_are_asked_for(hub, tmp_path, monkeypatch, capsys):
    """Online, config.json comes first: a model our architecture cannot compute (here SmolLM3 with NoPE layers) is
    refused before the weights, gigabytes for a real model, are downloaded; one that fits is fetched with only the
    files the reader uses. Stand-ins for the two downloads: nothing reaches the network."""
    cache, theirs = hub
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    snapshot, asked = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT, []

    def config_download(repo_id, filename, **kw):
        asked.append(("file", repo_id, filename))
        return str(snapshot / filename)

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kw):
        asked.append(("snapshot", repo_id, tuple(allow_patterns), local_files_only))
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    assert export_hf.main(["--import", f"hf:{REPO}", str(tmp_path / "run")]) == 0
    assert asked[0] == ("file", REPO, "config.json") and asked[1][:2] == ("snapshot", REPO) and not asked[1][3]
    assert "model-*.safetensors" in asked[1][2] and not any(p.endswith((".bin", ".pth", "*")) for p in asked[1][2])
    assert max_diff(load_ours(str(tmp_path / "run")), theirs) < TOLERANCE

    asked.clear()
    config = snapshot / "config.json"
    config.unlink()  # the link: the edited copy must not reach the shared blob
    shutil.copyfile(tmp_path / "src" / "config.json", config)
    edit_json(config, model_type="smollm3", architectures=["SmolLM3ForCausalLM"], no_rope_layer_interval=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", f"hf:{REPO}", str(tmp_path / "run2")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no_rope_layers=[1, 0]" in err and err.count("\n") == 1, err
    assert [a[0] for a in asked] == ["file"]  # refused before the snapshot was asked for


@pytest.mark.slow
def test_the_environment_alone_points_the_scripts_at_the_cache(hub, tmp_path):
    """A user sets HF_HOME and HF_HUB_OFFLINE=1 and runs the script: huggingface_hub reads them at import, so this
    runs it in a fresh process, as users do."""
    cache, _ = hub
    env = {**os.environ, "HF_HOME": str(cache.parent), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "export_hf.py", "--import", f"hf:{REPO}", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported hf:tiny-org/tiny-qwen2" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "text_generator.py", "hf:tiny-org/other", "--prompt", "x"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: hf:tiny-org/other is not in the Hugging Face "
                                                           f"cache ({cache})"), done.stderr
