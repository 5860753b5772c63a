"""Tests of gguf_format.py through export_hf.py --gguf: the file read back by the gguf package's own reader
and by transformers' GGUF loader (which undoes llama.cpp's conventions on its own) must be our model, our
tokenizer and our chat format; q8_0 must stay within a bound of f16; refusals and failed writes are one line
with nothing left."""

import errno
import json
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import pytest
import torch

# Test dependencies (requirements-test.txt): a missing one fails these tests, never skips them.
import accelerate  # noqa: F401  transformers loads GGUF files only with it
import gguf

from test_hf_format import CHAT, TEXTS, train
from tokenizers import Tokenizer

import export_hf
from config import SampleConfig
from conftest import PYTHON_SEQ, PYTHON_VOCAB, one_error_line, save_model
from llm.data.batches import Batches
from llm.formats import gguf_format
from llm.generate import engine
from llm.tokens.tokenizer import CHAT_TEMPLATE, chat_prompt_ids, chat_text, train_tokenizer
from modern_llm import Transformer

VOCAB, SEQ = PYTHON_VOCAB, PYTHON_SEQ
Q8_BPB_BOUND = 0.002  # README: q8_0 moved bits per byte by 0.0001 to 0.0002 (measured); room for other seeds


def sharp_model(tiny_config, **kw) -> Transformer:
    """A random model with sharp logits (no near-ties for greedy decoding) and norm scales away from 1, so a
    dropped, swapped or misnamed norm changes the output."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(**{"vocab_size": VOCAB, "max_seq_len": SEQ, "init_std": 0.2,
                                       "rope_theta": 5000.0, "rms_norm_eps": 1e-5, **kw}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def save(model, tokenizer_path, run_dir, step=1) -> str:
    return save_model(run_dir, step, model, tokenizer_path)


def export(src, out, qtype="f16", *flags) -> str:
    assert export_hf.main([str(src), str(out), "--gguf", qtype, *flags]) == 0
    return os.path.join(out, f"model-{qtype}.gguf")


def field(reader, key):
    return reader.fields[key].contents()


def load_theirs(path: str):
    """transformers' model of the GGUF file; it reads no head width for qwen3 (it assumes 128), so that one is
    taken from the file's own key, as llama.cpp takes it."""
    from transformers import AutoModelForCausalLM
    reader = gguf.GGUFReader(path)
    arch = field(reader, "general.architecture")
    extra = {"head_dim": field(reader, f"{arch}.attention.key_length")} if arch == "qwen3" else {}
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, **extra).eval()


