"""Tests of text_generator.py: loading for inference, the run list, the REPL and the one-shot CLI.

The model and tokenizer are the tiny checkpoint of conftest.py; CLI tests run the script in a subprocess.
"""

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace

import pytest
import torch

import text_generator as tg
from config import LoadConfig, SampleConfig
from conftest import save_model
from llm.base.errors import ConfigError
from llm.formats.checkpoint import save_checkpoint
from llm.formats.loading import read_model
from llm.generate.engine import generate_text
from llm.generate.inference import load_for_inference
from llm.tokens.tokenizer import chat_prompt_ids
from modern_llm import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "text_generator.py")
GREEDY = SampleConfig(temperature=0.0, max_new_tokens=12, seed=0)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tok, cfg, path = load_for_inference(ckpt, "cpu")
    return model, tok


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_default_run_folder_and_list(ckpt, tmp_path, monkeypatch, capsys):
    """No argument loads runs/default's newest checkpoint; --list shows step, size and the eval figures."""
    run = tmp_path / "runs" / "default"
    shutil.copytree(os.path.dirname(os.path.dirname(ckpt)), run)
    monkeypatch.chdir(tmp_path)
    *_, path = load_for_inference("", "cpu")
    assert os.path.samefile(path, run / "checkpoints" / "step_000010")
    assert tg.main(["--list"]) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[:2] == ["default", "10"] and line[4:6] == ["2.1250", "1.0625"]


