"""Tests of text_generator.py: sampling maths, cached batched generation, streaming text, REPL and CLI.

Every model and tokenizer is built here (a tiny byte-level BPE and a 2-layer model), saved with
checkpoint.save_checkpoint; nothing is downloaded. CLI tests run the script in a subprocess.
"""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import text_generator as tg
from checkpoint import save_checkpoint, weights_state_dict
from config import ModelConfig, SampleConfig
from modern_llm import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "text_generator.py")
TEXT = """def fibonacci(n):
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
GREEDY = SampleConfig(temperature=0.0, max_new_tokens=12, seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of a random 2-layer model with a BPE tokenizer that knows the ChatML tokens."""
    root = tmp_path_factory.mktemp("runs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[tg.EOT_TOKEN, tg.IM_START, tg.IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 3, trainer)
    tok_path = str(root / "tokenizer.json")
    tok.save(tok_path)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_seq_len=64, init_std=0.2)  # sharp logits: no near-ties
    torch.manual_seed(0)
    model = Transformer(cfg)
    run = root / "run1"
    path = save_checkpoint(str(run), 10, weights_state_dict(model), cfg, tok_path, {"step": 10}, keep=2)
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"kind": "eval", "step": 10, "val_loss": 2.125, "val_ppl": 8.4, "val_bpb": 1.0625}) + "\n")
    return path


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tok, cfg, path = tg.load_for_inference(ckpt, "cpu")
    return model, tok


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_greedy_matches_full_forward_argmax(loaded):
    """The cached decode must equal argmax over a full forward per step (catches cache/position bugs)."""
    model, tok = loaded
    prompt = ids_of(tok, "def push(self")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    first = tg.generate(model, [prompt], GREEDY)
    assert first == [ids[len(prompt):]]
    assert tg.generate(model, [prompt], GREEDY) == first  # deterministic


def test_top_k_one_is_greedy(loaded):
    """top_k=1 must pick the argmax whatever the temperature (an off-by-one in the k-th value breaks it)."""
    model, tok = loaded
    prompt = [ids_of(tok, "class Stack")]
    sampled = tg.generate(model, prompt, replace(GREEDY, temperature=1.5, top_k=1, top_p=1.0, seed=3))
    assert sampled == tg.generate(model, prompt, GREEDY)
    logits = torch.randn(5, 50)
    assert torch.equal(tg.sample_next(logits, 2.0, top_k=1), logits.argmax(-1, keepdim=True))


def test_top_p_keeps_smallest_set_reaching_p():
    """Nucleus keeps exactly the top tokens whose mass first reaches p, at least one (not one too many or few)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: (tg.filtered_probs(logits, 1.0, 0, p) > 0).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.1, 0.4, 0.75, 0.85, 0.97, 1.0)] == [1, 1, 2, 3, 4, 4]
    probs = tg.filtered_probs(logits, 1.0, 0, 0.75)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_filters_leave_a_valid_distribution():
    """After temperature, top-k and top-p the probabilities sum to 1 and are 0 outside the kept set."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.9), (0.5, 20, 0.8), (0.0, 0, 1.0)]:
        probs = tg.filtered_probs(logits, t, k, p)
        assert torch.allclose(probs.sum(-1), torch.ones(4)) and (probs >= 0).all()
        if k:
            outside = logits < torch.topk(logits, k).values[:, -1:]
            assert (probs[outside] == 0).all() and ((probs > 0).sum(-1) <= k).all()
        ids = tg.sample_next(logits, t, k, p, torch.Generator().manual_seed(1))
        assert ids.shape == (4, 1) and (probs.gather(1, ids) > 0).all()  # never a filtered token


def test_out_of_range_sampling_arguments_raise():
    """Bad arguments must raise ValueError (which the REPL reports), not sample garbage."""
    logits = torch.randn(1, 10)
    for kwargs in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            tg.sample_next(logits, **kwargs)


