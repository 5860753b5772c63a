"""Tests of hf_datasets.py: `--sources hf://datasets/OWNER/NAME/GLOB` fetched through huggingface_hub from a
stand-in Hub on 127.0.0.1 (hub_stand_in.py; the real Hub is never reached): the trainer trains on the files, a
download killed with -9 resumes where it stopped and gives the Hub's bytes, an offline run reads the cache,
only the files a token target needs come down, and every failure (no such dataset, a pattern that matches
nothing, a gated dataset, a token the Hub refuses, no network and nothing cached, a full disk) is one error
line; a file that cannot be read leaves the cache; what a hostile Hub sends (an ETag, a listed name, a
revision with `..`) never reaches a file outside the cache.

Run: python -m pytest -q tests/test_hf_datasets.py"""

import errno
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import constants
from hub_stand_in import COMMIT, Hub, git_blob_id

import gpu_training_optimized as trainer
import prepare_data
from config import DataConfig
from llm.base.errors import DataError, RunFailure
from llm.data import corpus, hf_datasets
from llm.formats import trainer_state
from llm.hub import hub_client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-text"
URL = f"hf://datasets/{REPO}/data/*"
SECRET = "hf_standInTokenNeverShown0123456789"


def _parquet(texts) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), out, compression="none", row_group_size=64)
    return out.getvalue()


@pytest.fixture(scope="module")
def files():
    """The stand-in dataset: two parquet files and a gzipped JSONL of real Python text, and a card not to
    read."""
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8").read()
    docs = [text[i:i + 600] for i in range(0, len(text), 600)]
    third = len(docs) // 3
    return {"data/part-0.parquet": _parquet(docs[:third]), "data/part-1.parquet": _parquet(docs[third:2 * third]),
            "data/part-2.jsonl.gz": gzip.compress("".join(json.dumps({"text": d}) + "\n"
                                                          for d in docs[2 * third:]).encode()),
            "README.md": b"# a dataset card, not data\n"}


def point_at(monkeypatch, home, endpoint: str, offline: bool = False):
    """huggingface_hub read HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE at import: set them and its constants both
    (the token `hf auth login` saves lies in HF_HOME too)."""
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    hf_datasets._fetched.clear()  # a new cache and endpoint: nothing fetched yet


@pytest.fixture
def hub(monkeypatch, tmp_path, files):
    server = Hub({REPO: dict(files), "tiny-org/gated": dict(files)}, gated={"tiny-org/gated"})
    point_at(monkeypatch, tmp_path / "hf_home", server.url)
    yield server
    server.stop()


def snapshot(tmp_path, name: str) -> str:
    return str(tmp_path / "hf_home" / "hub" / f"datasets--{REPO.replace('/', '--')}" / "snapshots" / COMMIT / name)


def one_error_line(capsys, call, code: int) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err
    assert exit_info.value.code == code and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_the_trainer_fetches_the_files_and_trains_on_them_then_again_offline(hub, tmp_path, argv_for, monkeypatch,
                                                                              files, capsys):
    """The trainer must fetch the pattern's data files (not the card) into huggingface_hub's cache with the
    user's token, train on them, and print or keep nothing of the token (config.json holds the sources as
    written); then, with HF_HUB_OFFLINE=1 and the Hub gone, train again from the cache."""
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    monkeypatch.setenv("HF_TOKEN", SECRET)  # as `hf auth login` would keep it: sent to the Hub, written nowhere
    assert trainer.main(argv_for(data, tmp_path / "run", "--max_steps", 3, "--eval_interval", 3)) == 0
    assert hub.tokens == {f"Bearer {SECRET}"}
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "data: 3 files" in out.out
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    names = [n for n in files if n.startswith("data/")]
    assert sorted(p.rsplit("/", 1)[1] for _, p, _ in hub.requests if "/resolve/" in p) == \
        sorted(n.split("/")[1] for n in names for _ in ("HEAD", "GET"))  # never README.md; the Hub asked once
    for name in names:
        assert open(snapshot(tmp_path, name), "rb").read() == files[name]
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["data"]["sources"] == [URL]

    hub.stop()
    point_at(monkeypatch, tmp_path / "hf_home", hub.url, offline=True)
    assert trainer.main(argv_for(data, tmp_path / "again", "--max_steps", 3, "--eval_interval", 3)) == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online, but the Hub is down: the cache, too
    hf_datasets._fetched.clear()
    assert len(corpus.source_files(DataConfig(sources=[URL]))) == 3


