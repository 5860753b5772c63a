"""Automatic fields: values for the fields config.py leaves at 0, chosen for this machine and corpus by
sizing.py's figures.

Only automatic fields are filled; a value written in config.py, a preset, a --config file or a flag is never
changed. Every choice comes back as a line for the start report, saying why.
- CPU (or Apple MPS): the tiny preset's shape, batch and rates, and a 10-minute time budget.
- CUDA: of the presets whose estimated training memory, without activation checkpointing, fits in 80% of the
  GPU and whose size the corpus can feed (at least one token per 20 parameters: a model far larger than its
  data memorises it), the one nearest the compute-optimal size for the time budget (an hour unless max_minutes
  says otherwise: the GPU's peak x the MFU measured here, 20 tokens a parameter); the largest when the run's
  length is in steps. The run: four passes over the corpus, or the budget where they would take longer. On a
  corpus larger than any run (corpus_bytes None: the GPU default), max_tokens left at 0 becomes the tokens the
  budget trains on, which a fetch of it should cover (token_target).
- The micro-batch, where automatic: on CUDA as many sequences as fit that memory, up to MICRO_TOKENS tokens a
  forward (the anchors' 65k; on an H200 64 x 1,024 ran 1.10x 16 x 1,024); elsewhere up to CPU_MICRO sequences.
  Accumulation, where automatic, keeps batch_tokens per optimizer step.
- --auto_micro_batch on CUDA: the largest micro-batch whose step fits, found by trying (fit_micro_batch).
- From scratch, optimizer auto is Muon (a fine-tune's optimizer and rates come first, from fine_tuning.py).
"""

import math
from dataclasses import replace

import torch

from config import AUTO, PRESETS, Config
from llm.base.errors import ConfigError
from llm.base.sizing import (BYTES_PER_TOKEN, CPU_MINUTES, FORWARDS_PER_STEP, GPU_MINUTES, MEMORY_FRACTION,
                             Machine, budget_minutes, count_parameters, optimal_parameters, plan_report,
                             token_target, training_bytes_estimate)
from llm.scores.evaluation import AUTO_EVALS, EVAL_SHARE, EVAL_TOKENS
from llm.train.fine_tuning import small_move_warning

CPU_SIZE = "tiny"  # the preset whose values fill a run's automatic fields off CUDA
# A compile from an empty cache took 20-60 s on the 2-core CPU here; at the speedups measured (1.5-2x) it pays
# back only over a budget of a minute or two, so an automatic compile is off below this.
COMPILE_PAYS_MINUTES = 2.0
# At fixed compute the loss is about symmetric in log N around its optimum (Hoffmann et al. 2022, figure 3's
# isoFLOP curves), so the preset nearest the optimum on a log scale learns most; one past 3x the optimum
# (under about two tokens per parameter in its budget) is never chosen.
MAX_OVER_OPTIMAL = 3.0
GPU_SIZES = ("xl", "large", "medium", "small")  # largest first
# A guard against a model far larger than its corpus, not an optimum: a preset is left out past 20 parameters
# per corpus token. Chinchilla's optimum (sizing.TOKENS_PER_PARAMETER) is 400 times stricter: it would keep
# small (100M parameters) from any corpus under 2B tokens, and the run's length already caps the passes over
# a corpus (GPU_EPOCHS).
MAX_PARAMETERS_PER_CORPUS_TOKEN = 20
GPU_EPOCHS = 4  # repeated up to about four times, data trains nearly as well as new (Muennighoff et al. 2023)
MIN_STEPS = 100
# An automatic batch leaves a fine-tune in epochs at least this many optimizer steps, in smaller steps where
# the data is small (300 short chats at --epochs 3 once made 7 steps at 16 windows a step, and learned
# nothing).
FINE_TUNE_STEPS = 100
FEW_STEPS = 30  # a run of fewer optimizer steps is said, before it starts, to be unlikely to learn anything
MICRO_TOKENS = 65_536  # the most tokens an automatic micro-batch holds on CUDA: past it a step gains little
MIN_MICRO_TOKENS = 8_192  # a GPU preset is chosen only if a micro-batch of this many tokens fits beside it
CPU_MICRO = 16  # the most sequences an automatic micro-batch holds off CUDA (tiny's, measured on 2 cores)


