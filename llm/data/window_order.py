"""Which windows of a split a micro-batch reads: a pure function of (seed, step, micro_step, rank) and the
split's shape, so a resumed run reads what an uninterrupted one would have read, and W ranks with A
micro-steps read what one process with W * A micro-steps reads. batches.py holds the tokens, waits for parts
still arriving and reads the windows named here.

- Tiled epochs: each epoch tiles the split with windows from a seeded offset and reads them in a seeded order,
  so an epoch sees every token once (random windows would leave a third of the split unread after one epoch's
  worth).
- A weighted mixture: random windows, each of a source drawn by its weight.
- Arrival order: the first epoch part by part, in the order the parts were written, each part's windows in a
  seeded order; the epochs after it tiled as above.
- Evaluation: consecutive windows, ranks interleaved, the same at every evaluation.
Packed windows (packing.py's plan) are read the same ways: training each once an epoch in a seeded order,
evaluation in file order.
"""

import numpy as np


def first_epoch_windows(parts: list, seq_len: int) -> list[int]:
    """Windows of seq_len + 1 tokens each part's train tokens hold, tiled from its start: a corpus read in
    arrival order reads these in its first epoch."""
    return [max(0, (p["train_tokens"] - 1) // seq_len) for p in parts]


def tiled_windows(length: int, seq_len: int) -> int:
    """Windows in one pass over length tokens: all that fit beside a shift of up to one window (at least one).
    """
    return max(1, (length - 1) // seq_len - 1)


class WindowOrder:
    """The windows one reader reads in each order: rank of world_size ranks, batch_size windows a micro-batch,
    accum micro-steps a step."""

    def __init__(self, seed: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
                 accum: int = 1):
        self.seed, self.batch_size, self.seq_len = seed, batch_size, seq_len
        self.rank, self.world_size, self.accum = rank, world_size, accum
        self._orders, self._part_orders = {}, {}  # epoch -> the order of its windows; part -> of its windows

    def slot(self, micro_step: int) -> int:
        """This micro-batch's place in its step. Slot micro_step * world + rank: W ranks x A micro-steps read
        what one process with W * A micro-steps reads, so a run resumes on another GPU count with the same
        batches."""
        return micro_step * self.world_size + self.rank

    def sequence_numbers(self, step: int, micro_step: int) -> np.ndarray:
        """Which of the run's training windows this micro-batch holds: the n-th of the sequence of epochs,
        (B,)."""
        first = (step * self.accum * self.world_size + self.slot(micro_step)) * self.batch_size
        return first + np.arange(self.batch_size)

    def step_end(self, step: int) -> int:
        """The step's last training window, counted over the run."""
        return (step + 1) * self.accum * self.world_size * self.batch_size - 1

    def epoch_order(self, epoch: int, windows: int) -> np.ndarray:
        """The order of the windows in one epoch of training, drawn from (seed, epoch)."""
        if epoch not in self._orders:  # kept: this epoch's and the one before (a batch may straddle the two)
            self._orders = {e: order for e, order in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch, 2]).permutation(windows)
        return self._orders[epoch]

    def epoch_shift(self, epoch: int, length: int) -> int:
        """Where this epoch's first window starts: seeded, so window edges fall elsewhere each epoch."""
        # tokens the tiling leaves over
        slack = length - 1 - tiled_windows(length, self.seq_len) * self.seq_len
        return int(np.random.default_rng([self.seed, epoch, 3]).integers(0, slack + 1))

    def part_order(self, part: int, windows: int) -> np.ndarray:
        """The order of one part's windows in the first epoch of a corpus read in arrival order."""
        if part not in self._part_orders:  # kept: this part's and the one before
            self._part_orders = {p: order for p, order in self._part_orders.items() if p == part - 1}
            self._part_orders[part] = np.random.default_rng([self.seed, part, 4]).permutation(windows)
        return self._part_orders[part]

    def tiled_starts(self, numbers: np.ndarray, length: int, first_epoch: int = 0) -> np.ndarray:
        """Starts of these sequence numbers in the tiling of a split of length tokens, counted from epoch
        first_epoch."""
        windows = tiled_windows(length, self.seq_len)
        epochs, within = np.divmod(numbers, windows)
        epochs += first_epoch
        # a batch spans one epoch or two
        shifts = {e: self.epoch_shift(e, length) for e in set(epochs.tolist())}
        return np.array([shifts[e] + self.epoch_order(e, windows)[i] * self.seq_len
                         for e, i in zip(epochs.tolist(), within.tolist())], dtype=np.int64)

    def arrival_starts(self, numbers: np.ndarray, part_starts: np.ndarray, part_windows: np.ndarray,
                       length: int) -> np.ndarray:
        """Starts of these sequence numbers when the first epoch reads the parts in arrival order (part_starts
        and part_windows: where each part's tokens and first-epoch windows begin, and where the last ends);
        the epochs after it tile the whole split of length tokens as any corpus does."""
        first = int(part_windows[-1])  # the first epoch's windows: final once a window past them is asked for
        later, out = numbers >= first, np.zeros(len(numbers), np.int64)
        if later.any():
            out[later] = self.tiled_starts(numbers[later] - first, length, first_epoch=1)
        for row in np.flatnonzero(~later).tolist():
            n = int(numbers[row])
            part = int(np.searchsorted(part_windows, n, side="right")) - 1
            order = self.part_order(part, int(part_windows[part + 1] - part_windows[part]))
            out[row] = part_starts[part] + order[n - part_windows[part]] * self.seq_len
        return out

    def mixture_starts(self, step: int, micro_step: int, ranges: np.ndarray,
                       weights: np.ndarray) -> np.ndarray:
        """Starts of random windows, each in a source drawn by its weight (ranges: where each source's tokens
        lie), drawn from (seed, step, slot)."""
        rng = np.random.default_rng([self.seed, step, self.slot(micro_step), 0])
        first, last = ranges[rng.choice(len(weights), size=self.batch_size, p=weights)].T
        return rng.integers(first, last - self.seq_len)

    def evaluation_starts(self, micro_step: int, length: int) -> np.ndarray:
        """Starts of consecutive windows tiling a split of length tokens, ranks interleaved, the same at every
        evaluation."""
        first = self.slot(micro_step) * self.batch_size
        span = length - self.seq_len  # a window of seq_len + 1 tokens starts before this
        return np.arange(first, first + self.batch_size) * self.seq_len % span

    def packed_ids(self, step: int, micro_step: int, windows: int) -> np.ndarray:
        """Which of `windows` packed windows this training micro-batch holds: the run's n-th sequence is
        window n of the sequence of epochs, each in its seeded order."""
        n = self.sequence_numbers(step, micro_step)
        return np.array([self.epoch_order(int(i // windows), windows)[i % windows] for i in n])

    def evaluation_ids(self, micro_step: int, windows: int) -> np.ndarray:
        """Which of `windows` packed windows this evaluation micro-batch holds: in file order, ranks
        interleaved."""
        return (self.slot(micro_step) * self.batch_size + np.arange(self.batch_size)) % windows
