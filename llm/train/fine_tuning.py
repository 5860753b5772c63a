"""The automatic optimizer and rates of a run from a pretrained model (--init_from): a fine-tune, whose rates
are not the presets' (those train from scratch, and on a pretrained model they undo what it knew).
- A base that is a run of ours, trained from scratch: the optimizer and peak rates it recorded (adapters:
  AdamW at its AdamW rate). SmolLM2's rates left a 2.4M-parameter run where it was, and half its own rates
  learned less than all of them (docs/fine-tuning.md#a-run-of-your-own).
- Any other base (a Hugging Face folder or Hub model, a GGUF): AdamW at FINE_TUNING_RATES, measured on
  SmolLM2.
Only automatic fields are filled; the start report says with what and why.
"""

import math
from dataclasses import dataclass, replace

from config import AUTO, Config
from llm.base.errors import ConfigError

# Adapting a pretrained model, chosen on SmolLM2-135M-Instruct by tools/finetune_check.py
# (docs/fine-tuning.md): the chats' style learned while general answers and general text's bits per byte hold.
# AdamW kept them best, for adapters and whole weights; muon_lr serves a fine-tuning run given --optimizer
# muon.
FINE_TUNING_OPTIMIZER = "adamw"
FINE_TUNING_RATES = {"lora": {"learning_rate": 2e-4, "muon_lr": 0.005},
                     "full": {"learning_rate": 2e-5, "muon_lr": 0.002}}


@dataclass(frozen=True)
class ChosenRates:
    """What fill_fine_tuning chose: said in one start-report line once the objective has scaled the rates (a
    preference or GRPO run), so that the line gives the rates the run trains at and no other."""
    fields: tuple  # the fields filled: optimizer, learning_rate, muon_lr
    what: str  # which weights train
    why: str  # where the rates come from

    def lines(self, t, scaled: str = "") -> list[str]:
        """The one line, with t's final values; muon_lr only where Muon trains (an AdamW run never reads it).
        """
        used = [k for k in self.fields if k != "muon_lr" or t.optimizer == "muon"]
        values = ", ".join(f"{k}={getattr(t, k):g}" if k != "optimizer" else f"{k}={t.optimizer}"
                           for k in used)
        scaled = scaled if set(used) - {"optimizer"} else ""  # said of a rate chosen here, never of one given
        return [f"automatic: {values} (fine-tuning {self.what} the pretrained --init_from model; {self.why}"
                f"{scaled})"] if used else []


def fill_fine_tuning(cfg: Config, base_train: dict | None = None) -> tuple[Config, ChosenRates | None]:
    """cfg with the automatic optimizer and rates of a run from a pretrained model (--init_from) filled for
    fine-tuning, and what was chosen (its line waits for the objective: fill_preference, fill_grpo); a run
    from scratch, or values given, pass as they are. base_train: the train settings a base that is a run of
    ours recorded (its config.json), which the rates follow; else those measured on SmolLM2."""
    t = cfg.train
    if not t.init_from:
        return cfg, None
    kind = "lora" if t.lora_rank else "full"
    recorded = _recorded_rates(base_train, bool(t.lora_rank))
    if recorded:
        # adapters: AdamW won on both bases
        optimizer = FINE_TUNING_OPTIMIZER if t.lora_rank else recorded["optimizer"]
        rates = {k: recorded[k] for k in ("learning_rate", "muon_lr")}
        why = "the peak rates the --init_from run trained at"
    else:
        optimizer, rates = FINE_TUNING_OPTIMIZER, FINE_TUNING_RATES[kind]
        why = "the presets' rates are for training from scratch"
    chosen = {"optimizer": optimizer} if t.optimizer == "auto" else {}
    chosen |= {k: v for k, v in rates.items() if getattr(t, k) == AUTO}
    if not chosen:
        return cfg, None
    what = "LoRA adapters on" if t.lora_rank else "every weight of"
    return replace(cfg, train=replace(t, **chosen)), ChosenRates(tuple(chosen), what, why)


def _recorded_rates(train: dict | None, lora: bool) -> dict | None:
    """The optimizer and peak rates a run of ours recorded, where they read as such: from scratch, or a
    fine-tune (so a chat run's preference or GRPO stage follows the rates it trained at), of the same kind as
    this one (LoRA or every weight: their rates differ tenfold)."""
    if not isinstance(train, dict) or train.get("optimizer") not in ("muon", "adamw"):
        return None
    if train.get("init_from") and bool(train.get("lora_rank")) != lora:
        return None
    rates = {k: train.get(k) for k in ("learning_rate", "muon_lr")}
    if not all(isinstance(v, (int, float)) and 0 < v < 1 for v in rates.values()):
        return None
    return {"optimizer": train["optimizer"], **rates}


