"""evaluate.py --log_samples: a line per item that lm-eval's own sample files line up with. The real-model
test runs lm-eval's evaluator on the same items and diffs its sample file with ours through
tools/diff_samples.py; the others hold the lines to what was scored, and the tool to finding what differs."""

import json

import pytest

import diff_samples
import evaluate
from llm.scores import tasks
from llm.scores.scoring import TaskScore, score_items
from test_scoring import smollm2


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_each_line_is_the_item_scored(tiny_loaded, tmp_path):
    """A line per item, in order, with lm-eval's (sub)task name and doc id, the requests as lm-eval writes
    them, and picks that are the argmax of the logged log-likelihoods (per character for acc_norm), whose
    right share is the task's score: a line that drifted from what was scored would mislead an audit."""
    model, tokenizer = tiny_loaded[:2]
    for name, limit in (("arc_easy", 5), ("mmlu", 1)):
        items = tasks.get(name).items(limit)[:6]
        score = score_items(model, tokenizer, items, TaskScore(name, "x", norm=tasks.get(name).norm))
        assert len(score.samples) == len(items)
        for item, line in zip(items, score.samples):
            assert (line["task"], line["doc_id"]) == (item.source, item.doc_id)
            assert [tuple(a.values()) for a in line["arguments"].values()] == list(item.requests)
            lls = line["loglikelihoods"]
            assert line["pred"] == diff_samples.best(lls) and line["target"] == str(item.gold)
            if name == "arc_easy":
                assert line["pred_norm"] == diff_samples.best([x / len(c) for x, c in zip(lls, item.choices)])
            else:
                assert "acc_norm" not in line  # MMLU reports acc alone
        assert sum(line["acc"] for line in score.samples) == score.correct
    assert [line["task"] for line in score.samples][:2] == ["mmlu_abstract_algebra", "mmlu_anatomy"]
    assert [line["doc_id"] for line in tasks_lines(tiny_loaded, "arc_easy", 3)] == [0, 1, 2]


def tasks_lines(tiny_loaded, name, limit):
    model, tokenizer = tiny_loaded[:2]
    return score_items(model, tokenizer, tasks.get(name).items(limit), TaskScore(name, "x")).samples


def test_the_file_is_written_checked_first_and_the_tool_finds_a_changed_score(tiny_checkpoint, tmp_path, capsys):
    """evaluate.py writes the file (a folder given as the path is refused before scoring), and diff_samples
    finds the file equal to itself but not to a copy with one log-likelihood moved, nor to one with another
    request."""
    out = tmp_path / "ours.jsonl"
    assert evaluate.main([tiny_checkpoint, "--tasks", "arc_easy", "copa", "--limit", "4", "--log_samples",
                          str(out), "--report", str(tmp_path / "r")]) == 0
    lines = read(out)
    assert [(line["task"], line["doc_id"]) for line in lines] == [("arc_easy", i) for i in range(4)] + \
        [("copa", i) for i in range(4)]
    theirs = tmp_path / "lm" / "samples_arc_easy_2026-11-29T10-00-00.123456.jsonl"
    theirs.parent.mkdir()
    as_lm_eval = lambda line: {**line, "filtered_resps": [[str(x), "False"] for x in line["loglikelihoods"]]}  # noqa
    theirs.write_text("".join(json.dumps(as_lm_eval(x)) + "\n" for x in lines[:4]))
    assert diff_samples.main([str(out), str(tmp_path / "lm")]) == 0
    moved = [as_lm_eval(x) for x in lines[:4]]
    wrong = 1 - moved[2]["pred"] if moved[2]["pred"] < 2 else 0
    moved[2]["filtered_resps"][wrong][0] = str(max(moved[2]["loglikelihoods"]) + 1.0)  # lm-eval would pick another
    moved[2]["acc"] = float(wrong == int(moved[2]["target"]))
    moved[3]["arguments"]["gen_args_0"]["arg_0"] += " "
    theirs.write_text("".join(json.dumps(x) + "\n" for x in moved))
    capsys.readouterr()
    assert diff_samples.main([str(out), str(theirs)]) == 1
    said = capsys.readouterr().out
    assert "1 with other requests" in said and "DIFFERS" in said and "largest log-likelihood gap" in said
    with pytest.raises(SystemExit) as stop:
        evaluate.main([tiny_checkpoint, "--tasks", "copa", "--log_samples", str(tmp_path), "--report",
                       str(tmp_path / "r")])
    assert stop.value.code == 2


@pytest.mark.slow
def test_log_samples_diff_clean_against_lm_evals_own_sample_file(tmp_path, monkeypatch, capsys):
    """SmolLM2-135M-Instruct on ARC-Easy's first items: lm-eval's evaluator (its `hf` backend, its own task
    file over the wheel's rows, --log_samples through its EvaluationTracker) and evaluate.py --log_samples
    write files that tools/diff_samples.py finds equal: the same requests, log-likelihoods within float32
    noise, the same acc and acc_norm on every item."""
    import bench_eval
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from test_tasks import lm_eval_task
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = tasks.get("arc_easy")
    results = simple_evaluate(model=bench_eval.their_model(smollm2(), batch_size=4),
                              tasks=[lm_eval_task("arc_easy", task, task.folders[0])], limit=8, log_samples=True)
    tracker = EvaluationTracker(output_path=str(tmp_path / "lm_eval" / "results.json"))  # samples: beside it
    tracker.save_results_aggregated(results=results, samples=results["samples"])  # as lm_eval's command line
    tracker.save_results_samples("arc_easy", results["samples"]["arc_easy"])
    ours = tmp_path / "ours.jsonl"
    assert evaluate.main([smollm2(), "--tasks", "arc_easy", "--limit", "8", "--log_samples", str(ours),
                          "--report", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert diff_samples.main([str(ours), str(tmp_path / "lm_eval")]) == 0
    said = capsys.readouterr().out
    assert said.startswith("arc_easy: 8 items in both (0 in one only), 0 with other requests") and "DIFFERS" not in said
