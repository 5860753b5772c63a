"""Tests of autofill.py: automatic values fill only the fields left automatic, for the machine and corpus
given (GPUs stubbed as Machine records), and every choice is reported with its reason."""

import math
from dataclasses import replace

import pytest

from config import Config, DataConfig, ModelConfig, TrainConfig, preset_tiny
from llm.base import sizing
from llm.base.errors import ConfigError
from llm.base.sizing import Machine
from llm.train import autofill

CPU = Machine("cpu", "cpu, 2 threads")
GIB = 2**30


def test_a_cpu_gets_the_tiny_size_and_a_ten_minute_budget():
    cfg = Config()
    filled, notes = autofill.fill_automatic(cfg, CPU, corpus_bytes=30_000_000)
    assert cfg == Config()  # the caller's config stays as it was: every filler returns a new one
    cfg, tiny = filled, preset_tiny()
    assert cfg.model == tiny.model
    assert (cfg.train.micro_batch_size, cfg.train.learning_rate, cfg.train.muon_lr) == (16, 5e-3, 0.01)
    assert len(notes) == 1 and "hidden_size=192" in notes[0] and "no CUDA device" in notes[0]
    cfg, notes = autofill.fill_run_length(cfg, CPU, train_tokens=9_000_000)
    assert (cfg.train.max_steps, cfg.train.max_minutes) == (0, 10.0)
    assert "max_minutes=10" in notes[0] and "no step limit" in notes[1]


def test_values_written_by_hand_are_never_changed():
    """A width, a step count and a rate given by the user stay; the fields that depend on them follow."""
    cfg = Config(model=ModelConfig(hidden_size=384), train=TrainConfig(max_steps=33, learning_rate=1e-3))
    cfg, notes = autofill.fill_automatic(cfg, CPU, corpus_bytes=1_000_000)
    assert (cfg.model.hidden_size, cfg.train.max_steps, cfg.train.learning_rate) == (384, 33, 1e-3)
    assert cfg.model.head_dim == 384 // cfg.model.num_attention_heads and cfg.model.intermediate_size == 1024
    assert "hidden_size" not in notes[0] and "learning_rate" not in notes[0]
    cfg, notes = autofill.fill_run_length(cfg, CPU, train_tokens=1_000_000)
    assert notes == [] and cfg.train.max_minutes == 0  # steps written: no time budget
    assert autofill.fill_automatic(cfg, CPU, corpus_bytes=1) == (cfg, [])  # nothing left automatic: nothing to say


def test_a_written_value_that_fits_no_automatic_one_is_refused_with_both_named():
    with pytest.raises(ConfigError, match=r"hidden_size=100 .*num_attention_heads=3 .*after filling the automatic "
                                          r"fields .*num_attention_heads.*tiny preset"):
        autofill.fill_automatic(Config(model=ModelConfig(hidden_size=100)), CPU, corpus_bytes=1_000_000)


@pytest.mark.parametrize("memory_gib,corpus_mb,expected", [
    (80, 32, "small"),  # a corpus of 8M tokens feeds no more than ~160M parameters
    (80, 40_000, "xl"),  # a 10B-token corpus and an 80 GB GPU: the largest preset
    (24, 40_000, "large"),  # xl needs more than 80% of 24 GB
    (16, 40_000, "medium"),  # so does large with 12k tokens a forward; medium fits 8 x 1,024
    (4, 40_000, "tiny"),  # not even small fits
])
def test_a_gpu_run_in_steps_gets_the_largest_preset_its_memory_and_the_corpus_allow(memory_gib, corpus_mb, expected):
    """With its length in steps (no time budget), the size weighs memory (without activation checkpointing)
    and the corpus: an 80 GB GPU once got the 1.4B-parameter xl for a corpus of 8M tokens, which it memorises
    in minutes."""
    cfg = Config(train=TrainConfig(max_steps=5000))
    cfg, notes = autofill.fill_automatic(cfg, Machine("cuda", "GPU", memory_gib * GIB), corpus_bytes=corpus_mb * 10**6)
    assert f"the {expected} preset" in notes[0]
    assert not cfg.model.gradient_checkpointing  # config.py's value, which no preset overrides here
    if expected != "tiny":  # the chosen size fits both limits
        tokens = corpus_mb * 10**6 / sizing.BYTES_PER_TOKEN
        assert sizing.count_parameters(cfg.model) <= autofill.MAX_PARAMETERS_PER_CORPUS_TOKEN * tokens
        assert sizing.training_bytes_estimate(cfg) <= 0.8 * memory_gib * GIB


