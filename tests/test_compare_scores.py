"""tools/compare_scores.py: two evaluations' difference task by task, with the standard error that says
whether it is outside the noise; held to lm-eval's own standard-error function and to cases whose answer is
known."""

import json
import random

import compare_scores


def lines(task, right, metric="acc"):
    return [{"task": task, "suite": task, "doc_id": i, metric: float(r)} for i, r in enumerate(right)]


def test_paired_items_tell_a_small_real_gain_from_noise(tmp_path, capsys):
    """The same 400 items: a second model right on every item the first got right and on 16 more is 4 points
    better and outside the noise, paired (its differences are all 0 or 1), where the unpaired standard error
    of two 400-item scores (±3.5) would call it noise; a second model that swaps 16 right answers for 16
    others is within it. The paired error is lm-eval's mean_stderr over the per-item differences."""
    from lm_eval.api.metrics import mean_stderr
    rng = random.Random(0)
    first = [rng.random() < 0.5 for _ in range(400)]
    wrong = [i for i, r in enumerate(first) if not r]
    better = list(first)
    for i in wrong[:16]:
        better[i] = True
    rows = compare_scores.from_samples(lines("piqa", first), lines("piqa", better))
    (task, metric, a, b, se, n, m), = rows
    assert (task, metric, n, m) == ("piqa", "acc", 400, 400) and abs((b - a) - 16 / 400) < 1e-12
    assert se == mean_stderr([float(y) - float(x) for x, y in zip(first, better)])
    assert compare_scores.verdict(a, b, se) == "second higher"
    unpaired = ((a * (1 - a) / 399) + (b * (1 - b) / 399)) ** 0.5
    assert compare_scores.verdict(a, b, unpaired) == "within the noise"
    right = [i for i, r in enumerate(first) if r]
    swapped = list(first)
    for i, j in zip(right[:8], wrong[:8]):
        swapped[i], swapped[j] = False, True
    (_, _, a, b, se, _, _), = compare_scores.from_samples(lines("piqa", first), lines("piqa", swapped))
    assert a == b and compare_scores.verdict(a, b, se) == "within the noise"
    one, two = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    one.write_text("".join(json.dumps(x) + "\n" for x in lines("piqa", first)))
    two.write_text("".join(json.dumps(x) + "\n" for x in lines("piqa", better)))
    assert compare_scores.main([str(one), str(two)]) == 0
    assert "second higher" in capsys.readouterr().out


def test_scores_files_compare_each_tasks_headline_unpaired(tmp_path, capsys):
    """From two --json files: each task on its headline metric (acc_norm for ARC-Easy, GSM8K's strict match in
    the acc column), the difference's standard error sqrt(se_a^2 + se_b^2), and tasks only one scored left
    out; a file of another kind is one line, exit 2."""
    def scores(arc, gsm):
        return {"tasks": {
            "arc_easy": {"headline_metric": "acc_norm", "acc": 0.5, "acc_stderr": 0.02, "acc_norm": arc,
                         "acc_norm_stderr": 0.03, "items": 570},
            "gsm8k_cot": {"headline_metric": "strict-match", "acc": gsm, "acc_stderr": 0.01, "acc_norm": 0.2,
                          "acc_norm_stderr": 0.01, "items": 1319}}}
    a, b = scores(0.40, 0.05), scores(0.50, 0.06)
    b["tasks"]["copa"] = {"headline_metric": "acc", "acc": 0.6, "acc_stderr": 0.05, "items": 100}
    rows = compare_scores.from_scores(a, b)
    assert [(r[0], r[1]) for r in rows] == [("arc_easy", "acc_norm"), ("gsm8k_cot", "strict-match")]
    assert rows[0][4] == (0.03 ** 2 + 0.03 ** 2) ** 0.5 and compare_scores.verdict(*rows[0][2:5]) == "second higher"
    assert rows[1][2:4] == (0.05, 0.06) and compare_scores.verdict(*rows[1][2:5]) == "within the noise"
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert compare_scores.main([str(bad), str(bad)]) == 2
    assert "error:" in capsys.readouterr().err