# Preference tuning and GRPO move a chat model less than chat fine-tuning does: they train at a share of
# the automatic rates above. Every weight: TRL's DPO and GRPO default against its SFT default (1e-6, 2e-5).
# LoRA adapters: a quarter, measured on SmolLM2-135M-Instruct (docs/fine-tuning.md). At x 0.05 (AdamW 1e-5)
# 120 DPO steps left its greedy replies as they were, where 5e-5 gave them all the chosen style and kept its
# general answers; 60 GRPO steps solved 14% of held-out problems, then 13%, where 5e-5 took the seed to 24%.
TUNING_RATE_SCALE = {"full": 1e-6 / 2e-5, "lora": 0.25}
PREFERENCE_BETA = {"dpo": 0.1, "simpo": 2.5}  # TRL's DPO default; SimPO's paper (with gamma 1.375)


def fill_preference(cfg: Config, pairs: bool, chosen: ChosenRates | None) -> tuple[Config, list[str]]:
    """cfg with the objective the data asks for (auto: dpo on preference pairs, lm on anything else), its
    beta, and for pairs the rates fill_fine_tuning chose scaled for tuning (tuning_rates); and the lines
    saying so (the chosen rates' one line among them). Refuses an objective the data cannot train and pairs
    without a model to start from."""
    t = cfg.train
    objective = t.objective if t.objective != "auto" else "dpo" if pairs else "lm"
    if pairs and objective == "lm":
        raise ConfigError("--objective lm trains by next-token loss, and these sources hold preference pairs "
                          "(chosen, rejected); pass --objective dpo or simpo, or sources of text or chats")
    if not pairs:
        if objective != "lm":
            raise ConfigError(f"--objective {objective} trains on preference pairs (rows with chosen and "
                              "rejected), and these sources hold none; pass such sources, or --objective lm")
        filled = replace(t, objective="lm")
        return replace(cfg, train=filled), chosen.lines(filled) if chosen else []
    if not t.init_from:
        raise ConfigError("preference pairs tune a model you have (a chat model, fine-tuned here or "
                          "downloaded): pass --init_from with it")
    beta = t.beta or PREFERENCE_BETA[objective]
    rates, scaled = tuning_rates(t, chosen, "preference tuning", "DPO")
    filled = replace(t, objective=objective, beta=beta, **rates)
    line = ("preference: the sources hold pairs of a chosen and a rejected reply, trained by "
            f"{objective} (beta {beta:g}{f', gamma {t.simpo_gamma:g}' if objective == 'simpo' else ''}, "
            f"NLL weight {t.nll_weight:g})")
    return replace(cfg, train=filled), [line] + (chosen.lines(filled, scaled) if chosen else [])


def tuning_rates(t, chosen: ChosenRates | None, what: str, trl_name: str) -> tuple[dict, str]:
    """The rates fill_fine_tuning chose times TUNING_RATE_SCALE for the weights that train (rates given by the
    user stay as given), and the start line's words for it. what: "preference tuning" or "GRPO"; trl_name: the
    TRL trainer whose default the scale of every weight follows."""
    kind = "lora" if t.lora_rank else "full"
    scale, fields = TUNING_RATE_SCALE[kind], chosen.fields if chosen else ()
    why = f"as TRL's {trl_name} and SFT defaults differ" if kind == "full" else "as measured for adapters"
    return ({k: getattr(t, k) * scale for k in ("learning_rate", "muon_lr") if k in fields},
            f", x {scale:g} for {what}, {why}")


# The most an Adam step moves a weight is about its learning rate, so rate x steps bounds how far a run can
# take a weight. Below this a fine-tune changes nothing one can see: the 1e-6 x 3 steps of a DPO run that
# learned nothing (3e-6), where runs that learned moved 1e-3 to 1e-2 (docs/fine-tuning.md).
MIN_MOVE = 1e-4


def small_move_warning(cfg: Config) -> list[str]:
    """A line where a fine-tune's peak rate times its steps is too small to move a weight visibly (MIN_MOVE),
    saying what to change; a run from scratch, or one whose length is a time budget, has none."""
    t = cfg.train
    if not t.init_from or not t.max_steps:
        return []
    name = "muon_lr" if t.optimizer == "muon" and not t.lora_rank else "learning_rate"  # the hidden matrices'
    rate = getattr(t, name)
    if not rate or rate * t.max_steps >= MIN_MOVE:
        return []
    return [f"warning: {name}={rate:g} for {t.max_steps} steps moves no weight more than about "
            f"{rate * t.max_steps:.1g} (an Adam step is at most about its rate): too little to change a "
            f"model (runs that learned here moved 1e-3 to 1e-2); raise --{name}, --epochs or --max_steps"]


def check_used(cfg: Config):
    """Refuse a flag that would do nothing in this run (once silently ignored), saying what it is for."""
    t = cfg.train
    if t.lora_base != "auto" and not t.lora_rank:
        raise ConfigError(f"--lora_base {t.lora_base} holds the frozen base of a LoRA run, "
                          "and without --lora_rank every weight trains; pass --lora_rank 16 "
                          "(say), or leave --lora_base out")
    if t.beta and t.objective == "lm":
        raise ConfigError(f"--beta {t.beta:g} scales a preference or GRPO loss, and this run trains by "
                          "next-token loss; leave --beta out, or pass --objective dpo, simpo or grpo")
    if t.objective != "grpo" and (t.reward or t.reward_weights):
        raise ConfigError(f"--reward and --reward_weights are for --objective grpo, and this run trains by "
                          f"{t.objective}; pass --objective grpo with prompts, or leave them out")


