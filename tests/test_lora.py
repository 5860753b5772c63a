"""LoRA: adapters trained on a frozen base, checked against PEFT on transformers (the merged export and the
adapter folder both give the logits our merge gives), resumed exactly, and refused in one line where they
cannot work."""

import json
import math
import os
import re

import pytest
import torch

import export_hf
import gpu_training_optimized as trainer
from llm.train.runner import start as runner_for
from config import TrainConfig
from conftest import killed_after_a_checkpoint, write_greetings
from llm.formats.loading import Kind, Source, detect, read_model
from llm.formats.lora import adapter_state, add_adapters, base_dtype, merged
from llm.reports.monitor import read_metrics
from llm.reports.start_report import stored_bytes
from modern_llm import Transformer


def with_adapters(model, t, amp_dtype):
    """add_adapters as a run calls it: the base held as base_dtype reads t.lora_base under amp_dtype."""
    return add_adapters(model, t, amp_dtype, base_dtype(t, amp_dtype))


def lora_argv(base, chats, run, *extra):
    return ["--init_from", str(base), "--sources", str(chats), "--run_dir", str(run), "--cache_dir",
            str(run) + "_cache", "--lora_rank", "4", "--micro_batch_size", "4", "--learning_rate", "1e-2",
            "--muon_lr", "0.05", "--compile", "off", "--log_interval", "1", *map(str, extra)]


