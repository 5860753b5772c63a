"""Windows of whole examples: every example once per epoch, nothing crossing examples, labels and masks where
they belong, the model's block-diagonal attention equal to running each example alone."""

import json
import random

import numpy as np
import pytest
import torch

from config import DataConfig, ModelConfig
from llm.data import batches, packing, preparation
from modern_llm import Transformer

SEQ, VOCAB = 64, 300


def chats(n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of 1-6 turn pairs with replies of long-tailed length: some longer than a window."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        for turn in range(1 + rng.randrange(6) if i % 7 else 8):
            msgs += [{"role": "user", "content": f"question {i}.{turn}: what is {rng.randrange(100)}?"},
                     {"role": "assistant", "content": " ".join("word" for _ in range(int(rng.paretovariate(1.2))))}]
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packing")
    convs = chats(60)
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = DataConfig(sources=[str(path)], cache_dir=str(folder / "cache"), val_fraction=0.1)
    data = preparation.prepare(cfg, vocab_size=VOCAB, seq_len=SEQ, log=lambda *a: None)
    return data, convs


def split(data, name):
    tokens = data.stream(name)[:].astype(np.int64)
    return tokens, data.stream(name, masks=True)[:]


def naive_examples(tokens, eot) -> list[list[int]]:
    """The split's examples, each with its end-of-text token, by walking the tokens one by one."""
    out, cur = [], []
    for t in tokens.tolist():
        cur.append(t)
        if t == eot:
            out.append(cur)
            cur = []
    return out


def test_best_fit_places_every_piece_once_within_the_window():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.pareto(1.0, 5000).astype(np.int64) * 8 + 1, 256)
    windows = packing.best_fit(lengths, 256, rng.permutation(len(lengths)))
    assert sorted(i for w in windows for i in w) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in w) <= 256 for w in windows)
    # A lower bound no packing can beat is total / 256 windows: best fit comes within a few percent of it.
    assert len(windows) <= 1.05 * lengths.sum() / 256 + 1


def test_long_examples_are_cut_at_turn_starts_into_pieces_that_cover_them():
    # Examples end (with their end-of-text token) at 9, 30 and 33; turns start at 0, 4, 12, 20 and 25.
    starts, lengths, cut = packing.pieces(np.array([9, 30, 33]), np.array([0, 4, 12, 20, 25]), seq_len=8)
    spans = sorted(zip(starts.tolist(), (starts + lengths).tolist()))
    assert spans == [(0, 4), (4, 9), (10, 12), (12, 20), (20, 25), (25, 30), (31, 33)] and cut == 2
    # No turn start within reach: cut at the window's length.
    starts, lengths, cut = packing.pieces(np.array([20]), np.array([0]), seq_len=8)
    assert sorted(zip(starts.tolist(), lengths.tolist())) == [(0, 8), (8, 8), (16, 4)] and cut == 1


def test_packed_windows_hold_each_example_once_with_its_own_labels_and_positions(chat_data):
    """Every window, decoded: rows are whole examples one after another (positions restart at each), the
    labels are the next tokens where the mask learns them, padding learns nothing; together the windows of an
    epoch hold every example of the split exactly once, compared with a walk over the split's tokens."""
    data, _ = chat_data
    tokens, mask = split(data, "train")
    eot = data.meta["eot_id"]
    loader = batches.PackedBatches(data, "train", 4, SEQ, seed=3)
    plan = loader.plan
    assert plan.examples == data.meta["train_documents"] and plan.cut > 0  # the set has some long conversations
    found = []
    for w in range(plan.windows):
        x, y, pos = packing.window(plan, w, tokens, mask, eot)
        starts = np.flatnonzero(pos == 0).tolist() + [SEQ]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b].tolist() == list(range(b - a))
        for s, n in zip(plan.piece_start[plan.first[w]:plan.first[w + 1]],
                        plan.piece_len[plan.first[w]:plan.first[w + 1]]):
            found.append((int(s), int(n)))
        used = sum(n for _, n in found[-(plan.first[w + 1] - plan.first[w]):])
        assert (y[used:] == -100).all() and (x[used:] == eot).all()
        at = 0
        for s, n in found[-(plan.first[w + 1] - plan.first[w]):]:
            assert x[at:at + n].tolist() == tokens[s:s + n].tolist()
            assert y[at:at + n].tolist() == np.where(mask[s + 1:s + n + 1] == 1, tokens[s + 1:s + n + 1], -100).tolist()
            at += n
    # The pieces, joined in file order, are the examples, each once.
    found.sort()
    rebuilt, cur = [], []
    for s, n in found:
        cur += tokens[s:s + n].tolist()
        if tokens[s + n] == eot:
            rebuilt.append(cur + [eot])
            cur = []
    assert rebuilt == naive_examples(tokens, eot)