def test_a_gpu_run_passes_over_its_corpus_four_times_within_an_hour():
    """A user's corpus on a GPU: four passes over it, or the hour's budget where they would take longer."""
    cfg = Config()
    cfg, _ = autofill.fill_automatic(cfg, Machine("cuda", "GPU", 80 * GIB), corpus_bytes=32 * 10**6)
    assert cfg.data.max_tokens == 0  # a corpus of the user's own: all of it, as max_tokens=0 says
    sized = cfg
    gpu = Machine("cuda", "GPU", 80 * GIB)
    cfg, notes = autofill.fill_run_length(sized, gpu, train_tokens=80_000_000, world_size=2)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * 2 * cfg.model.max_seq_len
    assert cfg.train.max_steps == -(-4 * 80_000_000 // per_step) > autofill.MIN_STEPS and cfg.train.max_minutes == 0
    assert "4 passes over 80,000,000 training tokens" in notes[-1]
    # two unknown GPUs (100 TFLOP/s assumed) at 40% MFU for an hour: 2.88e17 FLOPs, 714 MFLOP a token of
    # small: about 0.4B tokens, fewer than four passes over 200M
    cfg, notes = autofill.fill_run_length(sized, gpu, train_tokens=200_000_000, world_size=2)
    assert (cfg.train.max_steps, cfg.train.max_minutes) == (0, 60)
    assert "4 passes over 200,000,000 training tokens would not fit" in notes[0]


@pytest.mark.parametrize("preset,memory_gib,world,expected", [
    ("small", 80, 1, (64, 4)),  # an H100: the 65,536-token cap, not memory, bounds it
    ("large", 80, 1, (128, 8)),  # 170 sequences of 384 would be the cap: the power of two below
    ("small", 24, 1, (32, 8)),  # a 24 GB card: 64 x 1,024 needs about 32 GiB
    ("small", 80, 2, (64, 2)),  # two ranks: each accumulates half as many micro-steps
    ("small", 0, 1, (16, 16)),  # a CPU: 16 sequences, as the presets had
])
def test_an_automatic_micro_batch_fills_the_memory_and_accumulation_keeps_the_step(preset, memory_gib, world,
                                                                                    expected):
    """The GPU presets ran 12-16k tokens a forward (9 GiB of an H200's 140); they now leave the micro-batch to
    the memory, and the step keeps its tokens."""
    from config import PRESETS
    machine = Machine("cuda", "GPU", memory_gib * GIB) if memory_gib else CPU
    cfg, notes = autofill.fill_automatic(PRESETS[preset](), machine, corpus_bytes=None, world_size=world)
    t = cfg.train
    assert (t.micro_batch_size, t.grad_accum_steps) == expected
    assert t.micro_batch_size * cfg.model.max_seq_len * t.grad_accum_steps * world == PRESETS[preset]().train.batch_tokens
    assert any(f"micro_batch_size={expected[0]}, grad_accum_steps={expected[1]}" in note for note in notes)
    if memory_gib:
        assert sizing.training_bytes_estimate(cfg) <= 0.8 * memory_gib * GIB


def test_a_micro_batch_written_by_hand_is_kept_and_accumulation_follows():
    from config import preset_small
    cfg = preset_small()
    cfg.train = replace(cfg.train, micro_batch_size=8)
    cfg, _ = autofill.fill_automatic(cfg, Machine("cuda", "GPU", 80 * GIB), corpus_bytes=None)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (8, 32)
    cfg.train = replace(cfg.train, grad_accum_steps=4)  # all three written, and they disagree
    with pytest.raises(ConfigError, match=r"batch_tokens=262144 is not micro_batch_size=8 x max_seq_len=1024 x "
                                          r"grad_accum_steps=4"):
        autofill.fill_automatic(cfg, Machine("cuda", "GPU", 80 * GIB), corpus_bytes=None)


H100 = Machine("cuda", "NVIDIA H100 80GB HBM3", 80 * GIB)
RTX4090 = Machine("cuda", "NVIDIA GeForce RTX 4090", 24 * GIB)


@pytest.mark.parametrize("machine,peak_tflops,optimal_m,micro", [
    (H100, 989.4, 109, 64),  # 3600 s x 989.4e12 x 0.40 = 1.42e18 FLOPs; sqrt(1.42e18 / 120) = 109M
    (RTX4090, 165.2, 45, 32),  # 2.38e17 FLOPs: 45M; small (2.2x it) is nearer on a log scale than tiny (a 19th)
])
def test_a_no_flag_gpu_run_trains_the_model_an_hour_buys(machine, peak_tflops, optimal_m, micro):
    """With nothing written and the default corpus (larger than any run: corpus_bytes None), a GPU trained the
    2.4M-parameter tiny preset for 67 s (issue #42). Now an hour's compute picks the model (C = 6 N D, D = 20
    N), the micro-batch holds 32k tokens or more, and the corpus fetch is told the tokens the hour trains on.
    """
    cfg, notes = autofill.fill_automatic(Config(), machine, corpus_bytes=None)
    flops = 60 * 60 * peak_tflops * 1e12 * 0.40  # an hour at the MFU measured on an H200
    assert math.sqrt(flops / (6 * 20)) / 1e6 == pytest.approx(optimal_m, abs=0.5)
    assert "the small preset" in notes[0] and cfg.model.hidden_size == 768  # 100M: nearest, by far, on a log scale
    # small's training FLOPs a token by hand: 6 x 100,073,472 matmul weights (its 100,094,208 parameters, the
    # head tied, less the norms' 20,736) + attention's 12 x 12 layers x 12 heads x 64 wide x 1,024 positions
    small_flops = 6 * 100_073_472 + 12 * 12 * 12 * 64 * 1024
    assert cfg.data.max_tokens == pytest.approx(flops / small_flops, rel=1e-6)  # 2.0B on an H100, 0.33B on a 4090
    assert cfg.train.micro_batch_size == micro and micro * 1024 >= 32_768
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps * 1024 == 262_144
    report = "\n".join(notes)
    assert f"60 min x {peak_tflops:.0f} TFLOP/s ({machine.name} peak) x 40% MFU" in report
    assert f"{cfg.data.max_tokens / 1e9:.2f}B tokens" in report and "GB of token shards" in report
    cfg, notes = autofill.fill_run_length(cfg, machine, train_tokens=cfg.data.max_tokens)
    assert cfg.train.max_minutes == 60  # four passes over the fetched tokens take longer: the hour ends the run


def test_a_longer_budget_or_a_slower_gpu_moves_the_model():
    """Ten hours on an H100 buy 1.42e19 FLOPs: sqrt(1.42e19 / 120) = 344M parameters, large's 346M (medium's
    303M is further on a log scale). An hour on a T4 (65 TFLOP/s) buys 9.4e16: 28M, and small, 3.6x that, is
    too big."""
    cfg, notes = autofill.fill_automatic(Config(train=TrainConfig(max_minutes=600)), H100, corpus_bytes=None)
    assert "the large preset" in notes[0] and cfg.train.max_minutes == 600  # a budget written is the budget used
    t4 = Machine("cuda", "Tesla T4", 15 * GIB)
    cfg, notes = autofill.fill_automatic(Config(), t4, corpus_bytes=None)
    assert "the tiny preset" in notes[0] and "28M parameters" in notes[0]
    # tiny would read far more than the hour's compute-optimal tokens at the planned speed: 20 x 28M is the
    # fetch
    assert cfg.data.max_tokens == pytest.approx(20 * math.sqrt(3600 * 65e12 * 0.40 / 120), rel=1e-6)


def test_a_users_corpus_still_caps_the_model_and_is_read_whole():
    """--sources with a small corpus on an H100: 11 MB (about 2.75M tokens) feeds at most 55M parameters, so
    tiny, whatever the hour buys; and max_tokens stays 0, all of the user's corpus."""
    cfg, notes = autofill.fill_automatic(Config(), H100, corpus_bytes=11_000_000)
    assert "the tiny preset" in notes[0] and cfg.data.max_tokens == 0
    assert not any(note.startswith("budget:") for note in notes)  # the plan is for a corpus fetched for the run
    cfg, notes = autofill.fill_automatic(Config(data=DataConfig(max_tokens=5_000)), H100, corpus_bytes=None)
    assert cfg.data.max_tokens == 5_000  # written: kept


def test_a_budget_too_short_for_a_compile_to_pay_back_trains_eagerly_unless_compile_was_chosen():
    """A compile from an empty cache takes 20-60 s on a CPU: under a 0.3-minute budget it once spent the whole
    budget and the run ended at 5x its budget. Left automatic, compile is off under COMPILE_PAYS_MINUTES and
    says so; a longer budget, no budget, or a mode the user chose keep compiling."""
    def filled(minutes, compile_mode="auto"):
        cfg = preset_tiny()
        return autofill.fill_automatic(replace(cfg, train=replace(cfg.train, max_minutes=minutes,
                                                                  compile=compile_mode)), CPU, corpus_bytes=1_000_000)
    short, notes = filled(0.3)
    assert short.train.compile == "off" and any("compile=off" in n and "0.3-minute" in n for n in notes), notes
    assert filled(autofill.COMPILE_PAYS_MINUTES)[0].train.compile == "auto"
    assert filled(0)[0].train.compile == "auto"  # a run in steps
    assert filled(0.3, "default")[0].train.compile == "default"  # what a user writes is what runs


def test_a_grpo_run_off_cuda_left_at_compile_auto_trains_eagerly():
    """Off CUDA a compiled GRPO step measured no faster than the eager one (which trains a prompt once for
    several replies) and took more memory: left automatic, compile is off there and says why; on CUDA, or
    for another objective, or where the user chose a mode, it stays. (test_grpo_training.py runs one.)"""
    def filled(machine, objective="grpo", compile_mode="auto"):
        cfg = preset_tiny()
        cfg = replace(cfg, train=replace(cfg.train, objective=objective, compile=compile_mode))
        return autofill.fill_compile(cfg, machine)
    cfg, notes = filled(CPU)
    assert cfg.train.compile == "off" and any("compile=off" in n and "GRPO" in n for n in notes), notes
    assert filled(H100)[0].train.compile == "auto"
    assert filled(CPU, "dpo")[0].train.compile == "auto"
    assert filled(CPU, compile_mode="default")[0].train.compile == "default"


def test_a_short_fine_tune_takes_smaller_batches_so_that_it_has_steps_to_learn_in():
    """300 short chats (33 windows) at --epochs 3 once ran 7 steps of 16 windows and learned nothing. With the
    batch left automatic the run now has one window a step, 99 steps, said in a line; a batch written by hand
    stays (and gets a warning), and a large corpus keeps its batch."""
    automatic = {"batch_tokens", "grad_accum_steps", "micro_batch_size"}
    cfg = replace(preset_tiny(), train=replace(preset_tiny().train, init_from="runs/base", epochs=3.0))
    cfg, _ = autofill.fill_automatic(cfg, CPU, corpus_bytes=30_000)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (16, 1)
    small, notes = autofill.fill_run_length(cfg, CPU, train_tokens=0, epoch_sequences=33, automatic=automatic)
    t = small.train
    assert (t.micro_batch_size, t.grad_accum_steps, t.max_steps) == (1, 1, 99)
    assert t.batch_tokens == cfg.model.max_seq_len and "too few to learn" in notes[0]
    kept, notes = autofill.fill_run_length(cfg, CPU, train_tokens=0, epoch_sequences=33, automatic=set())
    assert (kept.train.micro_batch_size, kept.train.max_steps) == (16, 7)
    assert notes[-1].startswith("warning: 7 optimizer steps are too few")
    large, notes = autofill.fill_run_length(cfg, CPU, train_tokens=0, epoch_sequences=3300, automatic=automatic)
    assert (large.train.micro_batch_size, large.train.max_steps) == (16, 619) and not any("warning" in n for n in notes)


def test_a_fine_tune_whose_rate_times_steps_cannot_move_a_weight_is_warned_before_it_starts():
    """A DPO run at 1e-6 for 3 steps learned nothing and said nothing (an Adam step moves a weight by about
    its rate: 3e-6 in all). Before it starts, a fine-tune whose peak rate times its steps is below MIN_MOVE
    gets one line naming the rate and what to change; the rate runs that learned here (2.5e-4 for 50 steps)
    get none, nor does a run from scratch or one measured by a time budget."""
    from llm.train.fine_tuning import MIN_MOVE, fill_grpo, small_move_warning
    tiny = TrainConfig(init_from="runs/chat", optimizer="adamw", learning_rate=1e-6, max_steps=3)
    line, = small_move_warning(Config(train=tiny))
    assert "learning_rate=1e-06 for 3 steps" in line and "raise --learning_rate" in line
    assert small_move_warning(Config(train=replace(tiny, learning_rate=2.5e-4, max_steps=50))) == []
    assert small_move_warning(Config(train=replace(tiny, init_from=""))) == []
    assert small_move_warning(Config(train=replace(tiny, max_steps=0, max_minutes=5))) == []
    muon = replace(tiny, optimizer="muon", muon_lr=1e-6, learning_rate=0.1)  # Muon trains the matrices
    assert "muon_lr=1e-06" in small_move_warning(Config(train=muon))[0]
    assert small_move_warning(Config(train=replace(tiny, max_steps=math.ceil(MIN_MOVE / 1e-6)))) == []
    grpo = Config(train=TrainConfig(init_from="x", optimizer="adamw", learning_rate=1e-6, max_steps=4,
                                    objective="grpo", reward=["gsm8k"]))
    lines = fill_grpo(grpo, 100, 10, 64, None)[1]
    assert any(line.startswith("warning: learning_rate=1e-06 for 4 steps") for line in lines)


def test_a_grpo_runs_automatic_micro_batch_is_of_its_rows_and_the_cards_memory():
    """A GRPO step's replies once trained one prompt's G a forward: 8 rows of ~300 tokens, 2,400 tokens, a
    GPU's fraction. Its micro-batch is now chosen as a pretraining run's, at its rows: all 32 replies of a
    135M model's LoRA step in one forward on an 80 GB card (the context's 8,192 tokens would allow 8), fewer
    on a card whose memory holds fewer, and never one that the estimate says does not fit."""
    from llm.train.fine_tuning import at_rows_of
    smol = ModelConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, max_seq_len=8192)
    lora = TrainConfig(init_from="x", objective="grpo", lora_rank=16, precision="bf16")
    cfg = Config(model=smol, train=lora)
    big = Machine("cuda", "GPU", 80 * GIB)
    assert autofill.fit_micro(cfg, big, 32)[0] == 8  # at the context: the 65,536-token cap
    assert autofill.fit_micro(at_rows_of(cfg, 300), big, 32)[0] == 32
    small = Machine("cuda", "GPU", 2 * GIB)
    micro = autofill.fit_micro(at_rows_of(cfg, 300), small, 32)[0]
    need = lambda m: sizing.training_bytes_estimate(replace(at_rows_of(cfg, 300),  # noqa: E731
                                                            train=replace(cfg.train, micro_batch_size=m)))
    assert 0 < micro < 32 and need(micro) <= autofill.MEMORY_FRACTION * small.memory < need(2 * micro)
