"""The chat page serve.py gives at /, in a real headless browser (Debian's chromium and chromium-driver,
driven by selenium) against the server running in this process: the page asks for the API key and sends it,
shows the model's name, step and validation bits per byte, streams a chat reply as it is generated, and Stop
ends the request: the page goes idle, no more text arrives, and the server ends that generation early (the
client's disconnect cancels its row). Raw completion for the same model too. The browser tests are skipped
where no browser is installed; what the page reads from the API (the key, the step and bits per byte, the
page's policy) is checked without one."""

import json
import os
import re
import shutil
import socket
import threading
import time

import pytest
import torch

import serve
from conftest import save_model
from llm.generate import worker

KEY = "sesame"
MAX_TOKENS = 1500  # far more than a reply gets before Stop: only a cancelled generation ends early
READ_PAUSE_S = 0.02  # the engine reads every 8 tokens; pausing each read makes a reply take seconds, not ms


@pytest.fixture(scope="module")
def looper(tmp_path_factory, tiny_config, tiny_checkpoint):
    """A run whose model writes "abab..." forever, whatever the prompt (never an end token), with a long
    context and one evaluation record: every hidden state is its token's one-hot embedding, which the head
    maps on."""
    from tokenizers import Tokenizer

    from modern_llm import Transformer
    tok_path = os.path.join(tiny_checkpoint, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False, max_seq_len=2048)
    model = Transformer(cfg)
    state = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():  # blocks that add nothing
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                value.zero_()
        embed, head = state["embed_tokens.weight"], state["lm_head.weight"]
        embed[:, 0], embed[a], embed[b] = 1, torch.eye(cfg.hidden_size)[1], torch.eye(cfg.hidden_size)[2]
        head[a, 0] = head[b, 1] = head[a, 2] = 10  # any token -> a -> b -> a; sharp enough that sampling agrees
    run = tmp_path_factory.mktemp("looper") / "looper"
    path = save_model(run, 300, model, tok_path)
    with open(run / "metrics.jsonl", "w") as f:
        for step, bpb in ((300, 0.8125), (600, 0.5)):  # an evaluation after the checkpoint is not its own
            f.write(json.dumps({"kind": "eval", "step": step, "val_loss": 1.5, "val_ppl": 4.5, "val_bpb": bpb}) + "\n")
    return path


@pytest.fixture(scope="module")
def live(looper):
    """The server (with an API key) on a free port of 127.0.0.1, in a thread of this process: (Server, page
    URL)."""
    uvicorn = pytest.importorskip("uvicorn")
    server = serve.Server(*serve.parse_args([str(looper), "--device", "cpu", "--compile", "off", "--api_key", KEY]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(serve.app_for(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not web.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    assert web.started, "the server did not start"
    yield server, f"http://127.0.0.1:{port}/"
    web.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through its driver; skipped, saying what to install, where either is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="the page's tests need selenium: pip "
                                                                 "install -r requirements-test.txt")
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


@pytest.fixture
def spy(monkeypatch):
    """Each engine call the server makes: its `cancelled` answers and its sequences' lengths once it returns.
    Each read pauses READ_PAUSE_S, so that a reply streams for seconds."""
    calls, real = [], worker.generate

    def engine(*args, cancelled=None, **kwargs):
        call = {"cancelled": False, "lengths": None, "done": threading.Event()}
        calls.append(call)

        def asked(i):
            time.sleep(READ_PAUSE_S)
            call["cancelled"] |= cancelled(i)
            return cancelled(i)
        out = real(*args, cancelled=asked, **kwargs)
        call["lengths"] = [len(o) for o in out]
        call["done"].set()
        return out
    monkeypatch.setattr(worker, "generate", engine)
    return calls


def test_models_and_the_page_follow_the_api_rules(looper):
    """/v1/models needs the key like every API route and gives what the page shows: the checkpoint's step and
    the validation bits per byte of the run's evaluation at that step (not a later one). The page holds no
    secret; it is served with a policy that lets it load and call nothing but this server, and links nothing
    outside."""
    from starlette.testclient import TestClient
    server = serve.Server(*serve.parse_args([str(looper), "--device", "cpu", "--compile", "off", "--api_key", KEY]))
    with TestClient(serve.app_for(server)) as client:
        refused = client.get("/v1/models")
        (model,) = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
        page = client.get("/")
    assert refused.status_code == 401 and model["id"] == "looper" and model["chat"] is True
    assert (model["step"], model["val_bpb"], model["max_model_len"]) == (300, 0.8125, 2048)
    policy = page.headers["content-security-policy"]
    assert page.status_code == 200 and "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert KEY not in page.text and not re.search(r"""(src|href|action)\s*=\s*["']?[a-z]*:?//""", page.text)


def wait(chrome, condition, seconds: float = 10):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(chrome, seconds, poll_frequency=0.05).until(lambda d: condition())


def open_page(chrome, url: str):
    """The page, loaded with no key kept from before, then the API key typed into it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    chrome.get(url)
    chrome.execute_script("localStorage.clear()")
    chrome.refresh()
    find = lambda id_: chrome.find_element(By.ID, id_)  # noqa: E731
    wait(chrome, lambda: "API key" in find("status").text)  # refused without it: the page says what it needs
    find("key").send_keys(KEY, Keys.TAB)
    wait(chrome, lambda: find("status").text == "idle")
    return find


def set_field(find, name: str, value):
    find(name).clear()
    find(name).send_keys(str(value))


def test_the_page_streams_a_reply_and_stop_ends_its_generation(browser, live, spy):
    """A reply must appear while it is generated; Stop must return the page to idle at once, no text may
    arrive after it, and the server must end that generation well before its max_tokens (it once ran a gone
    client's row to its end)."""
    server, url = live
    find = open_page(browser, url)
    assert find("model").text == "looper"
    assert "step 300" in find("facts").text and "0.8125" in find("facts").text
    assert find("mode").get_attribute("value") == "chat"  # the tokenizer has the chat tokens
    set_field(find, "max_tokens", MAX_TOKENS)
    find("prompt").send_keys("hello")
    find("send").click()
    reply = lambda: browser.execute_script(  # noqa: E731
        "const r = document.querySelectorAll('#log .assistant .content'); return r.length ? r[r.length - 1]"
        ".textContent : ''")
    wait(browser, lambda: len(reply()) >= 40)
    assert find("status").get_attribute("data-state") == "busy" and reply().startswith("abab")
    find("stop").click()
    wait(browser, lambda: find("status").get_attribute("data-state") == "idle", 2)
    shown = reply()
    assert spy[-1]["done"].wait(5), "the generation went on after Stop"
    assert spy[-1]["cancelled"] and spy[-1]["lengths"][0] < MAX_TOKENS / 2
    time.sleep(0.3)
    assert reply() == shown and "stopped" in find("status").text
    find("clear").click()
    assert browser.execute_script("return document.querySelectorAll('#log .entry').length") == 0


def test_raw_completion_from_the_page(browser, live, spy):
    """In completion mode the page sends the prompt to /v1/completions and shows it with the continuation."""
    server, url = live
    find = open_page(browser, url)
    from selenium.webdriver.support.ui import Select
    Select(find("mode")).select_by_value("complete")
    set_field(find, "max_tokens", 8)
    find("prompt").send_keys("x")
    find("send").click()
    wait(browser, lambda: find("status").get_attribute("data-state") == "idle" and "max tokens" in find("status").text)
    shown = browser.execute_script("return document.querySelector('#log "
                                   ".completion .continuation').textContent")
    assert shown == "abababab" and spy[-1]["lengths"] == [8] and not spy[-1]["cancelled"]
