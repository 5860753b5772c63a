"""How big and how long: the FLOPs a token, the compute a time budget buys on this GPU, the model size and
tokens compute-optimal for it, a step's memory on a GPU (fit.py's estimate, for the step a CUDA run plans
with), and by that memory how many rows of the loss's logits a step computes at once.

autofill.py fills the fields config.py leaves automatic with these figures; monitor.py reports MFU against the
same peak table and FLOPs a token; the runner sets the model's loss chunks by loss_chunk_rows."""

import math
from dataclasses import dataclass

from config import Config, ModelConfig
# count_parameters: others import it from here
from llm.base.fit import FIT_FRACTION, Target, block_matrices, count_parameters, estimate

CPU_MINUTES = 10.0  # the time budget of a CPU run left automatic
# A GPU run left automatic works to an hour, from launch, data preparation and compile included, as a CPU run
# to CPU_MINUTES: a first run a user waits for. An hour buys an H100 or H200 about 1.4e18 FLOPs at
# MEASURED_MFU, whose compute-optimal model (TOKENS_PER_PARAMETER) has about 109M parameters: the small preset
# (GPT-2 small's size) on its 2B tokens. Half an hour would ask for a 77M model, which no preset has, and give
# small half its tokens.
GPU_MINUTES = 60.0
# of the bf16 peak, what a step reaches: small 41.3%, large 48.5% on an H200 (docs/gpu_report.md)
MEASURED_MFU = 0.40
# a GPU missing from PEAK_TFLOPS is planned at this peak: an A10-, V100- or 4080-class card
FALLBACK_TFLOPS = 100.0
# A training step costs about this many forward passes: the backward costs about twice the forward (a step's
# FLOPs are 6 per parameter and token, the forward's 2). Evaluations are planned from it.
FORWARDS_PER_STEP = 3
TOKENS_PER_PARAMETER = 20  # compute-optimal training (Hoffmann et al. 2022): C = 6 N D with D = 20 N
MEMORY_FRACTION = FIT_FRACTION  # of the GPU's memory (fit.py)
BYTES_PER_TOKEN = 4.0  # a guess for the corpus size before tokenizing: byte-level BPE on code and prose
# per logit of a whole training loss: bf16 logits, fp32 log-softmax, its fp32 and bf16 gradients
LOGIT_BYTES = 12
CPU_LOGITS_BYTES = 2**30  # off CUDA, the whole logits may take this much
GEMM_ROWS = 128  # loss chunks in whole GEMM tiles: another count makes Inductor pad (and time) every chunk


# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s from the vendors' datasheets, which sizing plans
# a GPU run's budget with and monitor.py reports MFU against. The first entry whose name occurs in the device
# name wins, so specific names come before general ones.
PEAK_TFLOPS = [
    ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("A6000", 154.8), ("RTX 6000 Ada", 364.2), ("RTX 5090", 209.5), ("RTX 4090", 165.2),
    ("RTX 4080", 97.5), ("RTX 4070", 58.3), ("RTX 3090", 71.0), ("RTX 3080", 59.5), ("V100", 125.0),
    ("T4", 65.0),
]


@dataclass
class Machine:
    """What sizing needs to know about where the run trains."""
    kind: str  # "cpu", "mps" or "cuda"
    name: str  # for the report
    memory: int = 0  # bytes of GPU memory; 0 off CUDA


