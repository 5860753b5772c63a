"""Tests of hf_families.py through export_hf.py: each Hugging Face family our model computes (Qwen2, Llama 3.x
with its RoPE rescaling, Mistral within its window, SmolLM2, SmolLM3 where every layer rotates) comes in with
the logits of transformers' own forward and goes back out as the same family; what it cannot compute is
refused in one line naming the field. Tiny random models built from transformers configs, offline."""

import os
import shutil
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the network

import pytest
import torch
from safetensors import safe_open

import export_hf
from config import ModelConfig
from conftest import edit_json, read_json
from llm.base.cli import parse_config
from llm.base.errors import ConfigError
from llm.formats import checkpoint as ckpt_io
from llm.formats.loading import read_model
from modern_llm import Transformer
from muon_optimizer import split_parameters

SEQ, TOLERANCE = 48, 1e-4  # float32 logits: max abs difference to transformers
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-5, initializer_range=0.05,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
# Llama 3.1's rule at a tiny scale: with head_dim 16 and theta 5e5 the wavelengths are 6.3, 32, 167, ...
# tokens, so original length 64 with factors 1 and 8 keeps the first, blends the second and divides the rest:
# all three cases.
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 64}
FAMILIES = {  # test id: (model_type, config fields besides the shape, config.json edits after save_pretrained)
    "qwen2": ("qwen2", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 2e4}),
              {}),
    "qwen2.5-tied": ("qwen2", dict(tie_word_embeddings=True), dict(  # Qwen2.5-0.5B's unused window fields
        use_sliding_window=False, sliding_window=32768, max_window_layers=21, layer_types="DELETE")),
    "llama3": ("llama", dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}), {}),
    "llama3-hub": ("llama", dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}),  # as Llama 3.x's hub files say it
                   dict(rope_parameters="DELETE", rope_scaling=LLAMA3, rope_theta=5e5)),
    "mistral": ("mistral", dict(sliding_window=SEQ), {}),  # a window as long as the context: full attention
    "mistral-v0.3": ("mistral", dict(sliding_window=None), {}),
    "smollm2": ("llama", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
                {}),
    "smollm3-all-rope": ("smollm3", dict(no_rope_layers=[1, 1]), {}),
}
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM"}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return os.path.join(tiny_checkpoint, "tokenizer.json")


def vocab_size(tokenizer: str) -> int:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(tokenizer).get_vocab_size()


