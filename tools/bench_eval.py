"""evaluate.py's scores against lm-eval's `hf` backend, side by side on the same model and items: how often the
two choose the same answer, where they differ whether two choices tied, each one's accuracy and seconds.

    python tools/bench_eval.py MODEL.gguf --tasks arc_easy piqa --limit 0 --batch_size 8
    python tools/bench_eval.py hf_folder --tasks hellaswag --limit 300

MODEL is a .gguf file or a Hugging Face folder that transformers reads too (float32 on the CPU for both). lm-eval
gets the very requests evaluate.py builds (tests/test_tasks.py holds them equal to its own tasks'), through its
HFLM.loglikelihood; the same process runs both, one after the other, task by task, so a busy machine slows both.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

TIE = 1e-4  # two choices this close in log-likelihood are a tie: float32 noise may order them either way


def their_model(path: str, batch_size: int):
    """lm-eval's HFLM on transformers' reading of the model, float32 on the CPU."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = (os.path.split(path) if path.endswith(".gguf") else (path, None))
    extra = {"gguf_file": name} if name else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder, **extra),
                batch_size=batch_size, device="cpu")


def their_predictions(lm, items) -> tuple[list[int], list[list[float]]]:
    """lm-eval's choice for each item (numpy's argmax: the first of equals) and its log-likelihoods."""
    from lm_eval.api.instance import Instance
    requests = [Instance("loglikelihood", {}, r, j) for item in items for j, r in enumerate(item.requests)]
    lls, k = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)], 0
    picks, per_item = [], []
    for item in items:
        mine = lls[k:k + len(item.requests)]
        k += len(item.requests)
        per_item.append(mine)
        picks.append(max(range(len(mine)), key=lambda i: (mine[i], -i)))
    return picks, per_item


def tokens_run(tokenizer, items, max_len: int) -> tuple[int, int]:
    """(the positions evaluate.py runs through the model, those lm-eval's `hf` backend runs), padding aside:
    here each item's shared prefix once and each choice's own tokens after it; there every request whole but
    its last token. On a CPU bound by its matmuls their ratio is the most a shared prefix can gain over a
    batched lm-eval."""
    from llm.scores.scoring import encode_item, prefix_id
    prefix = prefix_id(tokenizer)
    ours = theirs = 0
    for item in items:
        e = encode_item(tokenizer, item, max_len, prefix)
        ours += e.shared + sum(len(s) - e.shared - 1 for s in e.sequences)
        theirs += sum(len(s) - 1 for s in e.sequences)
    return ours, theirs


def compare(model_path: str, names: list[str], limit: int, batch_size: int) -> list[dict]:
    from llm.generate.inference import load_for_inference
    from llm.scores import tasks
    from llm.scores.scoring import TaskScore, score_items
    model, tokenizer, _, _ = load_for_inference(model_path, device="cpu", compile="off")
    lm, rows = their_model(model_path, batch_size), []
    for name in names:
        task = tasks.get(name)
        items = task.items(limit)
        start = time.perf_counter()
        ours = score_items(model, tokenizer, items, TaskScore(task.name, task.split, norm=task.norm))
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        picks, lls = their_predictions(lm, items)
        theirs_s = time.perf_counter() - start
        here, there = tokens_run(tokenizer, items, model.config.max_seq_len)
        differ = [i for i, (a, b) in enumerate(zip(ours.predictions, picks)) if a != b]
        untied = [i for i in differ if abs(lls[i][ours.predictions[i]] - lls[i][picks[i]]) > TIE]
        rows.append({"task": name, "items": len(items), "agree": 1 - len(differ) / len(items),
                     "differ": len(differ), "differ_untied": len(untied), "acc": ours.acc,
                     "acc_lm_eval": sum(p == it.gold for p, it in zip(picks, items)) / len(items),
                     "seconds": round(ours_s, 1), "seconds_lm_eval": round(theirs_s, 1),
                     "speedup": round(theirs_s / ours_s, 2), "tokens": here, "tokens_lm_eval": there,
                     "token_ratio": round(there / here, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tasks", nargs="+",
                   default=["arc_easy", "arc_challenge", "piqa", "winogrande", "hellaswag"])
    p.add_argument("--limit", type=int, default=0, help="the first N items of each task; 0: all")
    p.add_argument("--batch_size", type=int, default=1, help="lm-eval's batch size (its default is 1)")
    return p.parse_args(argv)


def main():
    args = parse_args(sys.argv[1:])
    rows = compare(args.model, args.tasks, args.limit, args.batch_size)
    print(f"\n{'task':<14} {'items':>6} {'agree':>7} {'differ':>6} {'untied':>6} {'acc':>6} {'lm-eval':>7} "
          f"{'s':>7} {'s lm-eval':>9} {'speedup':>7} {'tokens':>7}")
    for r in rows:
        print(f"{r['task']:<14} {r['items']:>6} {100 * r['agree']:>6.2f}% {r['differ']:>6} "
              f"{r['differ_untied']:>6} {100 * r['acc']:>6.1f} "
              f"{100 * r['acc_lm_eval']:>7.1f} {r['seconds']:>7.1f} "
              f"{r['seconds_lm_eval']:>9.1f} {r['speedup']:>6.2f}x {r['token_ratio']:>6.2f}x")


if __name__ == "__main__":
    main()
