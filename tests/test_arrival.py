"""Tests of arrival.py: a Hub dataset read to a token target trains while its files download. Against the stand-in
Hub on 127.0.0.1 (hub_stand_in.py): a run ends its steps while its last file is still held back by the Hub; the
batches read while parts arrive are those of the complete cache, and its first epoch reads every window of every
part once, part by part; the Hub going away mid-run leaves the steps trained saved, one error line, and a
--resume that goes on; the validation split is fixed before the first step; the next file downloads while one is
tokenized; only a one-process run to a token target over unpacked windows, its length not in epochs, trains so.

Run: python -m pytest -q tests/test_arrival.py
"""

import logging
import os
import threading
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_stand_in import Hub
from test_hf_datasets import point_at

import gpu_training_optimized as trainer
from config import PRESETS, DataConfig
from llm.base.distributed import Ranks
from llm.data import arrival, preparation
from llm.data import token_cache as tc
from llm.data.batches import Batches
from llm.data.preparation import prepare
from llm.train.startup import trains_while_arriving

REPO = "tiny-org/arriving"
URL = f"hf://datasets/{REPO}/data/*.parquet"
NAMES = [f"data/part-{i}.parquet" for i in range(4)]
MODULES = ["argparse.py", "textwrap.py", "calendar.py", "difflib.py"]


def _parquet(texts) -> bytes:
    out = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), out, compression="none", row_group_size=16)
    return out.getvalue().to_pybytes()


@pytest.fixture(scope="module")
def files():
    """Four parquet files of about 24 KB of text each, from four standard library modules."""
    out = {}
    for name, module in zip(NAMES, MODULES):
        text = open(os.path.join(os.path.dirname(os.__file__), module), encoding="utf-8").read()[:24_000]
        out[name] = _parquet([text[i:i + 600] for i in range(0, len(text), 600)])
    return out


@pytest.fixture
def hub(monkeypatch, tmp_path, files):
    server = Hub({REPO: dict(files)})
    point_at(monkeypatch, tmp_path / "hf_home", server.url)
    monkeypatch.setattr(tc, "GROUP_FILE_BYTES", 1)  # each file its own shard, as FineWeb-Edu's 2 GB files are
    monkeypatch.setattr(tc, "ARRIVAL_VAL_TOKENS", 64)  # the first part's val documents make the split
    yield server
    server.stall = None
    server.release.set()  # a held download ends short, and the rest comes on its retry
    for thread in threading.enumerate():  # a preparation a test left running ends before the Hub goes
        if thread.name in ("prepare", "fetch-ahead"):
            thread.join(60)
    server.stop()


def data_config(tmp_path) -> DataConfig:
    return DataConfig(sources=[URL], cache_dir=str(tmp_path / "cache"), max_tokens=10**6)


def test_a_run_ends_its_steps_while_its_last_file_still_downloads(hub, tmp_path, argv_for, capsys):
    """Before, the trainer fetched and tokenized every file before its first step. The Hub now holds the last
    file's download open; the run must still train its steps on the first files, evaluate, save and end."""
    hub.stall = (NAMES[-1], 0)
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    assert trainer.main(argv_for(data, tmp_path / "run", "--max_tokens", 10**6, "--max_steps", 3,
                                 "--eval_interval", 3)) == 0
    assert hub.stalled.is_set() and not hub.release.is_set()  # the last file was asked for, and never came
    out = capsys.readouterr().out
    assert "data: training starts on the first" in out and "while the rest of" in out, out
    assert (tmp_path / "run" / "checkpoints").is_dir() or any((tmp_path / "run").glob("**/*.safetensors"))


@pytest.mark.slow  # a 15-second budget run
def test_a_budget_spent_waiting_for_a_file_ends_the_run_on_time(hub, tmp_path, argv_for, capsys, monkeypatch):
    """A step waiting for a file that does not come waited past the run's time budget, as long as the file
    took (and the wait counted as step time). The wait is budget now: the run ends on its budget with its
    checkpoint."""
    from huggingface_hub import constants
    hub.stall = (NAMES[1], 0)  # the second file is held until the test ends
    # A slow file, not a dead Hub: past this read timeout the download fails, and the run would end on that
    # instead.
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 120)
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    started = time.monotonic()
    assert trainer.main(argv_for(data, tmp_path / "run", "--max_tokens", 10**6, "--max_minutes", 0.25)) == 0
    assert time.monotonic() - started < 15 + 20 and hub.stalled.is_set() and not hub.release.is_set()
    out = capsys.readouterr()
    assert "data: waiting for the part that holds training window" in out.err + out.out
    assert any((tmp_path / "run").glob("checkpoints/step_*"))


