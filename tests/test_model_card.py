"""Tests of model_card.py through export_hf.py: every export carries README.md with the numbers of the run
that made it, read from the run folder; a run that recorded little gives a card that says so, never a failed
export."""

import json
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import pytest

import export_hf
import gpu_training_optimized as trainer
from llm.base.sizing import count_parameters
from llm.formats import checkpoint as ckpt_io
from llm.reports.monitor import read_metrics


def rows(card: str) -> dict:
    """The card's table rows, name -> value."""
    return dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", card, re.M))


def card_of(folder) -> str:
    return open(os.path.join(folder, "README.md"), encoding="utf-8").read()


@pytest.fixture(scope="module")
def run(corpus, argv_for, tmp_path_factory):
    """A run of the tiny model through the trainer's command line: 3 steps, evaluated at the last."""
    folder = tmp_path_factory.mktemp("card") / "run"
    argv = argv_for(corpus, folder, "--max_steps", 3, "--eval_interval", 3, "--eval_tasks", "copa", "--eval_task_items",
                    4)
    assert trainer.run(argv) == 0
    return folder, argv


def test_the_card_holds_the_run_numbers(run, corpus, tmp_path):
    """The card of either export must give the model's shape and parameter count, the sources, the corpus and
    the tokens seen, the time, device and command the run recorded, and the validation loss and bits per byte
    that metrics.jsonl holds for the exported step: a card that misreads a field or reads another step's fails
    here."""
    folder, argv = run
    ckpt = ckpt_io.latest_checkpoint(str(folder))
    cfg, state = ckpt_io.load_model_config(ckpt), ckpt_io.load_trainer_state(ckpt)
    evaluation = read_metrics(str(folder), "eval")[-1]
    assert evaluation["step"] == 3 == state["step"]
    assert export_hf.main([str(folder), str(tmp_path / "hf")]) == 0
    assert export_hf.main([str(folder), str(tmp_path / "gguf"), "--gguf", "q8_0"]) == 0
    for out in ("hf", "gguf"):
        card = card_of(tmp_path / out)
        r = rows(card)
        assert card.startswith("<!-- model card written by export_hf.py")
        assert card.splitlines()[1] == "# run"
        assert r["parameters"].endswith(f"({count_parameters(cfg):,})") and r["layers"] == "2"
        assert r["width"] == "64 (SwiGLU 256)" and r["heads"] == "4 query, 2 key/value, 16 wide"
        assert r["context"] == "64 tokens" and r["vocabulary"] == "512 tokens"
        assert r["architecture"].startswith("Qwen3 (QK-norm)")
        assert r["data"] == f"`{os.path.basename(corpus['src'])}`"  # a local path by its name alone
        assert r["tokens seen"] == f"{3 * 4 * 64:,} over 3 steps" == f"{state['tokens']:,} over 3 steps"
        assert r["training time"].startswith(f"{state['spent_s'] / 60:.1f} min")
        assert r["device"].startswith("cpu, ") and r["precision"] in ("fp32", "bf16 autocast")
        assert "command" not in r and str(tmp_path) not in card and corpus["src"] not in card  # nothing local
        assert r["validation loss"] == f"{evaluation['val_loss']:.4f} (step 3)"
        assert r["bits per byte"].startswith(f"{evaluation['val_bpb']:.4f} (step 3)")
        assert r["benchmarks"] == f"copa {100 * evaluation['acc_copa']:.1f}% (accuracy; the first 4 items of each, " \
                                  "zero-shot, lm-eval's prompts) (step 3)"
        corpus_tokens = int(r["corpus"].split()[0].replace(",", ""))
        assert corpus_tokens > 10_000 and "not recorded" not in card
    assert "ollama create run -f Modelfile" in card_of(tmp_path / "gguf")
    assert "from_pretrained(\".\")" in card_of(tmp_path / "hf")


