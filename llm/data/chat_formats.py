"""The shapes a chat JSONL line may take, each turned into the one messages list that tokenizer.py renders.

    {"messages": [{"role": "user", "content": "..."}, ...]}       role: system, user, assistant
    {"conversations": [{"from": "human", "value": "..."}, ...]}   ShareGPT: human/user, gpt/assistant, system
    {"instruction": "...", "input": "...", "output": "..."}       Alpaca; input optional
    {"prompt": "...", "completion": "..."}                        one user turn, one assistant turn
corpus.py asks chat_messages() about every JSONL object, so the loss masks are the same for every shape.
"""

from llm.base.errors import DataError
from llm.tokens.tokenizer import check_messages

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
SHAPES = ("messages [{role, content}], conversations [{from, value}] (ShareGPT), instruction + output with "
          "optional input (Alpaca), prompt + completion")
# table columns
SHAPE_FIELDS = ("messages", "conversations", "instruction", "input", "output", "prompt", "completion")


def chat_messages(obj: dict, system_prompt: str = "") -> list | None:
    """The conversation a JSONL object holds, checked, with a system turn of system_prompt where it has none;
    None when the object has no chat shape. DataError names the field whose value is wrong."""
    messages = _as_messages(obj)
    if messages is None:
        return None
    messages = check_messages(messages)
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def _as_messages(obj: dict) -> list | None:
    """The object's turns as {role, content} dicts, unchecked; None when no shape's keys are there."""
    if "messages" in obj:
        return obj["messages"]
    if "conversations" in obj:
        return _sharegpt(obj["conversations"])
    if "instruction" in obj and "output" in obj:
        return _alpaca(obj)
    if "prompt" in obj and "completion" in obj:
        return [{"role": "user", "content": _string(obj, "prompt")},
                {"role": "assistant", "content": _string(obj, "completion")}]
    return None


def _string(obj: dict, key: str, where: str = "") -> str:
    """obj[key], which must be a string."""
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}{key} must be a string, not {type(value).__name__}")
    return value


def _sharegpt(turns) -> list:
    """ShareGPT turns ({from, value}) as messages."""
    if not isinstance(turns, list) or not turns:
        raise DataError("conversations must be a non-empty list of {\"from\", \"value\"} objects")
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or "value" not in turn:
            raise DataError(f"conversations turn {number} is not a {{\"from\", \"value\"}} object")
        speaker = turn.get("from")
        if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:  # str first: a list is unhashable
            raise DataError(f"conversations turn {number}: unknown speaker {speaker!r:.40}, use one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
        content = _string(turn, "value", f"conversations turn {number}'s ")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": content})
    return messages


def _alpaca(obj: dict) -> list:
    """An Alpaca record as one user turn (instruction, a blank line, then input when there is one) and one
    reply."""
    prompt, extra = _string(obj, "instruction"), obj.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"input must be a string, not {type(extra).__name__}")
    if extra and extra.strip():
        prompt += "\n\n" + extra
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(obj, "output")}]