def test_batches_read_while_parts_arrive_are_those_of_the_complete_cache(hub, tmp_path, files):
    """A micro-batch must be a pure function of the step: the windows read while files arrive (each read
    waiting for its part) are those a run reads from the finished cache, through the first epoch and into the
    next, and the data names itself the same (a resumed run is checked against it)."""
    hub.stall = (NAMES[2], 0)  # held until the batches ask for its windows
    arriving = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None, background=True)
    assert isinstance(arriving, arrival.ArrivingData) and not arriving.complete and len(arriving.parts) <= 2
    before = Batches(arriving, "train", 8, 32, seed=3)
    early = [before.get(step, 0)[0] for step in range(3)]  # in the first part
    asked = time.monotonic()  # a Ctrl-C while a step waits for its part: the wait ends, the run saves and stops
    assert before.ready(10**6, give_up=lambda: time.monotonic() - asked > 0.3)
    assert time.monotonic() - asked < 5 and not arriving.complete

    def let_it_come():
        hub.stall = None
        hub.release.set()  # the held connection ends short; huggingface_hub asks again for the rest
    threading.Timer(0.5, let_it_come).start()  # the held file comes while a later read waits for it
    count = 0
    while before.ready(count):
        count += 1
        if arriving.complete and count * 8 > 2 * before.epoch_sequences:
            break
    windows = [before.get(step, 0)[0] for step in range(count)]

    complete = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None)
    assert complete.fingerprint == arriving.fingerprint and len(complete.parts) == len(NAMES)
    after = Batches(complete, "train", 8, 32, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(windows, (after.get(s, 0)[0] for s in range(count))))
    assert all(np.array_equal(a, b) for a, b in zip(early, windows))


