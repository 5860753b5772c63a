"""The completions contract that lm-eval's `local-completions` model scores through: echo, logprobs, and
prompts sent as lists of token lists. Requests are built and answers sliced the way lm-eval does it (its
TemplateAPI and LocalCompletionsAPI, lm_eval/models/api_models.py and openai_completions.py; and, for the
older harness, max_tokens 0 with logprobs 10 and a comparison of token strings), written here from that
behaviour, not from the server's code. Every figure is held against a forward of the same weights in float64.
A server answering "logprobs": null, or one token short, made lm-eval report chance-level scores without an
error."""

import os

import pytest
import torch

import export_hf
import serve
from conftest import save_model
from llm.generate import openai_api
from llm.generate.inference import load_for_inference

SEED = 1234  # lm-eval's default seed, sent with every request
PAIRS = [("def push(self, item):\n", "        self.items.append(item)"),
         ("class Stack:\n    def __init__(self):\n", "        self.items = []"),
         ("for name in os.listdir(\".\"):", " print(name)"),
         ("import ", "os"),
         ("", "def fibonacci(n):"),  # an empty context: lm-eval puts its prefix token (the end token) first
         ("return fibonacci(n - 1) + fibonacci(n - 2)\n" * 6, "\nclass Stack:")]  # past the context: cut on the left


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """ids -> (log-probability of each id after the first, whether each is the argmax there): the same weights
    in float64, one plain forward with no cache, log_softmax taken directly."""
    model = load_for_inference(tiny_checkpoint, "cpu")[0].double()

    def score(ids):
        with torch.no_grad():
            logp = model(torch.tensor([ids]))[0][0].log_softmax(-1)[:-1]  # (T - 1, V)
        target = torch.tensor(ids[1:])
        return logp.gather(-1, target[:, None])[:, 0].tolist(), (logp.argmax(-1) == target).tolist()
    return model, score


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoint, tmp_path_factory):
    """The tokenizer lm-eval loads for the server (README: tokenizer=OUT, an export_hf.py folder)."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("export") / "hf"
    assert export_hf.main([tiny_checkpoint, str(out)]) == 0
    return transformers.AutoTokenizer.from_pretrained(str(out))


def lm_eval_inputs(tok, pairs, max_length: int):
    """lm-eval's loglikelihood inputs: (token lists, context lengths). LM.loglikelihood and _encode_pair
    encode the pair (trailing spaces of the context move to the continuation; an empty context becomes the
    prefix token), then TemplateAPI.batch_loglikelihood_requests cuts on the left to max_length - 1."""
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731 (tok_encode, no BOS)
    inputs, ctxlens, limit = [], [], max_length - 1
    for context, continuation in pairs:
        if context == "":
            cont = encode(continuation)
            ctx, cont = ([tok.eos_token_id], cont) if cont[0] != tok.eos_token_id else (cont[:1], cont[1:])
        else:
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, ctx = encode(context + continuation), encode(context)
            cont = whole[len(ctx):]
        inputs.append((ctx + cont)[-limit:])
        ctxlens.append(len(ctx) - max(0, len(ctx) + len(cont) - limit))
    return inputs, ctxlens


def lm_eval_scores(answer: dict, ctxlens) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: choices by index; token_logprobs[ctxlen:-1] (the last entry is the
    one generated token) summed; greedy when each equals the largest value of its top_logprobs."""
    out = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    return out


def old_lm_eval_scores(answer: dict, ctxlens) -> list[tuple[float, bool]]:
    """The older harness (max_tokens 0): token_logprobs[ctxlen:] summed; greedy when each token's string is
    the key of the largest top_logprobs value."""
    out = []
    for choice, ctxlen in zip(answer["choices"], ctxlens):
        lp = choice["logprobs"]
        greedy = all(max(top, key=top.get) == token for token, top in zip(lp["tokens"][ctxlen:],
                                                                            lp["top_logprobs"][ctxlen:]))
        out.append((sum(lp["token_logprobs"][ctxlen:]), greedy))
    return out