def gpu_peak_flops(name: str) -> float | None:
    """The peak dense bf16 FLOP/s of the GPU of this name (PEAK_TFLOPS), or None when the table lacks it."""
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS if key in name), None)


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token, the one count MFU and the budget's plan use: forward (2) and backward (4) per
    weight of every matmul, the head's included and the embedding lookup, norms and biases not, plus
    attention's QK^T and AV over the full context, 12 * layers * heads * head_dim * context (PaLM's appendix
    B)."""
    matmul = (m.num_hidden_layers * sum(i * o for i, o in block_matrices(m).values())
              + m.vocab_size * m.hidden_size)
    attention = 12 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * m.max_seq_len
    return 6 * matmul + attention


def budget_minutes(t, machine: Machine) -> float:
    """The minutes a run works to: max_minutes as written, else, when its length is automatic too (max_steps
    and epochs 0), CPU_MINUTES off CUDA and GPU_MINUTES on it; 0 for a run whose length is in steps or epochs.
    """
    if t.max_minutes or t.max_steps or t.epochs:
        return t.max_minutes
    return GPU_MINUTES if machine.kind == "cuda" else CPU_MINUTES


def planned_flops_per_s(machine: Machine, world_size: int = 1) -> float:
    """The training FLOP/s a CUDA run plans with: the GPU's peak (FALLBACK_TFLOPS when unknown) at
    MEASURED_MFU, on every rank."""
    return (gpu_peak_flops(machine.name) or FALLBACK_TFLOPS * 1e12) * MEASURED_MFU * world_size


def budget_tokens(cfg: Config, machine: Machine, world_size: int = 1) -> int:
    """Tokens this model trains on in its time budget at the planned FLOP/s; 0 off CUDA or without a budget.
    """
    minutes = budget_minutes(cfg.train, machine)
    if machine.kind != "cuda" or not minutes:
        return 0
    return int(minutes * 60 * planned_flops_per_s(machine, world_size) / flops_per_token(cfg.model))


def optimal_parameters(minutes: float, machine: Machine, world_size: int = 1) -> float:
    """The compute-optimal model size for a budget of these minutes: C = 6 N D with D = TOKENS_PER_PARAMETER *
    N."""
    return math.sqrt(minutes * 60 * planned_flops_per_s(machine, world_size) / (6 * TOKENS_PER_PARAMETER))


def token_target(cfg: Config, machine: Machine, world_size: int = 1) -> int:
    """The tokens a corpus fetched for this run should hold: what the model trains on in its budget, at most
    the budget's compute-optimal tokens (a model far smaller than that, tiny on a GPU, runs far below
    MEASURED_MFU: 0.4% on an H200, and repeats its data). 0 off CUDA or without a budget."""
    tokens = budget_tokens(cfg, machine, world_size)
    if not tokens:
        return 0
    optimal = optimal_parameters(budget_minutes(cfg.train, machine), machine, world_size)
    return min(tokens, int(TOKENS_PER_PARAMETER * optimal))


def plan_report(cfg: Config, machine: Machine, world_size: int = 1) -> list[str]:
    """A CUDA run's budget in figures: the compute it buys, the size compute-optimal for it, this model's
    speed and tokens, and the disk they take. Empty off CUDA or without a time budget."""
    target = token_target(cfg, machine, world_size)
    if not target:
        return []
    minutes, rate = budget_minutes(cfg.train, machine), planned_flops_per_s(machine, world_size)
    peak, optimal = gpu_peak_flops(machine.name), optimal_parameters(minutes, machine, world_size)
    params, shard_bytes = count_parameters(cfg.model), 2 if cfg.model.vocab_size <= 2**16 else 4
    gpus = f"{world_size} x " if world_size > 1 else ""
    speed = budget_tokens(cfg, machine, world_size) / (60 * minutes)
    capped = ", capped at the budget's compute-optimal tokens" if target < speed * 60 * minutes else ""
    known = f"{machine.name} peak" if peak else f"assumed: {machine.name} is not in the peak table"
    return [f"budget: {minutes:g} min x {gpus}{(peak or FALLBACK_TFLOPS * 1e12) / 1e12:.0f} TFLOP/s "
            f"({known}) x {MEASURED_MFU:.0%} MFU = {minutes * 60 * rate:.2e} FLOPs: compute-optimal "
            f"{optimal / 1e6:.0f}M parameters, {TOKENS_PER_PARAMETER * optimal / 1e9:.2f}B tokens",
            f"budget: this model, {params / 1e6:.0f}M parameters x {flops_per_token(cfg.model) / 1e6:.0f} "
            f"MFLOP a token: about {speed:,.0f} tokens/s, {target / 1e9:.2f}B tokens "
            f"({target / params:.0f} a parameter{capped})",
            f"budget: disk for {target / 1e9:.2f}B tokens: about {target * BYTES_PER_TOKEN / 1e9:.1f} GB of "
            f"text and {target * shard_bytes / 1e9:.1f} GB of token shards"]


def gpu_target(cfg: Config) -> Target:
    """The step a CUDA run plans with: bf16 autocast, compiled unless compile is off."""
    return Target("cuda", 2, compiled=cfg.train.compile != "off")


def activation_bytes(cfg: Config) -> int:
    """What a micro-batch adds to a GPU step: the activations kept for backward and the whole loss's logits.
    """
    return sum(b for name, b, _ in estimate(cfg, gpu_target(cfg)).terms if name in ("activations", "loss"))


def training_bytes_estimate(cfg: Config) -> int:
    """Peak memory of cfg's step on a GPU with its logits whole (fit.estimate): within 5% of the H200's
    measured peaks for small and large (tests/test_sizing.py)."""
    return estimate(cfg, gpu_target(cfg)).total


def loss_chunk_rows(cfg: Config, machine: Machine) -> int:
    """Rows per chunk of the training loss, 0 for the logits whole: whole while they fit beside the rest of
    the step in MEMORY_FRACTION of the GPU (CPU_LOGITS_BYTES off CUDA), else as many rows as fill a quarter of
    that room, in whole GEMM tiles. Chunks recompute the head's matmul in backward: about 1/3 more head FLOPs.
    """
    m, t = cfg.model, cfg.train
    rows, per_row = t.micro_batch_size * m.max_seq_len, m.vocab_size * LOGIT_BYTES
    room = CPU_LOGITS_BYTES if machine.kind != "cuda" else \
        MEMORY_FRACTION * machine.memory - (training_bytes_estimate(cfg) - _logit_bytes(cfg))
    if rows * per_row <= room:
        return 0
    return max(GEMM_ROWS, int(room / 4 / per_row) // GEMM_ROWS * GEMM_ROWS)


def _logit_bytes(cfg: Config) -> int:
    return next(b for name, b, _ in estimate(cfg, gpu_target(cfg)).terms if name == "loss")
