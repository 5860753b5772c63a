"""What a training run starts from, settled before its model is built: the final config (--init_from's shape
and tokenizer, a resumed run's automatic fields, fine-tuning rates, the machine's sizing, the micro-batch that
fits, the run length from the tokenized corpus), the checkpoint it continues and the data it reads. The
trainer calls settle() once for its Plan (plan.py); everything it refuses is refused here, before a model
exists."""

import math
import shlex
import sys
from dataclasses import replace

import psutil
import torch

from config import AUTO, Config
from llm.base.cli import describe
from llm.base.device import autocast, float8_training, machine, pick_precision
from llm.base.distributed import Ranks
from llm.base.errors import ConfigError
from llm.base.fit import FIT_FRACTION, Target, count_parameters, estimate, held_base, suggest
from llm.base.sizing import BYTES_PER_TOKEN, loss_chunk_rows
from llm.data import hf_datasets
from llm.data.batches import run_loaders
from llm.data.corpus import BUNDLED, GPU_CORPUS, corpus_bytes, in_arrival_order, is_bundled, source_files
from llm.data.corpus_totals import short_of_target
from llm.data.preparation import prepare_once
from llm.data.prompts import PromptSplit, read as read_prompts
from llm.formats.hf_hub import hub_shape, is_hub_name
from llm.formats.lora import fingerprint
from llm.formats.trainer_state import Saved
from llm.reports.model_card import next_token_train
from llm.scores.rewards import load_all
from llm.train.autofill import fill_automatic, fill_compile, fill_run_length, fit_micro, fit_micro_batch
from llm.train.fine_tuning import (ChosenRates, at_rows_of, check_grpo, check_used, fill_fine_tuning,
                                   fill_grpo, fill_preference, grpo_row)
from llm.train.resume import (apply_init_from, carry_settings, check_run_folder, check_same_data,
                              check_same_shape, lora_start, resume_point, with_shape)
from llm.train.plan import Plan, run_row, step_settings
from llm.train.runner import new_model


def bundled_report(cfg: Config, size: int) -> list[str]:
    """A line naming the bundled corpus and its size, when the run reads it."""
    if not is_bundled(cfg.data):
        return []
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    capped = " of them (max_source_mb)" if cfg.data.max_source_mb else ""
    return [f"corpus: the bundled one (--sources {BUNDLED}), Python {version}'s standard library without its "
            f"tests: {len(source_files(cfg.data))} files, {size / 1e6:.1f} MB{capped}, about "
            f"{size / BYTES_PER_TOKEN / 1e6:.1f}M tokens by its size (the tokenizer counts them below)"]


def default_corpus(cfg: Config, device: torch.device, saved: Saved | None = None) -> tuple[Config, list[str]]:
    """cfg reading the GPU default corpus where no --sources are given on CUDA and the Hub or the cache has
    it, with a line saying so; else cfg as it is, and on CUDA a line saying why the bundled corpus is read
    instead. saved: a resumed run's trainer state, whose corpus it goes on with (the Hub is not asked)."""
    if device.type != "cuda" or cfg.data.sources:
        return cfg, []
    if saved is not None:
        had = saved.config.get("data", {}).get("sources") == [GPU_CORPUS]
        return replace(cfg, data=replace(cfg.data, sources=[GPU_CORPUS] if had else [])), []
    problem = hf_datasets.unavailable(GPU_CORPUS)
    if problem:
        return cfg, ["data: the GPU default corpus cannot be read "
                     f"({problem.removeprefix('data source ')}); training on the bundled one instead; run "
                     "once with the Hub in reach to fetch it, or pass --sources"]
    return replace(cfg, data=replace(cfg.data, sources=[GPU_CORPUS])), [
        f"data: the GPU default corpus, FineWeb-Edu's sample ({GPU_CORPUS}): the files the token target "
        "below needs come into the Hugging Face cache (HF_HOME), training starting on the first while the "
        "rest arrive, and a later run reads them offline"]


def trains_while_arriving(cfg: Config, ranks: Ranks) -> bool:
    """Whether the run starts on the first files of its corpus while the rest download and tokenize
    (arrival.py): one Hub dataset read to a token target, in one process (other ranks would read parts rank 0
    has not written), a run whose length is not in passes over the corpus, and windows that are not packed
    across it."""
    d = cfg.data
    return in_arrival_order(d) and d.max_tokens > 0 and ranks.world_size == 1 and not cfg.train.epochs and \
        d.packing != "documents"