def expected(score, inputs, ctxlens) -> list[tuple[float, bool]]:
    """The continuation's log-likelihood and greediness from the float64 reference."""
    out = []
    for ids, ctxlen in zip(inputs, ctxlens):
        logprobs, greedy = score(ids)
        out.append((sum(logprobs[ctxlen - 1:]), all(greedy[ctxlen - 1:])))
    return out


def greedy_ids(model, ids: list[int], n: int) -> list[int]:
    """n new ids by greedy decoding with the float64 reference model."""
    new = []
    with torch.no_grad():
        for _ in range(n):
            new.append(int(model(torch.tensor([ids + new]))[0][0, -1].argmax()))
    return new


@pytest.mark.parametrize("harness", ["current", "older"])
def test_lm_eval_loglikelihoods_equal_a_float64_forward(app, reference, hf_tokenizer, harness):
    """The server's answer, read as lm-eval reads it, must give each continuation's log-likelihood (to float32
    precision) and whether greedy decoding would produce it, exactly as the model's own forward does."""
    server, client = app
    context = "import os"  # and the model's own continuation of it, which is greedy (and re-encodes as it was)
    encode = lambda text: server.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    pairs = PAIRS + [(context, server.tokenizer.decode(greedy_ids(reference[0], encode(context), 4)))]
    inputs, ctxlens = lm_eval_inputs(hf_tokenizer, pairs, server.config.max_seq_len)
    assert inputs[:4] == [encode(c + x) for c, x in PAIRS[:4]], "the exported tokenizer must encode as ours does"
    long = len(PAIRS) - 1
    assert len(inputs[long]) == server.config.max_seq_len - 1 and ctxlens[long] < len(inputs[long]) - 1  # cut
    if harness == "current":
        body = {"model": server.name, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                "seed": SEED, "echo": True}
    else:
        body = {"model": server.name, "prompt": inputs, "max_tokens": 0, "temperature": 0.0, "logprobs": 10,
                "seed": SEED, "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = (lm_eval_scores if harness == "current" else old_lm_eval_scores)(r.json(), ctxlens)
    want = expected(reference[1], inputs, ctxlens)
    assert {g for _, g in want} == {True, False}, "the pairs must hold greedy and non-greedy continuations"
    for (logprob, greedy), (ref_logprob, ref_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(ref_logprob, abs=1e-4) and greedy == ref_greedy
    counts = [len(c["logprobs"]["tokens"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert counts == [len(ids) + (harness == "current") for ids in inputs]


@pytest.fixture(scope="module")
def ender(tmp_path_factory, tiny_config, tiny_checkpoint):
    """A checkpoint (tiny_checkpoint's tokenizer) whose likeliest next token is always <|endoftext|>: every
    hidden state is the same vector, which the head reads as the end token's logit."""
    from tokenizers import Tokenizer

    from modern_llm import Transformer
    tok_path = os.path.join(tiny_checkpoint, "tokenizer.json")
    cfg = tiny_config(vocab_size=Tokenizer.from_file(tok_path).get_vocab_size(), tie_word_embeddings=False)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, value in model.state_dict().items():  # blocks that add nothing
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                value.zero_()
        model.embed_tokens.weight[:, 0] = 1
        model.lm_head.weight[Tokenizer.from_file(tok_path).token_to_id("<|endoftext|>"), 0] = 1
    return save_model(tmp_path_factory.mktemp("ender") / "run", 1, model, tok_path)


def test_a_generated_end_token_is_in_the_logprobs(ender):
    """lm-eval drops the last entry (the one generated token); when that token was the end token, the server
    once left it out, and lm-eval's slice then dropped the continuation's last token instead."""
    from starlette.testclient import TestClient
    server = serve.Server(*serve.parse_args([str(ender), "--device", "cpu", "--compile", "off"]))
    ids, ctxlen = server.tokenizer.encode("import os", add_special_tokens=False), 1
    with TestClient(serve.app_for(server)) as client:
        answer = client.post("/v1/completions", json={"prompt": [ids], "temperature": 0, "max_tokens": 1,
                                                      "logprobs": 1, "seed": SEED, "echo": True}).json()
    assert answer["choices"][0]["logprobs"]["tokens"][-1] == "<|endoftext|>" and answer["choices"][0]["text"] == \
        "import os"
    model = load_for_inference(ender, "cpu")[0].double()
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0][0].log_softmax(-1)
    want = sum(logp[k - 1, ids[k]].item() for k in range(ctxlen, len(ids)))
    (got, greedy), = lm_eval_scores(answer, [ctxlen])
    assert got == pytest.approx(want, abs=1e-4) and not greedy


def test_a_batch_with_n_orders_choices_by_prompt(app, reference):
    """Choice p * n + k is prompt p's k-th sequence (OpenAI's order), each echoing its own prompt."""
    server, client = app
    prompts = [server.tokenizer.encode(t, add_special_tokens=False) for t in ("def push(self", "import os")]
    r = client.post("/v1/completions", json={"prompt": prompts, "n": 2, "echo": True, "logprobs": 0,
                                              "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for choice in r["choices"]:
        ids = prompts[choice["index"] // 2]
        assert choice["text"].startswith(server.tokenizer.decode(ids))
        logprobs, _ = reference[1](ids)
        assert choice["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(logprobs, abs=1e-4)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the chosen only
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_logprobs_of_generated_tokens(app, reference):
    """Without echo, logprobs covers the new tokens: each one's log-probability and its top alternatives as
    the model gives them, text offsets counted from the start of the prompt."""
    server, client = app
    model, score = reference
    prompt = "class Stack:\n    def push(self"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 3,
                                              "temperature": 0}).json()["choices"][0]
    ids = server.tokenizer.encode(prompt, add_special_tokens=False)
    new = greedy_ids(model, ids, 6)
    lp = r["logprobs"]
    assert r["text"] == server.tokenizer.decode(new) and lp["tokens"] == [server.tokenizer.decode([t]) for t in new]
    logprobs, greedy = score(ids + new)
    assert lp["token_logprobs"] == pytest.approx(logprobs[len(ids) - 1:], abs=1e-4) and all(greedy[len(ids) - 1:])
    with torch.no_grad():
        logp = model(torch.tensor([ids + new]))[0][0].log_softmax(-1)
    for k, top in enumerate(lp["top_logprobs"]):
        values, indices = logp[len(ids) - 1 + k].topk(3)
        want = {}
        for i, v in zip(indices.tolist(), values.tolist()):
            want.setdefault(server.tokenizer.decode([i]), v)  # two tokens of one text (a lone byte): the likelier
        assert top == pytest.approx(want, abs=1e-4)
        assert lp["token_logprobs"][k] == max(top.values())
    assert lp["text_offset"][0] == len(prompt) and lp["text_offset"] == sorted(lp["text_offset"])


def test_a_prompt_scored_only_may_fill_the_context(app, reference):
    """echo with max_tokens 0 generates nothing, so a prompt as long as the context is scored whole."""
    server, client = app
    line = server.tokenizer.encode("def push(self, item):\n", add_special_tokens=False)
    ids = (line * 20)[:server.config.max_seq_len]
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(reference[1](ids)[0], abs=1e-4)
    assert r.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("change,param", [
    ({"logprobs": "1"}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logprobs": openai_api.MAX_LOGPROBS + 1}, "logprobs"), ({"logprobs": 1.5}, "logprobs"),
    ({"echo": "true"}, "echo"), ({"echo": 1}, "echo"),
    ({"echo": True, "stream": True}, "echo"), ({"logprobs": 1, "stream": True}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"), ({"prompt": [1, 10**6]}, "prompt"), ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1], 2]}, "prompt"), ({"prompt": ["x"] * (openai_api.MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": [[1, 2], [3] * 100]}, "prompt"),
])
def test_bad_echo_logprobs_and_prompts_get_400_naming_them(app, change, param):
    """Each was once taken as something else (an ignored logprobs, "echo": "true" as true) or reached the
    worker; now a 400 names the parameter, and the server goes on."""
    _, client = app
    r = client.post("/v1/completions", json={"prompt": "def", "max_tokens": 2, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/v1/completions", json={"prompt": "def", "max_tokens": 2}).status_code == 200