def test_bad_checkpoints_exit_2(ckpt, tmp_path, capsys):
    """A corrupt model.safetensors or a wrong path gives one error line naming the file, and exit code 2."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad")
    for path, words in ((bad, ["model.safetensors", "corrupt"]), (tmp_path / "nope", ["no checkpoint"])):
        with pytest.raises(SystemExit) as e:
            tg.main([str(path), "--prompt", "x"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ")
        assert all(w in err[0] for w in words) and "gpu_training_optimized.py" in err[0]
    with pytest.raises(SystemExit) as e:
        tg.main([str(ckpt), "--temperature", "-1"])
    assert e.value.code == 2 and "temperature" in capsys.readouterr().err


def test_loading_and_sampling_flags_fill_their_own_configs():
    """text_generator.py declares only its actions by hand: the checkpoint (a bare word) and the loading flags
    fill LoadConfig, the sampling flags SampleConfig, each checked by its own rules; `set` changes only the
    latter."""
    load, settings, extras = tg.parse_args(["runs/x", "--best", "--base", "b", "--device", "cpu", "--compile",
                                            "max-autotune", "--quantize", "int8", "--max_seq_len", "64",
                                            "--temperature", "0.5", "--top_k", "7", "--top_p", "0.9",
                                            "--repetition_penalty", "1.2", "--num_return_sequences", "2", "--seed",
                                            "3", "--max_new_tokens", "9", "--stop", "\\n", "--prompt", "p"])
    assert load == LoadConfig(checkpoint="runs/x", best=True, base="b", device="cpu", compile="max-autotune",
                              quantize="int8", max_seq_len=64)
    assert settings == SampleConfig(temperature=0.5, top_k=7, top_p=0.9, repetition_penalty=1.2,
                                    num_return_sequences=2, seed=3, max_new_tokens=9, stop=["\n"])
    assert extras.prompt == "p" and not extras.list
    assert tg.parse_args([])[:2] == (LoadConfig(), SampleConfig())
    assert [tg.parse_args(["--compile", w])[0].compile for w in ("true", "false")] == ["reduce-overhead", "off"]
    assert set(tg.SETTABLE) == {f.name for f in fields(SampleConfig)} and not set(tg.SETTABLE) & {
        f.name for f in fields(LoadConfig)}
    for argv, named in ((["--checkpoint", "x"], "--checkpoint"), (["--compile", "fast"], "fast"),
                        (["--max_seq_len", "-1"], "max_seq_len"), (["--port", "1"], "--port")):
        with pytest.raises(ConfigError, match=named):
            tg.parse_args(argv)


def test_a_config_file_may_name_the_checkpoint(tmp_path):
    """A --config file's checkpoint is the positional word it stands for; the command line's other flags apply
    on top."""
    (tmp_path / "g.json").write_text('{"checkpoint": "runs/y", "compile": "off", "temperature": 0.1}')
    load, settings, _ = tg.parse_args(["--config", str(tmp_path / "g.json"), "--temperature", "0.3"])
    assert (load.checkpoint, load.compile, settings.temperature) == ("runs/y", "off", 0.3)


def test_an_unknown_flag_is_one_line_and_exit_2(capsys):
    """A flag the generator does not take (the server's --port) is refused by name with exit code 2, before
    anything loads."""
    with pytest.raises(SystemExit) as e:
        tg.main(["--port", "8000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: unknown setting --port")


def test_settings_are_validated():
    """`set` parses by the field's type and reruns SampleConfig's checks; unknown names list valid ones."""
    s = tg.with_setting(SampleConfig(), "top_k", "7")
    assert s.top_k == 7 and tg.with_setting(s, "stop", "'\\n\\n' END").stop == ["\n\n", "END"]
    for name, value, msg in (("bogus", "1", "valid names are: "), ("top_p", "2", "top_p"), ("top_k", "x", "int")):
        with pytest.raises(ValueError, match=msg):
            tg.with_setting(s, name, value)


def test_loads_a_hugging_face_export(loaded, ckpt, tmp_path):
    """A folder written by export_hf.py loads (renamed weights, tied head) and gives the same logits."""
    import export_hf
    model, _ = loaded
    export_hf.export(ckpt, str(tmp_path / "hf"))
    hf_model, tok, cfg, path = load_for_inference(str(tmp_path / "hf"), "cpu")
    ids = torch.tensor([ids_of(tok, "def push(self, item):")])
    assert path == str(tmp_path / "hf") and cfg.max_seq_len == model.config.max_seq_len
    assert torch.allclose(hf_model(ids)[0], model(ids)[0], atol=1e-5)


def cli(args, cwd, stdin=""):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, SCRIPT, *args], input=stdin, capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.mark.slow
def test_one_shot_and_stdin_prompts(loaded, ckpt, tmp_path):
    """--prompt prints exactly the completion; stdin lines are prompts, one completion each."""
    model, tok = loaded
    expect = [generate_text(model, tok, [p], replace(GREEDY, max_new_tokens=6))[0][0] for p in ("def", "x =")]
    args = [ckpt, "--temperature", "0", "--max-new-tokens", "6"]
    one = cli(args + ["--prompt", "def"], tmp_path)
    assert one.returncode == 0 and one.stdout == expect[0] + "\n" and "tokens/s" in one.stderr
    many = cli(args, tmp_path, stdin="def\n\nx =\n")
    assert many.returncode == 0 and many.stdout == expect[0] + "\n" + expect[1] + "\n"


# text_generator.py with its compile held back until the file named first on its command line exists: every
# torch.compile waits for it. It says on stderr when generate() takes the compiled step and when the
# background compile's thread has ended.
HELD_COMPILE = """
import os, runpy, sys, threading, time
import torch
from llm.generate import decode_compile, engine
release, sys.argv = sys.argv[1], sys.argv[2:]  # then the script and its arguments
compile_ = torch.compile
def held(*args, **kwargs):
    while not os.path.exists(release):
        time.sleep(0.05)
    return compile_(*args, **kwargs)
torch.compile = held
slot = engine.compiled_slot
def used(model, batch):
    print("[compiled step used]", file=sys.stderr, flush=True)
    return slot(model, batch)
engine.compiled_slot = used
start = decode_compile.compile_in_background
def watched(*args, **kwargs):
    thread = start(*args, **kwargs)
    def report():
        thread.join()
        print(f"[compile ended: {thread.error!r}]", file=sys.stderr, flush=True)
    threading.Thread(target=report, daemon=True).start()
    return thread
decode_compile.compile_in_background = watched
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Talk:
    """A process whose stdout and stderr are read as they come, by two threads."""

    def __init__(self, args, cwd):
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT})
        self.out, self.err = [], []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, i=into: i.extend(iter(lambda: s.read(1), "")),
                             daemon=True).start()

    def stdout(self) -> str:
        return "".join(self.out)

    def stderr(self) -> str:
        return "".join(self.err)

    def send(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, ready, seconds: float, what: str):
        deadline = time.monotonic() + seconds
        while not ready():
            assert self.proc.poll() is None, f"the process ended ({self.proc.returncode}) before {what}: " \
                                             f"{self.stderr()[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} in {seconds:.0f} s; stderr: {self.stderr()[-2000:]}"
            time.sleep(0.05)