def hf_model(folder, tokenizer: str, model_type: str, edits: dict | None = None, **fields):
    """A random transformers model of this family saved with save_pretrained, our tokenizer beside it. Every
    weight random, biases and norm scales included (HF starts them at 0 and 1, which would hide a lost one).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(1)
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size(tokenizer), **{**SHAPE, **fields})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    shutil.copyfile(tokenizer, folder / "tokenizer.json")
    if edits:
        edit_json(folder / "config.json", **edits)
    return model


def max_diff(ours: Transformer, theirs, seed: int = 0, length: int = SEQ) -> float:
    ids = torch.randint(0, ours.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(ids)[0] - theirs(input_ids=ids).logits).abs().max().item()


def load_ours(ckpt: str) -> Transformer:
    found = read_model(ckpt)
    model = Transformer(found.config)
    model.load_stored(found.state)
    return model.eval()


def load_theirs(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("case", FAMILIES)
def test_family_imports_with_transformers_logits_and_exports_as_itself(tmp_path, tokenizer, case):
    """An imported model must compute transformers' logits (a lost bias, a wrong RoPE rescaling, a window
    taken for full attention all change them), carry its family's fields in model_config.json, and export as
    the same family, which transformers loads into the same class computing the same logits again."""
    model_type, fields, edits = FAMILIES[case]
    theirs = hf_model(tmp_path / "hf", tokenizer, model_type, edits, **fields)
    assert export_hf.main(["--import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ckpt = ckpt_io.latest_checkpoint(str(tmp_path / "run"))
    saved = read_json(os.path.join(ckpt, "model_config.json"))
    assert saved["family"] == ("auto" if model_type in ("qwen2", "llama") else model_type)  # the flags say those
    assert saved["qkv_bias"] == (model_type == "qwen2")
    assert saved["rope_type"] == ("llama3" if "llama3" in case else "default")
    ours = load_ours(ckpt)
    assert max_diff(ours, theirs) < TOLERANCE

    assert export_hf.main([ckpt, str(tmp_path / "out")]) == 0
    config = read_json(tmp_path / "out" / "config.json")
    assert config["model_type"] == model_type and config["architectures"] == [ARCHITECTURES[model_type]]
    if "llama3" in case:
        assert {k: config["rope_parameters"][k] for k in LLAMA3} == LLAMA3 and config["rope_scaling"] == LLAMA3
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        biases = [k for k in f.keys() if k.endswith("bias")]
    assert len(biases) == (3 * SHAPE["num_hidden_layers"] if model_type == "qwen2" else 0)
    back = load_theirs(tmp_path / "out")
    assert type(back) is type(theirs) and back.config.tie_word_embeddings == theirs.config.tie_word_embeddings
    assert max_diff(ours, back, seed=1) < TOLERANCE


def test_llama3_rescaling_changes_the_function(tmp_path, tokenizer):
    """The llama3 case above would pass with the rescaling ignored if it changed nothing at this scale: plain
    RoPE with the same weights must give other logits."""
    theirs = hf_model(tmp_path / "hf", tokenizer, "llama", rope_parameters={**LLAMA3, "rope_theta": 5e5})
    assert export_hf.main(["--import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours = load_ours(str(tmp_path / "run"))
    plain = Transformer(replace(ours.config, rope_type="default"))
    plain.load_state_dict(ours.state_dict())
    assert max_diff(ours, theirs) < TOLERANCE < max_diff(plain.eval(), theirs)


def test_a_window_shorter_than_the_context_is_refused_and_loads_within_it(tmp_path, tokenizer, capsys):
    """Mistral 7B v0.1's 4096-token window under a 32k context: our full attention differs past the window, so
    the import is refused naming sliding_window and the way out; at --max_seq_len of the window it computes
    transformers' logits (where the window covers the whole input)."""
    theirs = hf_model(tmp_path / "hf", tokenizer, "mistral", sliding_window=16)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", str(tmp_path / "hf"), str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "sliding_window=16" in err and f"context of {SEQ} tokens" in err and "--max_seq_len 16" in err
    assert export_hf.main(["--import", str(tmp_path / "hf"), str(tmp_path / "run"), "--max_seq_len", "16"]) == 0
    ours = load_ours(str(tmp_path / "run"))
    assert ours.config.max_seq_len == 16 and max_diff(ours, theirs, length=16) < TOLERANCE


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A saved folder of each base family the refusals edit, built once on first use."""
    folders = {}

    def folder(model_type: str):
        if model_type not in folders:
            folders[model_type] = tmp_path_factory.mktemp("refuse") / model_type
            hf_model(folders[model_type], tokenizer, model_type)
        return folders[model_type]
    return folder


SMOLLM3 = dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"])


@pytest.mark.parametrize("base,changes,reason", [
    ("llama", {**SMOLLM3, "no_rope_layer_interval": 2}, "no_rope_layers=[1, 0]"),  # SmolLM3's NoPE, every 2nd here
    ("llama", {**SMOLLM3, "no_rope_layers": [0, 1]}, "no_rope_layers=[0, 1]"),
    ("llama", dict(attention_bias=True), "attention_bias=true"),  # Llama's puts one on o_proj too
    ("llama", dict(mlp_bias=True), "mlp_bias=true"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type='yarn'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types="DELETE"),
     "sliding_window=8 on 1 of 2 layers"),
    ("llama", dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), "model_type='mixtral' is not"),
], ids=["smollm3-nope", "nope-list", "attention-bias", "mlp-bias", "yarn", "qwen2-window", "moe"])
def test_what_the_model_cannot_compute_is_refused_naming_the_field(saved, tmp_path, capsys, base, changes, reason):
    """A folder asking for what our architecture cannot compute must stop with one `error:` line naming the
    field and exit 2, writing nothing, instead of a checkpoint that silently computes something else."""
    folder = tmp_path / "hf"
    shutil.copytree(saved(base), folder)
    edit_json(folder / "config.json", **changes)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--import", str(folder), str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and reason in err, err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_checkpoints_from_before_the_family_fields_load_as_before(tiny_checkpoint, tmp_path):
    """model_config.json written before qkv_bias, rope_* and family existed must load as the model it was (no
    biases, plain RoPE) with the same logits, and export as before (Qwen3 for a QK-norm model)."""
    ckpt = tmp_path / "step_000010"
    shutil.copytree(tiny_checkpoint, ckpt)
    os.remove(ckpt / "manifest.json")  # its sizes would flag the rewritten config
    new = ("qkv_bias", "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
           "rope_original_max_position_embeddings", "family")
    edit_json(ckpt / "model_config.json", **dict.fromkeys(new, "DELETE"))
    old, now = load_ours(str(ckpt)), load_ours(tiny_checkpoint)
    assert old.config == now.config and not old.config.qkv_bias and old.config.family == "auto"
    ids = torch.randint(0, now.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(old(ids)[0], now(ids)[0])
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 0
    assert read_json(tmp_path / "out" / "config.json")["architectures"] == ["Qwen3ForCausalLM"]


def test_biases_start_at_zero_and_train_with_adamw_without_decay(tiny_config):
    """q/k/v biases are vectors: Muon orthogonalises matrices only, and decay would pull them to 0 as it would
    a norm's scale; and initialised as norm scales (1.0) they would shift every query and key."""
    model = Transformer(tiny_config(qkv_bias=True, qk_norm=False))
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == 3 * model.config.num_hidden_layers and all((p == 0).all() for p in biases)
    groups = {name: {id(p) for p in params} for name, params in split_parameters(model).items()}
    assert {id(p) for p in biases} <= groups["adamw_no_decay"]


