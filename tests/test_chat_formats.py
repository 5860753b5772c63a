"""Tests of chat_formats.py, through corpus.py and prepare_data.py: every accepted chat shape becomes the
conversation written by hand below, rendered as transformers renders the chat template and masked as a
messages line is; --system_prompt adds a system turn where there is none; bad lines name the file, the line
and the accepted shapes."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

import prepare_data as pd
from config import DataConfig
from llm.base.errors import DataError
from llm.data import preparation
from llm.data.chat_formats import chat_messages
from llm.tokens.tokenizer import IM_END, load_tokenizer

VOCAB, SEQ = 300, 16


def turns(*pairs) -> list:
    return [{"role": role, "content": content} for role, content in pairs]


# Each accepted shape, and the conversation it must become.
SHAPED = [
    ({"messages": turns(("user", "Name a colour."), ("assistant", "Green."))},
     turns(("user", "Name a colour."), ("assistant", "Green."))),
    ({"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi?"},
                        {"from": "gpt", "value": "Hello."}, {"from": "user", "value": "Bye?"},
                        {"from": "assistant", "value": "Bye."}]},
     turns(("system", "Be terse."), ("user", "Hi?"), ("assistant", "Hello."), ("user", "Bye?"), ("assistant", "Bye."))),
    ({"instruction": "Translate to French.", "input": "the cat", "output": "le chat"},
     turns(("user", "Translate to French.\n\nthe cat"), ("assistant", "le chat"))),
    ({"instruction": "Say yes.", "input": "", "output": "Yes."}, turns(("user", "Say yes."), ("assistant", "Yes."))),
    ({"instruction": "Count to two.", "output": "1 2"}, turns(("user", "Count to two."), ("assistant", "1 2"))),
    ({"instruction": "Say no.", "input": None, "output": "No."}, turns(("user", "Say no."), ("assistant", "No."))),
    ({"prompt": "2 + 2 =", "completion": " 4"}, turns(("user", "2 + 2 ="), ("assistant", " 4"))),
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def prepare(tmp_path, rows, **kw):
    cfg = DataConfig(sources=[write_jsonl(tmp_path / "chats.jsonl", rows)], cache_dir=str(tmp_path / "cache"), **kw)
    return preparation.prepare(cfg, vocab_size=VOCAB, seq_len=SEQ, log=lambda m: None)


def test_every_shape_becomes_its_conversation_and_the_system_prompt_fills_only_a_gap():
    """Prevents a shape read into the wrong roles (ShareGPT's gpt as the user), an Alpaca input dropped or
    glued to the instruction, and --system_prompt doubling a system turn a conversation already has."""
    for line, expected in SHAPED:
        assert chat_messages(line) == expected, line
        has_system = any(m["role"] == "system" for m in expected)
        added = expected if has_system else turns(("system", "Be kind.")) + expected
        assert chat_messages(line, "Be kind.") == added, line
    assert chat_messages({"text": "plain"}) is None and chat_messages({"prompt": "no completion"}) is None


def test_every_shape_is_rendered_and_masked_as_a_messages_line(tmp_path):
    """Prevents a converted shape from training on its prompt or losing its <|im_end|>, and the system prompt
    from being learned: the cache holds transformers' rendering of each conversation, and its learned tokens
    are exactly the assistant replies, each with <|im_end|>."""
    rows = [line for line, _ in SHAPED] * 4
    data = prepare(tmp_path, rows, system_prompt="Be kind.")
    expected = [chat_messages(line, "Be kind.") for line in rows]
    template = load_tokenizer(data.tokenizer_path)
    assert sorted(data.texts("train") + data.texts("val")) == sorted(
        template.apply_chat_template(messages, tokenize=False) for messages in expected)
    tok = Tokenizer.from_file(data.tokenizer_path)
    replies = [tuple(tok.encode(m["content"], add_special_tokens=False).ids + [tok.token_to_id(IM_END)])
               for messages in expected for m in messages if m["role"] == "assistant"]
    runs = []
    for split in ("train", "val"):
        tokens = data.stream(split)[:]
        mask = data.stream(split, masks=True)[:]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        runs += [tuple(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert sorted(runs) == sorted(replies)
    assert prepare(tmp_path, rows).path != data.path  # another system prompt is another cache


BAD_LINES = {
    "no shape": ({"prompt": "a prompt without its completion"},
                 r"no text field \(looked for text, .*\) and no chat shape \(accepted: messages .*conversations "
                 r".*ShareGPT.*Alpaca.*prompt \+ completion\)"),
    "value not a string": ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]},
                           r"conversations turn 1's value must be a string, not int"),
    "unknown speaker": ({"conversations": [{"from": "bot", "value": "x"}]},
                        r"conversations turn 1: unknown speaker 'bot', use one of human, user, gpt"),
    "speaker not a string": ({"conversations": [{"from": ["gpt"], "value": "x"}]},
                             r"conversations turn 1: unknown speaker \['gpt'\]"),
    "turn not an object": ({"conversations": ["hello"]}, r"conversations turn 1 is not a \{\"from\", \"value\"\}"),
    "conversations not a list": ({"conversations": "hi"}, r"conversations must be a non-empty list"),
    "instruction not a string": ({"instruction": ["a"], "output": "b"}, r"instruction must be a string, not list"),
    "input not a string": ({"instruction": "a", "input": 3, "output": "b"}, r"input must be a string, not int"),
    "completion not a string": ({"prompt": "a", "completion": None}, r"completion must be a string, not NoneType"),
    "no reply": ({"conversations": [{"from": "human", "value": "hi"}]}, r"the conversation has no assistant turn"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_line_of_no_shape_or_wrong_types_is_one_error_naming_file_and_line(tmp_path, case):
    """Prevents a wrong-typed field from ending in a traceback (or in a chat of a number), and a line of no
    known shape from being refused without saying which shapes would do."""
    line, pattern = BAD_LINES[case]
    rows = [line for line, _ in SHAPED] * 2
    with pytest.raises(DataError, match=r"chats\.jsonl line 3: " + pattern + r".*--skip_bad_lines") as err:
        prepare(tmp_path, rows[:2] + [line] + rows[2:])
    assert "\n" not in str(err.value)


def test_the_command_line_refuses_a_bad_line_with_one_line_and_exit_2(tmp_path, capsys):
    """Prevents the error contract from breaking on the new shapes: exit 2, one `error:` line, no traceback.
    """
    path = write_jsonl(tmp_path / "chats.jsonl", [line for line, _ in SHAPED] + [{"instruction": 1, "output": "x"}])
    with pytest.raises(SystemExit) as exit_:
        pd.main(["--sources", path, "--cache_dir", str(tmp_path / "cache"), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: 1 bad JSONL line(s), the first is ")
    assert f"chats.jsonl line {len(SHAPED) + 1}: instruction must be a string" in err