def corpus_size(cfg: Config, device: torch.device) -> int | None:
    """The bytes of text sizing plans with: None for the GPU default (larger than any run here); for a Hub
    dataset with a token target whose size picks no model (a CPU run, or a model given), the text that target
    reads, so its files download while the run trains; else the sources' size (a Hub dataset's files fetched
    first)."""
    if cfg.data.sources == [GPU_CORPUS]:
        return None
    if (in_arrival_order(cfg.data) and cfg.data.max_tokens
        and (device.type != "cuda" or not cfg.model.automatic())):
        return int(cfg.data.max_tokens * BYTES_PER_TOKEN)
    return corpus_bytes(cfg.data)


def fit_check(cfg: Config, device: torch.device, world_size: int = 1) -> list[str]:
    """The run's peak memory by the estimate (fit.py) beside the device's, as a report line; a run it says
    cannot fit the GPU (or clearly exceeds a CPU's RAM) is refused in one line naming the first change that
    fits. An automatic micro-batch is estimated at one sequence: sizing then picks the largest that fits.
    Under FSDP over several GPUs each holds a share of the weights and state, which the estimate does not
    divide: never refused."""
    where = machine(device)
    memory = where.memory if device.type == "cuda" else psutil.virtual_memory().total
    return fit_lines(cfg, where, pick_precision(cfg.train.precision, device), memory, world_size)


def fit_lines(cfg: Config, where, amp_dtype: torch.dtype | None, memory: int,
              world_size: int = 1) -> list[str]:
    """fit_check's report lines for a run on `where` (a sizing.Machine: a GPU, or this machine's CPU) of
    `memory` bytes under autocast in amp_dtype (None: fp32), or its refusal; what tools/what_fits.py asks of a
    card named."""
    t, gpu = cfg.train, where.kind == "cuda"
    if not t.micro_batch_size:
        cfg = replace(cfg, train=replace(t, micro_batch_size=1))
    target = Target(where.kind, 4 if amp_dtype is None else 2, compiled=t.compile != "off",
                    loss_rows=loss_chunk_rows(cfg, where), fp16=amp_dtype == torch.float16)
    room = FIT_FRACTION * memory if gpu else memory
    terms = estimate(cfg, target)
    need = terms.total
    m, micro = cfg.model, cfg.train.micro_batch_size
    held = held_base(t.lora_base, target.bf16)
    run = (f"LoRA rank {t.lora_rank} on a {held} base" if t.lora_rank else "training every weight") + \
        f" of {_size(count_parameters(m))} parameters, {micro} x {m.max_seq_len:,} tokens a forward" + \
        (", checkpointed" if m.gradient_checkpointing else "")
    line = f"memory: about {need / 2**30:.1f} GiB at the step's peak by the estimate ({run}), beside " \
        f"{memory / 2**30:.1f} GiB on {where.name}"
    if need <= room or (t.data_parallel == "fsdp" and world_size > 1):
        return [line + (f" (FSDP: a share of it on each of {world_size} GPUs)" if need > room else ""),
                f"memory: {terms.summary()}"]
    bases = ("auto", "int8", "nf4") if target.bf16 else ("auto", "int8")  # nf4 computes under bf16 only
    flags, least, base = suggest(cfg, target, room / FIT_FRACTION, bases)
    what = (f"{t.init_from or 'the run'}: {run} needs about {need / 2**30:.1f} GiB by the estimate, "
            f"more than the {room / 2**30:.1f} GiB a run may fill of {where.name}")
    least_gib = estimate(least, target, base).total / 2**30
    if least_gib > IMPLAUSIBLE_GIB:
        raise ConfigError(f"{what}; even its least form needs {least_gib / 2**10:,.0f} TiB, more than any "
                          f"machine holds: the model's shape ({_size(count_parameters(m))} parameters) is "
                          "implausible, check its config (hidden_size, num_hidden_layers, vocab_size)")
    if flags:
        fix = f"pass {flags} (about {least_gib:.1f} GiB)"
    else:
        base = base or held  # the default base
        lora = f"{least.train.lora_rank}-rank LoRA on {'an' if base[0] in 'fin' else 'a'} {base} base, " \
            if least.train.lora_rank else ""
        fix = f"nothing this version offers fits it (the least, {lora}checkpointed, one sequence of " \
              f"{least.model.max_seq_len} tokens, needs {least_gib:.1f} GiB); use a GPU of " \
              f"{math.ceil(least_gib * 2**30 / FIT_FRACTION / 1e9)} GB or more, or a smaller model"
    raise ConfigError(f"{what}; {fix}")


