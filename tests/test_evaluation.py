"""Tests of evaluation.py: bits per byte against a written-out loss, the code metric's prompts, cut and parse
rule against hand-made completions, the samples, and text_generator.py --eval."""

import math
import os
import subprocess
import sys

import pytest
import torch

from llm.generate.inference import load_for_inference
from llm.scores import evaluation as ev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = '''import os


def area(width, height):
    """The area of a rectangle."""
    return width * height


class Shape:
    def scale(self, factor: float) -> "Shape":
        """A copy, larger by factor.

        Long docstrings end on a later line.
        """
        return Shape()

    def bare(self):
        return 1


async def fetch(url):
    \'\'\'Single quotes.\'\'\'
    return url
'''


def test_function_prompts_are_signatures_with_their_docstrings():
    """Prompts end at the docstring's closing quotes, without the newline (one line or several, either
    quotes); functions without one are skipped."""
    prompts = ev.function_prompts([SOURCE])
    assert [indent for _, indent in prompts] == [0, 4, 0]
    assert prompts[0][0] == 'def area(width, height):\n    """The area of a rectangle."""'
    assert prompts[1][0].startswith("    def scale(self, factor: float) -> \"Shape\":\n")
    assert prompts[1][0].endswith('        Long docstrings end on a later line.\n        """')
    assert prompts[2][0] == "async def fetch(url):\n    '''Single quotes.'''"
    assert len(ev.function_prompts([SOURCE] * 5, n=7)) == 7


@pytest.mark.parametrize("completion,complete,parsed", [
    ("\n    return width * height\n\n\ndef next_one():\n", True, True),  # cut at the dedent: the body parses
    ("\n    if width:\n        return width\n    return 0\nclass", True, True),
    ("\n    return width *\n", True, False),  # a broken statement
    ("\n\n\ndef other():\n    pass\n", True, False),  # no statement before the dedent: only a docstring
    ("\n    # a comment only\n", True, False),
    ("\n    x = 1\n    y = (2", False, True),  # out of tokens: the cut last line is left out
    ("\n    x = 1\n    y = (2\n", True, False),  # finished (eos): the unclosed bracket counts
    ("  # the closing line goes on\n    return 1\n", True, True),  # the first line continues the quotes' line
    (" x = 1\n    return 1\n", True, False),  # code after the closing quotes, on their line
], ids=["dedent", "nested", "broken", "empty", "comment", "out-of-tokens", "finished-broken", "same-line-comment",
        "same-line-code"])
def test_a_body_ends_at_the_first_dedent_and_must_parse(completion, complete, parsed):
    prompt, indent = ev.function_prompts([SOURCE])[0]
    assert ev.parses(prompt, ev.function_body(completion, indent, complete)) is parsed


def test_a_method_body_is_judged_at_its_own_indent():
    prompt, indent = ev.function_prompts([SOURCE])[1]
    body = ev.function_body("\n        return Shape()\n    def other(self):\n", indent, True)
    assert body == "\n        return Shape()" and ev.parses(prompt, body)


def test_the_code_metric_counts_what_parses(monkeypatch, tiny_checkpoint):
    """End to end on scripted completions: 2 of 3 bodies parse, whatever the model."""
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    scripted = ["\n    return width * height\ndef x():\n", "\n        return (\n", "\n    return url\n"]
    monkeypatch.setattr(ev, "generate_text", lambda m, t, prompts, s: (scripted[:len(prompts)], [[1]] * len(prompts)))
    monkeypatch.setattr(model.config, "max_seq_len", 512)  # room for every prompt; the model never runs here
    rate, n = ev.code_parse_rate(model, tok, [SOURCE])
    assert n == 3 and rate == pytest.approx(2 / 3)
    assert ev.code_parse_rate(model, tok, ["no functions here\n"]) == (pytest.approx(math.nan, nan_ok=True), 0)


