"""Two evaluations side by side, task by task: each one's headline score, the difference, its standard error, and
whether the difference is outside the noise (more than two standard errors, about 95% confidence).

    python evaluate.py runs/mine/checkpoints/step_000500 --tasks arc_easy piqa --json early.json
    python evaluate.py runs/mine --tasks arc_easy piqa --json late.json
    python tools/compare_scores.py early.json late.json          # from the scores: unpaired standard errors
    python tools/compare_scores.py early.jsonl late.jsonl        # from --log_samples files: item by item, paired

From two --json files (or report.json), the difference's standard error is sqrt(se_a^2 + se_b^2): what it is for
two independent sets of items, and an upper bound when both read the same items. From two --log_samples files,
the items are paired by task and doc_id and the standard error is that of the per-item differences (lm-eval's
mean_stderr over them): both models answer the same questions, so what they share cancels and a smaller
difference can be told from noise. Exit 2 for a file it cannot read.
"""

import argparse
import json
import math
import os
import sys

NOISE = 2.0  # standard errors a difference must pass to be called outside the noise (about 95%)


def read(path: str):
    """A --json/report.json file as its dict, or a --log_samples file as its list of lines (SystemExit 2
    naming the file for anything else)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
            raise ValueError("no 'tasks' object: not evaluate.py's --json or report.json")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"error: {path}: {str(e)[:200]}; pass two evaluate.py --json "
                         "files, or two --log_samples files") from None


def from_scores(a: dict, b: dict) -> list[tuple]:
    """(task, metric, a, b, standard error of b - a, items a, items b) for each task both scored, on the
    task's headline metric (evaluate.py's JSON names it)."""
    rows = []
    for task in [t for t in a["tasks"] if t in b["tasks"]]:
        x, y = a["tasks"][task], b["tasks"][task]
        metric = x.get("headline_metric") or "acc"
        if metric == "acc_norm" and (x.get("acc_norm") is None or y.get("acc_norm") is None):
            metric = "acc"
        # another headline (GSM8K's strict match): acc's
        column = "acc_norm" if metric == "acc_norm" else "acc"
        se = math.sqrt((x.get(f"{column}_stderr") or 0.0) ** 2 + (y.get(f"{column}_stderr") or 0.0) ** 2)
        rows.append((task, metric, x[column], y[column], se, x.get("items", 0), y.get("items", 0)))
    return rows


def paired_stderr(differences: list[float]) -> float:
    """The standard error of the mean of per-item differences: their sample standard deviation over sqrt(n).
    """
    n = len(differences)
    if n < 2:
        return 0.0
    mean = sum(differences) / n
    return math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1) / n)


def from_samples(a: list[dict], b: list[dict]) -> list[tuple]:
    """The same rows from two --log_samples files, over the items both hold (by task and doc_id), per suite
    task (mmlu's subjects together), each on acc_norm where both lines have it, else acc (exact_match for
    answers)."""
    def keyed(lines):
        return {(line.get("suite") or line["task"], line["task"], int(line["doc_id"])): line
                for line in lines}
    mine, theirs = keyed(a), keyed(b)
    shared = sorted(set(mine) & set(theirs))
    rows = []
    for suite in dict.fromkeys(key[0] for key in shared):
        keys = [k for k in shared if k[0] == suite]
        first = mine[keys[0]]
        metric = "acc_norm" if "acc_norm" in first and "acc_norm" in theirs[keys[0]] else \
            "acc" if "acc" in first else "exact_match"
        x = [float(mine[k][metric]) for k in keys]
        y = [float(theirs[k][metric]) for k in keys]
        rows.append((suite, metric, sum(x) / len(x), sum(y) / len(y),
                     paired_stderr([q - p for p, q in zip(x, y)]), len(x), len(y)))
    return rows


def verdict(a: float, b: float, se: float) -> str:
    if se == 0.0:
        return "equal" if a == b else "no spread to judge by"
    if abs(b - a) <= NOISE * se:
        return "within the noise"
    return "second higher" if b > a else "first higher"


def table(rows: list[tuple], paired: bool) -> str:
    lines = [f"{'task':<16} {'metric':<17} {'first':>6} {'second':>6} {'diff':>6} {'± se':>6}  verdict",
             "-" * 78]
    for task, metric, a, b, se, n, m in rows:
        note = "" if n == m else f"  (items {n:,} and {m:,}: other items, compare with care)"
        lines.append(f"{task:<16} {metric:<17} {100 * a:>6.1f} {100 * b:>6.1f} {100 * (b - a):>+6.1f} "
                     f"{100 * se:>6.1f}  {verdict(a, b, se)}{note}")
    how = ("paired over the same items" if paired
           else "unpaired (an upper bound where both read the same items)")
    return "\n".join(lines + [f"standard errors {how}; outside the noise: more than {NOISE:g} of them apart"])


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="evaluate.py --json (or report.json), or a --log_samples .jsonl file")
    p.add_argument("second", help="the same kind of file, of the other model or checkpoint")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        a, b = read(args.first), read(args.second)
        if isinstance(a, list) != isinstance(b, list):
            raise SystemExit("error: compare two --json files or two --log_samples files, not one of each")
        rows = from_samples(a, b) if isinstance(a, list) else from_scores(a, b)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as e:
        print(f"error: a line or task without the field {e}; pass evaluate.py's files", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {os.path.basename(args.first)} and {os.path.basename(args.second)} share no task",
              file=sys.stderr)
        return 2
    print(table(rows, isinstance(a, list)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
