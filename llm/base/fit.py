"""Will it fit? The peak memory of a training step from shapes alone: the model's config (a Hub model's
config.json is a few KB), the base format, LoRA rank and targets, context, micro-batch, precision,
checkpointing and the loss's chunking, before any weight or data is downloaded and before any compile.

    estimate(cfg, Target("cuda", 2)).total     bytes at the step's peak, each term in .terms with why
The peak is during backward: weights, their autocast copies, gradients and optimizer state (held from the
first step on) beside the activations kept for backward and the loss's logits. autofill.py sizes the
micro-batch with it; startup.py refuses a run it says cannot fit, naming a change that does (suggest).
"""

from dataclasses import dataclass, replace

from config import LORA_TARGETS, Config, ModelConfig

# Bytes a frozen base weight takes as a LoRA run holds it. int8 adds a scale per output row (counted by shape,
# below). nf4 as torchao's NF4Tensor stores it: 4 bits a weight, an int8 scale per block of 64 weights, and an
# fp32 scale of those scales per 256 blocks (QLoRA's double quantization, Dettmers et al. 2023).
BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
# the CUDA context, cuBLAS/cuDNN workspaces and kernels: 0.5-1 GiB on an H100 beside torch's
CUDA_CONTEXT = 1 << 30
# the shortest context a refusal suggests: shorter windows hold too little of a chat to learn from
MIN_CONTEXT = 256
FIT_FRACTION = 0.8  # of the GPU's memory an estimate may fill: the caching allocator's slack takes the rest


@dataclass
class Target:
    """Where the step runs, as the estimate needs it."""
    kind: str  # "cuda", "cpu" or "mps"
    amp_bytes: int  # bytes of an autocast activation: 2 under bf16/fp16, 4 in fp32
    compiled: bool = False  # Inductor keeps the matmuls' inputs and recomputes pointwise ops in backward
    loss_rows: int = 0  # rows per chunk of the loss (sizing.loss_chunk_rows), 0 for the logits whole
    fp16: bool = False  # 2-byte autocast in fp16 (a GPU without bf16), not bf16

    @property
    def bf16(self) -> bool:
        return self.amp_bytes == 2 and not self.fp16


def held_base(lora_base: str, bf16: bool) -> str:
    """How a LoRA run holds its frozen base: as --lora_base asks, or where it is auto, in bf16 under bf16
    compute and else in fp32. The one rule: lora.py holds the base by it; the estimate and the report count
    it."""
    return lora_base if lora_base != "auto" else "bf16" if bf16 else "fp32"


@dataclass
class Estimate:
    terms: list  # (name, bytes, why)

    @property
    def total(self) -> int:
        return int(sum(b for _, b, _ in self.terms))

    def summary(self) -> str:
        """The terms in GiB, for the start report: where the memory goes."""
        return ", ".join(f"{name} {b / 2**30:.2f}" for name, b, _ in self.terms) + " GiB"


def count_parameters(m: ModelConfig) -> int:
    """Closed-form parameter count of modern_llm.Transformer for this config."""
    d, h = m.hidden_size, m.head_dim
    attn = d * h * (m.num_attention_heads * 2 + m.num_key_value_heads * 2)  # q, o, k, v
    norms = 2 * d + (2 * h if m.qk_norm else 0)
    biases = h * (m.num_attention_heads + 2 * m.num_key_value_heads) if m.qkv_bias else 0  # q, k, v
    per_layer = attn + 3 * d * m.intermediate_size + norms + biases
    embed = m.vocab_size * d * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * per_layer + embed + d