def test_bits_per_byte_equals_the_written_out_loss(tiny_checkpoint):
    """Every token of the texts (joined by <|endoftext|>, cut into context windows) counts once, over the
    texts' UTF-8 bytes: the same definition as training's (loss / ln 2 / bytes per token)."""
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    texts = [SOURCE, "caf\u00e9 \u65e5\u672c " * 30]
    r = ev.bits_per_byte(model, tok, texts, batch_size=3)
    ids = []
    for text in texts:
        ids += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    window, total = model.config.max_seq_len, 0.0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):  # one window at a time, written out
            chunk = torch.tensor([ids[s:s + window + 1]])
            logp = model(chunk[:, :-1])[0].double().log_softmax(-1)
            total -= logp[0].gather(-1, chunk[0, 1:, None]).sum().item()
    assert r["tokens"] == len(ids) - 1 and r["bytes"] == sum(len(t.encode()) for t in texts)
    assert r["bits_per_byte"] == pytest.approx(total / math.log(2) / r["bytes"], rel=1e-4)


def test_samples_are_seeded_and_follow_their_prompts(tiny_checkpoint):
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    prompts = ev.sample_prompts([SOURCE], python=True)
    a, b = ev.sample_texts(model, tok, prompts), ev.sample_texts(model, tok, prompts)
    assert [s["prompt"] for s in a] == ["def", "class", "import"] and a == b
    texts = ["first document text, long enough", "x", "a sentence with a space at 24"]
    assert ev.sample_prompts(texts, python=False) == ["first document text, lon", "x", "a sentence with a space"]


def test_chat_samples_are_replies_that_end_at_im_end(chat_stopper):
    """For conversations the samples answer each one's first user turn, and end where the reply does: the chat
    stopper model replies "OK<|im_end|>" forever, so a sample that ran on would read "OKOKOK..."."""
    model, tok, *_ = load_for_inference(chat_stopper, "cpu")
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    prompts = ev.sample_prompts([chat, "plain text"], python=False)
    assert prompts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    assert [s["text"] for s in ev.sample_texts(model, tok, prompts)] == ["OK"]


@pytest.mark.slow
def test_eval_command_measures_any_checkpoint_on_given_files(tiny_checkpoint, tmp_path):
    """text_generator.py --eval prints bits per byte and the code metric for the files given, one line."""
    (tmp_path / "code").mkdir()
    text = SOURCE + "".join(f'\ndef f{i}(x):\n    """Id."""\n    return x\n' for i in range(3))  # short: they fit
    (tmp_path / "code" / "shapes.py").write_text(text)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "text_generator.py"), tiny_checkpoint, "--eval",
                        "--eval_files", str(tmp_path / "code")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    expected = ev.bits_per_byte(model, tok, [text])["bits_per_byte"]
    rate, n = ev.code_parse_rate(model, tok, [text], ev.fitted(ev.CODE_SETTINGS, model.config.max_seq_len))
    line = r.stdout.strip()
    assert n >= 3 and f"{expected:.4f} bits per byte on {tmp_path / 'code'}" in line
    assert f"{round(rate * n)}/{n} Python function bodies parse" in line


@pytest.mark.parametrize("kind", ["bpe", "tiktoken"])
def test_code_prompts_end_where_the_tokenizer_puts_a_boundary(kind):
    """GPT-4's split (--tokenizer_type tiktoken) keeps closing quotes and the newline after them in one token:
    prompts cut at the quotes ended inside a token, and such a model wrote no body that parsed (0 of 16, its
    twin with the default tokenizer 10). Each prompt must encode as the start of its function's own encoding.
    """
    from transformers import PreTrainedTokenizerFast

    from llm.tokens.tokenizer import train_tokenizer
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer([SOURCE] * 50, kind, 400))
    for prompt, _ in ev.function_prompts([SOURCE]):
        text = SOURCE[SOURCE.index(prompt):]  # the function as written, from its signature on
        cut = ev.on_token_boundary(tokenizer, prompt)
        ids = tokenizer.encode(cut, add_special_tokens=False)
        assert text.startswith(cut) and tokenizer.encode(text, add_special_tokens=False)[:len(ids)] == ids, cut
