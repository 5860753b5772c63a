"""The micro-batches a run reads from the token cache: windows of the token stream, or windows of whole examples
packed by packing.py (chat and instruction data by default). Either way training reads each window once per epoch,
in a seeded order, and a micro-batch is a pure function of (seed, step, micro_step, rank), so a resumed run reads
what an uninterrupted one would have read, and W ranks with A micro-steps read what one process with W * A
micro-steps reads.
"""

import numpy as np
import torch
from tokenizers import Tokenizer

from config import Config
from llm import packing
from llm.errors import DataError
from llm.preparation import check_window
from llm.token_cache import PreparedData
from llm.tokenizer import IM_START


def batches_for(data: PreparedData, split: str, *, packing_mode: str, batch_size: int, seq_len: int, seed: int,
                rank: int = 0, device=torch.device("cpu"), world_size: int = 1, accum: int = 1):
    """The batch loader of a split for the run's --packing."""
    kind = PackedBatches if packing.packs(packing_mode, data.meta) else Batches
    return kind(data, split, batch_size, seq_len, seed, rank, device, world_size, accum)


def run_loaders(cfg: Config, data: PreparedData, rank: int, world_size: int, device) -> tuple:
    """A training run's loaders for this rank: (its training split's, its validation split's)."""
    t = cfg.train
    return tuple(batches_for(data, split, packing_mode=cfg.data.packing, batch_size=t.micro_batch_size,
                             seq_len=cfg.model.max_seq_len, seed=t.seed, rank=rank, device=device,
                             world_size=world_size, accum=t.grad_accum_steps) for split in ("train", "val"))


class Batches:
    """Windows of seq_len + 1 tokens of one split. Training tiles the split with windows that start at a seeded
    offset each epoch and reads them in a seeded order, so an epoch sees every token once (random windows would
    leave a third of the split unread after one epoch's worth); a weighted mixture draws random windows of each
    source by its weight. Evaluation reads consecutive windows, the same each time."""

    def __init__(self, data: PreparedData, split: str, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, device=torch.device("cpu"), world_size: int = 1, accum: int = 1):
        if split not in ("train", "val"):
            raise DataError(f"split {split!r} does not exist, use 'train' or 'val'")
        if seed < 0 or rank < 0:
            raise DataError(f"seed={seed} and rank={rank} must be >= 0")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.seed, self.rank, self.world_size, self.accum = seed, rank, world_size, accum
        self.device = torch.device(device)
        self.tokens = data.stream(split)
        self.masks = data.stream(split, masks=True) if data.meta["has_masks"] else None
        self.length = len(self.tokens)
        # A mixture draws each training window's source by its weight, then a place in that source's tokens.
        self.ranges = np.array(data.source_ranges() if data.weights and split == "train" else [(0, self.length)])
        self.weights = np.array(data.weights if data.weights and split == "train" else [1.0])
        self._orders = {}  # epoch -> the order of its windows
        self.check()

    def check(self):
        check_window(self.split, self.length, self.seq_len)

    @property
    def epoch_sequences(self) -> int:
        """Windows in one pass over the split: all that fit beside a shift of up to one window (at least one)."""
        return max(1, (self.length - 1) // self.seq_len - 1)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of the windows in one epoch of training, drawn from (seed, epoch)."""
        if epoch not in self._orders:  # kept: this epoch's and the one before (a batch may straddle the two)
            self._orders = {e: order for e, order in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch, 2]).permutation(self.epoch_sequences)
        return self._orders[epoch]

    def sequence_numbers(self, step: int, micro_step: int) -> np.ndarray:
        """Which of the run's training windows this micro-batch holds: the n-th of the sequence of epochs, (B,)."""
        # Slot micro_step * world + rank: W ranks x A micro-steps read what one process with W * A micro-steps
        # reads, so a run resumes on another GPU count with the same batches.
        slot = micro_step * self.world_size + self.rank
        return (step * self.accum * self.world_size + slot) * self.batch_size + np.arange(self.batch_size)

    def epoch_shift(self, epoch: int) -> int:
        """Where this epoch's first window starts: seeded, so window edges fall elsewhere each epoch."""
        slack = self.length - 1 - self.epoch_sequences * self.seq_len  # tokens the tiling leaves over
        return int(np.random.default_rng([self.seed, epoch, 3]).integers(0, slack + 1))

    def starts(self, step: int, micro_step: int) -> np.ndarray:
        """First token of each window in this micro-batch, shape (B,)."""
        span = self.length - self.seq_len  # a window of seq_len + 1 tokens starts before this
        if self.split == "train":
            if len(self.weights) == 1:
                epochs, within = np.divmod(self.sequence_numbers(step, micro_step), self.epoch_sequences)
                shifts = {e: self.epoch_shift(e) for e in set(epochs.tolist())}  # a batch spans one epoch or two
                return np.array([shifts[e] + self.epoch_order(e)[i] * self.seq_len
                                 for e, i in zip(epochs.tolist(), within.tolist())], dtype=np.int64)
            rng = np.random.default_rng([self.seed, step, micro_step * self.world_size + self.rank, 0])
            first, last = self.ranges[rng.choice(len(self.weights), size=self.batch_size, p=self.weights)].T
            return rng.integers(first, last - self.seq_len)
        # Evaluation tiles the split with consecutive windows, ranks interleaved, the same at every eval.
        first = (micro_step * self.world_size + self.rank) * self.batch_size
        return np.arange(first, first + self.batch_size) * self.seq_len % span

    def _windows(self, stream, starts) -> np.ndarray:
        return np.stack([stream[s:s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Inputs and next-token labels, both (B, T) int64 on the device (-100 labels are not learned), and None
        for positions: every row is one stretch of text."""
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
        super().__init__(data, split, *args, **kwargs)
        tok = Tokenizer.from_file(data.tokenizer_path)
        self.plan = packing.plan(self.tokens, data.meta["eot_id"], tok.token_to_id(IM_START), self.seq_len,
                                 self.seed if split == "train" else None)
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
        if self.split == "train":  # the run's n-th sequence is window n of the sequence of epochs
            n = self.sequence_numbers(step, micro_step)
            return np.array([self.epoch_order(int(i // self.plan.windows))[i % self.plan.windows] for i in n])
        slot = micro_step * self.world_size + self.rank
        return (slot * self.batch_size + np.arange(self.batch_size)) % self.plan.windows

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs, labels (-100: not learned, or padding) and positions, each (B, T) int64 on the device."""
        rows = [packing.window(self.plan, w, self.tokens, self.masks, self.pad)
                for w in self.window_ids(step, micro_step)]
        return self.to_device(*(torch.from_numpy(np.stack(parts)) for parts in zip(*rows)))