@pytest.mark.slow
def test_a_download_killed_midway_resumes_and_gives_the_hubs_bytes(hub, tmp_path, files):
    """kill -9 in the middle of a file must leave what came down, and the next run must ask only for the rest
    (a Range request) and end with the file the Hub holds; huggingface_hub 2.4 alone starts such a file over.
    """
    name = "data/part-0.parquet"
    hub.stall = (name, len(files[name]) * 2 // 3)
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from huggingface_hub import constants; "
              "constants.DOWNLOAD_CHUNK_SIZE = 16384; from llm.data import hf_datasets; "
              "hf_datasets.fetch(sys.argv[2])")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
    child = subprocess.Popen([sys.executable, "-c", script, ROOT, URL], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        assert hub.stalled.wait(60), "the download never began"
        blobs = tmp_path / "hf_home" / "hub" / f"datasets--{REPO.replace('/', '--')}" / "blobs"
        deadline = time.time() + 30
        while not any(p.stat().st_size for p in blobs.glob("*.partial")) and time.time() < deadline:
            time.sleep(0.05)  # the chunks before the stall reach the disk
    finally:
        child.kill()
        child.wait()
    kept = sum(p.stat().st_size for p in blobs.glob("*.partial"))
    assert 0 < kept < len(files[name])

    hub.stall = None
    paths = hf_datasets.fetch(URL)
    assert hub.gets(name)[-1] == f"bytes={kept}-"
    assert [open(p, "rb").read() for p in paths] == [files[n] for n in sorted(files) if n.startswith("data/")]
    assert not list(blobs.glob("*.partial"))


def test_a_partial_file_that_is_not_the_hubs_is_refused_then_fetched_anew(hub, tmp_path, files):
    """A kept .partial whose bytes are not the start of the Hub's file (the file changed, the disk lied) must
    not become data: the whole is checked against the Hub's hash, the partial removed, and the next run starts
    over."""
    name = "data/part-0.parquet"
    blobs = tmp_path / "hf_home" / "hub" / f"datasets--{REPO.replace('/', '--')}" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{hashlib.sha256(files[name]).hexdigest()}.partial").write_bytes(b"not the start of it")
    with pytest.raises(RunFailure, match=f"{name} came down different from the Hub's copy"):
        hf_datasets.fetch(URL)
    assert not list(blobs.glob("*.partial")) and hub.gets(name) == ["bytes=19-"]
    assert open(hf_datasets.fetch(URL)[0], "rb").read() == files[name]


def test_a_connection_cut_midway_resumes_in_the_same_run_and_says_so(hub, tmp_path, files, capsys):
    """A connection that drops after some bytes (a proxy, a flaky network) must not end the run nor start the
    file over: the download goes on from the bytes kept, with a Range, a line for each break; one that keeps
    breaking ends in one line after a few tries, its bytes kept for the next run."""
    name, quarter = "data/part-0.parquet", len(files["data/part-0.parquet"]) // 4
    hub.cut = (name, quarter, 2)
    assert open(hf_datasets.fetch(URL, 1)[0], "rb").read() == files[name]
    assert hub.gets(name) == [None, f"bytes={quarter}-", f"bytes={2 * quarter}-"]
    out = capsys.readouterr().out
    assert out.count(f"{name}: the connection broke after ") == 2 and "resuming" in out, out
    name = "data/part-1.parquet"
    hub.cut = (name, 100, 99)
    with pytest.raises(RunFailure, match=r"the Hub stopped answering \(RemoteProtocolError\); run again"):
        hf_datasets.fetch(f"hf://datasets/{REPO}/{name}")
    assert len(hub.gets(name)) == 6 and (storage(tmp_path) / "blobs" / (
        hashlib.sha256(files[name]).hexdigest() + ".partial")).stat().st_size == 600


def test_a_server_that_ignores_the_range_gives_the_whole_file_once(hub, tmp_path, files):
    """A server (a proxy, a CDN) that answers a Range with the whole file (200, not 206): the bytes kept must
    be dropped, not kept before the whole file, so the file checks and comes down once."""
    name = "data/part-0.parquet"
    blobs = storage(tmp_path) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{hashlib.sha256(files[name]).hexdigest()}.partial").write_bytes(files[name][:1000])
    hub.ranges = False
    assert open(hf_datasets.fetch(URL, 1)[0], "rb").read() == files[name]
    assert hub.gets(name) == ["bytes=1000-"]


def test_only_the_files_a_token_target_needs_come_down(hub, tmp_path, files):
    """--max_tokens sets how much text a Hub source brings (at about 4 bytes a token, with a margin): the
    first files in name order, the rest never asked for; a weighted Hub source sits in a mixture like a local
    one."""
    one = corpus.source_files(DataConfig(sources=[URL], max_tokens=10))
    assert one == [(snapshot(tmp_path, "data/part-0.parquet"), False)]
    assert not hub.gets("data/part-1.parquet")

    local = tmp_path / "notes"
    local.mkdir()
    (local / "a.txt").write_text("some local text\n")
    found = corpus.sources(DataConfig(sources=[URL + ":0.7", f"{local}:0.3"]))
    assert [(s.given, s.weight, len(s.files)) for s in found] == [(URL + ":0.7", 0.7, 3), (f"{local}:0.3", 0.3, 1)]
    assert corpus.split_weight(f"hf://datasets/{REPO}") == (f"hf://datasets/{REPO}", None)
    assert corpus.split_weight(f"hf://datasets/{REPO}@main/data/*.parquet:2") == \
        (f"hf://datasets/{REPO}@main/data/*.parquet", 2.0)


def test_patterns_read_as_the_shell_reads_them():
    """`*` stays in its folder, `**` crosses folders, a plain path is a file or a folder, @ names the
    revision."""
    assert hf_datasets.matches("data/a.parquet", "data/*.parquet")
    assert not hf_datasets.matches("data/sub/a.parquet", "data/*.parquet")
    assert hf_datasets.matches("data/sub/a.parquet", "data/**/*.parquet")
    assert hf_datasets.matches("data/a.parquet", "**/*.parquet")
    assert hf_datasets.matches("data/sub/a.parquet", "data") and not hf_datasets.matches("database/a", "data")
    assert hf_datasets.parse("hf://datasets/o/n@v1.0/en/*.jsonl.zst") == ("o/n", "v1.0", "en/*.jsonl.zst")
    assert hf_datasets.parse("hf://datasets/o/n@refs%2Fconvert%2Fparquet") == ("o/n", "refs/convert/parquet", "")
    with pytest.raises(DataError, match="not a Hub dataset URL"):
        hf_datasets.parse("hf://datasets/no-name")


def test_a_missing_dataset_is_one_error_line_naming_it(hub, tmp_path, capsys):
    """A dataset the Hub does not have must be one line, exit 2, naming it; so must a revision it lacks, a
    pattern that matches nothing and a gated dataset (with the way in)."""
    def prepare(source):
        return lambda: prepare_data.main(["--sources", source, "--cache_dir", str(tmp_path / "cache")])
    err = one_error_line(capsys, prepare("hf://datasets/tiny-org/missing/*.parquet"), 2)
    assert "no dataset tiny-org/missing on the Hub" in err and "hf auth login" in err
    assert "no revision 'v9'" in one_error_line(capsys, prepare(f"hf://datasets/{REPO}@v9/data/*"), 2)
    assert "matches no file" in one_error_line(capsys, prepare(f"hf://datasets/{REPO}/data/*.arrow"), 2)
    assert "matches no file" in one_error_line(capsys, prepare(f"hf://datasets/{REPO}/nothing/*.parquet"), 2)
    assert "only 1 file(s) of other kinds (README.md)" in one_error_line(capsys, prepare(f"hf://datasets/{REPO}/*.md"),
                                                                         2)
    assert "is not a Hub dataset name (" in one_error_line(capsys, prepare("hf://datasets/tiny-org/a--b/*"), 2)
    err = one_error_line(capsys, prepare("hf://datasets/tiny-org/gated/data/*"), 2)
    assert "gated" in err and "hf auth login" in err and "Bearer" not in err


def test_a_token_the_hub_refuses_is_named_not_a_missing_login(hub, tmp_path, capsys, monkeypatch):
    """With a token given, a private dataset the Hub would not show said "a private one needs `hf auth login`"
    and a token the Hub never issued, or one without the rights (403), said "try again later" (exit 1): each
    must say the token given was refused and to check it (one line, exit 2, the token never printed); without
    one, the line still says to log in."""
    hub.private.update({REPO: SECRET, "tiny-org/other": "hf_otherAccount"})
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert "(a private one needs `hf auth login`)" in one_error_line(capsys, prepare(tmp_path, URL), 2)
    token = "the token given (HF_TOKEN, or the one `hf auth login` saved)"
    monkeypatch.setenv("HF_TOKEN", "hf_otherAccount")  # an account that cannot read it: the Hub says 404
    err = one_error_line(capsys, prepare(tmp_path, URL), 2)
    assert f"no dataset {REPO} on the Hub that {token} can read; check the name, and the token" in err, err
    monkeypatch.setenv("HF_TOKEN", "hf_misTyped")  # a token the Hub never issued: 401
    err = one_error_line(capsys, prepare(tmp_path, URL), 2)
    assert f"data source {URL}: the Hub refused {token} as invalid; check it" in err and "misTyped" not in err, err
    hub.forbidden.add("hf_noReadAccess")  # a token it knows, without the rights (a fine-grained one): 403
    monkeypatch.setenv("HF_TOKEN", "hf_noReadAccess")
    err = one_error_line(capsys, prepare(tmp_path, URL), 2)
    assert f"data source {URL}: the Hub refused {token} access (403); check that it may read" in err, err
    assert "noReadAccess" not in err and "try again later" not in err and "a private one needs" not in err, err
    monkeypatch.setenv("HF_TOKEN", SECRET)
    err = one_error_line(capsys, prepare(tmp_path, "hf://datasets/tiny-org/gated/data/*"), 2)
    assert f"the dataset is gated, accept its terms on https://huggingface.co/datasets/tiny-org/gated with the " \
        f"account of {token}" in err and SECRET not in err, err


@pytest.mark.parametrize("name,kind", [("data/part-0.parquet", "parquet"), ("data/part-2.jsonl.gz", "gzip"),
                                       ("data/part-3.jsonl.zst", "zstd"), ("data/part-4.jsonl", "jsonl")])
def test_a_file_that_cannot_be_read_leaves_the_cache_and_comes_again(hub, tmp_path, capsys, files, name, kind):
    """A web page served as a data file (a proxy's sign-in page, a broken mirror) stayed in the cache and the
    line said "write it again": every rerun failed alike until someone found the cached file and deleted it (a
    page as .jsonl.gz, .jsonl.zst or .jsonl got as far as the tokenizer first). It must be removed, blob and
    link, before any of it is read, the line say so, and the next run fetch it anew."""
    import zstandard
    good = files.get(name) or (b'{"text": "a line of text"}\n' if kind == "jsonl" else
                               zstandard.ZstdCompressor().compress(b'{"text": "a line of text"}\n'))
    page = b"\n<!DOCTYPE html><html><body>Sign in to continue</body></html>\n"
    hub.repos[REPO][name] = page
    err = one_error_line(capsys, prepare(tmp_path, URL), 2)
    assert f"{name} is not a readable {kind} file (" in err and f"it came from data source {URL} and was removed " \
        "from the Hugging Face cache: run again" in err and "write it again" not in err, err
    assert not os.path.lexists(snapshot(tmp_path, name))
    assert not (storage(tmp_path) / "blobs" / hashlib.sha256(page).hexdigest()).exists()
    hub.repos[REPO][name] = good
    hf_datasets._fetched.clear()
    assert good in [open(p, "rb").read() for p in hf_datasets.fetch(URL)]


def test_a_file_the_hub_sends_to_its_cdn_comes_down_checked_and_without_the_token(hub, tmp_path, capsys, files,
                                                                                    monkeypatch):
    """The Hub answers a large file's HEAD with a 302 to another host (its CDN, a signed address), the file's
    sha256 in X-Linked-Etag and another hash in ETag. The file must come from there checked against
    X-Linked-Etag (bytes that do not give it are refused in one line and kept nowhere), a kept part resume
    there with a Range, and the user's token reach the Hub only: never the other host, whose address is signed
    and whose logs are not the Hub's."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    data = sorted(n for n in files if n.startswith("data/"))
    hub.redirect.update(data)
    name, other = data[0], hashlib.sha256(b"not the bytes the CDN sends").hexdigest()
    hub.etags[name] = other
    err = one_error_line(capsys, prepare(tmp_path, URL), 1)
    assert f"{name} came down different from the Hub's copy (hash mismatch); it was removed" in err, err
    assert not os.path.lexists(snapshot(tmp_path, name)) and not os.listdir(storage(tmp_path) / "blobs")

    del hub.etags[name]
    blobs = storage(tmp_path) / "blobs"
    kept = len(files[name]) // 3
    (blobs / f"{hashlib.sha256(files[name]).hexdigest()}.partial").write_bytes(files[name][:kept])
    hf_datasets._fetched.clear()
    assert [open(p, "rb").read() for p in hf_datasets.fetch(URL)] == [files[n] for n in data]
    assert [r for m, p, r, _ in hub.cdn_requests if m == "GET" and p == f"{REPO}/{name}"] == [None, f"bytes={kept}-"]
    assert sorted({p for m, p, _, _ in hub.cdn_requests if m == "GET"}) == [f"{REPO}/{n}" for n in data]
    assert not [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]  # the bytes came from the CDN
    assert hub.tokens == {f"Bearer {SECRET}"} and {auth for *_, auth in hub.cdn_requests} == {None}


@pytest.mark.parametrize("kept_in", ["git", "lfs"])
def test_bytes_that_do_not_give_the_etag_are_refused_and_leave_nothing(hub, tmp_path, capsys, files, kept_in):
    """A small file the Hub keeps in git has its git blob id (a sha1 of "blob SIZE", a NUL and the bytes) as
    ETag, a large one its sha256. Bytes that do not give it must be refused in one line (exit 1) with nothing
    left in the cache, neither blob nor snapshot link; the bytes that do give it must come down, the blob
    named by it."""
    name = "data/part-0.parquet"
    if kept_in == "git":
        hub.git.add(name)
    right = git_blob_id(files[name]) if kept_in == "git" else hashlib.sha256(files[name]).hexdigest()
    wrong = git_blob_id(b"other bytes") if kept_in == "git" else hashlib.sha256(b"other bytes").hexdigest()
    hub.etags[name] = wrong
    err = one_error_line(capsys, prepare(tmp_path, URL), 1)
    assert f"data source {URL}: {name} came down different from the Hub's copy (hash mismatch)" in err, err
    assert not os.path.lexists(snapshot(tmp_path, name)) and not os.listdir(storage(tmp_path) / "blobs")

    del hub.etags[name]
    hf_datasets._fetched.clear()
    assert open(hf_datasets.fetch(URL)[0], "rb").read() == files[name]
    assert os.path.realpath(snapshot(tmp_path, name)) == str(storage(tmp_path) / "blobs" / right)


def test_no_network_and_nothing_cached_is_one_error_line(monkeypatch, tmp_path, capsys):
    """With the Hub out of reach (nothing listens) and nothing cached, one line saying so, exit 1; with
    HF_HUB_OFFLINE=1, one line saying what to unset, exit 2."""
    point_at(monkeypatch, tmp_path / "hf_home", "http://127.0.0.1:9")
    argv = ["--sources", URL, "--cache_dir", str(tmp_path / "cache")]
    err = one_error_line(capsys, lambda: prepare_data.main(argv), 1)
    assert f"data source {URL}: no file of it is in the Hugging Face cache" in err and "could not be reached" in err
    point_at(monkeypatch, tmp_path / "hf_home", "http://127.0.0.1:9", offline=True)
    assert "unset it" in one_error_line(capsys, lambda: prepare_data.main(argv), 2)


def test_a_full_disk_is_a_runtime_failure_naming_the_room(hub, monkeypatch):
    """ENOSPC while a file comes down must say which file, how many bytes and where, not a traceback."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(hub_client, "_transfer", full)
    with pytest.raises(RunFailure, match=r"the disk is full downloading data/part-0.parquet \([\d,]+ bytes\)"):
        hf_datasets.fetch(URL)


def prepare(tmp_path, source: str):
    return lambda: prepare_data.main(["--sources", source, "--cache_dir", str(tmp_path / "cache")])


def storage(tmp_path):
    return tmp_path / "hf_home" / "hub" / f"datasets--{REPO.replace('/', '--')}"


@pytest.mark.parametrize("heads", ["every", "later"])
def test_a_hostile_etag_is_refused_before_it_names_a_file(hub, tmp_path, capsys, heads):
    """The Hub's ETag named the blob and its lock: `../` in it wrote the file's bytes and locks outside
    HF_HOME (and read a file already there as the data). It must be a sha1 or sha256 in hex, refused in one
    line before any path is built; huggingface_hub's own download asked the Hub again and took the second
    answer unchecked, so a Hub honest on the first HEAD and hostile after must reach no file either (it is
    asked once)."""
    victim = tmp_path / "victim" / "created_by_hub.txt"
    hostile = os.path.relpath(victim, storage(tmp_path) / "blobs")
    name = "data/part-0.parquet"
    hub.etags[name] = hostile if heads == "every" else [hashlib.sha256(hub.repos[REPO][name]).hexdigest(), hostile]
    if heads == "every":
        err = one_error_line(capsys, prepare(tmp_path, URL), 2)
        assert not victim.parent.exists()
        assert f"data source {URL}: the ETag the Hub sent for {name} '{hostile}' is not a hash" in err, err
        assert "HF_ENDPOINT" in err
    else:
        assert open(hf_datasets.fetch(URL)[0], "rb").read() == hub.repos[REPO][name]
        assert not victim.parent.exists()


def test_an_etag_that_breaks_http_is_the_hubs_fault_not_a_lost_connection(hub, tmp_path, capsys):
    """An ETag with a NUL in it is an answer no HTTP server sends: it once read as a dropped connection ("run
    again, the download resumes"), which a rerun meets again. It is refused as the Hub's (exit 2, HF_ENDPOINT
    named), and nothing is written; a connection that is really cut still says run again (the test above)."""
    name = "data/part-0.parquet"
    hub.etags[name] = "ab\x00cd"
    err = one_error_line(capsys, prepare(tmp_path, URL), 2)
    assert f"data source {URL}: the Hub's answer is not valid HTTP (illegal header line" in err, err
    assert "HF_ENDPOINT" in err and "run again" not in err
    assert not storage(tmp_path).exists() or not any((storage(tmp_path) / "blobs").glob("*"))


def test_a_listed_name_outside_the_snapshot_is_refused(hub, tmp_path, capsys):
    """Once the cache held the snapshot's folder, a listing entry data/../../(...)/localsecret.txt named a
    local file that the run then read as data. A listed name must stay inside the snapshot (no `..`, root,
    drive, backslash, NUL or empty segment): one line, exit 2, and the local file is never read."""
    hf_datasets.fetch(URL)
    secret = tmp_path / "victim" / "localsecret.txt"
    secret.parent.mkdir()
    secret.write_text("the local secret\n" * 100)
    name = "data/" + os.path.relpath(secret, snapshot(tmp_path, "data"))
    hub.listed.append({"type": "file", "path": name, "size": 5, "oid": "0" * 40})
    hf_datasets._fetched.clear()
    url = f"hf://datasets/{REPO}/data"
    err = one_error_line(capsys, prepare(tmp_path, url), 2)
    assert f"data source {url}: the file name the Hub listed '{name}' is not a path inside the dataset" in err, err
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != secret]
    assert not [p for p in written if b"local secret" in p.read_bytes()] and not (tmp_path / "cache").exists()
    for bad in ("/etc/passwd.txt", "data\\x.txt", "C:x.txt", "data//x.txt", "data/x\0.txt", "data/./x.txt"):
        hub.listed[:] = [{"type": "file", "path": bad, "size": 5, "oid": "0" * 40}]
        hf_datasets._fetched.clear()
        with pytest.raises(DataError, match="the file name the Hub listed"):
            hf_datasets.fetch(f"hf://datasets/{REPO}")