def test_a_run_that_recorded_little_still_exports_with_an_honest_card(tiny_checkpoint, tmp_path):
    """A checkpoint from before runs recorded their device and command (a bare trainer state), with a
    config.json whose sections are not objects and damaged metrics lines, must still export, and its card must
    say "not recorded" rather than invent numbers, while showing the evaluation of the exported step (not a
    later one) with its code metric."""
    run = tmp_path / "run1"
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    later = {"kind": "eval", "val_loss": 1.5, "val_bpb": 0.75}
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"kind": "eval", "step": 10, "val_loss": "oops"}\n{broken\n')
        f.write(json.dumps({"kind": "eval", "step": 10, "val_loss": 2.0, "val_bpb": 1.0, "code_ok": 0.25,
                            "code_samples": 16}) + "\n" + json.dumps({"step": 11, **later}) + "\n")
    (run / "config.json").write_text(json.dumps({"data": ["not", "a", "section"], "train": 3}))  # edited by hand
    assert export_hf.main([str(run), str(tmp_path / "hf")]) == 0
    r = rows(card_of(tmp_path / "hf"))
    for name in ("data", "tokens seen", "training time", "device", "precision"):
        assert r[name] == "not recorded", name
    assert r["validation loss"] == "2.0000 (step 10)" and r["bits per byte"].startswith("1.0000 (step 10)")
    assert r["code metric"].startswith("4 of 16 documented functions")


def test_only_a_model_that_chats_is_exported_with_a_chat_template(run, chat_corpus, argv_for, tmp_path):
    """A model trained here on plain text alone was exported with the ChatML template and a ChatML Modelfile,
    promising a chat it never learned: its folder and GGUF now carry none (transformers' apply_chat_template
    refuses, Ollama gets the prompt as it is), and a run on chats keeps the template in both."""
    from transformers import AutoTokenizer

    gguf = pytest.importorskip("gguf")
    chats = tmp_path / "chats"
    assert trainer.run(argv_for(chat_corpus, chats, "--max_steps", 2)) == 0
    for folder, chat in ((run[0], False), (chats, True)):
        hf, gg = tmp_path / f"hf{chat}", tmp_path / f"gguf{chat}"
        assert export_hf.main([str(folder), str(hf)]) == 0
        assert export_hf.main([str(folder), str(gg), "--gguf", "f16"]) == 0
        config = json.load(open(hf / "tokenizer_config.json", encoding="utf-8"))
        assert ("chat_template" in config) == chat and (AutoTokenizer.from_pretrained(str(hf)).chat_template
                                                        is not None) == chat
        reader = gguf.GGUFReader(str(gg / "model-f16.gguf"))
        assert ("tokenizer.chat_template" in reader.fields) == chat
        modelfile = open(gg / "Modelfile", encoding="utf-8").read()
        assert ('TEMPLATE """{{ .Prompt }}"""' in modelfile) != chat and ("<|im_start|>" in modelfile) == chat
        assert ("apply_chat_template" in card_of(hf)) == chat


def test_names_reach_markdown_as_text_and_an_upload_names_no_local_path(tiny_checkpoint, tmp_path):
    """A run folder named with an <img onerror> tag, a backtick and a `|` once put raw HTML into the card's
    heading and broke its tables; the card meant for upload carried absolute local paths. The heading now
    escapes the name, no row holds an unescaped `|`, and the card holds no path of this machine."""
    import evaluate
    from llm.reports import markdown as md
    hostile = "run<img src=x onerror=alert(1)>`a|b"
    run = tmp_path / hostile
    shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), run)
    (run / "config.json").write_text(json.dumps({"data": {"sources": [str(tmp_path / "my `data|x.jsonl")]},
                                                 "train": {"init_from": str(tmp_path / "base")}}))
    assert export_hf.main([str(run), str(tmp_path / "hf")]) == 0
    card = card_of(tmp_path / "hf")
    assert "<img" not in card and card.splitlines()[1] == f"# {md.text(hostile)}"
    table = [line for line in card.splitlines() if line.startswith("| ")]
    assert all(line.replace("\\|", "").count("|") == 3 for line in table), table  # two cells each, no more
    assert str(tmp_path) not in card and "data\\|x.jsonl" in card
    assert evaluate.main([str(run), "--tasks", "copa", "--limit", "2", "--report", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    outside_code = re.sub(r"(`+).+?\1", "", report)  # inside a code span a tag is text
    assert "<img" not in outside_code and report.splitlines()[0] == f"# Report card: {md.text(hostile)}"


def test_the_rates_a_stage_follows_are_those_of_the_next_token_run_behind_it(tiny_checkpoint, tmp_path):
    """A DPO or GRPO run's recorded rates are scaled down: a stage after it follows, through its --init_from,
    the rates of the chat or pretraining run it started from."""
    from llm.reports.model_card import next_token_train
    runs = {}
    for name, train in (("chat", {"objective": "lm", "learning_rate": 0.004}),
                        ("dpo", {"objective": "dpo", "learning_rate": 0.0002}),
                        ("grpo", {"objective": "grpo", "learning_rate": 0.00001})):
        runs[name] = tmp_path / name
        shutil.copytree(os.path.dirname(os.path.dirname(tiny_checkpoint)), runs[name])
        base = {"dpo": runs.get("chat"), "grpo": runs.get("dpo")}.get(name)
        (runs[name] / "config.json").write_text(json.dumps({"train": {**train, "init_from": str(base or "")}}))
    assert next_token_train(str(runs["chat"]))["learning_rate"] == 0.004
    assert next_token_train(str(runs["grpo"]))["learning_rate"] == 0.004  # through dpo, to the chat run
