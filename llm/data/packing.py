"""Windows of whole examples: a split's documents packed best-fit into training windows.

Random slices of one token stream start a chat in the middle of a conversation and attend across unrelated
ones. Packing gives each window whole examples instead (a conversation, an instruction, or a document with
--packing documents), one after another, the rest padded with ignored labels; positions restart at each
example, and the model's attention does not cross from one to the next (modern_llm.py derives the
block-diagonal mask from those positions). An example longer than the window is cut at a turn start (or, with
none in reach, at the window's end) and its pieces packed like examples. Pure numpy: batches.py (and
prepare_data.py --show) call these on the token cache's arrays.
"""

import bisect
from dataclasses import dataclass

import numpy as np

from llm.base.errors import DataError

SCAN_CHUNK = 2**24  # tokens per pass of the boundary scan: bounds the memory a memmap maps at once


def packs(mode: str, meta: dict) -> bool:
    """Whether a run packs whole examples: --packing documents always; auto when the cache holds chats."""
    return mode == "documents" or (mode == "auto" and meta["has_masks"])


@dataclass
class Plan:
    """Windows of one split: window w holds the pieces piece_start[first[w]:first[w + 1]] (each the first
    token of a piece's inputs; its labels run one further) with their lengths."""
    piece_start: np.ndarray  # (pieces,) int64, in window order
    piece_len: np.ndarray  # (pieces,) int64, inputs per piece, 1..seq_len
    first: np.ndarray  # (windows + 1,) int64: window w's pieces are first[w]:first[w + 1]
    seq_len: int
    examples: int  # documents the pieces come from
    cut: int  # examples longer than a window, cut into pieces

    @property
    def windows(self) -> int:
        return len(self.first) - 1

    @property
    def fill_rate(self) -> float:
        """Share of window positions that hold an example's tokens rather than padding."""
        return float(self.piece_len.sum()) / max(1, self.windows * self.seq_len)