@pytest.mark.slow
def test_the_repl_answers_while_its_decode_step_compiles(loaded, ckpt, tmp_path):
    """A compiling REPL once printed "compiling the decode step..." and waited (22 s on an H200) before its
    first prompt. It now compiles in the background and answers at once, eagerly, with the same tokens. Here
    the compile is held back until the test lets it go: the first reply must come while it is held, and must
    not use the compiled step; once the compile has ended, the next reply must use it, with the same tokens.
    """
    model, tok = loaded
    expect = generate_text(model, tok, ["def"], replace(GREEDY, max_new_tokens=6))[0][0]
    release = tmp_path / "release-the-compile"
    repl = Talk([sys.executable, "-u", "-c", HELD_COMPILE, str(release), SCRIPT, ckpt, "--interactive", "--compile",
                 "true", "--temperature", "0", "--max_new_tokens", "6"], tmp_path)
    try:
        repl.wait_for(lambda: "compiling the decode step in the background" in repl.stderr(), 120, "background compile")
        repl.send("def")
        repl.wait_for(lambda: repl.stderr().count("tokens/s") == 1, 60, "reply while the compile is held back")
        assert expect in repl.stdout()
        assert not release.exists() and "[compile ended" not in repl.stderr()  # the compile is still held back
        assert "[compiled step used]" not in repl.stderr()  # the reply was eager
        assert "compiling the decode step..." not in repl.stderr()  # no compile in front of the REPL
        release.touch()
        repl.wait_for(lambda: "[compile ended" in repl.stderr(), 300, "end of the compile")
        assert "[compile ended: None]" in repl.stderr()  # it compiled, without an error
        replied = len(repl.stdout())
        repl.send("def")
        repl.wait_for(lambda: repl.stderr().count("tokens/s") == 2, 120, "reply after the compile")
        assert "[compiled step used]" in repl.stderr().split("[compile ended")[1]
        assert expect in repl.stdout()[replied:]
        repl.send("quit")
        assert repl.proc.wait(timeout=60) == 0, repl.stderr()
    finally:
        repl.proc.kill()
        repl.proc.wait()


@pytest.mark.slow
def test_a_one_shot_compile_asked_by_name_compiles_first(loaded, ckpt, tmp_path):
    """A one-shot compile asked by name (--compile default) compiles first, as asked, then gives the same
    tokens."""
    model, tok = loaded
    expect = generate_text(model, tok, ["def"], replace(GREEDY, max_new_tokens=6))[0][0]
    one = cli([ckpt, "--compile", "default", "--temperature", "0", "--max_new_tokens", "6", "--prompt", "def"],
              tmp_path)
    assert one.returncode == 0 and one.stdout == expect + "\n" and "compiling the decode step..." in one.stderr


def test_a_reply_given_while_the_decode_step_compiles_exits_without_the_teardown(loaded, ckpt, tmp_path):
    """A prompt piped in is answered eagerly while the decode step compiles in a thread; at the end of stdin
    the interpreter's teardown then stopped that thread inside the compiler: "terminate called without an
    active exception" (exit 134) or a bogus "compiling the decode step failed" warning after the reply, seen
    with a cold compile cache. The script now leaves without the teardown while a compile runs: held here
    until the end, the compile never finishes, no atexit hook runs, and the exit status is the reply's."""
    model, tok = loaded
    expect = generate_text(model, tok, ["def"], replace(GREEDY, max_new_tokens=6))[0][0]
    held = (f"import atexit, runpy, sys, threading; sys.argv = {[SCRIPT, ckpt, '--compile', 'default']!r} + "
            "['--temperature', '0', '--max_new_tokens', '6']; from llm.generate import decode_compile; "
            "decode_compile.compiled_slot = lambda *a: threading.Event().wait(); atexit.register(lambda: "
            "print('teardown', file=sys.stderr)); runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", held], input="def\n", capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == expect + "\n", r.stderr
    assert "compiling the decode step in the background" in r.stderr and "teardown" not in r.stderr


@pytest.mark.slow
def test_repl_covers_every_command(ckpt, tmp_path):
    """Drive the REPL through stdin: every command works, a bad `set` is one error line, quit leaves."""
    script = "\n".join(["help", "settings", "set temperature 0", "set max_new_tokens 5", "set nope 1",
                        "set top_p 7", "greedy def", "sample def", "batch def", "def f", "chat", "hello",
                        "/settings", "/reset", "again", "/plain", "quit", "never reached"]) + "\n"
    r = cli([ckpt, "--interactive", "--seed", "1"], tmp_path, stdin=script)
    assert r.returncode == 0, r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 2 and "valid names are: " in errors[0] and "top_p" in errors[1]
    for expected in ("greedy TEXT", "temperature = 0.0", "max_new_tokens = 5", "--- 4 ---", "chat mode",
                     "(dialogue cleared)", "plain mode", f"checkpoint = {ckpt!r}"):
        assert expected in r.stdout
    assert r.stderr.count("tokens/s") == 6  # greedy, sample, batch, bare line, two chat replies