def test_repetition_penalty_matches_hand_computation():
    """CTRL penalty: seen positive logits divided, seen negative multiplied, unseen untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = tg.apply_repetition_penalty(logits, seen, 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))


def test_repetition_penalty_counts_prompt_and_generated_tokens(loaded):
    """With a huge penalty, greedy never repeats a token of the prompt or of its own output."""
    model, tok = loaded
    prompt = ids_of(tok, "return n")
    out = tg.generate(model, [prompt], replace(GREEDY, repetition_penalty=1e6, max_new_tokens=20))[0]
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_batch_of_different_lengths_equals_one_by_one(loaded):
    """Right-padded prefill with input_lengths must not let padding or other rows change any row."""
    model, tok = loaded
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    batched = tg.generate(model, prompts, GREEDY)
    assert batched == [tg.generate(model, [p], GREEDY)[0] for p in prompts]


def test_seed_and_counts(loaded):
    """Same seed, same samples; max_new_tokens and num_return_sequences are respected exactly."""
    model, tok = loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "for name")]
    s = SampleConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=9, num_return_sequences=3, seed=5)
    a, b = tg.generate(model, prompts, s), tg.generate(model, prompts, s)
    assert a == b and len(a) == 6 and all(len(x) == 9 for x in a)
    assert tg.generate(model, prompts, replace(s, seed=6)) != a
    assert len({tuple(x) for x in a}) > 1  # the sequences of one prompt are different samples


def test_eos_ends_a_sequence(loaded):
    """A sampled eos id ends its row, is not returned, and the other rows go on."""
    model, tok = loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "import")]
    full = tg.generate(model, prompts, GREEDY)
    eos = full[0][3]
    cut = tg.generate(model, prompts, GREEDY, eos_ids=[eos])
    assert cut[0] == full[0][:full[0].index(eos)]
    assert cut[1] == (full[1][:full[1].index(eos)] if eos in full[1] else full[1])


def test_generation_stops_at_the_context(loaded):
    """A row that reaches max_seq_len stops there (the cache cannot grow); a too-long prompt is refused."""
    model, tok = loaded
    ctx = model.config.max_seq_len
    prompt = (ids_of(tok, TEXT) * 4)[:ctx - 5]
    out = tg.generate(model, [prompt, prompt[:10]], replace(GREEDY, max_new_tokens=30))
    assert [len(o) for o in out] == [5, 30]
    with pytest.raises(ValueError, match="context"):
        tg.generate(model, [prompt + prompt[:5]], GREEDY)


def test_stop_strings_stop_and_are_not_printed(loaded):
    """Generation ends at a stop string spanning tokens; the streamed text ends just before it."""
    model, tok = loaded
    s = replace(GREEDY, max_new_tokens=30)
    (text,), (ids,) = tg.generate_text(model, tok, ["def push"], s, eos_ids=[])
    stop = text[8:12]  # some text the model does produce
    assert len(stop) == 4 and stop not in text[:11]
    (cut,), (cut_ids,) = tg.generate_text(model, tok, ["def push"], replace(s, stop=["zzz", stop]), eos_ids=[])
    assert cut == text[:text.index(stop)]
    assert tok.decode(cut_ids).startswith(cut + stop) and len(cut_ids) < len(ids)


def test_stream_never_prints_a_broken_utf8_character(loaded):
    """Multi-byte characters split across byte-level tokens must come out whole, never as U+FFFD."""
    _, tok = loaded
    text = "naïve café 日本語 ☃ def f(): return 'ß→∞' 🙂"
    ids = ids_of(tok, text)
    assert len(ids) > len(text.encode("utf-8")) // 2  # really byte-level pieces of multi-byte characters
    stream, pieces = tg.TextStream(tok), []
    for i in ids:
        pieces.append(stream.push(i))
    pieces.append(stream.flush())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    half = tg.TextStream(tok)
    assert "".join(half.push(i) for i in ids_of(tok, "日")[:-1]) + half.flush() == ""  # incomplete tail dropped


def test_stream_holds_back_possible_stop_prefix(loaded):
    """Text that may begin a stop string waits; if the stop string does not follow, it is released."""
    _, tok = loaded
    stream = tg.TextStream(tok, stops=["\n\n"])
    out = "".join(stream.push(i) for i in ids_of(tok, "a\nb\n"))
    assert out == "a\nb" and stream.flush() == "\n"
    stream = tg.TextStream(tok, stops=["\n\n"])
    assert "".join(stream.push(i) for i in ids_of(tok, "a\n\nb")) == "a" and stream.stopped


def test_default_run_folder_and_list(ckpt, tmp_path, monkeypatch, capsys):
    """No argument loads runs/default's newest checkpoint; --list shows step, size and the eval figures."""
    run = tmp_path / "runs" / "default"
    shutil.copytree(os.path.dirname(os.path.dirname(ckpt)), run)
    monkeypatch.chdir(tmp_path)
    *_, path = tg.load_for_inference("", "cpu")
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
    hf_model, tok, cfg, path = tg.load_for_inference(str(tmp_path / "hf"), "cpu")
    ids = torch.tensor([ids_of(tok, "def push(self, item):")])
    assert path == str(tmp_path / "hf") and cfg.max_seq_len == model.config.max_seq_len
    assert torch.allclose(hf_model(ids)[0], model(ids)[0], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_cuda_decode_matches_eager(ckpt):
    """The CUDA-graph decode step must give eager's greedy tokens, across calls and batch sizes (a stale
    graph output or a cache whose address changed would show up here)."""
    model, tok, *_ = tg.load_for_inference(ckpt, "cuda")
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    eager = tg.generate(model, prompts, GREEDY)
    for batch in (prompts, prompts[:1], prompts):
        assert tg.generate(model, batch, replace(GREEDY, compile=True)) == eager[:len(batch)]


def cli(args, cwd, stdin=""):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, SCRIPT, *args], input=stdin, capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_one_shot_and_stdin_prompts(loaded, ckpt, tmp_path):
    """--prompt prints exactly the completion; stdin lines are prompts, one completion each."""
    model, tok = loaded
    expect = [tg.generate_text(model, tok, [p], replace(GREEDY, max_new_tokens=6))[0][0] for p in ("def", "x =")]
    args = [ckpt, "--temperature", "0", "--max-new-tokens", "6"]
    one = cli(args + ["--prompt", "def"], tmp_path)
    assert one.returncode == 0 and one.stdout == expect[0] + "\n" and "tokens/s" in one.stderr
    many = cli(args, tmp_path, stdin="def\n\nx =\n")
    assert many.returncode == 0 and many.stdout == expect[0] + "\n" + expect[1] + "\n"


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
                     "(dialogue cleared)", "plain mode"):
        assert expected in r.stdout
    assert r.stderr.count("tokens/s") == 6  # greedy, sample, batch, bare line, two chat replies


def test_missing_default_checkpoint_cli(tmp_path):
    """With no argument and no runs/default, the real exit code is 2 and the message says how to train."""
    r = cli(["--prompt", "x"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: no checkpoint at runs/default")
    assert "python gpu_training_optimized.py" in r.stderr and len(r.stderr.strip().splitlines()) == 1