def boundaries(tokens, value: int) -> np.ndarray:
    """Positions of every `value` in a (memory-mapped) token array, scanned in chunks."""
    found = [start + np.flatnonzero(tokens[start:start + SCAN_CHUNK] == value)
             for start in range(0, len(tokens), SCAN_CHUNK)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def pieces(ends: np.ndarray, turn_starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(starts, lengths, examples cut) of the examples that end (with their end-of-text token) at `ends`.

    An example's inputs are its tokens before its end-of-text token, its labels the tokens after each input,
    the end-of-text token included. One longer than seq_len is cut before the last turn start within reach (a
    position in turn_starts, sorted), or at seq_len where no turn starts inside the reach."""
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    lengths = (ends - starts).astype(np.int64)
    keep = lengths > 0  # two end-of-text tokens in a row hold no example
    starts, lengths = starts[keep], lengths[keep]
    long = np.flatnonzero(lengths > seq_len)
    if not len(long):
        return starts, lengths, 0
    more_starts, more_lengths = [], []
    for i in long:  # only the long ones loop in Python
        begin, end = int(starts[i]), int(starts[i] + lengths[i])
        cuts = []
        while end - begin > seq_len:
            j = bisect.bisect_right(turn_starts, begin + seq_len) - 1  # the last turn start within reach
            cut = int(turn_starts[j]) if j >= 0 and turn_starts[j] > begin else begin + seq_len
            cuts.append((begin, cut - begin))
            begin = cut
        starts[i], lengths[i] = begin, end - begin  # the example keeps its last piece, the others follow
        more_starts += [c[0] for c in cuts]
        more_lengths += [c[1] for c in cuts]
    return (np.concatenate([starts, np.array(more_starts, np.int64)]),
            np.concatenate([lengths, np.array(more_lengths, np.int64)]), len(long))


def best_fit(lengths: np.ndarray, seq_len: int, order: np.ndarray) -> list[list[int]]:
    """Pieces (indices into lengths, taken in `order`) packed into windows of seq_len positions: each piece
    goes into the open window whose free space fits it most tightly, or opens a new one."""
    windows: list[list[int]] = []
    free_sizes: list[int] = []  # sorted distinct free sizes of open windows
    by_free: dict[int, list[int]] = {}  # free size -> open windows with that much room
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free_sizes, n)
        if k < len(free_sizes):
            size = free_sizes[k]
            w = by_free[size].pop()
            if not by_free[size]:
                del by_free[size], free_sizes[k]
        else:
            size, w = seq_len, len(windows)
            windows.append([])
        windows[w].append(i)
        left = size - n
        if left:  # a full window is closed
            if left not in by_free:
                bisect.insort(free_sizes, left)
                by_free[left] = []
            by_free[left].append(w)
    return windows


def plan(tokens, eot: int, turn_start: int | None, seq_len: int, seed: int | None) -> Plan:
    """The packing of a split: its examples (ending at each end-of-text token) cut to fit, shuffled by seed
    (None: in file order, as evaluation wants), best-fit into windows of seq_len inputs."""
    ends = boundaries(tokens, eot)
    turns = boundaries(tokens, turn_start) if turn_start is not None else np.zeros(0, np.int64)
    starts, lengths, cut = pieces(ends, turns, seq_len)
    order = (np.arange(len(starts)) if seed is None
             else np.random.default_rng([seed, 1]).permutation(len(starts)))
    windows = best_fit(lengths, seq_len, order)
    flat = np.fromiter((i for w in windows for i in w), np.int64, count=len(starts))
    first = np.cumsum([0] + [len(w) for w in windows]).astype(np.int64)
    return Plan(starts[flat], lengths[flat], first, seq_len, examples=len(ends), cut=cut)


def window(plan: Plan, w: int, tokens, masks, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs, labels (-100 where not learned, and over padding) and positions of window w, each (seq_len,).
    """
    x = np.full(plan.seq_len, pad, np.int64)
    y = np.full(plan.seq_len, -100, np.int64)
    pos = np.zeros(plan.seq_len, np.int64)
    at, held = 0, slice(plan.first[w], plan.first[w + 1])
    for s, n in zip(plan.piece_start[held].tolist(), plan.piece_len[held].tolist()):
        span = np.asarray(tokens[s:s + n + 1], np.int64)
        x[at:at + n], y[at:at + n], pos[at:at + n] = span[:-1], span[1:], np.arange(n)
        if masks is not None:
            y[at:at + n][np.asarray(masks[s + 1:s + n + 1]) == 0] = -100
        at += n
    # padding: one more example, of ignored labels, attending to itself
    pos[at:] = np.arange(plan.seq_len - at)
    return x, y, pos


# ----------------------------------------------------------------------------- preference pairs

@dataclass
class PairPlan:
    """Windows of whole preference pairs: a pair's prompt and chosen reply, then its rejected reply branching
    off the prompt (the prompt's last token again, at its position, then the reply: attention.py), so
    the prompt runs once for both; window w holds pairs pair_ids[first[w]:first[w + 1]]. Pair p's sequences
    start at start[p] (its chosen, its rejected; after any prompt tokens cut from the left) and hold length[p]
    inputs each (labels run one further, onto the end-of-text token), the first shared[p] of them the prompt
    both begin with."""
    start: np.ndarray  # (pairs, 2) int64
    length: np.ndarray  # (pairs, 2) int64
    shared: np.ndarray  # (pairs,) int64
    pair_ids: np.ndarray  # (packed pairs,) int64, in window order
    first: np.ndarray  # (windows + 1,) int64
    seq_len: int
    pairs: int  # pairs in the split (ids 0..pairs - 1, in file order)
    cut: int  # pairs whose prompt was cut from the left to fit a window
    dropped: int  # pairs whose replies alone do not fit a window: left out

    def sizes(self) -> np.ndarray:
        return pair_sizes(self.length, self.shared)

    @property
    def windows(self) -> int:
        return len(self.first) - 1


def pair_sizes(length: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """(pairs,) the positions each pair fills in a window: both sequences, less their shared prompt but its
    last token once."""
    return length.sum(1) - shared + 1


def pair_plan(tokens, masks, eot: int, seq_len: int, seed: int | None) -> PairPlan:
    """The pairs of a split (examples 2k and 2k + 1 ending at end-of-text tokens; a reply starts at the first
    learned token), each cut to fit one window: a prompt too long loses tokens from its left, the same number
    in both sequences (at least one stays, to predict the reply's first token). Shuffled by seed (None: file
    order), best-fit into windows of seq_len inputs."""
    ends = boundaries(tokens, eot)
    if len(ends) % 2:
        raise DataError(f"a cache of preference pairs holds {len(ends)} sequences, not two per pair; delete "
                        "the token cache folder and it is rebuilt")
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    learned = np.flatnonzero(np.asarray(masks[:]) != 0) if len(ends) else np.zeros(0, np.int64)
    reply = learned[np.minimum(np.searchsorted(learned, starts), len(learned) - 1)] if len(learned) else ends
    # tokens before the reply (shared)
    prompt = np.minimum(reply - starts, ends - starts).reshape(-1, 2).min(1)
    length = (ends - starts).reshape(-1, 2)
    # a token cut shortens both sequences, one window place
    cut = np.maximum(length.sum(1) - prompt + 1 - seq_len, 0)
    fits = cut <= prompt - 1
    cut = np.where(fits, cut, 0)
    start, length = starts.reshape(-1, 2) + cut[:, None], length - cut[:, None]
    kept = np.flatnonzero(fits)
    order = kept if seed is None else kept[np.random.default_rng([seed, 5]).permutation(len(kept))]
    shared = prompt - cut
    windows = best_fit(pair_sizes(length, shared), seq_len, order)
    pair_ids = np.fromiter((i for w in windows for i in w), np.int64, count=len(kept))
    first = np.cumsum([0] + [len(w) for w in windows]).astype(np.int64)
    return PairPlan(start, length, shared, pair_ids, first, seq_len, pairs=len(length),
                    cut=int((cut > 0).sum()), dropped=int((~fits).sum()))


def pair_window(plan: PairPlan, w: int, tokens, masks, pad: int) -> tuple[np.ndarray, ...]:
    """Inputs, labels (-100 outside the replies), positions and reply slots (2 * pair's place in the window +
    side, -1 outside the replies) of window w, each (seq_len,), and the ids of its pairs."""
    x = np.full(plan.seq_len, pad, np.int64)
    y = np.full(plan.seq_len, -100, np.int64)
    pos = np.zeros(plan.seq_len, np.int64)
    slot = np.full(plan.seq_len, -1, np.int64)
    ids = plan.pair_ids[plan.first[w]:plan.first[w + 1]]
    at = 0
    for j, p in enumerate(ids.tolist()):
        for side in (0, 1):
            s, n = int(plan.start[p, side]), int(plan.length[p, side])
            # the rejected reply branches off the prompt's end
            skip = 0 if side == 0 else int(plan.shared[p]) - 1
            span = np.asarray(tokens[s + skip:s + n + 1], np.int64)
            learned = np.asarray(masks[s + skip + 1:s + n + 1]) != 0
            x[at:at + n - skip], pos[at:at + n - skip] = span[:-1], np.arange(skip, n)
            y[at:at + n - skip] = np.where(learned, span[1:], -100)
            slot[at:at + n - skip] = np.where(learned, 2 * j + side, -1)
            at += n - skip
    pos[at:] = np.arange(plan.seq_len - at)
    return x, y, pos, slot, ids