@pytest.mark.slow
def test_missing_default_checkpoint_cli(tmp_path):
    """With no argument and no runs/default, the real exit code is 2 and the message says how to train."""
    r = cli(["--prompt", "x"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: no checkpoint at runs/default")
    assert "python gpu_training_optimized.py" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_python_api_loads_once_and_generates_like_the_cli(ckpt):
    """TextGenerator: one load, then generate() with the CLI's settings, one prompt or a batch; bad settings
    are refused by name; its load records what was loaded."""
    g = tg.TextGenerator(ckpt, device="cpu", max_new_tokens=6, temperature=0.0)
    assert g.load.checkpoint == ckpt
    one = g.generate("def")
    expected = generate_text(g.model, g.tokenizer, ["def"], replace(GREEDY, max_new_tokens=6))[0][0]
    assert isinstance(one, str) and one == expected
    batch = g.generate(["def", "x ="], max_new_tokens=4)
    assert batch == [generate_text(g.model, g.tokenizer, [p], replace(GREEDY, max_new_tokens=4))[0][0]
                     for p in ("def", "x =")]
    samples = g.generate("import", temperature=1.0, num_return_sequences=3, seed=4)
    assert len(samples) == 3 and samples == g.generate("import", temperature=1.0, num_return_sequences=3, seed=4)
    with pytest.raises(ValueError, match="valid names are"):
        g.generate("def", temprature=0.5)
    with pytest.raises(ValueError, match="top_p"):
        g.generate("def", top_p=2.0)
    reply = g.chat([{"role": "user", "content": "hello"}])
    assert isinstance(reply, str)


def test_chat_replies_end_at_im_end_with_no_stop_setting(chat_stopper, capsys):
    """A chat-trained model ends each reply with <|im_end|>: the REPL's chat and TextGenerator.chat must stop
    there with no stop setting, or the reply runs on into turns the model invents
    ("OK<|im_end|>OK<|im_end|>...")."""
    g = tg.TextGenerator(chat_stopper, device="cpu", compile="off", temperature=0.0, max_new_tokens=12)
    hello = [{"role": "user", "content": "hello"}]
    ok = g.tokenizer.encode("OK<|im_end|>", add_special_tokens=False)
    endless = generate_text(g.model, g.tokenizer, [chat_prompt_ids(g.tokenizer, hello)], g.settings, eos_ids=[])[1]
    assert endless == [(ok * 4)[:12]]  # what the fixture's model writes when nothing stops it
    assert g.chat(hello) == "OK"
    repl = tg.Repl(g.model, g.tokenizer, g.settings)
    repl.chat_turn("hello")
    assert repl.messages[-1] == {"role": "assistant", "content": "OK"} and capsys.readouterr().out == "assistant: OK\n"


@pytest.mark.slow
def test_best_checkpoint_is_listed_and_loaded(ckpt, tmp_path, capsys):
    """--list marks the run's best checkpoint, --best loads it instead of the newest."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(ckpt)), run)
    found = read_model(ckpt)
    for step, loss in ((20, 1.5), (30, 1.9)):
        save_checkpoint(str(run), step, found.state, model_config=found.config, tokenizer_path=found.tokenizer_path,
                        trainer_state={"step": step}, keep=5, val_loss=loss)
    assert tg.main(["--list", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [l.split()[1] for l in lines] == ["10", "20", "30"]
    assert [l.endswith("  best") for l in lines] == [False, True, False]
    *_, newest = load_for_inference(str(run), "cpu")
    *_, best = load_for_inference(str(run), "cpu", best=True)
    assert newest.endswith("step_000030") and best.endswith("step_000020")
    r = cli([str(run), "--best", "--prompt", "x", "--max_new_tokens", "2"], tmp_path)
    assert r.returncode == 0 and "loaded " + best in r.stderr


@pytest.mark.slow
def test_chat_is_offered_only_when_the_tokenizer_has_its_tokens(tmp_path, tiny_config):
    """A model whose tokenizer lacks <|im_start|>/<|im_end|> gets no chat command in help, and `chat` says
    why."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["def f(x): return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    plain.save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_config(vocab_size=plain.get_vocab_size())
    model = Transformer(cfg)
    path = save_model(tmp_path / "run", 1, model, tmp_path / "tokenizer.json")
    r = cli([path, "--interactive"], tmp_path, stdin="help\nchat\nquit\n")
    assert r.returncode == 0 and "  chat " not in r.stdout and "chat needs a model trained on conversations" in r.stderr


@pytest.mark.parametrize("leave", ["quit", "exit", "/quit"])
def test_quit_leaves_the_repl_in_chat_mode_too(ckpt, tmp_path, leave):
    """In chat mode `quit` was sent to the model as a message: only /quit left, and only the docs said so. A
    line of quit or exit alone leaves; the chat banner says how."""
    r = cli([ckpt, "--interactive", "--seed", "1", "--max_new_tokens", "3"], tmp_path,
            stdin=f"chat\n{leave}\nnever reached\n")
    assert r.returncode == 0, r.stderr
    assert "quit (or Ctrl-D) leaves" in r.stdout and r.stderr.count("tokens/s") == 0  # no reply was generated