def rounded(model: Transformer, dtype=torch.float16) -> Transformer:
    """Our model with its matrices rounded to f16, as the file stores them (norms stay f32)."""
    copy = Transformer(model.config).eval()
    copy.load_state_dict({k: v.to(dtype).float() if v.dim() > 1 else v for k, v in model.state_dict().items()})
    return copy


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)], ids=["qwen3-tied", "llama-untied"])
def test_f16_file_reads_back_as_our_model(python_data, tmp_path, tiny_config, qk_norm, tied):
    """The f16 file must hold the right architecture, names, types and hyperparameters (by the gguf reader),
    and transformers' model of it must compute our f16-rounded model's logits and greedy tokens: a wrong
    tensor name, a missing Q/K permutation for llama (transformers undoes llama.cpp's), a wrong eps, rope base
    or head width, or a lost tie changes them."""
    model = sharp_model(tiny_config, qk_norm=qk_norm, tie_word_embeddings=tied)
    path = export(save(model, python_data.tokenizer_path, tmp_path / "run"), tmp_path / "out")
    reader = gguf.GGUFReader(path)
    arch = "qwen3" if qk_norm else "llama"
    cfg = model.config
    assert field(reader, "general.architecture") == arch and field(reader, "general.file_type") == 1
    assert [field(reader, f"{arch}.{k}") for k in ("context_length", "embedding_length", "block_count",
                                                   "feed_forward_length", "attention.head_count",
                                                   "attention.head_count_kv", "attention.key_length")] == [
        SEQ, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.num_attention_heads,
        cfg.num_key_value_heads, cfg.head_dim]
    assert math.isclose(field(reader, f"{arch}.rope.freq_base"), 5000.0)
    assert math.isclose(field(reader, f"{arch}.attention.layer_norm_rms_epsilon"), 1e-5, rel_tol=1e-6)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert ("output.weight" in types) == (not tied) and ("blk.0.attn_q_norm.weight" in types) == qk_norm
    assert len(types) == len([k for k in model.state_dict() if not (tied and k == "lm_head.weight")])
    assert all(kind == ("F32" if name.endswith("norm.weight") else "F16") for name, kind in types.items())

    theirs, ours = load_theirs(path), rounded(model)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids)[0], rtol=1e-5, atol=2e-5)
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    tok = Tokenizer.from_file(python_data.tokenizer_path)
    for text in ("import os\n", "def parse_args(self", "class HelpFormatter(object):\n    "):
        prompt = tok.encode(text).ids
        mine = engine.generate(ours, [prompt], SampleConfig(temperature=0, max_new_tokens=16),
                               eos_ids=[eos])[0]
        x = torch.tensor([prompt])
        new = theirs.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                              eos_token_id=eos)[0, len(prompt):].tolist()
        assert new[:len(mine)] == mine and new[len(mine):] in ([], [eos]) and len(mine) > 3, text


@pytest.mark.parametrize("kind,pre", [("bpe", "gpt-2"), ("tiktoken", "dbrx")])
def test_tokenizer_and_chat_format_read_back(tmp_path, tiny_config, kind, pre):
    """The file's tokenizer, rebuilt by transformers from the metadata alone, must encode and decode every
    text as ours does, special tokens included; the reader must find our tokens in id order, our merges, the
    pre-tokenizer llama.cpp splits like ours with, <|im_end|> as the end of a chat turn and our ChatML
    template; the Modelfile's template must render what the model was trained on."""
    from transformers import AutoTokenizer

    from conftest import CODE
    ours = train_tokenizer([CODE] * 3, kind, 400)
    ours.save(str(tmp_path / "tok.json"))
    model = sharp_model(tiny_config, vocab_size=ours.get_vocab_size() + 5)  # rows past the tokenizer: [PADi]
    path = export(save(model, str(tmp_path / "tok.json"), tmp_path / "run"), tmp_path / "out", "q8_0")
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS + ["x = 12345 + 6; it's we'll\r\n\tdone"]:
        ids = ours.encode(text).ids
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text
    reader, vocab = gguf.GGUFReader(path), ours.get_vocab()
    n = ours.get_vocab_size()
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == pre
    padding = [f"[PAD{i}]" for i in range(n, n + 5)]
    assert field(reader, "tokenizer.ggml.tokens") == sorted(vocab, key=vocab.get) + padding
    merges = json.loads(ours.to_str())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(m) for m in merges] and len(merges) > 50
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[:3] == [3, 3, 3] and set(types[3:n]) == {1} and set(types[n:]) == {5}  # control, normal, unused
    eot, im_end = vocab["<|endoftext|>"], vocab["<|im_end|>"]
    assert [field(reader, f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "eot_token_id",
                                                           "padding_token_id", "add_bos_token")] == [
        eot, im_end, im_end, eot, False]
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE == theirs.chat_template
    assert theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == chat_text(CHAT) + \
        "<|im_start|>assistant\n" == ours.decode(chat_prompt_ids(ours, CHAT), skip_special_tokens=False)

    modelfile = open(os.path.join(os.path.dirname(path), "Modelfile"), encoding="utf-8").read()
    assert modelfile.startswith("FROM ./model-q8_0.gguf\n") and f"PARAMETER num_ctx {SEQ}\n" in modelfile
    assert re.findall(r'PARAMETER stop "(.*)"', modelfile) == ["<|im_end|>", "<|endoftext|>", "<|im_start|>"]
    template = re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S).group(1)
    loop, after = re.fullmatch(r"\{\{- range \.Messages \}\}(.*)\{\{ end \}\}(.*)", template, re.S).groups()
    rendered = "".join(loop.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in CHAT)
    assert rendered + after == chat_text(CHAT) + "<|im_start|>assistant\n"


