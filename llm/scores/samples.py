"""evaluate.py --log_samples: one JSON line per scored item, named as lm-eval's sample files name things, so
that tools/diff_samples.py lines the two up item by item.

A line holds what lm-eval's holds under the same keys (doc_id; arguments as {"gen_args_i": {"arg_0": context,
"arg_1": continuation}}; target; acc, acc_norm or exact_match) and, where lm-eval writes a string or leaves a
value to be worked out, the value itself: each choice's log-likelihood and length in characters, the picks for
acc and acc_norm, the gold index; for a written answer, the reply and the number read from it. `task` is
lm-eval's name of the (sub)task (mmlu_anatomy), `suite` the task it was scored in (mmlu)."""

import json

from llm.scores.tasks import Item


def arguments(item: Item) -> dict:
    """The item's requests as lm-eval's sample files write them."""
    return {f"gen_args_{i}": {"arg_0": context, "arg_1": continuation}
            for i, (context, continuation) in enumerate(item.requests)}


def choice_line(suite: str, item: Item, loglikelihoods: list[float], pick: int,
                pick_norm: int | None) -> dict:
    """A multiple-choice item's line: pick is acc's choice, pick_norm acc_norm's (None where the task has
    none)."""
    line = {"task": item.source or suite, "suite": suite, "doc_id": item.doc_id, "arguments": arguments(item),
            "target": str(item.gold), "choices": list(item.choices), "loglikelihoods": loglikelihoods,
            "lengths": [len(c) for c in item.choices], "pred": pick, "acc": float(pick == item.gold)}
    if pick_norm is not None:
        line |= {"pred_norm": pick_norm, "acc_norm": float(pick_norm == item.gold)}
    return line


def answer_line(suite: str, item: Item, reply: str, extracted: str | None, right: bool) -> dict:
    """A written answer's line: the reply, the number read from it, and whether it is the item's answer."""
    return {"task": item.source or suite, "suite": suite, "doc_id": item.doc_id, "arguments": arguments(item),
            "target": item.answer, "reply": reply, "extracted": extracted, "exact_match": float(right)}


def text(lines: list[dict]) -> str:
    """The JSONL text of the lines (non-ASCII kept as it is, as lm-eval writes it)."""
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
