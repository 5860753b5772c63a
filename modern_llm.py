"""The model: a decoder-only transformer with the shape of Qwen3 (Llama when QK-norm is off).

Token embedding -> N pre-norm blocks [RMSNorm -> GQA attention with QK-norm and RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head tied to the embedding.
Attention runs through F.scaled_dot_product_attention, so PyTorch picks flash or memory-efficient
kernels (on a CPU, where its flash kernel is slow for short rows, written out as two matmuls:
llm/base/attention.py). A preallocated KVCache serves generation: one prefill, then one token per step.
Only torch; no optimizer, device or file logic lives here.
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import ModelConfig
from llm.base.attention import (cached_attention, causal_attention, example_attention, example_mask,
                                example_rows, packed_attention)

# ----------------------------------------------------------------------------- how the trainer runs it

@dataclass(frozen=True)
class Execution:
    """How a training run executes the model, not what the model is: the trainer sets one
    (Transformer.execution) from the machine and the config; generation, scoring and export keep these
    defaults."""
    # rows per chunk of the loss, 0 for the logits whole (sizing.loss_chunk_rows)
    loss_chunk_rows: int = 0
    matmul_softmax: bool = False  # attention (causal or packed) as matmuls and a softmax, not SDPA's kernel
    # the residual stream's dtype under autocast, None for the embedding's
    stream_dtype: torch.dtype | None = None
    # eager only, shapes read from each batch: packed examples attend on rows of their own (example_attention)
    ragged: bool = False
    # eager only: the head meets the labelled rows alone (their number a host read)
    labelled_rows: bool = False


# ----------------------------------------------------------------------------- rotary embeddings

def rope_tables(head_dim: int, max_len: int, theta: float, rescale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_len, head_dim) in fp32, in the half-split layout Hugging Face uses. rescale,
    when given, maps the (head_dim/2,) frequencies to the ones used (rope_rescaling)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rescale is not None:
        inv_freq = rescale(inv_freq)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd): channel i pairs with channel i + hd/2
    return angles.cos(), angles.sin()


def rope_rescaling(cfg: ModelConfig):
    """The frequency map of cfg.rope_type for rope_tables: None for plain RoPE; llama3 is Llama 3.1's rule
    (Meta's reference code): wavelengths shorter than original / high_freq_factor are kept, longer than
    original / low_freq_factor divided by factor, and those between blended linearly in original / wavelength.
    """
    if cfg.rope_type == "default":
        return None
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_position_embeddings

    def llama3(inv_freq: torch.Tensor) -> torch.Tensor:
        wavelength = 2 * math.pi / inv_freq
        blend = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0: long wavelengths, 1: short
        return (1 - blend) * inv_freq / factor + blend * inv_freq
    return llama3


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) queries or keys; cos/sin broadcast as (T, hd) or (B, 1, T, hd). Computed in fp32.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


# ----------------------------------------------------------------------------- KV cache

class KVCache:
    """Static-shape keys and values, one (B, n_kv_head, max_len, head_dim) tensor per layer.

    `pos` holds, per sequence, how many positions are filled; it lives on the device so a decode step
    needs no host sync (and can be captured in a CUDA graph). Rows may have different lengths. One tensor per
    layer, not one stacked: a compiled step then writes each in place, where a write into a view of a stacked
    tensor made it copy the whole cache every step. `next_mask` follows `pos` (both change only in advance()).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.pos = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.max_len = max_len
        self.next_mask = torch.zeros(batch_size, 1, 1, max_len, device=device, dtype=dtype)
        # set by an eager caller that knows no row reaches past it: attention reads that far only
        self.span = None
        self.reset()

    def reset(self):
        self.advance(-self.pos)

    def advance(self, n):
        """Move each row's position on by n (an int, or (B,)), and write the attention mask of a one-token
        step from there: 0 at each row's filled places and its next, -inf after. A decode step's layers then
        read one tensor that is already there; a mask made inside the step was made again by each layer's
        attention call, one kernel per layer."""
        self.pos += n
        key_pos = torch.arange(self.max_len, device=self.pos.device)
        allowed = key_pos <= self.pos[:, None].clamp(max=self.max_len - 1)  # (B, max_len)
        self.next_mask.copy_(torch.where(allowed, 0.0, float("-inf"))[:, None, None])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write (B, Hkv, T, hd) keys/values at per-row positions (B, T); return the layer's whole cache."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # Advanced indices around a slice put the indexed dims first: the target is (B, T, Hkv, hd).
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)
        return self.k[layer], self.v[layer]


