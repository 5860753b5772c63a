"""Any lm-eval task through this project's model, in the same process: no export, no server. lm-eval (an
optional install) builds the task's requests from its own task files and datasets (which it fetches, so this
needs the network or its cache); the model answers them here:

- loglikelihood: each (context, continuation) tokenized as lm-eval's `hf` backend does (scoring.encode_item),
  its log-probabilities and whether greedy decoding writes it, from engine.score;
- loglikelihood_rolling: a whole text in lm-eval's rolling windows of the model's context;
- generate_until: greedy or sampled replies through the engine, cut at the task's stop strings.
"""

from config import SampleConfig
from llm.base.errors import ConfigError
from llm.generate.engine import generate_text, score
from llm.scores.scoring import TaskScore, encode_item, prefix_id
from llm.scores.tasks import Item

MAX_STOPS = 4  # the engine's stop strings per request; more are cut from the reply afterwards


def lm_eval_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def known(names: list[str], include_path: str | None = None) -> list[str]:
    """The names lm-eval knows among names (its task index; empty without lm-eval)."""
    if not names or not lm_eval_available():
        return []
    from lm_eval.tasks import TaskManager
    index = TaskManager(include_path=include_path).all_tasks
    return [n for n in names if n in index]


def project_lm(model, tokenizer):
    """An lm-eval LM whose every request runs on model (a Transformer made ready by inference.for_inference).
    """
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ctx = model.config.max_seq_len
    prefix = prefix_id(tokenizer)

    def scored(sequences: list[list[int]], starts: list[int]) -> list[tuple[float, bool]]:
        """Each sequence's tokens from `start` on: summed log-probability, and whether each is the likeliest.
        """
        out = []
        for (lp, top, _), seq, start in zip(score(model, sequences, top=1), sequences, starts):
            picks = range(start - 1, len(seq) - 1)  # score()'s entry i is token i + 1
            out.append((sum(lp[i] for i in picks), all(top[i][0] == seq[i + 1] for i in picks)))
        return out

    class ProjectLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            encoded = [encode_item(tokenizer, Item((r.args,), ("",), 0), ctx, prefix) for r in requests]
            return scored([e.sequences[0] for e in encoded], [e.starts[0] for e in encoded])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            totals = []
            for r in requests:
                ids = tokenizer.encode(r.args[0], add_special_tokens=False)
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, prefix, ctx, 1)]
                parts = scored([c + p for c, p in windows], [len(c) for c, _ in windows])
                totals.append(sum(lp for lp, _ in parts))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False):
            replies = []
            for r in requests:
                context, kwargs = r.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                room = min(int(kwargs.get("max_gen_toks", 256)), ctx // 2)
                sampled = kwargs.get("do_sample") and float(kwargs.get("temperature", 0) or 0) > 0
                settings = SampleConfig(max_new_tokens=room,
                                        temperature=float(kwargs["temperature"]) if sampled else 0,
                                        top_k=0, top_p=1.0, seed=0, stop=until[:MAX_STOPS])
                ids = tokenizer.encode(context, add_special_tokens=False)[-(ctx - room):] or [prefix]
                text = generate_text(model, tokenizer, [ids], settings)[0][0]
                for stop in until:
                    text = text.split(stop)[0]
                replies.append(text)
            return replies

    return ProjectLM()


def run_lm_eval(model, tokenizer, names: list[str], limit: int = 0, shots: int = 0,
                include_path: str | None = None) -> list[TaskScore]:
    """lm-eval's tasks of these names on the model, with `shots` solved examples (0: each task's default): a
    TaskScore each (acc, and acc_norm where the task has it; the split lm-eval scored). ConfigError without
    lm-eval."""
    if not lm_eval_available():
        raise ConfigError(f"{', '.join(names)}: lm-eval's tasks need lm-eval, pip install lm-eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    results = simple_evaluate(model=project_lm(model, tokenizer), tasks=list(names), limit=limit or None,
                              num_fewshot=shots or None,
                              task_manager=TaskManager(include_path=include_path), log_samples=False,
                              bootstrap_iters=0)
    scores = []
    for name in names:
        metrics = results["results"].get(name, {})
        acc = next((v for k, v in metrics.items() if k.split(",")[0] in ("acc", "exact_match") and
                    isinstance(v, float)), None)
        norm = next((v for k, v in metrics.items() if k.split(",")[0] == "acc_norm"
                     and isinstance(v, float)), None)
        items = results.get("n-samples", {}).get(name, {}).get("effective", 0)
        split = results.get("configs", {}).get(name, {}).get("test_split") or \
            results.get("configs", {}).get(name, {}).get("validation_split") or ""
        score = TaskScore(name, split, items=items, norm=norm is not None, shots=shots)
        score.correct, score.correct_norm = (acc or 0.0) * items, (norm or 0.0) * items
        scores.append(score)
    return scores
