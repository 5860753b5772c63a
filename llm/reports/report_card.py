"""The report card: a model's benchmark scores as a table, as JSON for scripts, and as report.md beside the
model's facts (data, tokens, time, device, bits per byte) and reference rows measured with the same tasks and
settings: chance, and models this tool measured itself.

evaluate.py writes it for any model, the trainer for its run; an export's model card carries the scores.
"""

import json
import os

from llm.base import atomic
from llm.reports import report_chart
from llm.reports import markdown as md
from llm.reports.model_card import run_facts
from llm.scores import tasks
from llm.scores.scoring import TaskScore

REPORT, REPORT_JSON = "report.md", "report.json"
# Measured by this tool on every item of each task's split (zero-shot, float32 on a CPU, by
# tools/bench_eval.py, which lm-eval's hf backend agreed with item for item): model -> task -> acc. A task not
# measured yet, or measured in other settings (gsm8k_chat before the chat tasks took the model's own
# template), is left out.
REFERENCES = {
    "SmolLM2-135M-Instruct (its Q4_1 GGUF)": {"arc_easy": 0.5228, "arc_challenge": 0.2308, "piqa": 0.6431,
                                              "winogrande": 0.5043},
}


def _pct(value) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def _err(value) -> str:
    return "" if value is None else f"±{100 * value:.1f}"


def table(scores: list[TaskScore], chances: dict | None = None) -> str:
    """Task, split, items, acc and acc_norm (where lm-eval reports it) each with its standard error, chance,
    seconds, and the task's headline metric centred on chance; then the items and seconds in all, and the
    centred mean of each suite scored (the headline: one number per suite, said plainly)."""
    chances = chances or {}
    lines = [f"{'task':<16} {'split':<11} {'items':>6} {'acc':>6} {'':<5} {'acc_norm':>8} {'':<5} "
             f"{'chance':>6} {'seconds':>8}  centred"]
    for s in scores:
        acc, norm = (s.acc, s.acc_norm) if s.items else (None, None)  # a task stopped before its first item
        name = f"{s.task} {s.shots}-shot" if s.shots else s.task
        metric, centred = headline(s, chances.get(s.task))
        lines.append(f"{name:<16} {s.split:<11} {s.items:>6} {_pct(acc):>6} {_err(s.acc_stderr):<5} "
                     f"{_pct(norm):>8} {_err(s.acc_norm_stderr):<5} {_pct(chances.get(s.task)):>6} "
                     f"{s.seconds:>8.1f}  {_pct(centred)}{f' ({metric})' if centred is not None else ''}"
                     + ("  (stopped)" if s.partial else ""))
    done = [s for s in scores if s.items]
    if len(done) > 1:
        lines.append(f"{'all':<16} {'':<11} {sum(s.items for s in done):>6} {'':>6} {'':<5} {'':>8} {'':<5} "
                     f"{'':>6} {sum(s.seconds for s in done):>8.1f}")
    for suite, value, count in suite_means(scores, chances):
        lines.append(f"{suite} suite: {_pct(value)}, the mean over its {count} task(s) of each one's "
                     "headline metric centred on chance, (score - chance) / (1 - chance)")
    for s in scores:
        if s.metrics != TaskScore.metrics:
            lines.append(f"{s.task}: acc is lm-eval's {s.metrics[0]}, acc_norm its {s.metrics[1]}")
    cut = sum(s.cut for s in scores)
    if cut:
        lines.append(f"{cut} item(s) had prompts longer than the model's context, "
                     "cut from the left as lm-eval does")
    return "\n".join(lines)


def headline(s: TaskScore, chance: float | None) -> tuple[str, float | None]:
    """The task's usual headline metric (its Task's headline column, named as the score names it: a written
    answer's strict match is its acc; acc for lm-eval's own tasks) and its value centred on chance, (x -
    chance) / (1 - chance), as nanochat's CORE centres its tasks: 0 is guessing, 1 is every item right. None
    before the task's first item."""
    known = tasks.TASKS.get(s.task)
    metric = "acc_norm" if known and known.headline == "acc_norm" and s.acc_norm is not None else s.metrics[0]
    if not s.items:
        return metric, None
    # written answers: nothing to guess
    value, c = (s.acc_norm if metric == "acc_norm" else s.acc), chance or 0.0
    return metric, (value - c) / (1 - c)


def suite_means(scores: list[TaskScore], chances: dict) -> list[tuple[str, float, int]]:
    """(suite, centred mean, tasks) for the base and the chat suite, over their tasks scored here."""
    out = []
    for suite, names in (("base", tasks.BASE_SUITE), ("chat", tasks.CHAT_SUITE)):
        values = [headline(s, chances.get(s.task))[1] for s in scores if s.task in names and s.items]
        if values:
            out.append((suite, sum(values) / len(values), len(values)))
    return out