GRPO_EVAL_PROMPTS = 32  # held-out prompts an automatic evaluation replies to (greedy): a reward mean to 1/32


def check_grpo(cfg: Config):
    """Refuse, before any prompt is read, what GRPO cannot run."""
    t = cfg.train
    if not t.init_from:
        raise ConfigError("--objective grpo samples replies from a model that can already answer: pass "
                          "--init_from (a chat run of yours, a Hugging Face folder, hf:ORG/NAME or a .gguf)")
    if t.num_generations < 2:
        raise ConfigError(f"num_generations={t.num_generations}: GRPO compares each reply with the others to "
                          "its prompt, so it needs at least 2 (8 is usual)")
    if t.beta and not t.lora_rank and t.data_parallel == "fsdp":
        raise ConfigError(f"--beta {t.beta:g}: a full fine-tune's reference is its starting weights "
                          "copied in whole, which FSDP's shards are not; pass --data_parallel ddp, "
                          "--lora_rank 16 (the base is the reference) or --beta 0")
    if cfg.model.max_seq_len - t.max_completion_length < 8:
        raise ConfigError(f"max_completion_length={t.max_completion_length} leaves no room for a prompt in "
                          f"max_seq_len={cfg.model.max_seq_len}; lower it")


def grpo_row(cfg: Config, longest_prompt: int) -> int:
    """A GRPO micro-batch row's tokens: the longest prompt and the longest reply, within the context. The
    step, its memory estimate and its tokens a step are of these rows, never of the model's whole context."""
    return min(cfg.model.max_seq_len, longest_prompt + cfg.train.max_completion_length)


def at_rows_of(cfg: Config, tokens: int) -> Config:
    """cfg as the memory estimate sees a run whose rows are this many tokens (a GRPO run's, grpo_row)."""
    return replace(cfg, model=replace(cfg.model, max_seq_len=tokens))


def fill_grpo(cfg: Config, train_prompts: int, held_out: int, row: int, chosen: ChosenRates | None,
              world_size: int = 1, auto_micro: int = 0) -> tuple[Config, list[str]]:
    """cfg with a GRPO run's automatic batch (auto_micro replies a forward where given, a GPU's: as many as
    its memory holds at this row; else one prompt's; accumulated over the step's replies), run length (one
    pass over the prompts, where neither max_steps, epochs nor a time budget is given), evaluation size, and
    the rates fill_fine_tuning chose scaled for tuning (tuning_rates); and the lines saying so (the chosen
    rates' one line among them). row: a micro-batch row's tokens (grpo_row). Refuses a batch that does not
    split into micro-batches."""
    t = cfg.train
    replies = t.prompts_per_step * t.num_generations
    micro = t.micro_batch_size or auto_micro or t.num_generations
    if replies % micro:
        raise ConfigError(f"micro_batch_size={micro} does not divide the step's {replies} replies "
                          f"(prompts_per_step x num_generations); pass a divisor of {replies}")
    accum = t.grad_accum_steps or replies // micro
    if micro * accum != replies:
        raise ConfigError(f"micro_batch_size x grad_accum_steps = {micro * accum}, not the step's "
                          f"{replies} replies (prompts_per_step x num_generations); leave "
                          "grad_accum_steps at 0 (automatic)")
    per_pass = max(1, -(-train_prompts // (t.prompts_per_step * world_size))) * t.num_iterations
    steps = t.max_steps or (0 if t.max_minutes else math.ceil((t.epochs or 1) * per_pass))
    rates, scaled = tuning_rates(t, chosen, "GRPO", "GRPO")
    filled = replace(t, micro_batch_size=micro, grad_accum_steps=accum, max_steps=steps, epochs=0.0,
                     batch_tokens=micro * row * accum * world_size,
                     eval_batches=t.eval_batches or min(held_out, GRPO_EVAL_PROMPTS), **rates)
    length = (f"{steps} steps ({steps / per_pass:.2g} passes over the {train_prompts:,} prompts)"
              if steps else f"a {t.max_minutes:g}-minute budget")
    return replace(cfg, train=filled), [
        f"grpo: {t.prompts_per_step} prompts x {t.num_generations} replies a step ({micro} a forward x "
        f"{accum}), {length}; rewards {', '.join(t.reward)}; loss {t.loss_type}, advantages r - group "
        f"mean{'' if t.scale_rewards == 'none' else ' over the ' + t.scale_rewards + ' std'}, beta "
        f"{t.beta:g}, {t.num_iterations} optimizer step(s) a sampling; evaluations: greedy replies to "
        f"{filled.eval_batches} held-out prompts"] + (chosen.lines(filled, scaled) if chosen else []) + \
        small_move_warning(replace(cfg, train=filled))