def exit_line(main, argv, capsys) -> str:
    """The one error line a script's main prints for argv; it must exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def our_logits(found, ids) -> torch.Tensor:
    model = Transformer(found.config)
    model.load_stored(found.state)
    return model.eval()(ids)[0]


@pytest.fixture(scope="module")
def lora_run(qwen3_folder, tmp_path_factory):
    return train_lora(qwen3_folder, tmp_path_factory.mktemp("lora"))


def train_lora(base, folder, *extra):
    chats = write_greetings(folder / "chats.jsonl", 200)
    assert trainer.main(lora_argv(base, chats, folder / "run", "--max_steps", 12, *extra)) == 0
    return folder / "run"


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_adapters_load_in_peft_and_export_merged_with_our_logits(family, lora_run, request, tmp_path):
    """Our merge (W + B @ A * alpha / r, read back from the checkpoint) against PEFT's own forward of the
    adapter folder on transformers' base, and against transformers on the merged export, for a Qwen3 base and
    a Qwen2.5- shaped one (q/k/v biases); the adapters must have moved the model away from its base, or equal
    logits would prove nothing."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base_folder = request.getfixturevalue(f"{family}_folder")
    run = lora_run if family == "qwen3" else train_lora(base_folder, tmp_path)
    found = read_model(str(run), base=str(base_folder))
    ids = torch.randint(0, found.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = our_logits(found, ids)
    base = AutoModelForCausalLM.from_pretrained(str(base_folder)).eval()
    with torch.no_grad():
        assert (base(ids).logits - ours).abs().max() > 1e-2  # training moved it

    assert export_hf.main([str(run), str(tmp_path / "adapter"), "--adapter_only", "--base", str(base_folder)]) == 0
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (peft_model(ids).logits - ours).abs().max() < 1e-4

    assert export_hf.main([str(run), str(tmp_path / "merged"), "--base", str(base_folder)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert (exported(ids).logits - ours).abs().max() < 1e-4


def test_nf4_adapters_load_in_peft_over_torchaos_dequantised_base_and_export_merged(qwen3_folder, tmp_path):
    """A run on an nf4 base trained its adapters over the dequantised weights, so its model is W' + B @ A:
    PEFT's forward of the adapter folder on transformers' base with each targeted matrix replaced by torchao's
    own dequantisation of it must give our merged logits, and so must transformers on the merged export; on
    the file's weights PEFT must not (else the merge ignored the quantisation)."""
    from peft import PeftModel
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM
    run = train_lora(qwen3_folder, tmp_path, "--lora_base", "nf4")
    assert json.loads((ckpt := sorted((run / "checkpoints").glob("step_*"))[-1] / "adapter_config.json")
                      .read_text())["base_format"] == "nf4", ckpt
    found = read_model(str(run), base=str(qwen3_folder))
    ids = torch.randint(0, found.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = our_logits(found, ids)
    assert export_hf.main([str(run), str(tmp_path / "adapter"), "--adapter_only", "--base", str(qwen3_folder)]) == 0
    base = AutoModelForCausalLM.from_pretrained(str(qwen3_folder)).eval()
    with torch.no_grad():
        assert (PeftModel.from_pretrained(base, str(tmp_path / "adapter"))(ids).logits - ours).abs().max() > 1e-3
    base = AutoModelForCausalLM.from_pretrained(str(qwen3_folder)).eval()
    with torch.no_grad():
        for name, module in base.named_modules():
            if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                blocks = module.weight.numel() // 64  # at most 256 in these small matrices: one factor for them all
                module.weight.copy_(to_nf4(module.weight, 64, blocks).get_original_weight())
        assert (PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(ids).logits - ours).abs().max() < 1e-4
    assert export_hf.main([str(run), str(tmp_path / "merged"), "--base", str(qwen3_folder)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert (exported(ids).logits - ours).abs().max() < 1e-4


@pytest.mark.slow
def test_an_nf4_run_killed_with_kill_9_resumes_to_the_uninterrupted_losses(qwen3_folder, tmp_path):
    """kill -9 once a checkpoint is written: the base is quantised again from the same weights at --resume,
    and the losses must be those of a run never interrupted, bit for bit."""
    chats = write_greetings(tmp_path / "chats.jsonl", 200)
    common = ("--max_steps", 16, "--save_interval", 4, "--eval_interval", 8, "--lora_base", "nf4")
    assert trainer.main(lora_argv(qwen3_folder, chats, tmp_path / "full", *common)) == 0
    reference = [r["loss"] for r in read_metrics(str(tmp_path / "full"), "train")]
    killed = tmp_path / "killed"
    step = killed_after_a_checkpoint(lora_argv(qwen3_folder, chats, killed, *common), killed)
    assert 4 <= step < 16  # killed mid-run, after a checkpoint
    assert trainer.main(lora_argv(qwen3_folder, chats, killed, *common, "--resume")) == 0
    resumed = [r["loss"] for r in read_metrics(str(killed), "train")]
    assert len(resumed) == 16 and resumed == reference and all(math.isfinite(x) for x in resumed)


def test_checkpoints_hold_adapters_and_readers_need_the_base(lora_run, qwen3_folder, tiny_checkpoint, capsys):
    ckpt = sorted((lora_run / "checkpoints").glob("step_*"))[-1]
    assert (ckpt / "adapters.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    from_step, from_run = (read_model(str(p), base=str(qwen3_folder)) for p in (ckpt, lora_run))  # as printed
    assert detect(str(lora_run)) == Source(Kind.LORA, str(ckpt))  # a LoRA run is known by its checkpoint's files
    assert from_step.path == from_run.path
    assert all(torch.equal(from_step.state[k], v) for k, v in from_run.state.items())
    assert os.path.getsize(ckpt / "adapters.safetensors") < 0.2 * os.path.getsize(qwen3_folder / "model.safetensors")
    assert re.search(r"holds LoRA adapters trained on .*qwen3.*; pass --base",
                     exit_line(export_hf.main, [str(lora_run), "unused_out"], capsys))
    assert "is not the base" in exit_line(export_hf.main, [str(lora_run), "unused_out", "--base", tiny_checkpoint],
                                          capsys)


def test_the_run_lets_go_of_the_bases_read_copy_once_the_model_holds_it(qwen3_folder, tmp_path):
    """--init_from's weights are read in fp32 and copied into the model (a LoRA base then held in bf16): the
    read copy must not stay referenced for the run, 4 bytes a parameter of host memory (2 GiB for
    SmolLM2-360M)."""
    import gc
    import weakref
    chats = write_greetings(tmp_path / "chats.jsonl", 40)
    plan = trainer.make_plan(lora_argv(qwen3_folder, chats, tmp_path / "run", "--max_steps", 1))
    read = [weakref.ref(v) for v in plan.init_state.values()]
    built, plan = runner_for(plan)
    gc.collect()
    assert built.raw_model.layers[0].attn.q_proj.lora_A.weight.requires_grad  # the model is built, adapters on
    assert plan.init_state is None and not [r for r in read if r() is not None]


def test_merging_equals_the_injected_adapters_in_float64(tiny_config):
    """The merge against the model with its adapters added, computing base and adapters separately."""
    cfg = tiny_config(vocab_size=64)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    base = {k: v.clone().float() for k, v in model.state_dict().items()}
    t = TrainConfig(lora_rank=3, lora_alpha=5.0)
    with_adapters(model, t, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # B starts at zero; both factors random here
    ids = torch.randint(0, 64, (2, 12))
    injected = model(ids)[0]
    ref = Transformer(cfg).double()
    ref.load_stored({k: v.double() for k, v in merged(base, adapter_state(model), {"rank": 3, "alpha": 5.0}).items()})
    assert (ref(ids)[0] - injected).abs().max() < 1e-5  # the merge is stored in fp32


def test_adapters_reading_one_input_run_stacked_as_they_run_apart_in_float64(tiny_config, monkeypatch):
    """q, k and v (and gate and up) read one input: their bases run as one stacked matrix and their adapters'
    A matrices as one (lora.LoraStack). The loss and every adapter's gradient must equal the layers run apart
    (each LoraLinear its own base and adapter, as PEFT's, which the tests above hold our logits to), with the
    base's memory held once, and switched off the stack must run the base alone."""
    from llm.formats import lora
    cfg = tiny_config(vocab_size=64, qkv_bias=True)
    torch.manual_seed(0)
    start = Transformer(cfg).double().state_dict()
    ids = torch.randint(0, 64, (2, 12))

    def trained(stack: bool):
        model = Transformer(cfg).double()
        model.load_state_dict(start)
        if not stack:
            monkeypatch.setattr(lora, "stack_adapters", lambda model: None)
        with_adapters(model, TrainConfig(lora_rank=3, lora_alpha=5.0), torch.float32)
        monkeypatch.undo()
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)  # B starts at zero; both factors random here
        loss = model(ids, labels=ids)[1]
        loss.backward()
        return model, loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    stacked, loss, grads = trained(True)
    apart, want, want_grads = trained(False)
    assert isinstance(stacked.layers[0].attn.qkv_proj, lora.LoraStack)
    assert isinstance(stacked.layers[0].mlp.gate_up_proj, lora.LoraStack)
    assert stacked.layers[0].attn.q_proj.base_layer is None  # the base held once, stacked
    assert sum(p.numel() for p in stacked.parameters()) == sum(p.numel() for p in apart.parameters())
    assert grads.keys() == want_grads.keys() and len(grads) == 2 * 7 * cfg.num_hidden_layers
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():  # the adapters are fp32 (master weights): their sums in another order
        assert (g - want_grads[name]).abs().max() <= 1e-4 * want_grads[name].abs().max(), name
    with torch.no_grad(), lora.adapters_off(stacked), lora.adapters_off(apart):
        torch.testing.assert_close(stacked(ids)[0], apart(ids)[0], rtol=1e-12, atol=1e-12)
        plain = Transformer(cfg).double()
        plain.load_state_dict(start)
        torch.testing.assert_close(stacked(ids)[0], plain(ids)[0], rtol=1e-12, atol=1e-12)
    for m in lora.adapter_layers(stacked):
        m.dropout = 0.5  # each adapter drops its own inputs while training, none while evaluating
    with torch.no_grad():
        torch.testing.assert_close(stacked.eval()(ids)[0], apart.eval()(ids)[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(stacked.train()(ids)[0], apart(ids)[0], rtol=1e-3, atol=1e-3)


def test_adapters_off_is_the_base_for_a_while_and_the_adapters_come_back_after_an_error(tiny_config):
    """A LoRA run's reference (DPO's stored log-probabilities, GRPO's KL term) is its model with the adapters
    off: the plain model's logits, in float64, with no copy. Afterwards, even when an error left the block,
    the model must compute what it computed before."""
    from llm.formats.lora import adapters_off
    cfg = tiny_config(vocab_size=64)
    torch.manual_seed(0)
    plain = Transformer(cfg).double()
    model = Transformer(cfg).double()
    model.load_state_dict(plain.state_dict())
    with_adapters(model, TrainConfig(lora_rank=2), torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # B starts at zero: the adapters must change the logits to be seen
        ids = torch.randint(0, 64, (2, 10))
        adapted = model(ids)[0]
        assert not torch.allclose(adapted, plain(ids)[0], atol=1e-3)
        with adapters_off(model) as base:
            torch.testing.assert_close(base(ids)[0], plain(ids)[0], rtol=1e-12, atol=1e-12)
        with pytest.raises(RuntimeError), adapters_off(model):
            raise RuntimeError("a step failed")
        torch.testing.assert_close(model(ids)[0], adapted, rtol=1e-12, atol=1e-12)


def test_int8_base_holds_a_quarter_of_fp32_and_trains(tiny_config):
    cfg = tiny_config(vocab_size=64, hidden_size=128, intermediate_size=256)
    model = Transformer(cfg)
    layers = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    fp32 = sum(p.nbytes for p in layers)
    with_adapters(model, TrainConfig(lora_rank=4, lora_base="int8"), torch.float32)
    held = sum(stored_bytes(p) for n, p in model.named_parameters() if ".base_layer." in n)
    assert held < 0.3 * fp32
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, labels=ids)[1]
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert torch.isfinite(loss) and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_nf4_base_computes_torchaos_dequantised_weights_and_merges_into_them(tiny_config):
    """An nf4 base (a quarter of bf16's bytes) must compute x @ W'.T with W' torchao's own dequantisation of W
    (its to_nf4 and get_original_weight, in float64 here), the adapters beside it; and the merge must add the
    adapters to that W', not to the file's W, or an export would not be the model that trained."""
    from torchao.quantization import to_nf4
    cfg = tiny_config(vocab_size=64, hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    model = Transformer(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    with_adapters(model, TrainConfig(lora_rank=3, lora_alpha=5.0, lora_base="nf4"), torch.float32)
    held = sum(stored_bytes(p) for n, p in model.named_parameters() if ".base_layer." in n)
    bf16 = sum(2 * v.numel() for k, v in base.items() if k.startswith("layers.") and v.dim() == 2)
    assert 0.25 < held / bf16 < 0.27  # 4 bits a weight and the scales
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    layer, x = model.layers[1].mlp.up_proj, torch.randn(2, 5, 128)
    a, b = layer.lora_A.weight.double(), layer.lora_B.weight.double()
    w = base["layers.1.mlp.up_proj.weight"]
    dequantised = to_nf4(w).get_original_weight().double()  # torchao's defaults: 512 blocks of 64, 2 factors
    want = x.double() @ dequantised.T + 5.0 / 3 * x.double() @ a.T @ b.T
    assert (layer(x).double() - want).abs().max() < 1e-5
    assert (dequantised - w.double()).abs().max() > 1e-3  # 4 bits: far from the file's weights

    ids = torch.randint(0, 64, (2, 12))
    injected = model(ids)[0].double()
    state = merged(base, adapter_state(model), {"rank": 3, "alpha": 5.0, "base_format": "nf4"})
    assert torch.equal(state["layers.1.mlp.up_proj.weight"].double(), (dequantised + 5.0 / 3 * b @ a).float().double())
    ref = Transformer(cfg).double()
    ref.load_stored({k: v.double() for k, v in state.items()})
    assert (ref(ids)[0] - injected).abs().max() < 1e-4
    loss = model(ids, labels=ids)[1]
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)


def test_nf4_refuses_a_matrix_that_does_not_split_into_blocks_of_64(tiny_config):
    """torchao asserts deep inside its quantiser (a traceback) on a weight count that is not a multiple of its
    block: the run says which layer and what to pass instead, before any layer is changed."""
    from llm.base.errors import ConfigError
    model = Transformer(tiny_config(vocab_size=64, hidden_size=36, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=18, intermediate_size=64))
    with pytest.raises(ConfigError, match=r"--lora_base nf4 quantises blocks of 64 weights and layers\.0\.attn\."
                                          r"q_proj holds 36x36 = 1,296, not a multiple of 64; pass --lora_base int8"):
        with_adapters(model, TrainConfig(lora_rank=2, lora_base="nf4"), torch.float32)
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("base", ["bf16", "int8", "nf4", "fp32"])
def test_frozen_embeddings_and_head_are_held_in_bf16_under_bf16_compute(base, tiny_config):
    """Under LoRA the embedding table and head are frozen: on a bf16, int8 or nf4 base under bf16 compute they
    are held in bf16 (half their bytes; Llama-3.1-8B's two take 2 GB in bf16), a tied head still the table
    itself, and the model must compute what it computes with those two rounded to bf16 and held in fp32 (the
    residual stream stays fp32 on a CPU). On an fp32 base they stay fp32."""
    cfg = tiny_config(vocab_size=64, tie_word_embeddings=base != "int8")
    torch.manual_seed(0)
    model = Transformer(cfg)
    rounded = {k: v.to(torch.bfloat16).float() if k.split(".")[0] in ("embed_tokens", "lm_head") else v.clone()
               for k, v in model.state_dict().items()}
    ref = Transformer(cfg)
    ref.load_stored(rounded if base != "fp32" else model.state_dict())
    with_adapters(model, TrainConfig(lora_rank=2, lora_base=base), torch.bfloat16)
    want = torch.float32 if base == "fp32" else torch.bfloat16
    assert model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == want
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert model.embed_tokens(torch.tensor([[1, 2]])).dtype == torch.float32
    if base in ("bf16", "fp32"):  # the same matrices as the reference's: equal up to the order of additions
        ids = torch.randint(0, 64, (2, 12))
        with torch.autocast("cpu", torch.bfloat16):
            assert (model(ids)[0].float() - ref(ids)[0].float()).abs().max() < 2e-2


@pytest.mark.parametrize("flags, message", [
    (["--lora_rank", "65"], r"--lora_rank 65 is larger than the smaller side \(32\) of layers\.\d\.attn\.k_proj"),
    (["--lora_rank", "4", "--lora_targets", "qkv"], r"--lora_targets qkv match no linear layer"),
    (["--lora_rank", "4", "--precision", "fp32", "--lora_base", "bf16"], r"--lora_base bf16 needs bf16 compute"),
    (["--lora_rank", "4", "--precision", "fp8"], r"drop --precision fp8"),
], ids=["rank", "targets", "bf16 base", "fp8"])
def test_bad_lora_settings_are_one_line(flags, message, qwen3_folder, tmp_path, capsys):
    chats = write_greetings(tmp_path / "chats.jsonl", 50)
    argv = lora_argv(qwen3_folder, chats, tmp_path / "run", "--max_steps", 1)
    argv[argv.index("--lora_rank"):argv.index("--lora_rank") + 2] = flags
    assert re.search(message, exit_line(trainer.run, argv, capsys))


def test_lora_needs_a_base_and_a_resume_needs_the_same_one(lora_run, qwen3_folder, tiny_checkpoint, tmp_path,
                                                           capsys):
    assert "--lora_rank trains adapters on a model: pass --init_from" in exit_line(
        trainer.run, ["--lora_rank", "4", "--max_steps", "1", "--run_dir", str(tmp_path / "r")], capsys)
    argv = lora_argv(tiny_checkpoint, lora_run.parent / "chats.jsonl", lora_run, "--max_steps", 20, "--resume")
    assert "is not the base" in exit_line(trainer.run, argv, capsys)
    argv = lora_argv(qwen3_folder, lora_run.parent / "chats.jsonl", lora_run, "--max_steps", 20, "--resume",
                     "--lora_alpha", 3)
    assert "was trained with other LoRA settings; resume with --lora_alpha 8.0" in exit_line(trainer.run, argv, capsys)
    # Adapters fitted to one rounding of the base do not fit another: a resume on another --lora_base is
    # refused.
    argv = lora_argv(qwen3_folder, lora_run.parent / "chats.jsonl", lora_run, "--max_steps", 20, "--resume",
                     "--lora_base", "nf4")
    assert re.search(r"other LoRA settings; resume with --lora_base \w+", exit_line(trainer.run, argv, capsys))


def test_an_adapter_folder_loads_by_itself_in_peft_and_says_what_it_is(lora_run, qwen3_folder, tiny_checkpoint,
                                                                       tmp_path, capsys):
    """AutoPeftModelForCausalLM on the adapter folder alone (it loads the base adapter_config.json names) must
    give our merged logits; the folder carries a card naming its base and settings; --overwrite replaces an
    adapter export; a base that is not the run's (a checkpoint of ours it was not trained on) is refused in
    one line."""
    from peft import AutoPeftModelForCausalLM
    out = tmp_path / "adapter"
    assert export_hf.main([str(lora_run), str(out), "--adapter_only"]) == 0  # the base the run recorded
    found = read_model(str(lora_run), base=str(qwen3_folder))
    ids = torch.randint(0, found.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    assert (theirs - our_logits(found, ids)).abs().max() < 1e-4
    card = open(out / "README.md", encoding="utf-8").read()
    assert card.startswith(f"---\nbase_model: \"{os.path.basename(qwen3_folder)}\"\nlibrary_name: peft\n---\n")
    assert "| rank | 4 |" in card and "AutoPeftModelForCausalLM" in card

    capsys.readouterr()  # transformers' loading bars
    assert "pass --overwrite" in exit_line(export_hf.main, [str(lora_run), str(out), "--adapter_only"], capsys)
    assert export_hf.main([str(lora_run), str(out), "--adapter_only", "--overwrite"]) == 0
    line = exit_line(export_hf.main, [str(lora_run), str(tmp_path / "x"), "--adapter_only", "--base",
                                      tiny_checkpoint], capsys)
    assert f"--base {tiny_checkpoint} is not the base" in line and not (tmp_path / "x-base").exists()


def test_adapters_on_a_base_run_of_ours_export_with_that_base_in_one_command(tiny_checkpoint, tmp_path, capsys):
    """--adapter_only for adapters trained on a run of this project was refused (PEFT loads a base only by a
    name transformers knows), so the base had to be exported first and the command run again. One command now
    writes both: the base as a Hugging Face folder OUT-base, said in one printed line, and the adapter folder
    whose adapter_config.json names it; AutoPeftModelForCausalLM on the adapter folder alone gives our merged
    logits (which training moved away from the base's, or equal logits would prove nothing)."""
    from peft import AutoPeftModelForCausalLM
    run, out = train_lora(tiny_checkpoint, tmp_path), tmp_path / "adapter"
    capsys.readouterr()
    assert export_hf.main([str(run), str(out), "--adapter_only"]) == 0  # the base the run recorded: ours
    printed = [line for line in capsys.readouterr().out.splitlines() if "exported the base" in line]
    assert len(printed) == 1 and f" to {out}-base, " in printed[0], printed
    with open(out / "adapter_config.json", encoding="utf-8") as f:
        assert json.load(f)["base_model_name_or_path"] == f"{out}-base"
    found = read_model(str(run), base=tiny_checkpoint)
    ids = torch.randint(0, found.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
        ours = our_logits(found, ids)
        assert (our_logits(read_model(tiny_checkpoint), ids) - ours).abs().max() > 1e-2  # training moved it
    assert (theirs - ours).abs().max() < 1e-4


def test_fine_tuning_takes_fine_tuning_rates_unless_given(qwen3_folder, tmp_path, capsys):
    """--init_from with the rates left automatic trained a pretrained model's adapters at the tiny preset's
    rates for training from scratch (Muon 0.03, AdamW 5e-3), which undid what it knew (docs/fine-tuning.md);
    LoRA and full fine-tuning now take AdamW at the measured rates of fine_tuning.FINE_TUNING_RATES, the start
    report says so, and a value given on the command line still wins. A run from scratch keeps Muon."""
    from llm.train.fine_tuning import FINE_TUNING_OPTIMIZER, FINE_TUNING_RATES
    chats = write_greetings(tmp_path / "chats.jsonl", 40)
    common = ["--init_from", str(qwen3_folder), "--sources", chats, "--cache_dir", str(tmp_path / "cache"),
              "--micro_batch_size", "4", "--max_steps", "2", "--compile", "off"]
    for name, extra, kind in (("lora", ["--lora_rank", "4"], "lora"), ("full", [], "full"),
                              ("given", ["--lora_rank", "4", "--muon_lr", "0.01"], "lora")):
        assert trainer.main([*common, "--run_dir", str(tmp_path / name), *extra]) == 0
        train = json.loads((tmp_path / name / "config.json").read_text())["train"]
        want = {**FINE_TUNING_RATES[kind], "optimizer": FINE_TUNING_OPTIMIZER,
                **({"muon_lr": 0.01} if name == "given" else {})}
        assert {k: train[k] for k in want} == want, name
        report = capsys.readouterr().out
        assert ("fine-tuning LoRA adapters on" if kind == "lora" else "fine-tuning every weight of") in report
        assert "learning_rate=0.005" not in report and "muon_lr=0.03" not in report
    scratch = tmp_path / "scratch"
    assert trainer.main(["--preset", "tiny", "--sources", chats, "--cache_dir", str(tmp_path / "cache2"), "--run_dir",
                         str(scratch), "--max_steps", "1", "--compile", "off", "--micro_batch_size", "2"]) == 0
    assert json.loads((scratch / "config.json").read_text())["train"]["optimizer"] == "muon"


def test_fine_tuning_a_run_of_ours_takes_its_recorded_rates(corpus, argv_for, tmp_path, capsys):
    """SmolLM2's fine-tuning rates left a 2.4M-parameter run of ours where it was (a chat loss of 5.7 where
    its own rates reached 0.14): a base that is a run of ours is fine-tuned with the optimizer and peak rates
    its config.json recorded (adapters with AdamW at its AdamW rate). A base that was itself fine-tuned once
    gave SmolLM2's rates (a DPO stage after a chat stage then trained at 1e-6 and learned nothing): it now
    gives the rates it trained at, where it is of the same kind (LoRA rates are not every weight's)."""
    from llm.train.fine_tuning import FINE_TUNING_RATES
    base = tmp_path / "base"
    assert trainer.main(argv_for(corpus, base, "--max_steps", 1, "--learning_rate", 0.003, "--muon_lr", 0.02)) == 0
    capsys.readouterr()
    chats = write_greetings(tmp_path / "chats.jsonl", 40)
    common = ["--sources", chats, "--cache_dir", str(tmp_path / "cache"), "--micro_batch_size", "4",
              "--max_steps", "1", "--compile", "off"]
    for name, start, extra, want in (
            ("full", base, [], {"optimizer": "muon", "learning_rate": 0.003, "muon_lr": 0.02}),
            ("lora", base, ["--lora_rank", "4"], {"optimizer": "adamw", "learning_rate": 0.003}),
            ("again", tmp_path / "full", [], {"optimizer": "muon", "learning_rate": 0.003, "muon_lr": 0.02}),
            ("lora_of_full", tmp_path / "full", ["--lora_rank", "4"], {"optimizer": "adamw",
                                                                       **FINE_TUNING_RATES["lora"]})):
        assert trainer.main(["--init_from", str(start), "--run_dir", str(tmp_path / name), *common, *extra]) == 0
        train = json.loads((tmp_path / name / "config.json").read_text())["train"]
        assert {k: train[k] for k in want} == want, name
        recorded = "the peak rates the --init_from run trained at" in capsys.readouterr().out
        assert recorded == (name != "lora_of_full"), name


def test_a_damaged_adapter_config_is_refused_under_python_dash_o_too(tmp_path):
    """read_meta once validated with assert, which `python -O` strips: a rank of 0 then loaded as adapters."""
    import json
    import subprocess
    import sys
    meta = {"rank": 0, "alpha": 8, "dropout": 0.0, "targets": ["q_proj"], "base": "b", "base_fingerprint": "f"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(meta))
    code = ("from llm.formats.lora import read_meta\nfrom llm.base.errors import CheckpointError\n"
            f"try:\n    read_meta({str(tmp_path)!r})\nexcept CheckpointError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.startswith("refused:") and "is damaged" in done.stdout, done.stdout + done.stderr
