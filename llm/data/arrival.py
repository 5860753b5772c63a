"""A Hub corpus that trains while it downloads: preparation.py writes its parts in a background thread, file
by file as they arrive (the next file downloading while one is tokenized), and the run starts once the first
parts hold the validation split and a training window. batches.py reads the first epoch in arrival order and
waits here for a part not yet written, so a micro-batch is the same pure function of the step as when the
cache was complete. Used for one unweighted Hub dataset (corpus.in_arrival_order) in a run of one process
whose length does not depend on the corpus size; any other run prepares everything first."""

import queue
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from llm.base.errors import DataError, InputError, RunFailure
from llm.data import token_cache
from llm.data.token_cache import PreparedData, val_parts

WAIT_NOTE_S = 2.0  # a wait for data longer than this is said, once per wait


def say(line: str):
    """A line from the background: above the training bar, which a plain print would break."""
    tqdm.write(line)


def one_ahead(items):
    """items, with the next one fetched in a thread while the caller works on this one: the next file
    downloads while this one is tokenized. An error fetching comes out where that item would."""
    ahead = queue.Queue(maxsize=1)

    def fetch():
        try:
            for item in items:
                ahead.put((item, None))
        except BaseException as e:  # handed to the reader, which raises it as its own
            ahead.put((None, e))
            return
        ahead.put((None, StopIteration()))

    threading.Thread(target=fetch, daemon=True, name="fetch-ahead").start()
    while True:
        item, error = ahead.get()
        if isinstance(error, StopIteration):
            return
        if error is not None:
            raise error
        yield item


@dataclass
class ArrivingData(PreparedData):
    """PreparedData whose parts grow while a thread prepares them; complete once the thread is done."""
    complete: bool = False
    error: BaseException | None = None  # what stopped the preparation, raised to the reader
    changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def arrived(self) -> bool:
        return self.complete and self.error is None

    def publish(self, parts: list, meta: dict):
        with self.changed:
            self.parts, self.meta = parts, meta
            self.changed.notify_all()

    def finish(self, meta: dict):
        with self.changed:
            self.meta, self.complete = meta, True
            self.changed.notify_all()

    def fail(self, error: BaseException):
        with self.changed:
            self.error, self.complete = error, True
            self.changed.notify_all()

    def wait(self, enough, what: str, give_up=lambda: False) -> bool:
        """Block until enough(parts), the preparation ends or give_up() (a Ctrl-C); False if the preparation
        failed. Says what it waits for when that takes a while."""
        start, said = time.monotonic(), False
        with self.changed:
            while not (enough(self.parts) or self.complete or give_up()):
                if not said and time.monotonic() - start > WAIT_NOTE_S:
                    say(f"data: waiting for {what} to download and tokenize")
                    said = True
                self.changed.wait(0.5)
        return self.error is None

    def wait_to_start(self, seq_len: int) -> bool:
        """Block until the validation split is final (its parts hold token_cache.ARRIVAL_VAL_TOKENS) and the
        training split holds a window, or every part is in; False if the preparation failed."""
        def enough(parts):
            val = sum(p["val_tokens"] for p in val_parts(parts, True))
            return val >= token_cache.ARRIVAL_VAL_TOKENS and sum(p["train_tokens"] for p in parts) > seq_len
        return self.wait(enough, "the first parts")


def start(data: ArrivingData, work) -> ArrivingData:
    """Run work(data) (which publishes parts, then finishes) in a thread; returns data at once."""
    def run():
        try:
            work(data)
        except BaseException as e:  # the run's thread raises it, as its own error
            data.fail(e)

    threading.Thread(target=run, daemon=True, name="prepare").start()
    return data


def stopped_by(error: BaseException, step: int, ckpt: str | None) -> BaseException:
    """The error that stopped a corpus arriving, as the run's last line: with the step it reached and where
    that step is saved (the loop saved it before raising this)."""
    if not isinstance(error, (InputError, RunFailure)):
        return error  # not a failure we name: its traceback is the report
    saved = f"; training stopped at step {step}, saved in {ckpt}: --resume goes on from it" if ckpt else ""
    return (DataError if isinstance(error, InputError) else RunFailure)(f"{error}{saved}")
