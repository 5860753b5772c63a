"""Preference rows: a prompt with a better (chosen) and a worse (rejected) reply, as one pair document.

    {"prompt": "...", "chosen": "...", "rejected": "..."}                 strings: the prompt is one user turn
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  TRL's conversational format
    {"chosen": [messages], "rejected": [messages]}                        the prompt implicit: what both share
A row's conversational replies are what follows the longest run of messages chosen and rejected share (so the
preference splits of HuggingFaceH4/ultrafeedback_binarized, whose replies repeat the user turn, read as
intended).
The pair is rendered as two chats in the token cache, prompt + chosen then prompt + rejected, an end-of-text
token after each; every piece is encoded on its own (tokenizer.encode_segments), so both hold the same prompt
ids and the replies start exactly where the prompt ends, never a token merged across the boundary (trl#2054).
"""

from llm.base.errors import DataError
from llm.tokens.tokenizer import EOT_TOKEN, chat_segments, check_messages

PAIR_FIELDS = ("chosen", "rejected")  # table columns a preference row is read from, besides its prompt
PAIR_SHAPE = "prompt + chosen + rejected (strings, or lists of messages)"


def is_pair(doc) -> bool:
    return isinstance(doc, dict)


def pair_document(obj: dict, system_prompt: str = "") -> dict | None:
    """A preference row as {"prompt", "chosen", "rejected"}, each a list of messages, checked; None when the
    row has neither chosen nor rejected. DataError says what is wrong with it."""
    has = [k for k in PAIR_FIELDS if k in obj]
    if not has:
        return None
    if len(has) == 1:
        missing = ({"chosen", "rejected"} - set(has)).pop()
        raise DataError(f"a preference row needs chosen and rejected, this one has no {missing}")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = _prompt(obj)
        chosen, rejected = [_reply(chosen)], [_reply(rejected)]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = check_messages(chosen, False), check_messages(rejected, False)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == len(chosen) == len(rejected):
            raise DataError("chosen and rejected are the same reply: a pair "
                            "teaches only where its replies differ")
        prompt = chosen[:shared] if shared else _prompt(obj)
        chosen, rejected = chosen[shared:], rejected[shared:]
    else:
        raise DataError(f"chosen and rejected must both be strings or both lists of messages, not "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if reply and not any(m["role"] == "assistant" for m in reply):
            raise DataError(f"the {name} reply holds no assistant turn (it has "
                            f"{', '.join(m['role'] for m in reply)}): give the replies as assistant messages")
        if not reply or not any(m["role"] == "assistant" and m["content"].strip() for m in reply):
            raise DataError(f"the {name} reply is empty: a pair needs two replies to compare")
        if reply[0]["role"] != "assistant":
            raise DataError(f"the {name} reply starts with a {reply[0]['role']} turn, not the assistant's")
    if chosen == rejected:
        raise DataError("chosen and rejected are the same reply: a pair "
                        "teaches only where its replies differ")
    if system_prompt and not any(m["role"] == "system" for m in prompt):
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _prompt(obj: dict) -> list:
    """The row's prompt as messages: a string is one user turn."""
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("the prompt is empty")
        return [{"role": "user", "content": prompt}]
    if prompt is None:
        raise DataError("a preference row without a shared conversation needs "
                        "a prompt (a string or messages)")
    messages = check_messages(prompt, False)
    if messages[-1]["role"] == "assistant":
        raise DataError("the prompt ends with an assistant turn: it should end where the replies begin")
    return messages


def _reply(text) -> dict:
    return {"role": "assistant", "content": text}


def pair_segments(doc: dict) -> list:
    """The pair as tokenizer segments: prompt + chosen, an end-of-text token, prompt + rejected (each reply's
    assistant content and <|im_end|> learned, as in a chat; the prompt's template text is the same in both).
    """
    prompt = chat_segments(doc["prompt"])
    return (prompt + chat_segments(doc["chosen"]) + [(EOT_TOKEN, False, True)] + prompt
            + chat_segments(doc["rejected"]))


def as_messages(doc):
    """A chat document's messages; a pair's prompt with its chosen reply (where text is wanted of it)."""
    return doc["prompt"] + doc["chosen"] if is_pair(doc) else doc
