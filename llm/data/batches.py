"""The micro-batches a run reads from the token cache: windows of the token stream, or windows of whole
examples packed by packing.py (chat and instruction data by default). Which windows a micro-batch holds is
window_order.py's to say, a pure function of (seed, step, micro_step, rank); here the split's tokens are held
(read again as the parts of a corpus read in arrival order come in), a step waits for a part not yet written,
and the windows are read into tensors on the device."""

from typing import NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from config import Config
from llm.base.errors import DataError
from llm.data import packing
from llm.data.arrival import ArrivingData
from llm.data.token_cache import PreparedData
from llm.data.window_order import WindowOrder, first_epoch_windows, tiled_windows
from llm.tokens.tokenizer import IM_START


def check_window(split: str, tokens: int, seq_len: int):
    """A split must hold one training window of seq_len + 1 tokens."""
    if tokens < seq_len + 1:
        raise DataError(f"the {split} split holds {tokens} tokens, fewer than one window of max_seq_len + 1 "
                        f"= {seq_len + 1}; add text, raise --val_fraction or lower --max_seq_len")


def check_windows(data: PreparedData, mode: str, seq_len: int):
    """Both splits hold a training window, and so does each weighted source, where windows are random slices
    (packed ones, by --packing `mode`, fit any example; they read the corpus as a whole, so refuse weights).
    """
    if packing.packs(mode, data.meta) or data.meta.get("has_pairs"):
        if data.weights:
            raise DataError("source weights apply to random windows, and these windows are packed "
                            "whole examples (--packing auto with chats, or documents); pass "
                            "--packing off or give no weights")
        return
    for split in ("train", "val"):
        check_window(split, data.meta[f"{split}_tokens"], seq_len)
    for source, (a, b) in zip(data.meta["sources"], data.source_ranges() if data.weights else []):
        if b - a < seq_len + 1:
            raise DataError(f"data source {source['source']} gives {b - a} train tokens, fewer "
                            f"than one window of max_seq_len + 1 = {seq_len + 1}; add text to "
                            "it, raise its cap or leave it out")


def batches_for(data: PreparedData, split: str, *, packing_mode: str, batch_size: int, seq_len: int,
                seed: int, rank: int = 0, device=torch.device("cpu"), world_size: int = 1, accum: int = 1):
    """The batch loader of a split for the run's --packing."""
    kind = PairBatches if data.meta.get("has_pairs") else \
        PackedBatches if packing.packs(packing_mode, data.meta) else Batches
    return kind(data, split, batch_size, seq_len, seed, rank, device, world_size, accum)


def run_loaders(cfg: Config, data: PreparedData, rank: int, world_size: int, device) -> tuple:
    """A training run's loaders for this rank: (its training split's, its validation split's)."""
    t = cfg.train
    return tuple(batches_for(data, split, packing_mode=cfg.data.packing, batch_size=t.micro_batch_size,
                             seq_len=cfg.model.max_seq_len, seed=t.seed, rank=rank, device=device,
                             world_size=world_size, accum=t.grad_accum_steps) for split in ("train", "val"))


