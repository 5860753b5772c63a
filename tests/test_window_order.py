"""The windows each order reads, held to the values batches.py gave before the order had a module of its own:
a changed seed, slot numbering, tiling shift or part order passes the property tests (every window once an
epoch) but changes the batches a resumed run reads, so the figures themselves are held here."""

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from llm.data.batches import Batches, PackedBatches
from llm.data.token_cache import PreparedData

SEQ, EOT = 16, 1
PARTS = [(700, 150, 0), (523, 90, 0), (910, 130, 1)]  # train tokens, val tokens, source
# Recorded from batches.py as it was before llm/data/window_order.py (commit aca065e).
TILED = [[1044, 1348, 308, 692, 724], [500, 1092, 1988, 2116, 1380], [548, 1124, 1924, 132, 1716],
         [1076, 1012, 1971, 2035, 275], [2036, 1844, 2052, 1220, 1748], [916, 1236, 660, 628, 68]]
MIXTURE = [[169, 1576, 1767, 1571], [638, 2098, 575, 1001]]
ARRIVAL = [[160, 256, 304, 64], [988, 1036, 1116, 1148], [2023, 1815, 1591, 1612], [1388, 1068, 492, 1692]]
CONSECUTIVE = [[64, 80, 96, 112], [94, 110, 126, 142]]
PACKED = [[46, 9, 70], [35, 99, 24]]
PACKED_VAL = [[21, 22, 23], [3, 4, 5]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Three parts of documents of 5-40 random tokens each, ended by EOT, in a cache folder with a tokenizer.
    """
    root, rng = tmp_path_factory.mktemp("order"), np.random.default_rng(0)
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(root / "tokenizer.json"))
    parts = []
    for i, (train, val, source) in enumerate(PARTS):
        part = root / f"part{i}"
        part.mkdir()
        for split, n in (("train", train), ("val", val)):
            tokens = rng.integers(2, 500, n).astype(np.uint16)
            tokens[np.cumsum(rng.integers(5, 40, n))[:n // 5].clip(max=n - 1)] = EOT
            tokens.tofile(part / f"{split}.bin")
        parts.append({"folder": str(part), "source": source, "train_tokens": train, "val_tokens": val,
                      "has_masks": False})
    return str(root), parts


def data(folder, weights=None, arrival=False) -> PreparedData:
    root, parts = folder
    meta = {"dtype": "uint16", "vocab_size": 512, "has_masks": False, "eot_id": EOT,
            "sources": [{"source": "a"}, {"source": "b"}]}
    return PreparedData(root, meta, list(parts), weights, arrival)


def test_tiled_epochs_read_the_recorded_windows(folder):
    """Seeded shifts and orders over two ranks and two micro-steps, across the first epoch's end (step 6's
    second micro-step) and into the third."""
    b = Batches(data(folder), "train", 5, SEQ, seed=1, rank=0, world_size=2, accum=2)
    assert b.epoch_sequences == 132
    assert [b.starts(step, micro).tolist() for step in (0, 6, 14) for micro in (0, 1)] == TILED


def test_a_weighted_mixture_draws_the_recorded_windows(folder):
    b = Batches(data(folder, weights=[0.7, 0.3]), "train", 4, SEQ, seed=2, rank=1, world_size=2)
    assert [b.starts(step, 0).tolist() for step in (0, 5)] == MIXTURE


def test_arrival_order_reads_the_recorded_windows(folder):
    """The first epoch part by part, a step across its end, then a tiled epoch."""
    b = Batches(data(folder, arrival=True), "train", 4, SEQ, seed=3)
    assert [b.starts(step, 0).tolist() for step in (0, 11, 32, 40)] == ARRIVAL


def test_evaluation_reads_the_recorded_consecutive_windows(folder):
    b = Batches(data(folder), "val", 4, SEQ, seed=4, rank=1, world_size=2)
    assert [b.starts(0, micro).tolist() for micro in (0, 3)] == CONSECUTIVE


def test_packed_windows_are_read_in_the_recorded_order(folder):
    """Training across the first epoch's end (step 21), evaluation in file order around the split's end."""
    train = PackedBatches(data(folder), "train", 3, SEQ, seed=5, rank=1, world_size=2)
    val = PackedBatches(data(folder), "val", 3, SEQ, seed=5, rank=1, world_size=2)
    assert (train.epoch_sequences, val.epoch_sequences) == (131, 24)
    assert [train.window_ids(step, 0).tolist() for step in (0, 21)] == PACKED
    assert [val.window_ids(0, micro).tolist() for micro in (3, 4)] == PACKED_VAL
