"""How a token attends: causal over a row (SDPA's kernel, or written out as two matmuls and a softmax where
that is faster on a CPU), over a KV cache (a decode step on a CPU written out), and over windows that pack
several examples, told apart by their positions alone. modern_llm.py's attention layer picks one per call.

Packed windows

A window's tokens form segments, each a run of consecutive positions. A segment starting at position 0 begins
a sequence of its own. A segment starting at position s > 0 is a branch: it continues the first s tokens of
the sequence before it in the row, which it attends to as if they stood in front of it, and attends to nothing
else of that sequence. A preference pair packs so (packing.pair_window): its prompt and chosen reply, then
its rejected reply branching off the prompt, so the prompt runs once for both replies; so does an eager GRPO
step's row of a prompt and several of its replies (rollouts.Rollouts.lay_out). Plain packed examples are
segments that all start at 0.

Two ways to run it, equal in result: packed_attention under a (T, T) mask (example_mask; a compiled step's
fixed shapes), and example_attention, each segment moved to a row of its own with its branch point's keys and
values in front (example_rows; eager, the work each segment's length squared rather than the window's)."""

import torch
import torch.nn.functional as F

# Measured on a 2-core CPU, forward and backward: written out, attention is 2x faster at 128-256 positions
# compiled, and eager under bf16 2.5x at 104, even at 256 and slower at 512; eager in fp32 the kernel wins.
WRITTEN_OUT_ROWS = 256


def written_out_is_faster(device_kind: str, compiled: bool, amp_dtype: torch.dtype | None, rows: int) -> bool:
    """Whether causal or packed attention runs faster written out as matmuls and a softmax than through SDPA's
    kernel: on a CPU, in a compiled step or under bf16 autocast, for rows of up to WRITTEN_OUT_ROWS tokens.
    GPUs keep SDPA's flash and cuDNN kernels."""
    faster = compiled or amp_dtype == torch.bfloat16
    return device_kind == "cpu" and faster and rows <= WRITTEN_OUT_ROWS


def causal_attention(q, k, v, gqa: bool, matmul_softmax: bool = False) -> torch.Tensor:
    """Causal softmax attention of (B, H, T, hd) queries over (B, Hkv, T, hd) keys and values: SDPA's kernel,
    or written out, which on a CPU is faster for short rows: about twice the flash kernel's speed compiled by
    Inductor and 2.5x eager under bf16, forward and backward (written_out_is_faster)."""
    if not matmul_softmax:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    T = q.shape[2]
    at = torch.arange(T, device=q.device)
    return written_out_attention(q, k, v, at[None, :] <= at[:, None])


def cached_attention(q, k, v, cache, layer: int, positions: torch.Tensor, mask: torch.Tensor):
    """Attention of (B, H, T, hd) queries over the layer's cache, after writing this call's keys and values
    into it at positions (B, T); mask (B, 1, T, max_len), bool or the cache's next_mask, hides each row's
    later and unfilled places."""
    k, v = cache.update(layer, k, v, positions)  # (B, Hkv, max_len, hd)
    if cache.span is not None:  # the places past it are unfilled (masked): skip them rather than mask them
        k, v, mask = k[:, :, :cache.span], v[:, :, :cache.span], mask[..., :cache.span]
    if q.device.type == "cpu" and q.shape[2] == 1:
        # The CPU's flash kernel is slow for one query a row: a bf16 decode step's attention took 6x as long
        # as the same arithmetic written out in fp32, which rounds only the output, as the kernel does. A
        # prefill keeps the kernel, which never holds its scores.
        wide = matmul_dtype(q)
        # A span's keys are copied for a CPU's bf16 batched matmul either way: as they lie, that takes half
        # the time it does transposed (3% of a LoRA GRPO rollout's sampling on a CPU). fp32 copies neither.
        keys_first = cache.span is not None and wide == torch.bfloat16
        return written_out_attention(q.to(wide), k.to(wide), v.to(wide), mask, keys_first).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    # the cache's dtype: the queries' when inferring
    mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=gqa)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x computes in: autocast's where it is on (it casts the inputs whatever they are:
    a bf16 cache cast up to fp32 first was cast back, two copies of the cache a layer and step), else at least
    fp32."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, torch.float32)