def as_json(scores: list[TaskScore], model: str, limit: int, chances: dict) -> dict:
    """What a script reads: each task's acc, acc_norm (and what they are: metrics), items, split, shots,
    seconds and chance."""
    return {"model": model, "limit": limit,
            "headline": {suite: {"centred_mean": value, "tasks": count} for suite, value, count in
                         suite_means(scores, chances)},
            "tasks": {s.task: {"centred": headline(s, chances.get(s.task))[1],
                               "headline_metric": headline(s, chances.get(s.task))[0], "acc": s.acc,
                               "acc_stderr": s.acc_stderr, "acc_norm": s.acc_norm,
                               "acc_norm_stderr": s.acc_norm_stderr, "metrics": list(s.metrics),
                               "items": s.items, "split": s.split, "shots": s.shots,
                               "seconds": round(s.seconds, 2), "chance": chances.get(s.task), "cut": s.cut,
                               "partial": s.partial} for s in scores}}


def write_json(path: str, data: dict):
    _folder(os.path.dirname(os.path.abspath(path)))
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")


def _folder(path: str):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise atomic.write_error(e, f"making the folder {path}") from None


def report(model: str, scores: list[TaskScore], limit: int, chances: dict, device: str) -> str:
    """report.md: what the model is, what it was trained on and for how long, then the scores with chance and
    the reference models beside them (full splits only: a --limit scores other items)."""
    facts = run_facts(model) if os.path.isdir(model) else {}
    lines = [f"# Report card: {md.text(facts.get('name') or os.path.basename(os.path.normpath(model)))}", "",
             f"- model: {md.code(model)}"]
    if facts.get("step") is not None:
        lines.append(f"- step {facts['step']:,}"
                     + (f", {facts['tokens']:,} tokens" if facts.get("tokens") else ""))
    if facts.get("spent_s"):
        where = md.text(facts.get("device", "a device not recorded"))
        lines.append(f"- training time: {facts['spent_s'] / 60:.1f} min on {where}")
    sources = (facts.get("config", {}).get("data", {}).get("sources")
               if isinstance(facts.get("config"), dict) else None)
    if isinstance(sources, list):
        lines.append("- data: " + (", ".join(md.code(s) for s in sources)
                                   or "the Python standard library's sources"))
    if isinstance(facts.get("eval"), dict) and facts["eval"].get("val_bpb") is not None:
        lines.append(f"- bits per byte: {facts['eval']['val_bpb']:.4f} (validation, "
                     f"step {facts['eval']['step']:,})")
    shot = [f"{s.task} {s.shots}-shot" for s in scores if s.shots]
    splits = {}
    for score in scores:
        splits.setdefault(score.split, []).append(score.task)
    lines += [f"- scored on: {device}, "
              + (f"the first {limit} items of each task" if limit else "every item"),
              f"- shots: {', '.join(shot + ['the rest zero-shot']) if shot else 'zero-shot'}",
              "- splits: " + "; ".join(f"{split} ({', '.join(names)})" for split, names in splits.items()),
              f"- prompts and metrics: lm-eval's task definitions, as of lm-eval {tasks.LM_EVAL_VERSION}", "",
              "```", table(scores, chances), "```", ""]
    if report_chart.available() and any(s.items for s in scores):
        lines += ["![each task's accuracy with its standard error, chance and the "
                  f"references]({report_chart.CHART})",
                  ""]
    if shot:
        lines += ["The reference rows are left out: they are zero-shot scores.", ""]
    else:
        lines += _reference_rows(scores, chances, limit)
    return "\n".join(lines) + "\n"


def _reference_rows(scores: list[TaskScore], chances: dict, limit: int) -> list[str]:
    names = [s.task for s in scores]
    head = "| model | " + " | ".join(names) + " |"
    rows = [head, "|" + "---|" * (len(names) + 1),
            "| this model | " + " | ".join(_pct(s.acc) for s in scores) + " |",
            "| chance | " + " | ".join(_pct(chances.get(n)) for n in names) + " |"]
    for model, results in REFERENCES.items():
        rows.append(f"| {model} | " + " | ".join(_pct(results.get(n)) for n in names) + " |")
    said = ("on every item of each split, where this model had the first {limit} of each task: a difference "
            "within a few standard errors says little" if limit else "on the same items")
    return ["Accuracy (acc, %) beside references measured by this "
            f"tool {said.format(limit=limit)}:", ""] + rows + [""]


def write_report(folder: str, text: str, data: dict, scores: list | None = None, chances: dict | None = None):
    """report.md and report.json in folder, each replaced whole, and given the scores the chart report.md
    shows (report.png, where matplotlib is installed)."""
    _folder(folder)
    if scores and any(s.items for s in scores) and report_chart.available():
        title = f"{data.get('model', '')}" + (f", the first {data['limit']} items of each task"
                                              if data.get("limit") else "")
        atomic.write_bytes(os.path.join(folder, report_chart.CHART),
                           report_chart.png(scores, chances or {}, REFERENCES, os.path.basename(title)))
    atomic.write_text(os.path.join(folder, REPORT), text)
    write_json(os.path.join(folder, REPORT_JSON), data)