def test_an_epoch_reads_every_window_once_in_a_seeded_order_on_any_number_of_ranks(chat_data):
    data, _ = chat_data
    one = batches.PackedBatches(data, "train", 2, SEQ, seed=5, accum=2)
    n = one.plan.windows
    steps = -(-n // 4)
    seen = [one.window_ids(step, micro) for step in range(steps) for micro in range(2)]
    first_epoch = np.concatenate(seen)[:n]
    assert sorted(first_epoch.tolist()) == list(range(n))  # each once
    assert first_epoch.tolist() != list(range(n))  # shuffled
    second = np.concatenate([one.window_ids(step, m) for step in range(steps, 2 * steps + 1) for m in range(2)])
    assert not np.array_equal(second[:8], first_epoch[:8])  # another order next epoch
    # Two ranks with one micro-step each read what one process with two micro-steps reads.
    ranks = [batches.PackedBatches(data, "train", 2, SEQ, seed=5, rank=r, world_size=2, accum=1) for r in (0, 1)]
    for step in (0, 3, steps + 1):
        for r in (0, 1):
            assert np.array_equal(ranks[r].window_ids(step, 0), one.window_ids(step, r))
            assert all(torch.equal(a, b) for a, b in zip(ranks[r].get(step, 0), one.get(step, r)))
    # A fresh loader (a resumed run) reads the same batch at the same step.
    again = batches.PackedBatches(data, "train", 2, SEQ, seed=5, accum=2)
    assert all(torch.equal(a, b) for a, b in zip(again.get(7, 1), one.get(7, 1)))


def test_packing_is_chosen_for_chats_and_refused_for_nothing(chat_data, tmp_path):
    data, _ = chat_data
    loader = lambda packing: batches.batches_for(data, "train", packing_mode=packing, batch_size=2,  # noqa: E731
                                                 seq_len=SEQ, seed=1)
    assert isinstance(loader("auto"), batches.PackedBatches) and type(loader("off")) is batches.Batches
    text = {**data.meta, "has_masks": False}
    assert not packing.packs("auto", text) and packing.packs("documents", text)


def test_packed_attention_equals_each_example_run_alone():
    """The block-diagonal mask and restarting positions, against the model run on each example separately
    (float64), with and without gradient checkpointing; a mask that leaks one position changes the logits."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    lengths = [5, 11, 1, 9]
    examples = [torch.randint(0, 64, (1, n)) for n in lengths]
    x = torch.cat(examples, 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    alone = torch.cat([model(e)[0] for e in examples], 1)
    packed, _ = model(x, positions=pos)
    assert (packed - alone).abs().max() < 1e-10
    model.config.gradient_checkpointing = True
    model.train()
    checkpointed, _ = model(x, positions=pos)
    assert (checkpointed - alone).abs().max() < 1e-10
    plain, _ = model(x)  # one causal sequence: the later examples see the earlier ones
    assert (plain[:, 5:] - alone[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("ragged", [False, True])
def test_a_branch_runs_as_its_whole_sequence_alone(ragged):
    """A preference pair's layout: a prompt and its chosen reply, then the rejected reply branching off the
    prompt (its last token again, at its position), then a plain example. Each branch token's logits, and
    every weight's gradient, equal the model's on prompt + chosen and prompt + rejected run apart (float64;
    gradients to RoPE's fp32), under the mask and on rows of their own; seeing the chosen reply from the
    rejected one, or losing the prompt, changes them."""
    from dataclasses import replace
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    model.execution = replace(model.execution, ragged=ragged)
    prompt, chosen, rejected, other = (torch.randint(0, 64, (n,)) for n in (6, 7, 4, 5))
    x = torch.cat([prompt, chosen, prompt[-1:], rejected, other])[None]
    pos = torch.cat([torch.arange(13), torch.arange(5, 10), torch.arange(5)])[None]
    w = torch.randn(1, 23, 64, dtype=torch.float64)
    packed = model(x, positions=pos)[0]
    (packed * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apart = [model(torch.cat(parts)[None])[0] for parts in ((prompt, chosen), (prompt, rejected), (other,))]
    (apart[0] * w[:, :13]).sum().backward()
    (apart[1][:, 5:] * w[:, 13:18]).sum().backward()  # the prompt's last token's, on the branch
    (apart[2] * w[:, 18:]).sum().backward()
    assert (packed[:, :13] - apart[0]).abs().max() < 1e-10
    assert (packed[:, 13:18] - apart[1][:, 5:]).abs().max() < 1e-10 and (packed[:, 18:] - apart[2]).abs().max() < 1e-10
    for n, p in model.named_parameters():
        # RoPE rotates in fp32: the prompt's key gradients from both replies meet before its rounding, apart
        # after
        assert (grads[n] - p.grad).abs().max() < 1e-7 * p.grad.abs().max(), n
    flat = torch.cat([torch.arange(13), torch.arange(13, 18), torch.arange(5)])[None]  # no branch: sees the chosen
    assert (model(x, positions=flat)[0][:, 13:18] - apart[1][:, 5:]).abs().max() > 1e-3
    alone = torch.cat([torch.arange(13), torch.arange(5), torch.arange(5)])[None]  # a sequence of its own: no prompt
    assert (model(x, positions=alone)[0][:, 13:18] - apart[1][:, 5:]).abs().max() > 1e-3


@pytest.mark.slow
def test_compiled_packed_loss_equals_eager(chat_data):
    data, _ = chat_data
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x, y, pos = batches.PackedBatches(data, "train", 4, SEQ, seed=1).get(0, 0)
    eager = model(x, labels=y, positions=pos)[1]
    compiled = torch.compile(model)(x, labels=y, positions=pos)[1]
    assert torch.allclose(eager, compiled, rtol=1e-4, atol=1e-5)


def test_an_epochs_run_resumes_with_more_epochs(chat_corpus, tmp_path, argv_for):
    """--epochs sets max_steps from the packed windows; a resume with more epochs runs on to the new length
    (the saved run's max_steps once blocked it)."""
    import gpu_training_optimized as trainer
    from llm.reports.monitor import read_metrics
    run = tmp_path / "run"
    assert trainer.main(argv_for(chat_corpus, run, "--epochs", 0.5)) == 0
    data = preparation.prepare(DataConfig(sources=[chat_corpus["src"]], cache_dir=chat_corpus["cache"]), vocab_size=512,
                      seq_len=64, log=lambda *a: None)
    windows = batches.PackedBatches(data, "train", 4, 64, seed=1337).plan.windows
    assert max(r["step"] for r in read_metrics(str(run), "train")) == -(-windows // 8)  # half an epoch: 4 x 0.5
    assert trainer.main(argv_for(chat_corpus, run, "--epochs", 1, "--resume")) == 0
    assert max(r["step"] for r in read_metrics(str(run), "train")) == -(-windows // 4)