def block_matrices(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each linear layer of one block, by its name."""
    q, kv, d, f = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.hidden_size, \
        m.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
            "up_proj": (d, f), "down_proj": (f, d)}


def adapter_parameters(cfg: Config) -> int:
    """Parameters of the LoRA adapters cfg.train asks for: rank * (inputs + outputs) per targeted matrix."""
    sides = block_matrices(cfg.model)
    return cfg.model.num_hidden_layers * cfg.train.lora_rank * sum(sum(sides[name]) for name in _targets(cfg))


def _targets(cfg: Config) -> list[str]:
    """The targeted matrices the estimate knows: an unknown name is refused in one line when adapters are
    added."""
    return [name for name in cfg.train.lora_targets or LORA_TARGETS if name in block_matrices(cfg.model)]


def layer_activation_bytes(m: ModelConfig, target: Target, lora_rank: int = 0, targets=()) -> float:
    """Bytes one block keeps for backward per token. a: an autocast activation; r: the residual stream (bf16
    under a GPU's autocast, modern_llm's stream_dtype; fp32 elsewhere). SDPA keeps q, k, v, its output and a
    logsumexp row per head (flash and memory-efficient kernels: no T x T matrix)."""
    a, d, f = target.amp_bytes, m.hidden_size, m.intermediate_size
    r = a if target.kind == "cuda" else 4
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    lse = 4 * m.num_attention_heads  # fp32 logsumexp per head
    if target.compiled:  # matmul inputs, the attention's inputs and output; norms and SiLU recomputed
        attention = r * d + a * d + a * (q + 2 * kv) + a * q + lse
        mlp = r * d + a * d + 3 * a * f  # gate and up for SiLU's backward, their product for down_proj
    else:  # eager: every op keeps its own inputs, and each norm its input and output beside the matmul's copy
        qk_norm = a * (q + kv) if m.qk_norm else 0  # QK-norm's inputs
        # SDPA's output, o_proj's copy
        attention = 2 * r * d + a * d + a * (q + 2 * kv) + qk_norm + 2 * a * q + lse
        # gate (SiLU), silu(gate) and up (the product), the product (down_proj)
        mlp = 2 * r * d + a * d + 4 * a * f
    adapters = a * lora_rank * len(targets)  # each adapter keeps its A output for B
    return attention + mlp + adapters


def estimate(cfg: Config, target: Target, base: str = "") -> Estimate:
    """The step's peak memory in terms, for cfg as it would run on target. base: a LoRA run's base format
    (fp32, bf16, int8, nf4); empty: cfg.train.lora_base as held_base reads it."""
    m, t = cfg.model, cfg.train
    a, P, L = target.amp_bytes, count_parameters(m), m.num_hidden_layers
    tokens = t.micro_batch_size * m.max_seq_len
    sides = block_matrices(m)
    matmul = L * sum(i * o for i, o in sides.values()) + m.vocab_size * m.hidden_size  # the head included
    terms = []
    if not t.lora_rank:
        trained, targets = P, []
        terms.append(("weights", 4 * P, "fp32 master weights (DESIGN.md numerics)"))
        if a < 4:
            terms.append(("autocast copies", a * matmul, "16-bit copies of each matmul weight, cached by "
                                                         "autocast and kept for backward"))
    else:
        base = base or held_base(t.lora_base, target.bf16)
        targets = _targets(cfg)
        held = L * sum(i * o for name, (i, o) in sides.items() if name in targets)
        rows = L * sum(o for name, (i, o) in sides.items() if name in targets)
        scales = 4 * rows if base == "int8" else 0  # an fp32 scale per output row
        trained = adapter_parameters(cfg)
        embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        e = 2 if base != "fp32" and target.bf16 else 4  # lora.hold_embeddings_in_bf16 under bf16 compute
        terms.append((f"base ({base})", BASE_BYTES[base] * held + scales + e * embed + 4 * (P - held - embed),
                      "frozen targeted matrices in the base format; embeddings and head in "
                      f"{'bf16' if e == 2 else 'fp32'}, norms in fp32"))
        if base == "fp32" and a < 4:
            terms.append(("autocast copies", a * held, "16-bit copies of the frozen matrices, "
                                                       "kept for the inputs' gradients"))
        if base == "int8":  # measured on a CPU: 0.68x the peak without this term, 0.87x with it
            terms.append(("dequantised copies", a * held, "torchao's int8 linear keeps each matrix "
                                                          "dequantised for its input's gradient"))
        if base == "nf4":  # torchao's linear_nf4 keeps the NF4 weight and dequantises again in backward
            widest = max(i * o for name, (i, o) in sides.items() if name in targets)
            terms.append(("dequantised weight", 2 * a * widest, "the largest matrix dequantised for "
                                                                "its matmul, forward and backward"))
        terms.append(("adapters", 4 * trained, "fp32 adapters"))
    terms.append(("gradients", 4 * trained, "fp32, one per trained weight, held across accumulation"))
    terms.append(("optimizer", optimizer_bytes(cfg, trained), _optimizer_why(cfg)))
    per_layer = layer_activation_bytes(m, target, t.lora_rank, targets)
    # each block's input kept; one block's activations alive while it is recomputed
    if m.gradient_checkpointing:
        r = a if target.kind == "cuda" else 4
        terms.append(("activations", tokens * (L * r * m.hidden_size + per_layer),
                      f"checkpointed: {L} block inputs and one block recomputed, {tokens:,} tokens"))
    else:
        terms.append(("activations", tokens * L * per_layer,
                      f"{per_layer / m.hidden_size:.0f} x hidden bytes a token in each of {L} blocks, "
                      f"{tokens:,} tokens"))
    rows = min(target.loss_rows or tokens, tokens)
    terms.append(("loss",
                  rows * m.vocab_size * loss_bytes_per_logit(target) + tokens * m.hidden_size * (a + 4),
                  ("whole" if rows == tokens else f"{rows:,}-row chunks") + ": logits and their gradient, "
                  "the fp32 log-softmax (eager) or one fp32 temporary (compiled); the final norm's output"))
    if target.kind == "cuda":
        terms.append(("CUDA context", CUDA_CONTEXT, "context, cuBLAS workspace, kernels"))
    elif t.objective == "grpo" and t.beta and not t.lora_rank:  # beside a GPU these two live in host memory
        terms.append(("reference", 8 * P, "the starting weights and the trained ones set aside while the KL "
                                          "term's reference runs, fp32 (rollouts.StartingWeights)"))
    return Estimate(terms)


def loss_bytes_per_logit(target: Target) -> int:
    """Eager: the fp32 log-softmax (kept), its gradient, the fp32 logits' gradient and theirs in the logits'
    dtype; compiled, Inductor fuses the softmax: the logits and their gradient plus one fp32 temporary (within
    5% of the H200's measured peaks, tests/test_sizing.py)."""
    return 2 * target.amp_bytes + 4 if target.compiled else 12 + target.amp_bytes


def optimizer_bytes(cfg: Config, trained: int) -> float:
    """AdamW keeps two fp32 moments per weight; Muon one fp32 momentum per hidden matrix weight, AdamW the
    rest (embeddings, head, norms: muon_optimizer's split). Adapters: AdamW (fine_tuning.py's choice)."""
    t, m = cfg.train, cfg.model
    if t.lora_rank or t.optimizer != "muon":
        return 8 * trained
    hidden = m.num_hidden_layers * sum(i * o for i, o in block_matrices(m).values())
    return 4 * hidden + 8 * (trained - hidden)


def _optimizer_why(cfg: Config) -> str:
    muon = cfg.train.optimizer == "muon" and not cfg.train.lora_rank
    return "Muon: one fp32 momentum per hidden matrix weight, AdamW's two for the rest" if muon else \
        "AdamW: two fp32 moments per trained weight"


def fits(cfg: Config, target: Target, memory: int, base: str = "") -> bool:
    return estimate(cfg, target, base).total <= FIT_FRACTION * memory


def suggest(cfg: Config, target: Target, memory: int, bases=("auto", "int8")) -> tuple[str, Config, str]:
    """The first change that the estimate says fits memory, each step adding to the one before: a smaller
    micro-batch with more accumulation (the same tokens a step), gradient checkpointing, LoRA (rank 16 where
    none was asked; a fine-tune only) on each base of `bases` in turn (auto: the default), then the least of
    these with a context halved down to MIN_CONTEXT. Returns (flags, config, base); flags empty when none
    fits, the config then the least of them."""
    t, m = cfg.train, cfg.model
    accum = max(1, t.grad_accum_steps)
    for micro in [2**k for k in range(t.micro_batch_size.bit_length() - 1, -1, -1)
                  if 2**k < t.micro_batch_size]:
        changed = replace(cfg, train=replace(t, micro_batch_size=micro,
                                             grad_accum_steps=accum * t.micro_batch_size // micro))
        if fits(changed, target, memory):
            return (f"--micro_batch_size {micro} --grad_accum_steps {changed.train.grad_accum_steps}",
                    changed, "")
    flags = []
    if t.micro_batch_size > 1:
        cfg = replace(cfg, train=replace(t, micro_batch_size=1, grad_accum_steps=accum * t.micro_batch_size))
        flags.append(f"--micro_batch_size 1 --grad_accum_steps {cfg.train.grad_accum_steps}")
    candidates = []
    if not m.gradient_checkpointing:
        cfg = replace(cfg, model=replace(m, gradient_checkpointing=True))
        flags.append("--gradient_checkpointing true")
        candidates.append((list(flags), cfg, ""))
    if not t.lora_rank and t.init_from:
        flags.append("--lora_rank 16")
        cfg = replace(cfg, train=replace(cfg.train, lora_rank=16, optimizer="adamw"))
    for base in bases if cfg.train.lora_rank else ():
        lora = cfg if base == "auto" else replace(cfg, train=replace(cfg.train, lora_base=base))
        candidates.append(([*flags, f"--lora_base {base}"] if base != "auto" else list(flags), lora,
                           base if base != "auto" else ""))
    candidates = candidates or [(flags, cfg, "")]  # already checkpointed, from scratch: the context is left
    for flags, changed, base in candidates:
        if fits(changed, target, memory, base):
            return " ".join(flags), changed, base
    flags, shorter, base = min(candidates, key=lambda c: estimate(c[1], target, c[2]).total)  # the least
    context = shorter.model.max_seq_len // 2
    while context >= MIN_CONTEXT:
        shorter = replace(shorter, model=replace(shorter.model, max_seq_len=context))
        if fits(shorter, target, memory, base):
            return " ".join([*flags, f"--max_seq_len {context}"]), shorter, base
        context //= 2
    return "", shorter, base  # the least this version can ask for: what a card would need for it