class Batches:
    """Windows of seq_len + 1 tokens of one split: the split's tokens, read again as a corpus read in arrival
    order gains parts, a read waiting for a part not yet written (arrival.py); which windows each micro-batch
    holds is self.order's to say (window_order.py: tiled epochs, a mixture's draws, arrival order, or
    consecutive windows)."""

    def __init__(self, data: PreparedData, split: str, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, device=torch.device("cpu"), world_size: int = 1, accum: int = 1):
        if split not in ("train", "val"):
            raise DataError(f"split {split!r} does not exist, use 'train' or 'val'")
        if seed < 0 or rank < 0:
            raise DataError(f"seed={seed} and rank={rank} must be >= 0")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.order = WindowOrder(seed, batch_size, seq_len, rank, world_size, accum)
        self.device = torch.device(device)
        self.data, self.arrival = data, data.arrival and split == "train"
        self._load()
        self.check()

    def _load(self):
        """Read the split's parts as they are now: a corpus read in arrival order gains parts while a run
        reads."""
        d = self.data
        self.final = getattr(d, "complete", True)  # read before the parts: once complete, they are all there
        now = PreparedData(d.path, d.meta, list(d.parts), d.weights, d.arrival, d.commit)
        self.tokens = now.stream(self.split)
        self.masks = now.stream(self.split, masks=True) if now.meta["has_masks"] else None
        self.length = len(self.tokens)
        # A mixture draws each training window's source by its weight, then a place in that source's tokens.
        self.ranges = np.array(now.source_ranges() if now.weights and self.split == "train"
                               else [(0, self.length)])
        self.weights = np.array(now.weights if now.weights and self.split == "train" else [1.0])
        # the first epoch's windows, part by part: where each part's tokens and windows begin
        if self.arrival:
            self.part_starts = np.cumsum([0] + [p["train_tokens"] for p in now.parts])
            self.part_windows = np.cumsum([0] + first_epoch_windows(now.parts, self.seq_len))

    def check(self):
        check_window(self.split, self.length, self.seq_len)

    @property
    def failure(self) -> BaseException | None:
        """What stopped the preparation of a corpus read as it arrives, if anything did."""
        return getattr(self.data, "error", None)

    def in_hand(self, step: int) -> bool:
        """Whether ready(step) returns at once: the corpus is complete and loaded, or holds this step's
        windows."""
        return self._holds(self.order.step_end(step))

    def ready(self, step: int, give_up=lambda: False) -> bool:
        """Wait until every window of this step is in, where the corpus is still arriving, or give_up() (the
        run was asked to stop); False if its preparation failed first (the run then saves and stops)."""
        return self._arrived(self.order.step_end(step), give_up)

    def _holds(self, sequence: int) -> bool:
        """Whether the run's sequence-th training window is readable now, with no wait."""
        return not self.arrival or self.final or sequence < self.part_windows[-1]

    def _arrived(self, sequence: int, give_up=lambda: False) -> bool:
        """Wait until the run's sequence-th training window is in (or every part is, or give_up()); False if
        the preparation failed."""
        data = self.data
        if self._holds(sequence):
            return True
        if not data.complete:
            data.wait(lambda parts: sum(first_epoch_windows(parts, self.seq_len)) > sequence,
                      f"the part that holds training window {sequence:,}", give_up)
        self._load()
        return data.error is None

    @property
    def epoch_sequences(self) -> int:
        """Windows in one pass over the split: all that fit beside a shift of up to one window (at least one).
        """
        return tiled_windows(self.length, self.seq_len)

    def starts(self, step: int, micro_step: int) -> np.ndarray:
        """First token of each window in this micro-batch, shape (B,)."""
        order = self.order
        if self.split != "train":
            return order.evaluation_starts(micro_step, self.length)
        if self.arrival:
            numbers = order.sequence_numbers(step, micro_step)
            if not self._arrived(int(numbers.max())):  # waits, then loads the parts that came
                raise self.failure
            return order.arrival_starts(numbers, self.part_starts, self.part_windows, self.length)
        if len(self.weights) == 1:
            return order.tiled_starts(order.sequence_numbers(step, micro_step), self.length)
        return order.mixture_starts(step, micro_step, self.ranges, self.weights)

    def _windows(self, stream, starts) -> np.ndarray:
        return np.stack([stream[s:s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Inputs and next-token labels, both (B, T) int64 on the device (-100 labels are not learned), and
        None for positions: every row is one stretch of text."""
        starts = self.starts(step, micro_step)
        windows = self._windows(self.tokens, starts)
        x, y = torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
        if self.masks:
            learned = self._windows(self.masks, starts)[:, 1:]
            y[torch.from_numpy(learned == 0)] = -100
        return *self.to_device(x, y), None

    def to_device(self, *tensors) -> tuple:
        if self.device.type == "cuda":  # pinned pages let the copy overlap with the previous step's compute
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in tensors)
        return tuple(t.to(self.device) for t in tensors)


class PackedBatches(Batches):
    """Windows of whole examples (packing.py's plan of the split). Training reads every window once per epoch,
    in an order drawn from (seed, epoch); evaluation reads the split's windows in file order."""

    def __init__(self, data: PreparedData, split: str, *args, **kwargs):
        if isinstance(data, ArrivingData) and not data.wait(lambda parts: False, "every part, to pack them"):
            raise data.error  # a plan covers the whole split: a corpus still arriving is waited for
        super().__init__(data, split, *args, **kwargs)
        self.arrival = False  # packed windows are drawn from the plan, which covers the whole split
        tok = Tokenizer.from_file(data.tokenizer_path)
        self.plan = packing.plan(self.tokens, data.meta["eot_id"], tok.token_to_id(IM_START), self.seq_len,
                                 self.order.seed if split == "train" else None)
        if not self.plan.windows:
            raise DataError(f"the {split} split holds no example to pack; add data or raise --val_fraction")
        self.pad = data.meta["eot_id"]

    def check(self):
        pass  # any example fits: a long one is cut into pieces

    @property
    def epoch_sequences(self) -> int:
        return self.plan.windows

    def window_ids(self, step: int, micro_step: int) -> np.ndarray:
        """The windows of this micro-batch, (B,)."""
        if self.split == "train":
            return self.order.packed_ids(step, micro_step, self.plan.windows)
        return self.order.evaluation_ids(micro_step, self.plan.windows)

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs, labels (-100: not learned, or padding) and positions, each (B, T) int64 on the device."""
        rows = [packing.window(self.plan, w, self.tokens, self.masks, self.pad)
                for w in self.window_ids(step, micro_step)]
        return self.to_device(*(torch.from_numpy(np.stack(parts)) for parts in zip(*rows)))


class PairBatch(NamedTuple):
    """A micro-batch of whole preference pairs: inputs, labels (-100 outside the replies), positions and reply
    slots (2 * pair + side, -1 outside the replies), each (B, T) on the device; the pairs' ids in their split
    (P,) on the device, and P."""
    x: torch.Tensor
    y: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    pair_ids: torch.Tensor
    pairs: int


# A cut window's length rounds up to a multiple of this: a few shapes, so the CPU's matmul library (oneDNN)
# keeps a few kernels and their buffers rather than a set per length (cut exactly, the bench's peak grew from
# 0.65 to 0.9 GiB).
TRIM_STEP = 64


class PairBatches(PackedBatches):
    """Windows of whole preference pairs (packing.pair_plan), read as PackedBatches reads windows of examples:
    training each window once per epoch in an order drawn from (seed, epoch), evaluation in file order. Pairs
    are always packed, whatever --packing says: a pair is whole or not trained. trim: each micro-batch cut
    after its windows' last filled position, rounded up to TRIM_STEP (an eager step's shapes may change; a
    compiled step's stay); the step's Runner sets it (runner.start), as it alone knows which."""
    trim = False

    def __init__(self, data: PreparedData, split: str, *args, **kwargs):
        Batches.__init__(self, data, split, *args, **kwargs)
        self.arrival = False
        self.plan = packing.pair_plan(self.tokens, self.masks, data.meta["eot_id"], self.seq_len,
                                      self.order.seed if split == "train" else None)
        if not self.plan.windows:
            raise DataError(f"the {split} split holds no preference pair that fits a window of "
                            f"{self.seq_len} tokens ({self.plan.dropped} do not); raise --max_seq_len, "
                            "add pairs or raise --val_fraction")
        self.pad = data.meta["eot_id"]
        # filled, a window
        self.fills = np.add.reduceat(self.plan.sizes()[self.plan.pair_ids], self.plan.first[:-1])

    def get(self, step: int, micro_step: int) -> PairBatch:
        return self.of_windows(self.window_ids(step, micro_step))

    def of_windows(self, windows) -> PairBatch:
        """The micro-batch of these windows, its pairs numbered across its rows."""
        rows = [packing.pair_window(self.plan, w, self.tokens, self.masks, self.pad) for w in windows]
        filled = (min(self.seq_len, -(-max(self.fills[w] for w in windows) // TRIM_STEP) * TRIM_STEP)
                  if self.trim else self.seq_len)
        x, y, pos, slot = (np.stack(parts)[:, :filled] for parts in list(zip(*rows))[:4])
        before = np.cumsum([0] + [len(r[4]) for r in rows[:-1]])
        slot = np.where(slot >= 0, slot + 2 * before[:, None], -1)
        ids = np.concatenate([r[4] for r in rows])
        tensors = self.to_device(*(torch.from_numpy(a) for a in (x, y, pos, slot, ids)))
        return PairBatch(*tensors, pairs=len(ids))