def test_a_revision_or_commit_outside_the_cache_is_refused(hub, tmp_path, capsys, monkeypatch):
    """A revision with `..` (its / written %2F in the URL) named refs/REVISION, the file a run writes to
    remember its commit: a Hub that said it exists made the run write outside HF_HOME. Refused in one line
    before any request; so are a commit the Hub sends that is not 40 hex digits and a cached refs/ file that
    names none."""
    victim = tmp_path / "victim" / "ref"
    revision = os.path.relpath(victim, storage(tmp_path) / "refs")
    hub.revisions.add(revision)
    url = f"hf://datasets/{REPO}@{revision.replace('/', '%2F')}/data/*"
    err = one_error_line(capsys, prepare(tmp_path, url), 2)
    assert not victim.parent.exists() and not hub.requests
    assert f"data source {url}: the revision '{revision}' is not a path inside the dataset" in err, err
    with pytest.raises(DataError, match="the revision '..' "):
        hf_datasets.parse(f"hf://datasets/{REPO}@../data/*")

    from huggingface_hub import HfApi
    with monkeypatch.context() as patch:
        patch.setattr(HfApi, "dataset_info", lambda *args, **kwargs: SimpleNamespace(sha="../" + COMMIT))
        with pytest.raises(DataError, match=f"the commit the Hub sent '../{COMMIT}' is not a hash"):
            hf_datasets.fetch(URL)
    (storage(tmp_path) / "refs").mkdir(parents=True)
    (storage(tmp_path) / "refs" / "main").write_text("../../../victim")
    point_at(monkeypatch, tmp_path / "hf_home", hub.url, offline=True)
    with pytest.raises(DataError, match="refs/main names '../../../victim'"):
        hf_datasets.fetch(URL)


