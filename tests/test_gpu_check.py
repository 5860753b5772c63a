"""gpu_check.py's dry run: on a CPU it builds every configuration the GPU check runs, on the tiny shape, and
writes the report, so the script stays runnable for the day a GPU is at hand."""

import argparse
import json

import gpu_check
import gpu_generation as gen
import gpu_report
import pytest
import torch

pytestmark = pytest.mark.slow


def test_dry_run_builds_every_configuration_and_writes_the_report(corpus, tmp_path):
    out = tmp_path / "out"
    assert gpu_check.main(["--dry_run", "--out", str(out), "--sources", corpus["src"]]) == 0
    parts = {p: json.load(open(out / f"{p}.json")) for p in gpu_check.PARTS}
    assert all(part["meta"]["dry_run"] for part in parts.values())
    rows = parts["throughput"]["rows"]
    assert [(r["preset"], r["model"]) for r in rows] == [(p, m) for p in gpu_check.PRESET_NAMES for m in ("ours", "hf")]
    assert all(r["tokens_per_s"] > 0 for r in rows) and 0 < rows[0]["share"] < 1
    assert [(r["mode"], r["grad_accum_steps"]) for r in parts["graphs"]["rows"]] == [
        ("reduce-overhead", 1), ("max-autotune", 1), ("reduce-overhead", 4), ("max-autotune", 4)]
    assert all(r["within_noise"] for r in parts["graphs"]["rows"])  # compile off everywhere: the same steps
    assert parts["startup"]["launch_to_first_step_s"] > 0 and "ddp" in parts["startup"]["tokens_per_s"]
    assert parts["curves"]["compiled_vs_eager"]["max_relative_difference"] < 1e-6  # both eager on a CPU
    report = (out / "gpu_report.md").read_text()  # a dry run writes its report beside its figures, not in docs/
    for heading in ("Training throughput, throughput", "Training throughput, autotune", "CUDA-graph modes",
                    "Start-up and DDP", "Loss curves"):
        assert f"## {heading}" in report


def test_the_ddp_overhead_is_said_in_words():
    """A DDP run faster than plain once read "DDP on one GPU -85.0% slower than plain"."""
    assert gpu_report.overhead_words(0.02) == "2.0% slower than plain"
    assert gpu_report.overhead_words(-0.85) == "85.0% faster than plain"
    assert gpu_report.overhead_words(None).startswith("not measured")


def test_the_quick_check_runs_every_part_on_a_cpu_and_writes_one_table(corpus, tmp_path):
    """--quick is what a lent GPU runs first (docs/gpu_report.md); its dry run builds every part here, so the
    15-minute lease is not spent finding a typo. Each row of the table is a figure the issue of GPU speed asks
    for."""
    out = tmp_path / "quick"
    assert gpu_check.main(["--quick", "--dry_run", "--out", str(out), "--sources", corpus["src"]]) == 0
    parts = {p: json.load(open(out / f"{p}.json")) for p in gpu_check.QUICK_PARTS}
    assert all(part["meta"]["quick"] and part["meta"]["dry_run"] for part in parts.values())
    first = parts["default_run"]  # FineWeb-Edu's path from the stand-in Hub, stopped by SIGTERM after its steps began
    assert first["steps"] >= 2 and first["checkpoint"] and first["files_fetched"] == 2 and first["preset"] == "tiny"
    assert 0 < first["first_step_s"] < first["seconds"]
    assert [r["mode"] for r in parts["first_token"]["rows"]] == ["compiled, cold cache", "eager"]
    reply = parts["first_token"]["first_reply"]
    assert "error" not in reply, reply["error"]
    assert 0 < reply["loaded_to_reply_s"] < reply["launch_to_exit_s"]
    rows = parts["quick_throughput"]["rows"]
    assert [(r["preset"], r["model"]) for r in rows] == [(p, m) for p in gpu_check.QUICK_PRESETS
                                                         for m in ("ours", "hf")]
    assert [r["batch"] for r in parts["decode"]["rows"]] == [1, 8] and parts["decode"]["greedy_identical"]
    assert [(r["task"], r["items"]) for r in parts["scores"]["rows"]] == [("arc_easy", 2), ("copa", 2)]
    leads = parts["decode_leads"]  # batch 1 under each Inductor setting no GPU has run yet
    assert [(r["batch"], r["lead"]) for r in leads["rows"]] == [(1, lead) for lead in gen.DECODE_LEADS]
    assert all(leads["greedy_identical"].values()) and not leads["errors"]
    assert parts["quick_graphs"]["rows"][0]["within_noise"] and parts["fp8"]["rows"][0]["tokens_per_s"] > 0
    tuned = parts["quick_autotune"]["rows"]  # max-autotune against default, each with its compile's seconds
    assert [r["compile"] for r in tuned] == ["default", "max-autotune-no-cudagraphs"]
    assert all(r["tokens_per_s"] > 0 and r["warmup_s"] > 0 for r in tuned)
    budget = parts["short_budget"]
    assert budget["steps"] >= 1 and budget["checkpoint"] and not budget["traceback"]
    beside = parts["beside_preparation"]["rows"][0]  # the step beside a thread tokenizing, as a Hub corpus arrives
    assert beside["preparations"] >= 1 and beside["ratio"] > 0 and len(beside["beside_tokens_per_s"]) == 1
    table = (out / "gpu_report.md").read_text().split("## ")[0]
    for row in ("the no-flag trainer as a first run", "one-shot generation, eager", "a prompt on stdin (as the REPL)",
                "training `small`", "training `large`, FP8", "training `large`, max-autotune", "CUDA graphs",
                "decode, `tiny` shape, batch 8", "greedy tokens against transformers",
                "`--preset small --max_minutes 1`", "training `small` beside a "
                                                    "thread preparing a token cache"):
        assert f"| {row}" in table, row