def written_out_attention(q, k, v, allowed: torch.Tensor, keys_first: bool = False) -> torch.Tensor:
    """Softmax attention of (B, H, T, hd) queries over (B, Hkv, S, hd) keys and values as two matmuls in the
    inputs' dtype and a softmax in at least fp32, the queries of a key head stacked as rows of one matmul.
    allowed (..., T, S): bool, True where a query sees a key, or added to the scores (0 or -inf). keys_first:
    the scores as keys times queries, transposed (the same sums)."""
    (B, H, T, hd), Hkv = q.shape, k.shape[1]
    grouped = q.reshape(B, Hkv, H // Hkv * T, hd)
    if keys_first:
        scores = (k @ grouped.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = grouped @ k.transpose(-1, -2)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * hd ** -0.5  # bf16's in fp32
    allowed = allowed.tile((H // Hkv, 1))  # rows (query head within its group, query), as the scores'
    if allowed.dtype == torch.bool:
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        scores = scores + allowed
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, T, hd)


def packed_attention(q, k, v, mask: torch.Tensor, matmul_softmax: bool = False) -> torch.Tensor:
    """Attention of (B, H, T, hd) queries under a (B, 1, T, T) mask of packed examples (example_mask), written
    out where matmul_softmax (as causal_attention). The kernel's keys and values are repeated to every head:
    GPU kernels that take a mask want them so, not grouped."""
    if matmul_softmax:
        return written_out_attention(q, k, v, mask)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def example_attention(q, k, v, at, matmul_softmax: bool = False) -> torch.Tensor:
    """packed_attention without its (T, T) mask: each segment of the (B, H, T, hd) queries moved to a row of
    its own (at: example_rows), a branch's keys and values behind its sequence's first ones, attended causally
    there (causal_attention: written out where matmul_softmax) and moved back."""
    (B, H, T, hd), (segment, col, shared, n, longest) = q.shape, at

    # (B, h, T, hd) -> (n, h, longest, hd), zeros past a row's end (never attended)
    def unpack(t, prefix: bool):
        t = t.transpose(1, 2).reshape(B * T, t.shape[1], hd)
        rows = t.new_zeros(n, longest, *t.shape[1:]).index_put((segment, col), t)
        if prefix:  # a branch's row starts with the keys and values of the tokens it continues
            rows = rows.index_put(shared[:2], t[shared[2]])
        return rows.transpose(1, 2)
    y = causal_attention(unpack(q, False), unpack(k, True), unpack(v, True), H != k.shape[1], matmul_softmax)
    return y.transpose(1, 2)[segment, col].view(B, T, H, hd).transpose(1, 2)


def _segments(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (B, T) positions: whether each token starts a segment, the position its segment starts at, and its
    sequence's number in the row (0 before a row's first position 0: a row may open inside a sequence)."""
    at = torch.arange(positions.shape[1], device=positions.device)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    begun = torch.where(starts, at, 0).cummax(dim=1).values  # where each token's segment begins in the row
    return starts, positions - (at - begun), (positions == 0).cumsum(dim=1)


def example_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask of packed examples: causal within each segment, a branch that starts at
    position s also seeing the first s tokens of its sequence."""
    starts, begins_at, sequence = _segments(positions)
    segment = starts.cumsum(dim=1)
    at = torch.arange(positions.shape[1], device=positions.device)
    same_sequence = (sequence[:, :, None] == sequence[:, None, :]) & (sequence[:, :, None] > 0)
    own = segment[:, :, None] == segment[:, None, :]
    continued = same_sequence & (begins_at[:, None, :] == 0) & (positions[:, None, :] < begins_at[:, :, None])
    return ((own | continued) & (at[None, :] <= at[:, None]))[:, None]


def example_rows(positions: torch.Tensor) -> tuple:
    """Where example_attention moves each token: its segment (a row) and place there, (B * T,) each; the
    (rows, places, tokens) of the keys a branch's row starts with; then the rows' number and longest (read on
    the host, once a forward)."""
    B, T = positions.shape
    positions = positions.contiguous()  # an expanded batch's positions, say
    starts, begins_at, sequence = _segments(positions)
    flat = torch.arange(B * T, device=positions.device).view(B, T)
    # each token's sequence's first
    first = torch.where(positions == 0, flat, 0).cummax(dim=1).values.view(-1)
    segment = starts.view(-1).cumsum(0) - 1
    trunk = torch.bincount(segment)[segment[first]]  # its sequence's first segment's length
    branch = (sequence.view(-1) > 0) & (begins_at.view(-1) > 0)
    prefix = torch.where(branch, torch.minimum(begins_at.view(-1), trunk), 0)  # the tokens a branch continues
    col = positions.view(-1) - begins_at.view(-1) + prefix
    opens = starts.view(-1).nonzero()[:, 0]  # each segment's first token
    counts = prefix[opens]
    place = torch.arange(int(counts.sum()), device=positions.device) - torch.repeat_interleave(
        counts.cumsum(0) - counts, counts)  # 0, 1, ... within each branch's copied tokens
    shared = (torch.repeat_interleave(segment[opens], counts), place,
              torch.repeat_interleave(first[opens], counts) + place)
    return segment, col, shared, *(torch.stack([segment[-1], col.max()]) + 1).tolist()
