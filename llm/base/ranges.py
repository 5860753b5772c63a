"""The range of every numeric setting in config.py: the lowest and highest value that makes sense, checked
with each config (fields.require_choices) and said in --help. A value past a bound is a typo or a
misunderstanding (a learning rate of 30, a 10**12-token context), refused in one line before anything runs,
not a setting to try. A bound may be open (Below(1): up to 1, not 1 itself). This is the one place a field's
bounds are said; rules between fields (heads dividing the width, a warmup and decay that fit) stay with their
config's __post_init__."""


class Below(float):
    """An upper bound the value stays under: a momentum or a dropout of 1 would never move or never pass."""


class Above(float):
    """A lower bound the value stays over: a top_p of 0 would keep no token."""


WIDE = 2**40  # a count no run reaches (tokens, steps, items): past it, an integer typed with extra digits
SEED = 2**63 - 1  # the largest seed torch's and numpy's generators take

# field -> (lowest, highest[, what to do instead]); 0 stands for "automatic" where a field's help says so. A
# name shared by two configs (max_seq_len, seed) means the same thing in both.
RANGES = {
    # the model's shape
    "vocab_size": (0, 2**22), "hidden_size": (0, 2**17), "num_hidden_layers": (0, 4096),
    "num_attention_heads": (0, 4096), "num_key_value_heads": (0, 4096), "head_dim": (0, 4096),
    "intermediate_size": (0, 2**20),
    "max_seq_len": (0, 2**22, "a model that declares a longer context loads a "
                              "shorter one with --max_seq_len N"),
    "rope_theta": (1e-3, 1e12), "rms_norm_eps": (1e-12, 0.1), "rope_factor": (1, 1024),
    "rope_low_freq_factor": (1e-3, 1e3), "rope_high_freq_factor": (1e-3, 1e3),
    "rope_original_max_position_embeddings": (1, 2**22), "init_std": (1e-6, 1),
    # the data
    "max_source_mb": (0, 1e9), "max_tokens": (0, WIDE), "val_fraction": (1e-6, Below(0.5)),
    "data_seed": (0, SEED),
    # training
    "seed": (-1, SEED), "batch_tokens": (0, WIDE), "micro_batch_size": (0, 2**20),
    "grad_accum_steps": (0, 2**20), "max_steps": (0, WIDE), "epochs": (0, 1e6),
    # a year: a budget past it no run reaches, and its warmup would hold the learning rate near 0
    "max_minutes": (0, 525_600, "for a run without a time limit set max_steps or epochs"),
    "learning_rate": (0, 10), "muon_lr": (0, 10), "muon_momentum": (0, Below(1)), "weight_decay": (0, 10),
    "adam_beta1": (0, Below(1)), "adam_beta2": (0, Below(1)), "adam_eps": (1e-30, 1), "grad_clip": (0, 1e6),
    "weight_average": (0, Below(1)), "warmup_ratio": (0, Below(1)), "decay_ratio": (Above(0), 1),
    "restart_cycles": (1, 1e6),
    "min_lr_ratio": (0, 1), "eval_interval": (0, WIDE), "eval_batches": (0, WIDE), "log_interval": (1, WIDE),
    "save_interval": (0, WIDE), "eval_task_items": (0, 10**9), "keep_checkpoints": (1, 1e6),
    "max_bad_steps": (1, 1e6),
    # adapters and the chat objectives
    "lora_rank": (0, 2**16), "lora_alpha": (0, 1e6), "lora_dropout": (0, Below(1)),
    "beta": (0, 1000, "0.1 is DPO's usual; past 1000 every sigmoid saturates"),
    "simpo_gamma": (0, 1000), "nll_weight": (0, 1000), "num_generations": (1, 1024),
    "prompts_per_step": (1, 2**16), "max_completion_length": (1, 2**22), "rollout_temperature": (0, 100),
    "rollout_top_k": (0, 2**22), "rollout_top_p": (Above(0), 1), "num_iterations": (1, 1000),
    "epsilon": (0, Below(1)), "epsilon_high": (0, 100),
    # generation, serving, evaluation
    "max_new_tokens": (1, 2**22), "temperature": (0, 100), "top_k": (0, 2**22), "top_p": (Above(0), 1),
    "repetition_penalty": (1e-3, 1e6),  # 1e6: never repeat a token
    "num_return_sequences": (1, 1024, "a batch past this is a typo, not a request"),
    "port": (1, 65535), "max_batch": (1, 4096),
    "limit": (0, 10**9, "0 scores every item; MMLU, the largest task, has 14,042"),
    "num_fewshot": (0, 64, "0 is zero-shot; 25, ARC's, is the most a known leaderboard asks"),
}


def number(value) -> str:
    """A bound as people write it: 1,000,000,000 rather than 1e+09, a port as 65535, 0.001 and 1e-12 as they
    are."""
    if not float(value).is_integer() or abs(value) >= 2**64:
        return f"{value:g}"
    return f"{int(value):,}" if abs(value) >= 100_000 else str(int(value))


def said(name: str) -> str:
    """The range as --help says it ("" for a field without one): [0 to 1), an open end in a round
    bracket."""
    if name not in RANGES:
        return ""
    low, high = RANGES[name][:2]
    opens, closes = "(" if isinstance(low, Above) else "[", ")" if isinstance(high, Below) else "]"
    return f"{opens}{number(low)} to {number(high)}{closes}"


def inside(value, low, high) -> bool:
    """Whether value lies between the bounds, an open one excluded."""
    return (value > low if isinstance(low, Above) else value >= low) and \
        (value < high if isinstance(high, Below) else value <= high)


def outside(name: str, value) -> str:
    """Why value is refused ("" where it lies in the field's range, or the field has none)."""
    low, high, *hint = RANGES.get(name, (-float("inf"), float("inf")))
    if inside(value, low, high):
        return ""
    ends = [f"{number(b)} excluded" for b in (low, high) if isinstance(b, (Above, Below))]
    return f"must be from {number(low)} to {number(high)}" + (f", {' and '.join(ends)}" if ends else "") + \
        (f" ({hint[0]})" if hint else "")