def test_autotune_says_when_its_longer_compile_has_paid_for_itself(monkeypatch):
    """max-autotune's row: after how many seconds of training a run that compiled it has caught up with one
    that compiled the default (here 10 s and 100 tokens/s against 70 s and 125 tokens/s)."""
    measured = iter([{"tokens_per_s": 100.0, "warmup_s": 10.0}, {"tokens_per_s": 125.0, "warmup_s": 70.0}])
    monkeypatch.setattr(gpu_check.bench, "measure", lambda *a, **k: next(measured))
    monkeypatch.setattr(gpu_check, "new_model", lambda cfg, device: None)
    got = gpu_check.quick_autotune(argparse.Namespace(dry_run=True))
    t = got["pays_after_s"]  # T seconds of a default run's training: both runs have then trained the same tokens
    assert 10 + t == pytest.approx(70 + t * 100 / 125)
    assert "pays for its compile after 5.0 minutes" in "".join(gpu_report.quick_table({"quick_autotune": got}))
    slower = iter([{"tokens_per_s": 100.0, "warmup_s": 10.0}, {"tokens_per_s": 99.0, "warmup_s": 70.0}])
    monkeypatch.setattr(gpu_check.bench, "measure", lambda *a, **k: next(slower))
    got = gpu_check.quick_autotune(argparse.Namespace(dry_run=True))
    assert got["pays_after_s"] is None and "never pays" in "".join(gpu_report.quick_table({"quick_autotune": got}))


def test_minutes_starts_only_the_parts_that_fit_and_names_the_rest(corpus, tmp_path, capsys):
    """A lease's call must end with its report before the device's limit kills it: a part whose usual time
    (QUICK_SECONDS) would end past --minutes is not started, and the line at the end says how to run it later.
    """
    out = tmp_path / "quick"
    minutes = (gpu_check.QUICK_SECONDS["quick_graphs"] + 10) / 60  # quick_graphs fits; fp8, after it, cannot
    assert gpu_check.QUICK_SECONDS["fp8"] > 10
    assert gpu_check.main(["--quick", "--dry_run", "--out", str(out), "--sources", corpus["src"], "--minutes",
                           str(minutes), "--part", "quick_graphs", "fp8"]) == 0
    assert (out / "quick_graphs.json").exists() and not (out / "fp8.json").exists()
    said = capsys.readouterr().out.splitlines()[-2]
    assert said.startswith("not started, past --minutes") and said.endswith(f"--out {out} --part fp8")


def test_a_failing_part_is_its_row_and_the_parts_after_it_still_run(corpus, tmp_path, monkeypatch):
    """The first part failing on a lent GPU (the no-flag run, say) must not end the check: its row says why,
    and the generation parts that read its checkpoint get one from a short run of their own."""
    import gpu_first_run
    def broken(args):
        raise RuntimeError("gpu_training_optimized.py ended with status 1:\n...\nerror: out of memory")
    monkeypatch.setattr(gpu_first_run, "default_run", broken)
    out = tmp_path / "quick"
    assert gpu_check.main(["--quick", "--dry_run", "--out", str(out), "--sources", corpus["src"], "--part",
                           "default_run", "first_token"]) == 0
    assert json.load(open(out / "default_run.json"))["failed"] == "RuntimeError: error: out of memory"
    assert json.load(open(out / "first_token.json"))["first_reply"]["loaded_to_reply_s"] > 0
    table = (out / "gpu_report.md").read_text()
    assert "| part `default_run` | failed: RuntimeError: error: out of memory |" in table
    assert "| one-shot generation, eager |" in table


def test_a_failing_decode_lead_is_reported_and_the_part_goes_on(monkeypatch):
    """The decode leads have run on no GPU yet: if one fails to compile on the lent one, the part measures the
    others and the table says what failed, instead of the check stopping before its last parts."""
    calls = []
    def rates(cfg, device, compiled, batches, n, reps):
        calls.append(batches)
        if torch._inductor.config.combo_kernels:
            raise RuntimeError("triton: combo kernel failed\nmore")
        return [{"batch": b, "tokens_per_s": 100.0, "ms_per_step": 10.0, "bound_share": 0.2} for b in batches]
    monkeypatch.setattr(gen, "decode_rates", rates)
    monkeypatch.setattr(gen, "greedy_identical", lambda *a: True)
    out = gen.decode_leads(argparse.Namespace(dry_run=True), "unused")
    assert calls == [(1,), (1,)] and [r["lead"] for r in out["rows"]] == ["coordinate descent tuning"]
    both = "coordinate descent tuning and combo kernels"
    assert out["errors"] == {both: "RuntimeError: triton: combo kernel failed"}
    table = "\n".join(gpu_report.quick_table({"decode_leads": out}))
    assert f"| decode with {both} | failed: RuntimeError: triton: combo kernel failed |" in table
    assert "| decode, `tiny` shape, batch 1, coordinate descent tuning | 100 tokens/s" in table
    assert "| the same, coordinate descent tuning | identical |" in table