# ----------------------------------------------------------------------------- layers

def is_stored(name: str, cfg: ModelConfig) -> bool:
    """Whether checkpoints and exports store this tensor: all but a tied head, which is the embedding itself.
    """
    return not (cfg.tie_word_embeddings and name == "lm_head.weight")


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight takes the input's dtype: under autocast the queries and keys arrive in bf16,
    and a float32 weight would send F.rms_norm off its fused kernel (with a "Mismatch dtype" warning)."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    """Grouped-query attention with optional QK-norm (before RoPE, as Qwen3) and optional q/k/v biases
    (Qwen2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = (cfg.num_attention_heads,
                                                      cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.qkv_proj = None  # q, k and v stacked in one layer (fuse_projections; a LoRA run's LoraStack)

    def fuse_projections(self):
        """q_proj, k_proj and v_proj as one layer: a decode step then reads the three weights in one matmul.
        """
        self.qkv_proj = stacked(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, attend):
        """attend(q, k, v) -> (B, H, T, hd): how this call attends, which Transformer.attention_plan chose."""
        B, T, _ = x.shape
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split([self.n_head * self.head_dim,
                                              *[self.n_kv_head * self.head_dim] * 2], -1)
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = None  # gate and up stacked into one layer (fuse_projections; lora.LoraStack)

    def fuse_projections(self):
        """gate_proj and up_proj as one layer: one matmul where a decode step made two."""
        self.gate_up_proj = stacked(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        gate, up = (self.gate_proj(x), self.up_proj(x)) if self.gate_up_proj is None else \
            self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def stacked(*linears: nn.Linear) -> nn.Linear:
    """One linear layer whose outputs are the given layers' outputs side by side (their weights and biases
    concatenated), in their dtype and on their device."""
    w = torch.cat([m.weight for m in linears])
    b = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    with torch.device("meta"):  # allocates nothing: the parameters are set below
        out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    out.weight = nn.Parameter(w, requires_grad=False)
    out.bias = None if b is None else nn.Parameter(b, requires_grad=False)
    return out


class Block(nn.Module):
    """Pre-norm residual pair: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attend):
        x = x + self.attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the model

class Transformer(nn.Module):
    """Transformer(cfg) is ready to train, its weights drawn by init_weights(). Built under
    torch.device("meta") it allocates and draws nothing: materialize(device) then gives it memory and its RoPE
    tables, and init_weights() (a new run, after seeding) or load_stored() (a checkpoint) fills the weights,
    once."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # filled by compute_rope: computed from the config, never stored
        table = (cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("rope_cos", torch.empty(table, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table, dtype=torch.float32), persistent=False)
        self.execution = Execution()  # the step's runner (llm/train/runner.py) replaces it, whole
        self.tie_weights()
        if self.rope_cos.device.type != "meta":
            self.compute_rope()
            self.init_weights()

    def tie_weights(self):
        """With tie_word_embeddings, make the head the embedding itself (one tensor): at construction, and
        again after materialize, which gives each module its own new tensor."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def compute_rope(self):
        """Fill the RoPE tables, computed on the CPU in fp32: the same tables on every device."""
        cfg = self.config
        with torch.device("cpu"):
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_rescaling(cfg))
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def materialize(self, device) -> "Transformer":
        """A model built on the meta device given uninitialised memory on `device`, its RoPE tables computed
        and a tied head tied again; init_weights() or load_stored() fills the weights. Returns the model."""
        # New tensors set in place of the meta ones: to_empty swaps tensors, which fails on any that something
        # (a fake-tensor mode, say) holds a weak reference to.
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                setattr(module, name, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        self.rope_cos, self.rope_sin = (torch.empty_like(t, device=device)
                                        for t in (self.rope_cos, self.rope_sin))
        self.tie_weights()
        self.compute_rope()
        return self

    def init_weights(self):
        """Normal(0, init_std) for every matrix; o_proj and down_proj also scaled by 1/sqrt(2 * n_layer)
        (GPT-2's rule: each block adds two residual branches, so this keeps the residual stream's variance
        roughly independent of depth); biases at 0; RMSNorm scales at 1. Draws from torch's global generator
        (the device's), in parameter order; a tied head is drawn once, as the embedding."""
        std, n = self.config.init_std, self.config.num_hidden_layers
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            else:
                scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * n) if scaled else std)

    def make_kv_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty cache on this model's device; max_len defaults to (and may not exceed) max_seq_len."""
        max_len = max_len or self.config.max_seq_len
        if max_len > self.config.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={self.config.max_seq_len}")
        w = self.embed_tokens.weight
        return KVCache(self.config, batch_size, max_len, device=w.device, dtype=dtype or w.dtype)

    def fuse_projections(self):
        """Stack each block's q/k/v and gate/up layers (Attention and MLP.fuse_projections): fewer, larger
        matmuls for generation. Checkpoints store the layers apart, so this is for a model that only
        generates."""
        for block in self.layers:
            block.attn.fuse_projections()
            block.mlp.fuse_projections()

    def forward(self, input_ids, labels=None, kv_cache: KVCache | None = None, input_lengths=None,
                last_only: bool = False, positions=None, reduction: str = "mean"):
        """input_ids (B, T) -> (logits (B, T, V), loss or None); logits None when the loss is computed
        execution.loss_chunk_rows rows at a time instead (set when the whole logits would not fit in memory).

        labels (B, T): next-token targets, -100 where not learned; the loss is their mean cross-entropy in
        fp32, or with reduction "none" each label's, (B, T), never from the whole logits
        (chunked_cross_entropy; logits None). With kv_cache, the tokens continue each row at kv_cache.pos;
        afterwards pos advances by input_lengths (B,) when given (right-padded prompts of different lengths),
        else by T. last_only: logits (B, 1, V) of each row's last input only (input_lengths - 1): a prefill
        needs no more. positions (B, T), without kv_cache: several examples packed in a row, each starting at
        position 0; a token attends only to the tokens before it in its own example (or, in a branch that
        starts past 0, to its sequence's first tokens too: llm/base/attention.py)."""
        B, T = input_ids.shape
        run = self.execution
        x = self.embed_tokens(input_ids)
        if run.stream_dtype is not None:
            # bf16 under a GPU's autocast: half the bytes of each add, norm and gradient
            x = x.to(run.stream_dtype)
        cos, sin, attends = self.attention_plan(T, kv_cache, positions)
        for block, attend in zip(self.layers, attends):
            if self.config.gradient_checkpointing and self.training and kv_cache is None:
                x = checkpoint(block, x, cos, sin, attend, use_reentrant=False)
            else:
                x = block(x, cos, sin, attend)
        if kv_cache is not None:
            kv_cache.advance(T if input_lengths is None else input_lengths)
        if last_only:
            last = (input_lengths - 1 if input_lengths is not None
                    else torch.full((B,), T - 1, device=x.device))
            x = x[torch.arange(B, device=x.device), last][:, None]  # (B, 1, d)
        x = self.norm(x)
        if labels is not None and (reduction == "none" or 0 < run.loss_chunk_rows < labels.numel()):
            rows = run.loss_chunk_rows or TOKEN_CHUNK_ROWS
            return None, chunked_cross_entropy(x, self.lm_head.weight, labels, rows, reduction,
                                               run.labelled_rows)
        logits = self.lm_head(x)
        loss = None if labels is None else cross_entropy(logits, labels)
        return logits, loss

    def attention_plan(self, T: int, kv_cache: KVCache | None, positions):
        """(cos, sin, one attend(q, k, v) per layer) for a call of T tokens, the one place that tells its
        kinds apart: causal over the T tokens (training, a whole prefill); packed examples (positions (B, T)),
        each attending within itself; or tokens continuing each row of kv_cache at kv_cache.pos."""
        n = self.config.num_hidden_layers
        if kv_cache is None and positions is None:
            gqa = self.config.num_attention_heads != self.config.num_key_value_heads
            attend = partial(causal_attention, gqa=gqa, matmul_softmax=self.execution.matmul_softmax)
            return self.rope_cos[:T], self.rope_sin[:T], [attend] * n
        if kv_cache is None:
            attends = [partial(example_attention, at=example_rows(positions),
                               matmul_softmax=self.execution.matmul_softmax) if self.execution.ragged
                       else partial(packed_attention, mask=example_mask(positions),
                                    matmul_softmax=self.execution.matmul_softmax)] * n
        else:
            positions = kv_cache.pos[:, None] + torch.arange(T, device=kv_cache.pos.device)  # (B, T)
            positions = positions.clamp(max=kv_cache.max_len - 1)  # padding past the end is never read
            if T == 1:  # a decode step: the mask the cache wrote when it last advanced
                mask = kv_cache.next_mask
            else:
                key_pos = torch.arange(kv_cache.max_len, device=positions.device)
                mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, max_len)
            attends = [partial(cached_attention, cache=kv_cache, layer=i, positions=positions, mask=mask)
                       for i in range(n)]
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None], attends  # (B, 1, T, hd)

    def load_stored(self, state: dict):
        """Weights as checkpoints store them (is_stored): every tensor, a tied head left out."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if is_stored(k, self.config)]:
            self.load_state_dict(state)  # strict: raises with torch's list of what differs

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters; without the embedding table when asked (a tied head counts as embedding)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if exclude_embeddings else n


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy over labels != -100; 0 (not NaN) when every label is masked."""
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat,
                            ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


# per-token losses' rows a chunk when loss_chunk_rows is 0: a 49k vocabulary's logits at 200 MB
TOKEN_CHUNK_ROWS = 1024


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int,
                          reduction: str = "mean", labelled_only: bool = False) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, labels) without the whole (B, T, V) logits: `rows` rows at a time,
    each chunk's logits recomputed in backward instead of kept (a 32k vocabulary's fp32 logits can outweigh a
    model). reduction "none": each label's, (B, T), 0 at -100; with labelled_only only the labelled rows meet
    the head (no matmul for a prompt; their number is a host read, so not for torch.compile, whose shapes stay
    static)."""
    h, flat = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    # cast the head once, not once per chunk and again in backward
    if torch.is_autocast_enabled(h.device.type):
        weight = weight.to(torch.get_autocast_dtype(h.device.type))
    if reduction == "mean":
        total = sum(checkpoint(_chunk_loss, h[i:i + rows], weight,
                               flat[i:i + rows], "sum", use_reentrant=False)
                    for i in range(0, h.shape[0], rows))
        return total / (flat != -100).sum().clamp(min=1)
    at = (flat != -100).nonzero().squeeze(1) if labelled_only else None  # a host sync
    h, flat = (h, flat) if at is None else (h[at], flat[at])  # (labelled rows, d), (labelled rows,)
    nll = torch.cat([checkpoint(_chunk_loss, h[i:i + rows], weight,
                                flat[i:i + rows], "none", use_reentrant=False)
                     for i in range(0, h.shape[0], rows)] or [h.new_zeros(0, dtype=torch.float32)])
    return (nll if at is None else nll.new_zeros(labels.numel()).index_copy(0, at, nll)).view(labels.shape)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=-100, reduction=reduction)