def test_the_first_epoch_reads_every_window_of_each_part_once_in_part_order(hub, tmp_path):
    """Counted naively from the parts' lengths: the first epoch's windows are each part's windows tiled from
    its start, every one once, the parts one after another in the order they were written."""
    data = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None)
    batches, seq_len = Batches(data, "train", 1, 32, seed=5), 32
    expected, start = [], 0
    for p in data.parts:
        expected.append({start + k * seq_len for k in range((p["train_tokens"] - 1) // seq_len)})
        start += p["train_tokens"]
    total = sum(map(len, expected))
    read = [int(batches.starts(n, 0)[0]) for n in range(total)]
    at = 0
    for windows in expected:
        assert set(read[at:at + len(windows)]) == windows and len(set(read[at:at + len(windows)])) == len(windows)
        at += len(windows)
    assert sorted(read) != read  # a seeded order within each part, not the file's


@pytest.mark.slow
def test_the_hub_going_away_mid_run_saves_the_steps_and_resume_goes_on(hub, tmp_path, argv_for, capsys, caplog):
    """The Hub stops answering while the run waits for a file: the steps trained are saved, the run ends with
    one line naming the failure and the saved step, and --resume with the Hub back trains to the end."""
    hub.stall = (NAMES[2], 0)
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    args = argv_for(data, tmp_path / "run", "--max_tokens", 10**6, "--max_steps", 400, "--eval_interval", 400)

    def hub_goes_away():
        hub.stalled.wait(60)
        hub.stop()
    threading.Thread(target=hub_goes_away, daemon=True).start()
    caplog.set_level(logging.ERROR, logger="huggingface_hub")  # its retries' warnings: this test reads our line
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(args)
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress bar, which stderr shows
    assert exit_info.value.code == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert "the Hub stopped answering" in err and "training stopped at step" in err and "--resume" in err, err
    step = int(err.split("training stopped at step ")[1].split(",")[0])
    assert 0 < step < 400

    again = Hub({REPO: hub.repos[REPO]})
    point_at(pytest.MonkeyPatch(), tmp_path / "hf_home", again.url)
    try:
        assert trainer.main(args + ["--resume"]) == 0
    finally:
        again.stop()
    out = capsys.readouterr().out
    assert "resumed from" in out and f"at step {step}\n" in out and "done: 400 steps" in out, out[-2000:]


@pytest.mark.slow
def test_a_download_failing_while_the_run_has_data_in_hand_ends_it_at_the_next_step(hub, tmp_path, argv_for, capsys,
                                                                                      caplog, monkeypatch):
    """The Hub goes away at step 2 while the run still holds windows for all its steps: before, the run trained on
    to 'done' with exit 0 and nothing said. Now the next step saves, one line names the failure, exit 1, and
    --resume with the Hub back ends the run."""
    hub.stall = (NAMES[-1], 0)  # parts 0-2 come in, and hold the run's 6 steps; the last is held back
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    args = argv_for(data, tmp_path / "run", "--max_tokens", 10**6, "--max_steps", 6, "--eval_interval", 6)
    real_step = trainer.train_step

    def step_then_lose_the_hub(b, batches, step, *rest):
        if step == 2:
            hub.stalled.wait(60)
            hub.stop()
            deadline = time.monotonic() + 60
            while batches.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert batches.failure is not None and batches.in_hand(5)  # failed, with the run's data still in hand
        return real_step(b, batches, step, *rest)
    monkeypatch.setattr(trainer, "train_step", step_then_lose_the_hub)
    caplog.set_level(logging.ERROR, logger="huggingface_hub")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        trainer.run(args)
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert "training stopped at step 3, saved in" in err and "--resume" in err, err

    monkeypatch.setattr(trainer, "train_step", real_step)
    again = Hub({REPO: hub.repos[REPO]})
    point_at(monkeypatch, tmp_path / "hf_home", again.url)
    try:
        assert trainer.main(args + ["--resume"]) == 0
    finally:
        again.stop()
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 3\n" in out and "done: 6 steps" in out, out[-2000:]


def test_a_run_offline_with_part_of_its_dataset_cached_says_it_trains_short_of_its_target(hub, tmp_path, argv_for,
                                                                                           capsys, monkeypatch):
    """Offline with only the first file cached, a run asked for 10^6 tokens trains on the few thousand there
    are: before, it named the cached files and said nothing of the target. Now the start report and the
    summary say how many tokens it has of how many."""
    data = {"src": URL, "cache": str(tmp_path / "cache")}
    assert trainer.main(argv_for(data, tmp_path / "first", "--max_tokens", 2000, "--max_steps", 1)) == 0
    point_at(monkeypatch, tmp_path / "hf_home", hub.url, offline=True)
    capsys.readouterr()
    assert trainer.main(argv_for(data, tmp_path / "offline", "--max_tokens", 10**6, "--max_steps", 2)) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "of the --max_tokens target of 1,000,000" in line]
    have = int(said[0].split("the sources hold ")[1].split(" ")[0].replace(",", ""))
    assert len(said) == 2 and out.index(said[0]) < out.index("done: 2 steps") < out.rindex(said[1]), out[-3000:]
    assert 0 < have < 50_000 and "cached files" in said[0]
    assert not [line for line in out.splitlines() if "--max_tokens target" in line and "first" in line]


def test_a_gpu_run_whose_model_the_corpus_sizes_measures_its_files_first(hub, tmp_path):
    """A token target's text stands in for a Hub corpus's size only where that size picks no model (a CPU run,
    or a model given): on CUDA with the model left automatic the files are fetched and measured, or a small
    dataset under a large target would size a model too large for it."""
    import torch

    from config import PRESETS
    from llm.base.sizing import BYTES_PER_TOKEN
    from llm.data import corpus
    from llm.train import startup
    cfg, given = PRESETS["auto"](), PRESETS["small"]()
    cfg.data = given.data = data_config(tmp_path)
    estimate = cfg.data.max_tokens * BYTES_PER_TOKEN
    assert startup.corpus_size(cfg, torch.device("cuda")) == corpus.corpus_bytes(cfg.data) < estimate / 10
    assert startup.corpus_size(cfg, torch.device("cpu")) == estimate
    assert startup.corpus_size(given, torch.device("cuda")) == estimate


def test_the_validation_split_a_run_starts_on_is_the_one_it_ends_on(hub, tmp_path, monkeypatch):
    """Validation is the first parts' val documents up to ARRIVAL_VAL_TOKENS, fixed before the first step: the
    loss a user watches and the best checkpoint compare the same text at every evaluation, and a reader made
    once every part is in (a resumed run, a run on the complete cache) reads that text too, not the later
    parts' val documents. The threshold is set one token past the first part's val tokens, so the split needs
    the first two parts: the run may not start on the first alone. The third part is held until the first
    evaluation is read."""
    real_publish, real_wait = arrival.ArrivingData.publish, arrival.ArrivingData.wait
    waiting, more = threading.Event(), threading.Event()

    def publish(self, parts, meta):  # in the preparing thread, before readers see these parts
        if len(parts) == 1:
            monkeypatch.setattr(tc, "ARRIVAL_VAL_TOKENS", parts[0]["val_tokens"] + 1)
        elif len(parts) == 2:  # held until the run is seen waiting on the first part alone, or has started on it
            waiting.wait(60)
        elif len(parts) == 3:
            more.wait(60)
        real_publish(self, parts, meta)

    def wait(self, enough, what, give_up=lambda: False):
        def looked(parts):
            ok = enough(parts)
            if parts and not ok:
                waiting.set()
            return ok
        return real_wait(self, looked, what, give_up)

    monkeypatch.setattr(arrival.ArrivingData, "publish", publish)
    monkeypatch.setattr(arrival.ArrivingData, "wait", wait)

    def evaluation(batches: Batches) -> list:  # every window an evaluation of the whole split reads
        return [batches.get(0, m)[0] for m in range(-(-batches.length // (8 * 32)))]

    try:
        arriving = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None, background=True)
        waiting.set()
        started = [dict(p) for p in arriving.parts]
        first_meta, first = dict(arriving.meta), Batches(arriving, "val", 8, 32, seed=3)
        assert len(started) == 2 and not arriving.complete, started  # the run starts with the rest still to come
        first_windows, first_tokens = evaluation(first), np.array(first.tokens[0:first.length])
    finally:
        waiting.set()
        more.set()
    assert arriving.wait(lambda parts: False, "every part") and len(arriving.parts) == len(NAMES)
    assert first.length == sum(p["val_tokens"] for p in started) < sum(p["val_tokens"] for p in arriving.parts)
    complete = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None)
    for data in (arriving, complete):
        assert data.meta["val_tokens"] == first_meta["val_tokens"] == first.length
        last = Batches(data, "val", 8, 32, seed=3)
        assert last.length == first.length and np.array_equal(np.array(last.tokens[0:last.length]), first_tokens)
        assert all(np.array_equal(a, b) for a, b in zip(first_windows, evaluation(last), strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(first_windows, evaluation(first), strict=True))


def test_the_next_file_downloads_while_one_is_tokenized(hub, tmp_path, monkeypatch):
    """The files of a corpus read as it arrives are fetched one ahead (arrival.one_ahead): the tokenizing of
    the first file is held until the Hub is asked for the second file's bytes, which a fetch in the reader's
    own thread would ask for only once the first is tokenized (downloads and tokenizing then take turns)."""
    hub.stall = (NAMES[1], 0)  # the GET of the second file sets hub.stalled
    real_encode, held = preparation.encode_segments, []
    first_text = open(os.path.join(os.path.dirname(os.__file__), MODULES[0]), encoding="utf-8").read()[:600]

    def encode(tok, segments, encoder=None):
        if not held:  # the first file's first batch: nothing of it tokenized yet
            held.append(("".join(s for s in segments if isinstance(s, str)), hub.stalled.wait(20)))
        return real_encode(tok, segments, encoder)

    monkeypatch.setattr(preparation, "encode_segments", encode)
    arriving = prepare(data_config(tmp_path), 512, 32, log=lambda *a: None, background=True)
    assert len(held) == 1 and first_text in held[0][0]  # what was held is the first file's text
    assert held[0][1], "the second file was not asked for while the first was tokenized"
    assert hub.gets(NAMES[1]) and len(arriving.parts) == 1 and not arriving.complete


def test_only_a_run_of_one_process_to_a_token_target_over_unpacked_windows_trains_while_its_files_arrive(tmp_path):
    """trains_while_arriving's conditions, one at a time: a run whose length is in passes over the corpus
    (--epochs) or whose windows are packed across it (--packing documents) must know the whole corpus first;
    so must a run of two ranks (the second would read parts the first has not written) and one without a token
    target (the whole dataset is read)."""
    plain = PRESETS["tiny"]()
    plain.data = data_config(tmp_path)
    one, two = Ranks(), Ranks()
    two.world_size = 2
    assert one.world_size == 1 and trains_while_arriving(plain, one)
    assert not trains_while_arriving(plain, two)
    assert not trains_while_arriving(replace(plain, train=replace(plain.train, max_steps=0, epochs=1.0)), one)
    assert not trains_while_arriving(replace(plain, data=replace(plain.data, packing="documents")), one)
    assert trains_while_arriving(replace(plain, data=replace(plain.data, packing="off")), one)
    assert not trains_while_arriving(replace(plain, data=replace(plain.data, max_tokens=0)), one)