def test_a_tokenizer_without_chat_tokens_gets_a_plain_template(tmp_path, tiny_config):
    """A tokenizer with no ChatML tokens must end generations at <|endoftext|>, carry no chat template, and
    give Ollama the prompt as it is."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from conftest import CODE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([CODE] * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tok.json"))
    model = sharp_model(tiny_config, vocab_size=tok.get_vocab_size())
    path = export(save(model, str(tmp_path / "tok.json"), tmp_path / "run"), tmp_path / "out")
    reader = gguf.GGUFReader(path)
    assert field(reader, "tokenizer.ggml.eos_token_id") == tok.token_to_id("<|endoftext|>")
    assert "tokenizer.chat_template" not in reader.fields and "tokenizer.ggml.eot_token_id" not in reader.fields
    modelfile = open(os.path.join(os.path.dirname(path), "Modelfile"), encoding="utf-8").read()
    assert 'TEMPLATE """{{ .Prompt }}"""' in modelfile and re.findall(r'stop "(.*)"', modelfile) == ["<|endoftext|>"]


def bits_per_byte(logits: torch.Tensor, ids: torch.Tensor, bytes_per_token: float) -> float:
    """Bits per byte of ids (B, T+1) under logits (B, T, V) of their first T tokens."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    return loss.item() / math.log(2) / bytes_per_token


def test_q8_0_stays_within_the_stated_bound_of_f16(python_data, tmp_path, tiny_config):
    """q8_0 must store every matrix as Q8_0 blocks (a file that silently kept f16 would pass any bound), each
    weight within half a quantisation step of ours, in about 53% of f16's bytes, and move the validation bits
    per byte of a trained model by less than the bound README states (both files read back by transformers).
    """
    model = train(sharp_model(tiny_config, init_std=0.02), python_data, steps=25)
    ckpt = save(model, python_data.tokenizer_path, tmp_path / "run", 25)
    f16, q8 = export(ckpt, tmp_path / "f16"), export(ckpt, tmp_path / "q8", "q8_0")
    reader = gguf.GGUFReader(q8)
    assert field(reader, "general.file_type") == 7
    ours = {gguf_format.gguf_name(k, "qwen3"): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for t in reader.tensors:
        want = ours[t.name].numpy()
        if t.name.endswith("norm.weight"):
            assert t.tensor_type.name == "F32" and (t.data == want).all()
            continue
        assert t.tensor_type.name == "Q8_0", t.name
        blocks = want.reshape(-1, 32)
        step = abs(blocks).max(axis=1, keepdims=True) / 127
        error = abs(gguf.dequantize(t.data, t.tensor_type).reshape(-1, 32) - blocks)
        # Half a step, plus the f16 rounding of the scale (2^-11 of it) times a value of up to 127 steps.
        assert (error <= step * (0.5 + 127 / 2048)).all() and error.max() > 0, t.name
    assert 0.5 < os.path.getsize(q8) / os.path.getsize(f16) < 0.56

    windows = Batches(python_data, "val", 8, SEQ, 0)
    ids = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y, _ in (windows.get(i, 0) for i in range(2))])
    per_token = python_data.meta["val_bytes_per_token"]
    with torch.no_grad():
        bpb = [bits_per_byte(load_theirs(p)(input_ids=ids[:, :-1]).logits, ids, per_token) for p in (f16, q8)]
        untrained = bits_per_byte(sharp_model(tiny_config, init_std=0.02)(ids[:, :-1])[0], ids, per_token)
    assert bpb[0] < 0.9 * untrained  # the bound is measured on a model that learned something
    print(f"bits per byte: f16 {bpb[0]:.5f}, q8_0 {bpb[1]:.5f}, difference {bpb[1] - bpb[0]:+.5f}")
    assert abs(bpb[1] - bpb[0]) < Q8_BPB_BOUND


