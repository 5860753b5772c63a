"""Tests of hf_format.py through export_hf.py, its command line: our checkpoints as transformers folders and
back, with equal logits, equal greedy generations, an equal tokenizer and chat template, clear refusals of
what our model cannot represent, and the benchmarks' transformers twins computing our function."""

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import pytest
import torch
from tokenizers import Tokenizer

import export_hf
from config import SampleConfig
from conftest import PYTHON_SEQ, PYTHON_VOCAB, edit_json, read_json, save_model
from llm.data.batches import Batches
from llm.formats import checkpoint as ckpt_io
from llm.formats.hf_format import hf_twin, is_hf_folder, load_hf_folder
from llm.generate import engine
from llm.tokens.tokenizer import CHAT_TEMPLATE, chat_prompt_ids, render_chat
from modern_llm import Transformer

VOCAB, SEQ = PYTHON_VOCAB, PYTHON_SEQ
TEXTS = ["def main():\n    return 0\n", "  spaces\tand tabs\n\n", "<|im_start|>user\nhi<|im_end|>\n",
         "text<|endoftext|>more", "unicode: caf\u00e9 \u00fc \u4e2d\u6587", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(scope="module")
def tiny(tiny_config):
    """The tiny model at this file's vocabulary, with rope_theta and eps away from every library's default."""
    return lambda **kw: tiny_config(**{"vocab_size": VOCAB, "max_seq_len": SEQ, "rope_theta": 5000.0,
                                       "rms_norm_eps": 1e-5, **kw})


def train(model: Transformer, python_data, steps: int, seed: int = 0) -> Transformer:
    """A few AdamW steps on real text: every weight, norms included, moves away from its initial value."""
    batches = Batches(python_data, "train", 4, SEQ, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        x, y, _ = batches.get(step, 0)
        model(x, labels=y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def save(model: Transformer, python_data, run_dir, step: int) -> str:
    return save_model(run_dir, step, model, python_data.tokenizer_path, keep=2)


def load_ours(ckpt: str) -> Transformer:
    model = Transformer(ckpt_io.load_model_config(ckpt))
    ckpt_io.load_weights(ckpt, model)
    return model.eval()


def load_theirs(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def assert_same_logits(ours: Transformer, theirs, seed: int = 0):
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a, b = ours(ids)[0], theirs(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def greedy(model: Transformer, prompt: list[int], n: int, stop: set) -> tuple[list[int], torch.Tensor]:
    """Our own greedy decoding with the KV cache (one prefill, then one token per step): tokens, step logits.
    """
    cache = model.make_kv_cache(1, len(prompt) + n)
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt]), kv_cache=cache)
        out, steps = [], []
        for _ in range(n):
            steps.append(logits[0, -1])
            out.append(int(steps[-1].argmax()))
            if out[-1] in stop:
                break
            logits, _ = model(torch.tensor([out[-1:]]), kv_cache=cache)
    return out, torch.stack(steps)


def export(src, out, *flags):
    assert export_hf.main([str(src), str(out), *flags]) == 0
    return out


def hf_folder(tmp_path, python_data, model_type: str, **kw):
    """A randomly initialised transformers Qwen3/Llama model saved with save_pretrained, our tokenizer beside
    it."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        model_type]
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    torch.manual_seed(1)
    model = model_cls(config_cls(**{**shape, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm scales start at exactly 1, which would hide a swapped or missing norm
                p.uniform_(0.5, 1.5)
    folder = tmp_path / f"hf_{model_type}"
    model.save_pretrained(str(folder), max_shard_size="40KB" if model_type == "llama" else "5GB")
    PreTrainedTokenizerFast(tokenizer_file=python_data.tokenizer_path).save_pretrained(str(folder))
    return folder, model


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)], ids=["qwen3-tied", "llama-untied"])
def test_export_gives_equal_logits_and_greedy_generations(python_data, tmp_path, qk_norm, tied, tiny):
    """The exported folder must load in transformers as the right architecture and compute our function
    exactly (a wrong name map, norm order, eps, head_dim, RoPE layout or tie flag changes the logits), and
    HF's cached greedy generate must produce our tokens (catches position or cache mismatches that a full
    forward hides)."""
    model = train(Transformer(tiny(qk_norm=qk_norm, tie_word_embeddings=tied)), python_data, steps=10)
    save(model, python_data, tmp_path / "run", 10)
    out = export(tmp_path / "run", tmp_path / "hf")
    config = read_json(out / "config.json")
    assert config["architectures"] == ["Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"]
    assert sorted(os.listdir(out)) == ["README.md", "chat_template.jinja", "config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert is_hf_folder(str(out))
    theirs = load_theirs(out)
    assert theirs.config.tie_word_embeddings == tied and theirs.config.head_dim == 16
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == tied
    assert_same_logits(model, theirs)

    tok = Tokenizer.from_file(python_data.tokenizer_path)
    stop = set(theirs.generation_config.eos_token_id)
    for text in ("import os\n", "def parse_args(self", "class HelpFormatter(object):\n    "):
        prompt = tok.encode(text).ids
        mine, my_logits = greedy(model, prompt, 12, stop)
        ids = torch.tensor([prompt])
        generated = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        assert generated.sequences[0, len(prompt):].tolist() == mine, text
        ours = engine.generate(model, [prompt], SampleConfig(temperature=0, max_new_tokens=12),
                               eos_ids=sorted(stop))[0]  # the engine users run: eos ids are not returned
        assert ours == [t for t in mine if t not in stop][:len(ours)] and len(ours) == len(mine) - (mine[-1] in stop)
        # Every step's logits, not only the argmax: a repeated token would hide a position or cache bug.
        torch.testing.assert_close(torch.cat(generated.logits), my_logits, rtol=1e-5, atol=2e-5)


def test_exported_tokenizer_matches_ours(python_data, tmp_path, tiny):
    """AutoTokenizer on the export must encode and decode like our tokenizer, special tokens included, and its
    chat template must render the text prepare_data trains on; eos and pad must be the tokens we chose."""
    from transformers import AutoTokenizer, GenerationConfig
    save(Transformer(tiny()), python_data, tmp_path / "run", 1)
    out = export(tmp_path / "run", tmp_path / "hf", "--eos", "<|im_end|>")
    theirs, ours = AutoTokenizer.from_pretrained(str(out)), Tokenizer.from_file(python_data.tokenizer_path)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text
    assert (theirs.eos_token, theirs.pad_token) == ("<|im_end|>", "<|endoftext|>")
    eot, im_end = ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == [im_end, eot]

    ids, _ = render_chat(ours, CHAT)
    assert theirs.apply_chat_template(CHAT, tokenize=False) == ours.decode(ids, skip_special_tokens=False)
    prompt = chat_prompt_ids(ours, CHAT)
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.decode(prompt, skip_special_tokens=False)
    assert theirs(rendered)["input_ids"] == prompt


def test_a_chat_model_exported_without_eos_stops_at_im_end(tiny_checkpoint, chat_stopper, tmp_path):
    """Exported with no --eos, a tokenizer with <|im_end|> must give a generation_config whose eos ids list it
    beside <|endoftext|>, and keep the chat template, so that transformers' generate ends a reply where the
    model learned to (it ran on into invented turns: the stopper's "OK<|im_end|>OK<|im_end|>...")."""
    from transformers import AutoTokenizer, GenerationConfig
    ours = Tokenizer.from_file(os.path.join(tiny_checkpoint, "tokenizer.json"))
    out = export(tiny_checkpoint, tmp_path / "tiny")
    stops = [ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")]
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == read_json(out / "generation_config.json")[
        "eos_token_id"] == stops
    out = export(chat_stopper, tmp_path / "stopper")
    theirs, tok = load_theirs(out), AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    new = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert tok.decode(new[0, ids.shape[1]:]) == "OK<|im_end|>"


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_import_train_export_round_trip(python_data, tmp_path, model_type):
    """A transformers model imported as our checkpoint must compute the same logits (Qwen3: a hub-style config
    with rope_theta on top and an unused sliding_window, which must not be refused; Llama: untied, sharded),
    keep doing so after training in our format, and come back out loadable by transformers."""
    folder, theirs = hf_folder(tmp_path, python_data, model_type, tie_word_embeddings=model_type == "qwen3")
    if model_type == "qwen3":  # how Qwen3 folders on the hub (written by transformers 4.x) look
        edit_json(folder / "config.json", rope_parameters="DELETE", layer_types="DELETE", rope_theta=20000.0,
                  rope_scaling=None, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  torch_dtype="float32")
    else:
        assert (folder / "model.safetensors.index.json").is_file()
    assert is_hf_folder(str(folder))
    assert export_hf.main(["--import", str(folder), str(tmp_path / "run")]) == 0
    ckpt = ckpt_io.latest_checkpoint(str(tmp_path / "run"))
    assert not is_hf_folder(ckpt) and not is_hf_folder(str(tmp_path / "run"))
    ours = load_ours(ckpt)
    assert ours.config.qk_norm == (model_type == "qwen3") and ours.config.rope_theta == 20000.0
    assert ckpt_io.load_trainer_state(ckpt)["step"] == 0
    assert_same_logits(ours, theirs)

    cfg, state, tokenizer = load_hf_folder(str(folder))  # the generator's direct path
    assert cfg == ours.config and tokenizer == str(folder / "tokenizer.json")
    torch.testing.assert_close(state, ckpt_io.weights_state_dict(ours))

    trained = train(ours, python_data, steps=3)
    out = export(save(trained, python_data, tmp_path / "run", 3), tmp_path / "out")
    assert_same_logits(trained, load_theirs(out), seed=1)


@pytest.fixture(scope="module")
def qwen3_folder(python_data, tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("refuse"), python_data, "qwen3")[0]


@pytest.mark.parametrize("changes,reason", [
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types="DELETE"),
     "sliding window attention in use"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type='linear'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    (dict(model_type="qwen3_moe"), "model_type='qwen3_moe' is not supported"),
], ids=["bias", "sliding", "rope-scaling", "act", "layer-types", "moe"])
def test_unrepresentable_folder_is_refused(qwen3_folder, tmp_path, capsys, changes, reason):
    """Importing a model our architecture cannot compute must stop with one `error:` line naming the feature
    and exit 2, instead of writing a checkpoint that silently computes something else."""
    folder = tmp_path / "hf"
    shutil.copytree(qwen3_folder, folder)
    edit_json(folder / "config.json", **changes)
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", str(folder), str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and reason in err, err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_export_is_atomic_and_never_clobbers(python_data, tmp_path, capsys, tiny):
    """An existing folder must not be overwritten without --overwrite, and with it only when it is an earlier
    export, which the new export replaces whole, no temporary folder left behind; bf16 export stores bf16
    tensors and says so."""
    save(Transformer(tiny()), python_data, tmp_path / "run", 1)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    for flags in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as exit_info:
            export_hf.main([str(tmp_path / "run"), str(out), *flags])
        assert exit_info.value.code == 2 and "overwrite" in capsys.readouterr().err
    assert os.listdir(out) == ["precious.txt"]
    os.remove(out / "precious.txt")
    export(tmp_path / "run", out)
    export(tmp_path / "run", out, "--overwrite", "--dtype", "bfloat16")
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]
    assert read_json(out / "config.json")["dtype"] == "bfloat16"
    from safetensors.torch import load_file
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)], ids=["qwen3-tied", "llama-untied"])
def test_benchmark_twins_compute_our_function(python_data, qk_norm, tied, tiny):
    """The transformers twins the benchmarks time must be the same network as ours, rope_theta included (three
    hand-written twin configs once drifted on it, so the benchmarks compared different models); the training
    twin's loss must be our loss on the same labels."""
    import bench
    model = train(Transformer(tiny(qk_norm=qk_norm, tie_word_embeddings=tied, rope_theta=777.0)), python_data, steps=2)
    twin = hf_twin(model.config, model.state_dict()).eval()
    assert twin.config.rope_parameters["rope_theta"] == 777.0 == model.config.rope_theta
    assert_same_logits(model, twin)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids[:, :-1], labels=ids[:, 1:])[1]
        theirs = bench.TwinForTraining(twin)(ids[:, :-1], labels=ids[:, 1:])[1]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
