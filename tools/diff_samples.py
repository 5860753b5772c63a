"""Compare evaluate.py --log_samples with lm-eval's sample files, item by item: the same requests, each choice's
log-likelihood within a tolerance, and the same acc and acc_norm (a pick that differs only where two choices tie
within the tolerance is counted apart, as a tie).

    python evaluate.py MODEL --tasks arc_easy --limit 100 --log_samples ours.jsonl
    lm_eval --model hf --model_args pretrained=... --tasks arc_easy --limit 100 --log_samples --output_path out/
    python tools/diff_samples.py ours.jsonl out/                     # a folder: its samples_*.jsonl, any depth
    python tools/diff_samples.py ours.jsonl out/x/samples_arc_easy_2026-11-29T10-00-00.jsonl --tolerance 1e-3

Prints a line per (sub)task and exits 0 when nothing differs, 1 when something does (an item in one file only
included), 2 for a file it cannot read.
"""

import argparse
import glob
import json
import os
import re
import sys

TOLERANCE = 2e-3  # float32 log-likelihoods of two implementations (batching, kernels) differ by about 1e-4
THEIR_NAME = re.compile(r"samples_(.+)_\d{4}-\d{2}-\d{2}T[\d.:-]+\.jsonl$")  # samples_{task}_{date}.jsonl


def read_jsonl(path: str) -> list[dict]:
    """A file's JSON lines (SystemExit 2 naming the file and line for one that is not a JSON object)."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    rows.append(json.loads(line))
                    if not isinstance(rows[-1], dict):
                        raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        where = f"{path} line {number}" if "number" in locals() else path
        raise SystemExit(f"error: {where}: {str(e)[:200]}; pass evaluate.py's --log_samples "
                         "file and lm-eval's samples_*.jsonl") from None
    return rows


def their_files(paths: list[str]) -> list[str]:
    """lm-eval's sample files among paths (a folder: every samples_*.jsonl under it)."""
    found = []
    for path in paths:
        found += sorted(glob.glob(os.path.join(path, "**", "samples_*.jsonl"), recursive=True)) \
            if os.path.isdir(path) else [path]
    if not found:
        raise SystemExit(f"error: no samples_*.jsonl in {', '.join(paths)}; pass "
                         "lm-eval's --output_path folder")
    return found


def loglikelihood(response) -> float:
    """A choice's log-likelihood from lm-eval's filtered_resps entry: [ll, is_greedy], kept as strings."""
    value = response[0] if isinstance(response, (list, tuple)) else response
    if isinstance(value, str):  # an older writer's "(-1.25, False)"
        value = re.match(r"\(?\s*([-+0-9.eE]+|nan|-?inf)", value).group(1)
    return float(value)


def theirs(paths: list[str]) -> dict:
    """(task, doc_id) -> lm-eval's sample line with its log-likelihoods read as numbers under
    'loglikelihoods'."""
    out = {}
    for path in their_files(paths):
        match = THEIR_NAME.search(os.path.basename(path))
        task = (match.group(1) if match
                else os.path.basename(path).removeprefix("samples_").removesuffix(".jsonl"))
        for row in read_jsonl(path):
            if "acc" in row:  # multiple choice: one loglikelihood request per choice
                row = {**row, "loglikelihoods": [loglikelihood(r) for r in row["filtered_resps"]]}
            out[(task, int(row["doc_id"]))] = row
    return out


def best(values: list[float]) -> int:
    """The first index of the largest value, as lm-eval picks (numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def compare(mine: dict, their: dict, tolerance: float) -> dict:
    """One item's differences: requests, the largest log-likelihood gap, and acc/acc_norm, where a differing
    pick between two choices equally likely within the tolerance counts as a tie."""
    out = {"arguments": mine["arguments"] != their.get("arguments"), "gap": 0.0, "picks": 0, "ties": 0}
    if "loglikelihoods" not in mine:  # a written answer: the match alone
        out["picks"] = int(float(mine["exact_match"]) != float(their.get("exact_match", -1)))
        return out
    a, b = mine["loglikelihoods"], their["loglikelihoods"]
    if len(a) != len(b):
        return out | {"gap": float("inf"), "picks": 1}
    out["gap"] = max(abs(x - y) for x, y in zip(a, b))
    for metric, scale in (("acc", [1] * len(a)), ("acc_norm", [max(n, 1) for n in mine["lengths"]])):
        if metric in mine and float(mine[metric]) != float(their.get(metric, -1)):
            ours, others = [x / n for x, n in zip(a, scale)], [y / n for y, n in zip(b, scale)]
            tied = abs(ours[best(ours)] - ours[best(others)]) <= tolerance
            out["ties" if tied else "picks"] += 1
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ours", help="evaluate.py's --log_samples file")
    p.add_argument("theirs", nargs="+", help="lm-eval's samples_*.jsonl files, or the folder holding them")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="the log-likelihood gap counted as equal")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        mine = {(row["task"], int(row["doc_id"])): row for row in read_jsonl(args.ours)}
        their = theirs(args.theirs)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        print(f"error: a sample line without the field {e}; pass evaluate.py's --log_samples "
              "file and lm-eval's samples_*.jsonl", file=sys.stderr)
        return 2
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    differ = False
    for task in sorted({task for task, _ in mine} | {task for task, _ in their}):
        a, b = {i for t, i in mine if t == task}, {i for t, i in their if t == task}
        if not a or not b:  # a task scored on one side only: nothing to compare, nothing wrong
            side = "the first file" if a else "lm-eval's files"
            print(f"{task}: only in {side} ({len(a | b)} items), not compared")
            continue
        ids, only = a & b, len(a ^ b)
        found = [compare(mine[(task, i)], their[(task, i)], args.tolerance) for i in sorted(ids)]
        requests = sum(f["arguments"] for f in found)
        gap, picks, ties = max((f["gap"] for f in found), default=0.0), sum(f["picks"] for f in found), \
            sum(f["ties"] for f in found)
        bad = requests or picks or only or gap > args.tolerance  # an item in one file only: another --limit?
        differ |= bool(bad)
        print(f"{task}: {len(ids)} items in both ({only} in one only), {requests} with other requests, "
              f"largest log-likelihood gap {gap:.2g}, {picks} metric(s) differing, {ties} tie(s)"
              f"{'  DIFFERS' if bad else ''}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
