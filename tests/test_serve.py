"""Tests of serve.py through the openai client and plain HTTP, against a server started on 127.0.0.1: results
equal to the one-shot CLI's, streaming, OpenAI-style refusals the server survives, the API key, the context
limit, clients leaving mid-stream, and a burst of 50 concurrent requests. Batching faults are held to in this
process, through Starlette's TestClient, with the worker held so that requests share a batch."""

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai  # a test dependency (requirements-test.txt): missing, these tests fail, never skip
import psutil
import pytest
import torch

import serve
from config import LoadConfig, SampleConfig, ServeConfig
from llm.base.errors import ConfigError, RunFailure
from llm.generate import openai_api, worker
from llm.generate.engine import generate, generate_text
from llm.generate.inference import load_for_inference
from llm.tokens.tokenizer import stop_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(ckpt: str, *flags, log: str = os.devnull):
    """The server in a subprocess, once it answers, its stderr into the file `log`; (process, base URL)."""
    port = free_port()
    with open(log, "w") as err:  # a file, not a pipe: a test reads it while the server runs, and it never fills
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve.py"), ckpt, "--port", str(port), *flags],
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/models", timeout=1)
            return proc, url
        except urllib.error.HTTPError:  # answering (401 with an API key)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(open(log).read())
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "stderr.log")
    proc, url = start(tiny_checkpoint, log=log)
    proc.log = log  # what the server printed: no traceback for anything a client sends
    yield proc, url, openai.OpenAI(base_url=url, api_key="unused")
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    """What the one-shot CLI prints for a prompt (greedy): the engine's text, in this process."""
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    return lambda prompt, n: generate_text(model, tok, [prompt], SampleConfig(temperature=0, max_new_tokens=n))[0][0]