def test_the_new_fields_are_flags_and_validated():
    """Every ModelConfig field is a flag with its type; a llama3 setting out of range names its field."""
    cfg, _ = parse_config(["--preset", "tiny", "--qkv_bias", "true", "--qk_norm", "false", "--rope_type", "llama3",
                           "--rope_factor", "16", "--family", "qwen2"])
    assert cfg.model.qkv_bias and cfg.model.rope_type == "llama3" and cfg.model.rope_factor == 16.0
    for bad, field in ((dict(rope_factor=0.5), "rope_factor"), (dict(rope_low_freq_factor=4.0), "rope_low_freq_factor"),
                       (dict(rope_original_max_position_embeddings=0), "rope_original_max_position_embeddings")):
        with pytest.raises(ConfigError, match=field):
            ModelConfig(rope_type="llama3", **bad)
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig(rope_type="yarn")


@pytest.mark.parametrize("changes,words", [
    (dict(qk_norm=True, qkv_bias=True), "no Hugging Face family computes it"),
    (dict(family="llama"), "family='llama' needs qk_norm=False and qkv_bias=False"),
], ids=["qk-norm-and-bias", "llama-with-qk-norm"])
def test_export_refuses_a_model_no_family_computes(tiny_checkpoint, tmp_path, capsys, changes, words):
    """QK-norm with q/k/v biases (Qwen3's attention_bias puts one on o_proj too), or a family whose fields the
    model lacks, must be one error line before anything is written."""
    ckpt = tmp_path / "step_000010"
    shutil.copytree(tiny_checkpoint, ckpt)
    os.remove(ckpt / "manifest.json")
    edit_json(ckpt / "model_config.json", **changes)
    if changes.get("qkv_bias"):  # the weights a biased model has, so the shape check passes
        from safetensors.torch import load_file, save_file
        state = load_file(str(ckpt / "model.safetensors"))
        for name in [k for k in state if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            state[name.replace("weight", "bias")] = torch.zeros(state[name].shape[0])
        save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main([str(ckpt), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()