def _filled(cfg: Config, size: str) -> Config:
    """cfg with its automatic shape, batch and rates taken from preset `size`."""
    source = PRESETS[size]()
    model = {k: getattr(source.model, k) for k in cfg.model.automatic()}
    train = {k: getattr(source.train, k) for k in cfg.train.automatic() if getattr(source.train, k) != AUTO}
    try:
        return Config(model=replace(cfg.model, **model), data=cfg.data, train=replace(cfg.train, **train))
    except ConfigError as e:
        raise ConfigError(f"{e} (after filling the automatic fields {', '.join([*model, *train])} from the "
                          f"{size} preset); set them in config.py or on the command line") from None


def fill_batch(cfg: Config, machine: Machine, world_size: int = 1) -> tuple[Config, str]:
    """cfg with an automatic micro-batch, accumulation and batch_tokens filled, and the reason: the
    micro-batch the memory holds (fit_micro), accumulation keeping batch_tokens (or one micro-step when that
    is automatic too), batch_tokens what the two give."""
    t, seq = cfg.train, cfg.model.max_seq_len
    micro, accum = t.micro_batch_size, t.grad_accum_steps
    # per rank and step
    sequences = max(1, round(t.batch_tokens / (seq * world_size))) if t.batch_tokens else 0
    if micro and accum and t.batch_tokens and micro * seq * accum * world_size != t.batch_tokens:
        raise ConfigError(f"batch_tokens={t.batch_tokens} is not micro_batch_size={micro} x "
                          f"max_seq_len={seq} x grad_accum_steps={accum} x {world_size} ranks; set "
                          "two of the three (0: automatic)")
    why = "as written"
    if micro == AUTO:
        micro, why = fit_micro(cfg, machine, sequences if accum == AUTO else sequences // accum)
        if not micro:
            raise ConfigError(f"not even one sequence of max_seq_len={seq} fits in {machine.name}'s "
                              "memory by the estimate; lower max_seq_len, set "
                              "gradient_checkpointing true or pick a smaller preset")
    if accum == AUTO:
        accum = max(1, sequences // micro)
    filled = replace(cfg, train=replace(t, micro_batch_size=micro, grad_accum_steps=accum,
                                        batch_tokens=micro * seq * accum * world_size))  # what runs
    return filled, why


def fit_micro(cfg: Config, machine: Machine, sequences: int) -> tuple[int, str]:
    """The largest power of two of sequences (dividing `sequences`, when given) whose training fits in
    MEMORY_FRACTION of the GPU, up to MICRO_TOKENS tokens; CPU_MICRO off CUDA. 0 when not even one fits."""
    seq = cfg.model.max_seq_len
    most = max(1, MICRO_TOKENS // seq) if machine.kind == "cuda" else CPU_MICRO
    if sequences:
        most = min(most, sequences)
    micro = 1 << (most.bit_length() - 1)
    while sequences and sequences % micro:
        micro //= 2
    if machine.kind != "cuda":
        return micro, f"{micro} sequences a forward off CUDA"
    budget = MEMORY_FRACTION * machine.memory
    need = lambda m: training_bytes_estimate(replace(cfg,  # noqa: E731
                                                     train=replace(cfg.train, micro_batch_size=m)))
    while micro and need(micro) > budget:
        micro //= 2
    return micro, (f"{micro * seq:,} tokens a forward, about {need(micro) / 2**30:.1f} GiB of training "
                   f"memory in {budget / 2**30:.1f} GiB")


def choose_size(cfg: Config, machine: Machine, corpus_bytes: int | None,
                world_size: int = 1) -> tuple[str, str]:
    """The preset whose values fill the automatic fields, and why. On CUDA, of the presets that fit the memory
    and that the corpus feeds (corpus_bytes None: a corpus larger than any run here, FineWeb-Edu's sample):
    under a time budget the one nearest the budget's compute-optimal size, else the largest."""
    if machine.kind != "cuda":
        return CPU_SIZE, f"no CUDA device ({machine.name})"
    corpus_tokens = math.inf if corpus_bytes is None else corpus_bytes / BYTES_PER_TOKEN
    most = MAX_PARAMETERS_PER_CORPUS_TOKEN
    feeds = "" if corpus_bytes is None else (f", and the corpus (about {corpus_tokens / 1e6:.1f}M tokens) "
                                             f"feeds up to {most} parameters per token")
    room, fitting = MEMORY_FRACTION * machine.memory, []
    for size in GPU_SIZES:
        candidate = _filled(cfg, size)
        candidate.model = replace(candidate.model, gradient_checkpointing=False)
        # the smallest micro-batch worth a GPU must fit beside it
        if candidate.train.micro_batch_size == AUTO:
            # fit_micro's 2^k
            least = 1 << (-(-MIN_MICRO_TOKENS // candidate.model.max_seq_len) - 1).bit_length()
            candidate.train = replace(candidate.train, micro_batch_size=least)
        need, params = training_bytes_estimate(candidate), count_parameters(candidate.model)
        if need <= room and params <= most * corpus_tokens:
            fitting.append((size, params, need))
    if not fitting:
        return CPU_SIZE, f"no larger preset fits {room / 2**30:.1f} GiB of {machine.name}{feeds}"
    fits = f"{room / 2**30:.1f} GiB ({MEMORY_FRACTION:.0%} of {machine.name})"
    minutes = budget_minutes(cfg.train, machine)
    if not minutes:  # the run's length is in steps: memory and corpus alone decide
        size, params, need = fitting[0]
        return size, (f"{params / 1e6:.0f}M parameters, about {need / 2**30:.1f} GiB "
                      f"of training memory in {fits}{feeds}")
    optimal = optimal_parameters(minutes, machine, world_size)
    budget = f"compute-optimal for {minutes:g} minutes here: {optimal / 1e6:.0f}M parameters"
    near = [f for f in fitting if f[1] <= MAX_OVER_OPTIMAL * optimal]
    if not near:
        return CPU_SIZE, f"{budget}, under a third of the smallest GPU preset that fits {fits}{feeds}"
    size, params, need = min(near, key=lambda f: abs(math.log(f[1] / optimal)))
    return size, (f"{params / 1e6:.0f}M parameters, the preset nearest the {budget}; about "
                  f"{need / 2**30:.1f} GiB of training memory in {fits}{feeds}")


def fill_automatic(cfg: Config, machine: Machine, corpus_bytes: int | None,
                   world_size: int = 1) -> tuple[Config, list[str]]:
    """cfg with its automatic shape, batch and rates filled, and report lines saying with what and why; an
    optimizer still automatic (a run from scratch) is Muon. corpus_bytes None: a corpus larger than any run
    here (the GPU default, FineWeb-Edu's sample), of which a CUDA run with a time budget reads the tokens the
    budget trains on (budget_tokens) as its max_tokens, where that is left at 0."""
    if cfg.train.optimizer == "auto":
        cfg = replace(cfg, train=replace(cfg.train, optimizer="muon"))
    batch = ("batch_tokens", "micro_batch_size", "grad_accum_steps")
    wanted = cfg.model.automatic() + [k for k in cfg.train.automatic()
                                      if k not in ("max_steps", "max_minutes", "eval_batches", *batch)]
    notes = []
    if wanted:
        size, why = choose_size(cfg, machine, corpus_bytes, world_size)
        filled = _filled(cfg, size)
        # a shape given (--init_from): the micro-batch
        if machine.kind == "cuda" and not cfg.model.automatic():
            # and accumulation its memory holds (fill_batch), not those of the preset's own shape
            t = cfg.train
            filled = replace(filled, train=replace(filled.train, micro_batch_size=t.micro_batch_size,
                                                   grad_accum_steps=t.grad_accum_steps))
        section = {name: "model" if name in filled.model.__dataclass_fields__ else "train" for name in wanted}
        values = ", ".join(f"{k}={getattr(getattr(filled, section[k]), k)}" for k in wanted)
        notes.append(f"automatic: {values} (the {size} preset: {why})")
        cfg = filled
    auto = [k for k in batch[1:] if getattr(cfg.train, k) == AUTO]
    cfg, why = fill_batch(cfg, machine, world_size)
    if auto:
        t = cfg.train
        notes.append(f"automatic: {', '.join(f'{k}={getattr(t, k)}' for k in auto)} ({t.micro_batch_size} x "
                     f"{cfg.model.max_seq_len} tokens x {t.grad_accum_steps} accumulation x {world_size} "
                     f"ranks = {t.batch_tokens:,} tokens a step; {why})")
    cfg, lines = fill_compile(cfg, machine)
    notes += lines
    if corpus_bytes is None:  # a corpus fetched for the run: what it needs, said before the fetch
        notes += plan_report(cfg, machine, world_size)
        if not cfg.data.max_tokens and (tokens := token_target(cfg, machine, world_size)):
            cfg = replace(cfg, data=replace(cfg.data, max_tokens=tokens))
            notes.append(f"automatic: max_tokens={tokens} (the tokens of the budget above, "
                         "of a corpus larger than the run)")
    return cfg, notes


def fill_compile(cfg: Config, machine: Machine) -> tuple[Config, list[str]]:
    """cfg with compile=auto set off where a compile would not pay back, and the line saying why."""
    why = eager_reason(cfg, machine) if cfg.train.compile == "auto" else ""
    if not why:
        return cfg, []
    return replace(cfg, train=replace(cfg.train, compile="off")), [f"automatic: compile=off ({why})"]


def eager_reason(cfg: Config, machine: Machine) -> str:
    """Why a run left at compile=auto trains eagerly, or "" where the compile pays back."""
    t = cfg.train
    if 0 < t.max_minutes < COMPILE_PAYS_MINUTES:
        return (f"a {t.max_minutes:g}-minute budget is too short for a compile to pay back: it takes 20-60 s "
                f"from an empty cache; under {COMPILE_PAYS_MINUTES:g} minutes the run trains eagerly")
    if t.objective == "grpo" and machine.kind != "cuda":
        # Measured on the 2-core CPU here: SmolLM2-135M's compiled step trained in 3.8-4.1 s against 3.4-3.9
        # eager, after about 100 s of compiling, at 3.0 GiB against 2.1; the GRPO bench's, 0.24 s either way.
        return ("a GRPO step off CUDA: compiled, it measured no faster than the eager one, which trains a "
                "prompt once for several of its replies, and it took more memory and minutes to compile")
    return ""


def fine_tune_batch(cfg: Config, epoch_sequences: float, world_size: int,
                    automatic: set) -> tuple[Config, list[str]]:
    """cfg with a smaller automatic batch where a fine-tune in epochs (--init_from, --epochs) would take fewer
    than FINE_TUNE_STEPS optimizer steps: as many windows a step as leave it that many (one at least), and the
    line saying so; else cfg as it is. automatic: the batch fields left automatic before sizing filled them.
    """
    t = cfg.train
    if not (t.init_from and t.epochs and t.max_steps == AUTO
            and {"batch_tokens", "grad_accum_steps"} <= automatic):
        return cfg, []
    sequences = t.epochs * epoch_sequences / world_size  # per rank, over the run
    per_step = t.micro_batch_size * t.grad_accum_steps
    if sequences / per_step >= FINE_TUNE_STEPS:
        return cfg, []
    wanted = max(1, int(sequences // FINE_TUNE_STEPS))
    micro = 1 << (min(wanted, t.micro_batch_size).bit_length() - 1) if "micro_batch_size" in automatic else \
        t.micro_batch_size
    accum = max(1, wanted // micro)
    seq = cfg.model.max_seq_len
    filled = replace(t, micro_batch_size=micro, grad_accum_steps=accum,
                     batch_tokens=micro * seq * accum * world_size)
    return replace(cfg, train=filled), [
        f"automatic: micro_batch_size={micro}, grad_accum_steps={accum} ({micro * accum * world_size} "
        f"window(s) a step: {t.epochs:g} passes over {epoch_sequences:,.0f} windows would be "
        f"{sequences / per_step:.0f} steps at {per_step * world_size} a step, too few to learn; a fine-tune "
        f"takes at least {FINE_TUNE_STEPS} where the data has the windows)"]


def few_steps_warning(cfg: Config) -> list[str]:
    """A line where a run in epochs has too few optimizer steps to learn anything, saying what to change (a
    step count written by hand, a smoke run's --max_steps 2 say, is taken as meant)."""
    t = cfg.train
    if not t.epochs or not t.max_steps or t.max_steps >= FEW_STEPS:
        return []
    return [f"warning: {t.max_steps} optimizer steps are too few to teach a model much (a tiny run "
            "fine-tuned on 300 chats answered 9 of 12 prompts exactly after 6 steps, 12 of 12 after 90); "
            "raise --epochs or --max_steps, or lower --batch_tokens"]


def fill_run_length(cfg: Config, machine: Machine, train_tokens: int, world_size: int = 1,
                    epoch_sequences: float | None = None,
                    automatic: set = frozenset()) -> tuple[Config, list[str]]:
    """cfg with max_steps, max_minutes and eval_batches filled where automatic, once the corpus is tokenized,
    and report lines (a fine-tune's batch made smaller where its epochs would be too few steps:
    fine_tune_batch). epoch_sequences: training windows in one pass over the split (packed windows), if not
    train_tokens / context; automatic: the fields left automatic before sizing filled them."""
    epoch_sequences = epoch_sequences or train_tokens / cfg.model.max_seq_len
    cfg, notes = fine_tune_batch(cfg, epoch_sequences, world_size, automatic)
    t = cfg.train
    per_step = t.micro_batch_size * t.grad_accum_steps * world_size  # sequences
    steps, minutes, eval_batches = t.max_steps, t.max_minutes, t.eval_batches
    if t.epochs and steps == AUTO:
        steps = max(1, math.ceil(t.epochs * epoch_sequences / per_step))
        notes.append(f"epochs: max_steps={steps} ({t.epochs:g} passes over {epoch_sequences:,.0f} training "
                     f"windows at {per_step} per step)")
    if minutes == AUTO and steps == AUTO and machine.kind != "cuda":
        minutes = CPU_MINUTES
        notes.append(f"automatic: max_minutes={CPU_MINUTES:g} (a CPU run trains for a fixed time; set "
                     "max_steps or max_minutes to change it)")
    # on CUDA: GPU_EPOCHS passes, or the budget where they would take longer
    if steps == AUTO and minutes == AUTO:
        steps = max(MIN_STEPS, math.ceil(GPU_EPOCHS * epoch_sequences / per_step))
        passes = f"{GPU_EPOCHS} passes over {train_tokens:,} training tokens"
        # by the planned speed, at most the budget's compute-optimal tokens: a model far below the GPU presets
        # (tiny) runs far below MEASURED_MFU, and its passes would outlast the budget
        if steps * per_step * cfg.model.max_seq_len <= token_target(cfg, machine, world_size):
            notes.append(f"automatic: max_steps={steps} ({passes} at "
                         f"{per_step * cfg.model.max_seq_len:,} tokens per step, within a GPU run's "
                         f"{GPU_MINUTES:g}-minute budget at the planned speed)")
        else:
            steps, minutes = AUTO, GPU_MINUTES
            notes.append(f"automatic: max_minutes={GPU_MINUTES:g} (a GPU run's time budget, in which "
                         f"{passes} would not fit; set max_steps or max_minutes to change it)")
    if steps == AUTO:
        notes.append(f"automatic: no step limit, the {minutes:g}-minute budget ends the run")
    if eval_batches == AUTO:  # evaluations cost the same whatever the micro-batch
        run_tokens = steps * t.micro_batch_size * t.grad_accum_steps * cfg.model.max_seq_len * world_size
        # AUTO_EVALS evaluations of these tokens, a forward each (a step costs FORWARDS_PER_STEP), take
        # EVAL_SHARE of a run in steps (a 10-step smoke run reads one micro-batch); under a time budget the
        # clock spaces them out.
        tokens = (min(EVAL_TOKENS, FORWARDS_PER_STEP * EVAL_SHARE * run_tokens / AUTO_EVALS)
                  if steps else EVAL_TOKENS)
        eval_batches = max(1, math.ceil(tokens / (t.micro_batch_size * cfg.model.max_seq_len)))
    train = replace(t, max_minutes=minutes, eval_batches=eval_batches,
                    **({} if t.epochs else {"max_steps": steps}))
    # derived from the epochs, as head_dim from hidden_size: input may set one of the two, not both
    if t.epochs:
        train.max_steps = steps
    cfg = replace(cfg, train=train)
    return cfg, notes + few_steps_warning(cfg) + small_move_warning(cfg)


def fit_micro_batch(raw_model, cfg: Config, amp, ranks) -> Config:
    """cfg with the largest micro-batch (halving from the whole step's batch) whose forward and backward fit
    in GPU memory; accumulation rises to keep the tokens per step. Probed on the uncompiled model; CUDA only.
    """
    t = cfg.train
    if next(raw_model.parameters()).device.type != "cuda":
        ranks.print("auto micro-batch: searched on CUDA only, keeping --micro_batch_size")
        return cfg
    sequences = t.micro_batch_size * t.grad_accum_steps
    micro = sequences
    while True:
        try:
            x = torch.zeros(micro, cfg.model.max_seq_len, dtype=torch.long,
                            device=next(raw_model.parameters()).device)
            with amp:
                _, loss = raw_model(x, labels=x)
            loss.backward()
            break
        except torch.OutOfMemoryError:
            loss = x = None
            raw_model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if micro == 1:
                raise
            micro //= 2
    raw_model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    accum = math.ceil(sequences / micro)
    ranks.print(f"auto micro-batch: {micro} sequences x {accum} accumulation steps")
    return replace(cfg, train=replace(t, micro_batch_size=micro, grad_accum_steps=accum))
