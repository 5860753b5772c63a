"""Tests of the benchmark scripts' arithmetic: what they report must be what they measured."""

import json
import time

import pytest

import bench
import compare_optimizers as cmp

SMALL = ["--vocab_size", "128", "--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--max_seq_len", "16", "--micro_batch_size", "2", "--compile", "off",
         "--precision", "fp32", "--device", "cpu"]


def test_mean_curve_averages_seeds_step_by_step():
    runs = [{"train": [(10, 4.0), (20, 3.0)]}, {"train": [(10, 6.0), (20, 2.0)]}]
    assert cmp.mean_curve(runs) == [(10, 5.0), (20, 2.5)]


def test_first_step_at_or_below_finds_the_first_crossing_or_none():
    curve = [(10, 5.0), (20, 3.5), (30, 3.0), (40, 3.6)]
    assert cmp.first_step_at_or_below(curve, 3.5) == 20
    assert cmp.first_step_at_or_below(curve, 3.0) == 30
    assert cmp.first_step_at_or_below(curve, 2.9) is None


def test_a_run_counts_as_finished_only_with_its_last_evaluation(tmp_path):
    """An interrupted run (no eval at the last step, or a half-written last line) must be trained again."""
    metrics = tmp_path / "metrics.jsonl"
    assert not cmp.finished(str(tmp_path), 200)
    metrics.write_text(json.dumps({"kind": "eval", "step": 100, "val_loss": 3.0}) + "\n" + '{"kind": "eval", "st')
    assert not cmp.finished(str(tmp_path), 200)
    with open(metrics, "a", encoding="utf-8") as f:
        f.write("\n" + json.dumps({"kind": "eval", "step": 200, "val_loss": 2.0}) + "\n")
    assert cmp.finished(str(tmp_path), 200)


def test_optimizer_share_measures_a_known_optimizer_cost(tmp_path, monkeypatch):
    """The share must time the optimizer step inside the trainer's own step: with a stub optimizer step that
    sleeps a known 0.1 s, the reported optimizer time is that 0.1 s (not the forward or backward) and the
    forward + backward time stays what it is with the real optimizer."""
    import muon_optimizer

    def run(name):
        out = tmp_path / f"{name}.json"
        bench.main(SMALL + ["--skip_hf", "--optimizer_share", "--bench_steps", "3", "--warmup_steps_bench", "1",
                            "--json", str(out)])
        return json.loads(out.read_text())["optimizer_share"]

    real = run("real")
    monkeypatch.setattr(muon_optimizer.MuonAdamW, "step", lambda self, *a, **k: time.sleep(0.1))
    stub = run("stub")
    assert 0.1 <= stub["optimizer_s"] < 0.13
    assert stub["forward_backward_s"] == pytest.approx(real["forward_backward_s"], rel=0.5, abs=0.02)
    assert stub["share"] == pytest.approx(0.1 / (0.1 + stub["forward_backward_s"]), rel=0.15)
    assert 0 < real["optimizer_s"] < 0.1