def post(url: str, path: str, body: bytes, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_and_greedy_completions_equal_the_cli(server, expected):
    _, _, client = server
    (model,) = client.models.list().data
    assert model.id == "run1"
    for prompt in ("def push(self", "import os\n"):
        r = client.completions.create(model="run1", prompt=prompt, max_tokens=10, temperature=0)
        assert r.choices[0].text == expected(prompt, 10) and r.usage.completion_tokens <= 10
        assert r.choices[0].finish_reason in ("stop", "length") and r.object == "text_completion"


def test_streams_give_the_same_text_as_whole_answers(server):
    _, _, client = server
    whole = client.completions.create(model="run1", prompt="class Stack", max_tokens=12, temperature=0)
    parts = [c.choices[0].text for c in client.completions.create(model="run1", prompt="class Stack", max_tokens=12,
                                                                  temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].text and len(parts) > 2
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="run1", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="run1", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_seeded_samples_repeat_and_stop_strings_end_them(server):
    _, _, client = server
    ask = lambda **kw: client.completions.create(model="run1", prompt="def", max_tokens=12, **kw)  # noqa: E731
    a, b = ask(temperature=0.9, seed=3, n=2), ask(temperature=0.9, seed=3, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    full = ask(temperature=0).choices[0].text
    cut = ask(temperature=0, stop=[full[3:6]]).choices[0]
    assert cut.text == full[:full.index(full[3:6])] and cut.finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), "model"),
    (json.dumps({"model": "run1", "prompt": "x", "max_tokens": 10**6}).encode(), "max_tokens"),
    (json.dumps({"model": "run1", "prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": "run1", "prompt": 5}).encode(), "prompt"),
    (json.dumps({"model": "run1", "prompt": "x", "stop": 7}).encode(), "stop"),
    (json.dumps([1, 2]).encode(), None),
    (json.dumps({"prompt": "x", "seed": 1e30}).encode(), "seed"),
    (json.dumps({"prompt": "x", "max_tokens": float("inf")}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_completion_tokens": float("inf")}).encode(), "max_completion_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": float("nan")}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": float("nan")}).encode(), "temperature"),
    (json.dumps({"prompt": "x", "top_p": float("nan")}).encode(), "top_p"),
    (json.dumps({"prompt": "x", "top_k": "5"}).encode(), "top_k"),
    (json.dumps({"prompt": "x", "n": True}).encode(), "n"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"prompt": "x", "stop": "y" * (openai_api.MAX_STOP_CHARS + 1)}).encode(), "stop"),
    (json.dumps({"prompt": "\ud800"}).encode(), "prompt"),
    (b'{"prompt": ' + b"[" * 100_000, None),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (json.dumps({"prompt": "x", "best_of": 10**9}).encode(), "best_of"),
    (json.dumps({"prompt": "x", "logit_bias": "garbage"}).encode(), "logit_bias"),
    (json.dumps({"prompt": "x", "logit_bias": {"12": 100}}).encode(), "logit_bias"),
    (json.dumps({"prompt": "x", "presence_penalty": float("nan")}).encode(), "presence_penalty"),
    (json.dumps({"prompt": "x", "frequency_penalty": 1.5}).encode(), "frequency_penalty"),
    (json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}).encode(), "stream_options"),
], ids=["malformed", "unknown-model", "max-tokens", "negative-temperature", "prompt-type", "stop-type", "a-list",
        "huge-seed", "infinite-max-tokens", "infinite-max-completion-tokens", "nan-max-tokens", "nan-temperature",
        "nan-top-p", "text-top-k", "bool-n", "text-stream", "long-stop", "lone-surrogate", "deep-nesting",
        "5000-digit-integer", "best-of", "garbage-logit-bias", "logit-bias", "nan-presence-penalty",
        "frequency-penalty", "stream-options-unstreamed"])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, param):
    """From huge-seed on, each once got a 500 (an overflow, a RecursionError, a tokenizer's TypeError on a
    lone surrogate), a 400 naming no parameter (NaN), or was served against its meaning (a 1 MB stop string
    held the worker a minute, "stream": "yes" streamed)."""
    proc, url, client = server
    status, answer = post(url, "/completions", body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    assert proc.poll() is None and client.completions.create(model="run1", prompt="x", max_tokens=2).choices


def test_neutral_values_of_unimplemented_parameters_are_accepted(server):
    """A client sending OpenAI's defaults (best_of equal to n, no bias, zero penalties) is served, not
    refused."""
    _, url, _ = server
    status, answer = post(url, "/completions", json.dumps({
        "prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2, "logit_bias": {}, "presence_penalty": 0,
        "frequency_penalty": 0.0, "suffix": None}).encode())
    assert status == 200 and len(answer["choices"]) == 2


def test_chat_logprobs_follow_openais_chat_contract(server, tiny_checkpoint):
    """logprobs: true and top_logprobs: k give, for each token of the reply, its text, log-probability and
    bytes, and its k likeliest tokens, as a float64 forward of the same weights scores them; the tokens join
    to the reply. Values outside the contract are refused by name (they were ignored: 200 and no logprobs)."""
    from llm.tokens.tokenizer import chat_prompt_ids
    proc, url, client = server
    messages = [{"role": "user", "content": "def push(self, item):"}]
    r = client.chat.completions.create(model="run1", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content, reply = r.choices[0].logprobs.content, r.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == reply and len(content) == \
        r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # its end token is no part of the reply
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    prompt = chat_prompt_ids(tok, messages)
    ids = prompt + generate(model, [prompt], SampleConfig(temperature=0, max_new_tokens=8), stop_ids(tok))[0]
    with torch.no_grad():
        logp = model.double()(torch.tensor([ids]))[0][0].log_softmax(-1)
    for k, entry in enumerate(content):
        at = logp[len(prompt) + k - 1]
        assert abs(entry.logprob - at[ids[len(prompt) + k]].item()) < 1e-4
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in at.topk(3).indices.tolist()]
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest is the one chosen
        assert entry.token == tok.decode([ids[len(prompt) + k]])
    assert client.chat.completions.create(model="run1", messages=messages, max_tokens=2).choices[0].logprobs is None
    for bad, param in (({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "top_logprobs": 10**9}, "top_logprobs"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "stream": True}, "logprobs")):
        status, answer = post(url, "/chat/completions", json.dumps({"messages": messages, **bad}).encode())
        assert status == 400 and answer["error"]["param"] == param, bad


