"""Tests of the benchmark scripts' arithmetic: what they report must be what they measured."""

import json

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
    """An interrupted run (no eval at the last step) must be trained again, not reused."""
    metrics = tmp_path / "metrics.jsonl"
    assert not cmp.finished(str(metrics), 200)
    metrics.write_text(json.dumps({"kind": "eval", "step": 100, "val_loss": 3.0}) + "\n")
    assert not cmp.finished(str(metrics), 200)
    with open(metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "eval", "step": 200, "val_loss": 2.0}) + "\n")
    assert cmp.finished(str(metrics), 200)


def test_optimizer_share_is_the_optimizer_fraction_of_the_step(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(SMALL + ["--skip_hf", "--optimizer_share", "--bench_steps", "2", "--warmup_steps_bench", "1",
                        "--json", str(out)])
    share = json.loads(out.read_text())["optimizer_share"]
    assert share["optimizer_s"] > 0 and share["forward_backward_s"] > 0
    assert share["share"] == pytest.approx(share["optimizer_s"] / (share["optimizer_s"] + share["forward_backward_s"]))