@pytest.mark.parametrize("gpu,gib,preset,least", [("NVIDIA H100 80GB HBM3", 80, "small", 1e9),
                                                  ("NVIDIA GeForce RTX 4090", 24, "small", 2e8)])
def test_a_no_flag_cuda_run_trains_on_fineweb_edu_sized_for_its_budget(monkeypatch, tmp_path, files, gpu, gib, preset,
                                                                       least):
    """With no --sources on CUDA the run read the bundled corpus (2.7M tokens) and so trained the tiny preset.
    It now reads FineWeb-Edu's sample from the Hub (here a stand-in holding one of its files), sized by the
    hour's compute rather than by the corpus: the start report names the corpus, the preset, the budget and a
    micro-batch of at least 32k tokens, and the fetch brings the files the token target needs. With the Hub
    out of reach and nothing cached, one line says the bundled corpus is read instead; a CPU run is untouched.
    """
    import torch

    from config import PRESETS
    from llm.base import sizing
    from llm.train import autofill, startup
    server = Hub({"HuggingFaceFW/fineweb-edu": {"sample/10BT/000_00000.parquet": files["data/part-0.parquet"],
                                                "README.md": files["README.md"]}})
    point_at(monkeypatch, tmp_path / "hf_home", server.url)
    try:
        cfg, notes = startup.default_corpus(PRESETS["auto"](), torch.device("cuda"))
        assert cfg.data.sources == [corpus.GPU_CORPUS] and "FineWeb-Edu" in notes[0]
        cfg, sized = autofill.fill_automatic(cfg, sizing.Machine("cuda", gpu, gib * 2**30), None)
        report = "\n".join(notes + sized)
        assert f"the {preset} preset" in report and "budget: 60 min" in report, report
        assert cfg.train.micro_batch_size * cfg.model.max_seq_len >= 32_768
        # The hour's tokens at about 40% of the card's peak: some 2B on an H100, a third of a billion on a
        # 4090 (its peak a sixth of the H100's), where the bundled corpus holds 2.7M.
        assert least <= cfg.data.max_tokens <= 5 * least
        # It trains while the files beyond the first download (arrival.py), in one process; under torchrun it
        # waits.
        assert startup.trains_while_arriving(cfg, SimpleNamespace(world_size=1))
        assert not startup.trains_while_arriving(cfg, SimpleNamespace(world_size=2))
        paths = corpus.source_files(cfg.data)
        assert [os.path.basename(p) for p, _ in paths] == ["000_00000.parquet"]
        assert open(paths[0][0], "rb").read() == files["data/part-0.parquet"]
    finally:
        server.stop()
    point_at(monkeypatch, tmp_path / "elsewhere", "http://127.0.0.1:9")  # nothing listens, nothing cached
    cfg, notes = startup.default_corpus(PRESETS["auto"](), torch.device("cuda"))
    assert cfg.data.sources == [] and len(notes) == 1 and "training on the bundled one instead" in notes[0], notes
    for had in ([corpus.GPU_CORPUS], []):  # a resumed run goes on with its own corpus, the Hub unasked
        state = trainer_state.parse({"step": 1, "tokens": 1, "best_val_loss": 1.0,
                                     "config": json.dumps({"data": {"sources": had}})})
        cfg, notes = startup.default_corpus(PRESETS["auto"](), torch.device("cuda"), state)
        assert cfg.data.sources == had and notes == []
    assert startup.default_corpus(PRESETS["auto"](), torch.device("cpu")) == (PRESETS["auto"](), [])


def test_a_listed_file_that_answers_404_says_the_dataset_changed(hub, tmp_path, capsys):
    """A file the Hub listed, then answered 404 for, was reported as "matches no file, check the pattern": the
    pattern was right, the dataset changed under the run."""
    hub.listed.append({"type": "file", "path": "data/gone.parquet", "size": 5, "oid": "0" * 40})
    hf_datasets._fetched.clear()
    with pytest.raises(RunFailure, match="the Hub listed data/gone.parquet but answers 404 for it"):
        hf_datasets.fetch(f"hf://datasets/{REPO}")