def test_a_stream_ends_with_its_usage_when_asked(server):
    """stream_options.include_usage: a last chunk with no choices and the usage a whole answer gives; every
    chunk before it carries usage: null."""
    _, _, client = server
    messages = [{"role": "user", "content": "class Stack"}]
    whole = client.chat.completions.create(model="run1", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="run1", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(model="run1", prompt="x", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert plain[-1].usage.prompt_tokens == 1 and plain[-1].usage.completion_tokens <= 3


def test_a_prompt_past_the_context_names_it_and_lm_evals_max_length(server, tiny_checkpoint):
    """lm-eval's default max_length (2048) overfills a shorter context and shows only "400 Client Error": the
    answer, and the server's log, name the context and the max_length to pass."""
    proc, url, _ = server
    cfg = load_for_inference(tiny_checkpoint, "cpu")[2]
    ids = [5] * (cfg.max_seq_len + 3)
    status, answer = post(url, "/completions", json.dumps({"prompt": ids, "echo": True, "max_tokens": 0,
                                                           "logprobs": 1}).encode())
    assert status == 400 and answer["error"]["param"] == "prompt"
    message = answer["error"]["message"]
    assert f"context is {cfg.max_seq_len}" in message and f"max_length={cfg.max_seq_len}" in message
    time.sleep(0.2)
    assert f"max_length={cfg.max_seq_len}" in open(proc.log).read()


def test_an_abandoned_request_frees_its_rows(app, monkeypatch):
    """A client that leaves a non-streamed request (a timeout, a closed notebook) must stop its rows, as a
    stream's are stopped: the engine, held generating, is told the rows are cancelled once the socket closes.
    """
    import uvicorn
    server, _ = app
    told = threading.Event()

    def engine(model, prompts, settings, *args, cancelled=None, **kwargs):
        deadline = time.time() + 30
        while time.time() < deadline and not all(cancelled(i) for i in range(len(prompts) * 16)):
            time.sleep(0.01)
        told.set()
        return [[] for _ in range(len(prompts) * 16)]
    monkeypatch.setattr(worker, "generate", engine)
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(serve.app_for(server), port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        while not web.started:
            time.sleep(0.05)
        body = json.dumps({"prompt": "def", "n": 16, "max_tokens": 50}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
        started = time.time()
        sock.close()
        assert told.wait(30) and time.time() - started < 20
    finally:
        web.should_exit = True
        thread.join(10)


def test_a_request_past_the_context_stops_there(server, tiny_checkpoint):
    """max_tokens up to the context is accepted; the answer ends where the context does, as 'length'."""
    _, _, client = server
    model, tok, cfg, _ = load_for_inference(tiny_checkpoint, "cpu")
    ids = tok.encode("def push(self, item): return item\n" * 20, add_special_tokens=False)[:cfg.max_seq_len - 6]
    prompt = tok.decode(ids)
    alone = generate(model, [ids], SampleConfig(temperature=0, max_new_tokens=cfg.max_seq_len), stop_ids(tok))[0]
    r = client.completions.create(model="run1", prompt=prompt, max_tokens=cfg.max_seq_len, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(alone)
    assert r.choices[0].finish_reason == ("length" if len(alone) == 6 else "stop")


def test_the_api_key_is_required_when_set(tiny_checkpoint):
    proc, url = start(tiny_checkpoint, "--api_key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        assert post(url, "/completions", b'{"prompt": "x"}')[0] == 401
        good = openai.OpenAI(base_url=url, api_key="sesame")
        assert good.completions.create(model="run1", prompt="x", max_tokens=2).choices
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_burst_of_requests_is_batched_correctly_and_memory_stays_flat(server, expected):
    """50 concurrent greedy requests, several prompts: each answer must be its own prompt's (rows never mix),
    a client leaving mid-stream frees its row, and the server's memory is flat after the burst."""
    proc, url, client = server
    prompts = ["def ", "class A", "import os", "for name in", "return n"]
    want = {p: expected(p, 8) for p in prompts}
    def ask(prompt):
        return client.completions.create(model="run1", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(ask, prompts * 2))  # warm: the engine's first batches of each size
        rss = psutil.Process(proc.pid).memory_info().rss
        start = time.time()
        answers = list(pool.map(ask, prompts * 10))
        seconds = time.time() - start
    assert answers == [want[p] for p in prompts * 10]
    stream = client.completions.create(model="run1", prompt="def", max_tokens=60, temperature=0.8, stream=True)
    next(iter(stream))
    stream.close()  # gone mid-stream
    assert ask("def ") == want["def "]
    grown = psutil.Process(proc.pid).memory_info().rss - rss
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB more after the burst"
    print(f"50 requests in {seconds:.2f} s: {50 / seconds:.1f} requests/s, {50 * 8 / seconds:.0f} tokens/s")


def test_a_stop_string_on_the_last_allowed_token_is_a_stop(server):
    """The server once derived finish_reason from the length alone, so a stop string completed by the last
    token max_tokens allows was reported as "length"; the engine now says why each sequence ended."""
    _, _, client = server
    ask = lambda prompt, n, **kw: client.completions.create(model="run1", prompt=prompt, max_tokens=n,  # noqa: E731
                                                           temperature=0, **kw).choices[0]
    for prompt in ("class Stack", "return n", "import os\n", "def push(self"):
        for n in (2, 3, 4, 5, 6):
            before, whole = ask(prompt, n - 1).text, ask(prompt, n)
            last = whole.text[len(before):]  # the text of the last token, found nowhere before it
            if whole.finish_reason == "length" and before and last.strip() and whole.text.find(last) == len(before):
                cut = ask(prompt, n, stop=[last])
                assert cut.text == before and cut.finish_reason == "stop"
                chunks = list(client.completions.create(model="run1", prompt=prompt, max_tokens=n, temperature=0,
                                                        stop=[last], stream=True))
                assert chunks[-1].choices[0].finish_reason == "stop"
                return
    pytest.fail("no prompt's greedy text ends in a token whose text is new; try other prompts")


def test_a_port_out_of_range_is_one_line(tiny_checkpoint):
    """`serve.py --port 70000` once loaded the model and ended in an OverflowError traceback. ServeConfig now
    refuses it, as every setting is refused, before the model loads."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "serve.py"), tiny_checkpoint, "--port", "70000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: port=70000 is invalid") and "65535" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_the_flags_are_loadconfigs_and_serveconfigs():
    """serve.py declares no flag of its own: the checkpoint (a bare word) and the loading flags fill
    LoadConfig, the server's fill ServeConfig, with the generator's words and checks; an older --compile word
    still works."""
    load, serving = serve.parse_args(["runs/x", "--best", "--base", "hf:A/B", "--device", "cpu", "--compile", "false",
                                      "--quantize", "int8", "--max_seq_len", "64", "--host", "0.0.0.0", "--port",
                                      "8080", "--api_key", "k", "--name", "m", "--max_batch", "3"])
    assert load == LoadConfig(checkpoint="runs/x", best=True, base="hf:A/B", device="cpu", compile="off",
                              quantize="int8", max_seq_len=64)
    assert serving == ServeConfig(host="0.0.0.0", port=8080, api_key="k", name="m", max_batch=3)
    assert serve.parse_args([]) == (LoadConfig(), ServeConfig())
    assert serve.parse_args(["--compile", "true"])[0].compile == "reduce-overhead"
    for argv, named in ((["--temperature", "1"], "--temperature"), (["--compile", "fast"], "fast"),
                        (["--max_batch", "0"], "max_batch=0"), (["a", "b"], "b")):
        with pytest.raises(ConfigError, match=named):
            serve.parse_args(argv)


def test_an_unknown_flag_is_one_line_and_exit_2():
    """A flag serve.py does not take (a sampling one) is refused by name, before the model loads: exit 2."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "serve.py"), "--temperature", "0.5"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown setting --temperature") and "Traceback" not in \
        r.stderr and r.stderr.count("\n") == 1, r.stderr


def connect(url: str) -> socket.socket:
    host, port = url.split("//")[1].split("/")[0].split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def head(length: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n"
            .encode())


def test_a_body_over_the_bound_is_refused_before_it_is_read(server):
    """A 50 MB body was once read whole (80 s, 3 GB resident) before its 400; a declared length past MAX_BODY
    is now refused at once, with nothing of the body sent."""
    _, url, _ = server
    with connect(url) as s:
        s.sendall(head("Content-Length: 50000000"))
        assert select.select([s], [], [], 10)[0], "no answer without the body"
        assert s.recv(4096).startswith(b"HTTP/1.1 413")


def test_a_chunked_body_is_cut_at_the_bound(server):
    """A chunked body has no length to check first; the server once buffered all of it. Now the answer is a
    413 as soon as MAX_BODY bytes have come, while the client is still sending."""
    proc, url, client = server
    piece, sent = b"x" * 2**16, 0
    with connect(url) as s:
        s.sendall(head("Transfer-Encoding: chunked"))
        while sent < 8 * serve.MAX_BODY and not select.select([s], [], [], 0.01)[0]:
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        assert sent < 8 * serve.MAX_BODY, "no answer while the body kept coming"
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert client.completions.create(model="run1", prompt="x", max_tokens=2).choices


def test_a_client_sending_less_than_its_length_leaves_no_traceback(server):
    """A client that closed after part of its declared body once left an 'Exception in ASGI application'
    traceback in the server's log."""
    proc, url, client = server
    with connect(url) as s:
        s.sendall(head("Content-Length: 100") + b'{"prompt": ')
    time.sleep(0.5)  # the server sees the connection close
    assert client.completions.create(model="run1", prompt="x", max_tokens=2).choices
    assert "Traceback" not in open(proc.log).read()


# ----------------------------------------------------------------------------- batches, in this process

def in_one_batch(app, monkeypatch, bodies: list[dict], fail_on: list[int] | None = None) -> list:
    """(status, answer) of each body, posted while the worker is held in a batch of its own, so that every
    body it queues joins the next batch; the engine fails any batch holding the prompt ids fail_on."""
    server, client = app
    entered, release, real = threading.Event(), threading.Event(), worker.generate

    def engine(model, prompts, *args, **kwargs):
        if not entered.is_set():
            entered.set()
            release.wait(60)
        if fail_on in prompts:
            raise RunFailure("out of memory (injected)")
        return real(model, prompts, *args, **kwargs)
    monkeypatch.setattr(worker, "generate", engine)

    def ask(body):
        r = client.post("/v1/completions", json={"max_tokens": 4, "temperature": 0, **body})
        return r.status_code, r.json()
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        held = pool.submit(ask, {"prompt": "def"})
        assert entered.wait(60)
        answers = [pool.submit(ask, body) for body in bodies]
        while sum(a.done() for a in answers) + server.worker.jobs.qsize() < len(bodies):
            time.sleep(0.01)  # each answered at once, or waiting for the next batch
        release.set()
        assert held.result()[0] == 200
        return [a.result() for a in answers]


def test_a_bad_seed_never_fails_its_batch(app, monkeypatch):
    """"seed": 1e30 once reached the engine and failed every request of its batch with a 500; values are now
    checked before a request joins a batch."""
    (good, good_body), (bad, bad_body) = in_one_batch(app, monkeypatch, [{"prompt": "class"},
                                                                         {"prompt": "import", "seed": 1e30}])
    assert good == 200 and good_body["choices"][0]["finish_reason"] in ("stop", "length")
    assert bad == 400 and bad_body["error"]["param"] == "seed"


def test_a_request_the_engine_fails_fails_alone(app, monkeypatch):
    """When the engine refused a batch (memory, say), every request in it got the 500; the batch is now
    retried one request at a time, and only the one that fails alone gets the error."""
    server, _ = app
    poison = server.tokenizer.encode("import os", add_special_tokens=False)
    (good, good_body), (bad, bad_body) = in_one_batch(app, monkeypatch, [{"prompt": "class", "n": 2},
                                                                         {"prompt": "import os"}], poison)
    assert good == 200 and len(good_body["choices"]) == 2
    assert bad == 500 and "injected" in bad_body["error"]["message"]


def test_completions_of_a_chat_model_end_at_im_end_too(chat_stopper):
    """/v1/completions on a chat-trained model once printed <|im_end|> as text and went on: every route ends
    where the model ends its reply."""
    from starlette.testclient import TestClient
    server = serve.Server(*serve.parse_args([str(chat_stopper), "--device", "cpu", "--compile", "off"]))
    body = {"prompt": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 12,
            "temperature": 0}
    with TestClient(serve.app_for(server)) as client:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "OK" and choice["finish_reason"] == "stop"


def test_a_chat_reply_ends_at_im_end_with_no_stop_in_the_request(chat_stopper):
    """/v1/chat/completions must stop where a chat-trained model ends its reply, at <|im_end|>, with no stop
    in the request: "OK" with finish_reason "stop", whole or streamed, not "OK<|im_end|>OK..." cut at
    max_tokens."""
    from starlette.testclient import TestClient
    server = serve.Server(*serve.parse_args([str(chat_stopper), "--device", "cpu", "--compile", "off"]))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0}
    with TestClient(serve.app_for(server)) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    assert whole["message"]["content"] == "OK" and whole["finish_reason"] == "stop"
    chunks = [json.loads(l[6:])["choices"][0] for l in lines if l.startswith("data: {")]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "OK" and chunks[-1]["finish_reason"] == "stop"