def test_bad_requests_are_one_line_and_write_nothing(python_data, tmp_path, tiny_config, capsys):
    """A tokenizer llama.cpp cannot reproduce, flags that mean nothing for GGUF, and an output folder that is
    not an earlier GGUF export (a card rewritten by hand makes it the user's) must each stop with one `error:`
    line, exit 2, and leave every file as it was; --overwrite replaces an earlier GGUF export whole."""
    from conftest import CODE
    wordpiece = train_tokenizer([CODE] * 3, "wordpiece", 400)
    wordpiece.save(str(tmp_path / "wp.json"))
    model = sharp_model(tiny_config, vocab_size=wordpiece.get_vocab_size())
    cases = [([str(save(model, str(tmp_path / "wp.json"), tmp_path / "wp")), str(tmp_path / "a"), "--gguf", "f16"],
              "not a byte-level BPE tokenizer"),
             ([str(tmp_path / "wp"), str(tmp_path / "a"), "--gguf", "f16", "--dtype", "bfloat16"], "no --import")]
    for argv, words in cases:
        with pytest.raises(SystemExit) as e:
            export_hf.main(argv)
        assert words in one_error_line(capsys, 2, e) and not (tmp_path / "a").exists()

    run = save(sharp_model(tiny_config), python_data.tokenizer_path, tmp_path / "run")
    export(run, tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        export_hf.main([run, str(tmp_path / "out"), "--gguf", "q8_0"])
    assert "--overwrite" in one_error_line(capsys, 2, e)
    export(run, tmp_path / "out", "q8_0", "--overwrite")
    assert sorted(os.listdir(tmp_path / "out")) == ["Modelfile", "README.md", "model-q8_0.gguf"]
    (tmp_path / "out" / "README.md").write_text("my notes on this model")  # the card, rewritten by hand
    with pytest.raises(SystemExit) as e:
        export_hf.main([run, str(tmp_path / "out"), "--gguf", "f16", "--overwrite"])
    assert "not an earlier GGUF export (it holds README.md)" in one_error_line(capsys, 2, e)
    assert (tmp_path / "out" / "README.md").read_text() == "my notes on this model"


@pytest.mark.parametrize("fault,code,words", [("full", 1, ["No space left on device", "free some space"]),
                                              ("read-only", 2, ["Read-only file system", "choose a folder"])])
def test_a_failed_write_is_one_line_and_leaves_no_file(python_data, tmp_path, tiny_config, capsys, monkeypatch, fault,
                                                       code, words):
    """A disk that fills up while the tensors are written, or a folder that cannot be written, must end in one
    line (exit 1 for the full disk, 2 for the path, as for checkpoints) with no half-written file or temporary
    folder left, and an earlier export as it was."""
    run = save(sharp_model(tiny_config), python_data.tokenizer_path, tmp_path / "run")
    earlier = export(run, tmp_path / "out")
    before = open(earlier, "rb").read()
    number = errno.ENOSPC if fault == "full" else errno.EROFS

    def refuse(self, *args, **kwargs):
        raise OSError(number, os.strerror(number), str(self.path))
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file" if fault == "full" else "write_header_to_file",
                        refuse)
    with pytest.raises(SystemExit) as e:
        export_hf.main([run, str(tmp_path / "out"), "--gguf", "f16", "--overwrite"])
    line = one_error_line(capsys, code, e)
    assert all(w in line for w in words), line
    assert sorted(os.listdir(tmp_path)) == ["out", "run"] and open(earlier, "rb").read() == before