IMPLAUSIBLE_GIB = 2**17  # 128 TiB, 100x the largest open model's bf16 weights: a typo, not a model to buy for


def _size(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


def settle(cfg: Config, ranks: Ranks, device: torch.device) -> Plan:
    """Every value the run will use, in one pass; each filler returns a new config and the lines saying what
    it set, and fills only what is still automatic (a value given in config.py or by a flag stays):
        apply_init_from   model shape, tokenizer                      --init_from
        carry_settings    the automatic fields a resumed run had      --resume
        fill_fine_tuning  optimizer and rates for a pretrained base   --init_from
        default_corpus    sources: FineWeb-Edu on a GPU               no --sources
        fill_automatic    preset shape and rates, batch, max_tokens,  this machine, the corpus size
                          compile (fill_compile)
        fit_micro_batch   micro-batch and accumulation                --auto_micro_batch, on CUDA
        fill_preference   objective, beta; rates x 1/20 for pairs      the tokenized corpus
        fill_run_length   max_steps, max_minutes, eval_batches        the tokenized corpus
    A GRPO run reads prompts, not a token cache, from fill_fine_tuning on (settle_prompts).
    Refuses what cannot run before the model is built."""
    init = None
    if is_hub_name(cfg.train.init_from):  # refused before any weight downloads: its config.json is enough
        shaped = with_shape(cfg, hub_shape(cfg.train.init_from, cfg.model.max_seq_len))
        if cfg.train.objective == "grpo":  # rows of a prompt and a reply: what fails at the reply's alone
            shaped = at_rows_of(shaped, grpo_row(shaped, 1))
        fit_check(shaped, device, ranks.world_size)
    if cfg.train.init_from:
        cfg, init = apply_init_from(cfg)
    ckpt, saved, notes = resume_point(cfg)
    lora_meta = lora_start(cfg, ckpt, init)
    if ranks.is_main:
        check_run_folder(cfg.train, resuming=ckpt is not None)  # before the data, which may take a while
    if saved:
        cfg, lines = carry_settings(cfg, saved)
        notes += lines
    base_train = next_token_train(init.path) if init else None  # a run of ours: the rates it trained at
    # What sizing fills: preference and GRPO scale the rates, a short fine-tune takes smaller batches.
    automatic = {k for k in ("learning_rate", "muon_lr", "batch_tokens", "grad_accum_steps",
                             "micro_batch_size") if getattr(cfg.train, k) == AUTO}
    # Before the presets' rates, which are for training from scratch; said once the objective has scaled them.
    cfg, chosen = fill_fine_tuning(cfg, base_train)
    if cfg.train.objective == "auto" and cfg.train.reward:  # rewards given: the run learns from them
        cfg = replace(cfg, train=replace(cfg.train, objective="grpo"))
    if cfg.train.objective == "grpo":  # prompts and rewards, not a token cache
        return settle_prompts(cfg, ranks, device, (ckpt, saved, init, lora_meta), notes, chosen)
    cfg, lines = default_corpus(cfg, device, saved)
    notes += lines
    size = corpus_size(cfg, device)
    cfg, lines = fill_automatic(cfg, machine(device), size, ranks.world_size)
    lines += fit_check(cfg, device, ranks.world_size)  # before the data and the compile
    # before the data's lines
    ranks.print("\n".join([describe(cfg), *notes, *lines, *bundled_report(cfg, size)]))
    arriving = trains_while_arriving(cfg, ranks)
    data = prepare_once(cfg, ranks, background=arriving)
    if not arriving and (line := short_of_target(cfg.data, data.meta)):  # else the preparing thread says it
        ranks.print(line)
    cfg, lines = fill_preference(cfg, bool(data.meta.get("has_pairs")), chosen)
    check_used(cfg)
    for line in lines:
        ranks.print(line)
    if cfg.train.auto_micro_batch:  # before the run length: automatic eval batches count micro-batches
        probe = new_model(cfg, device)
        cfg = fit_micro_batch(float8_training(probe) if cfg.train.precision == "fp8" else probe, cfg,
                              autocast(device, pick_precision(cfg.train.precision, device)), ranks)
        del probe
    batches = run_loaders(cfg, data, ranks.rank, ranks.world_size, device)
    # A corpus still arriving is planned at its token target: what the run reads of it is known only when it
    # is in.
    train_tokens = cfg.data.max_tokens if arriving else data.meta["train_tokens"]
    sized = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    cfg, lines = fill_run_length(cfg, machine(device), train_tokens, ranks.world_size,
                                 None if arriving else batches[0].epoch_sequences, automatic)
    if (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) != sized:  # a short fine-tune's smaller batch
        batches = run_loaders(cfg, data, ranks.rank, ranks.world_size, device)
    for line in lines:
        ranks.print(line)
    return planned(cfg, ranks, device, (ckpt, saved, init, lora_meta), data, batches)


def settle_prompts(cfg: Config, ranks: Ranks, device: torch.device, start: tuple, notes: list[str],
                   chosen: ChosenRates | None) -> Plan:
    """settle() for a GRPO run, from the fine-tuning rates on: its reward functions loaded (the user's files,
    before any model), its prompts read whole, its batch, length and rates (those fill_fine_tuning chose,
    which GRPO scales) filled, the memory checked."""
    ckpt, saved = start[:2]
    if ckpt and not cfg.train.reward:  # never taken from the run folder: a reward is code, named by its user
        had = " ".join(f"--reward {shlex.quote(str(r))}"
                       for r in saved.config.get("train", {}).get("reward") or [])
        raise ConfigError("a resumed GRPO run names its reward functions again (code is never read from a "
                          f"run folder): pass {had or '--reward ...'}")
    check_grpo(cfg)
    check_used(cfg)
    rewards = load_all(cfg.train.reward, cfg.train.reward_weights)
    data = read_prompts(cfg, cfg.model.max_seq_len - cfg.train.max_completion_length)
    row = grpo_row(cfg, data.longest)
    replies = cfg.train.prompts_per_step * cfg.train.num_generations
    # On a GPU as many replies a forward as fit at the row's length, as a pretraining run's sequences: one
    # prompt's 8 replies left it idle. On a CPU one prompt's: 16 and 32 a forward measured 50.9 and 54.5
    # replies a second against 52.2 (tools/bench_grpo.py, runs apart, within their spread) and held 16% and
    # 46% more memory.
    auto_micro = fit_micro(at_rows_of(cfg, row), machine(device), replies)[0] if device.type == "cuda" else 0
    cfg, lines = fill_grpo(cfg, len(data.train), len(data.val), row, chosen, ranks.world_size, auto_micro)
    cfg, compile_lines = fill_compile(cfg, machine(device))
    lines += compile_lines
    lines += fit_check(at_rows_of(cfg, row), device, ranks.world_size)  # a prompt and reply, not the context
    ranks.print("\n".join([describe(cfg), *notes, *data.lines, *lines]))
    loaders = (PromptSplit(data.train, device), PromptSplit(data.val, device))
    return planned(cfg, ranks, device, start, data, loaders, rewards)


def planned(cfg: Config, ranks: Ranks, device: torch.device, start: tuple, data, loaders: tuple,
            rewards: tuple | None = None) -> Plan:
    """The Plan, once a resume is checked to fit it. start: (the checkpoint --resume continues, its trainer
    state, what --init_from read, the LoRA run's adapter config)."""
    ckpt, saved, init, lora_meta = start
    t = cfg.train
    if ckpt and t.max_steps and saved.step >= t.max_steps:
        raise ConfigError(f"--resume: the run is already at step {saved.step} and max_steps={t.max_steps} "
                          "leaves nothing to train, raise --max_steps")
    if ckpt:
        check_same_shape(cfg, ckpt)
        check_same_data(cfg, saved, data)
    # A LoRA run always starts from its base: a resume then loads the adapters into it. A resumed DPO run
    # starts from the --init_from weights too: a reference missing or damaged is computed again from them
    # before the checkpoint loads; so does a full GRPO run with a KL term, whose reference is those weights
    # (rollouts.StartingWeights).
    reference = t.objective == "dpo" or (t.objective == "grpo" and t.beta > 0)
    init_state = init.state if init and (lora_meta or not ckpt or reference) else None
    settings = step_settings(cfg, device, run_row(cfg, data), ranks.enabled)
    return Plan(cfg=cfg, settings=settings, ranks=ranks, device=device, ckpt=ckpt, saved=saved,
                init_state=init_state, data=data, batches=loaders[0], val_batches=loaders[1],
                lora_meta=lora_meta,
                init_fingerprint=fingerprint(init.path) if init and t.objective == "dpo" else "",
                rewards=rewards)
