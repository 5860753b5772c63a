"""Preference data: rows of chosen and rejected replies read in each accepted shape, tokenized with the
prompt's ids shared and no shift at the prompt-reply boundary, packed several pairs per window, and every bad
row refused in one line."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from config import DataConfig
from llm.base.errors import DataError
from llm.data import packing
from llm.data.batches import TRIM_STEP, PairBatches
from llm.data.pairs import pair_document
from llm.data.preparation import prepare
from llm.tokens.tokenizer import chat_prompt_ids, encode_segments


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen reply gives the right sum and the rejected one a wrong sum, in TRL's conversational
    form."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(v) for v in rng.integers(0, 50, 2))
        wrong = a + b + int(rng.choice([-3, -2, -1, 1, 2, 3]))
        prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                     "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {wrong}."}]})
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def prepared(tmp_path, rows, seq_len=128):
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    return prepare(DataConfig(sources=[src], cache_dir=str(tmp_path / "cache"), val_fraction=0.1), 320, seq_len,
                   log=lambda *a: None)


@pytest.mark.parametrize("row,want", [
    ({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}, (["user"], "Hello!", "Go away.")),
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
      "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}],
      "prompt": "Hi"}, (["user"], "Hello!", "Go away.")),  # ultrafeedback_binarized: the user turn in both
    ({"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
      "chosen": [{"role": "assistant", "content": "Hello!"}],
      "rejected": [{"role": "assistant", "content": "Go away."}]}, (["system", "user"], "Hello!", "Go away.")),
])
def test_each_shape_reads_as_one_prompt_and_two_replies(row, want):
    """Strings with a prompt, TRL's conversational rows, and rows whose replies repeat the prompt's turns (the
    Hub's ultrafeedback_binarized) must give the same pair, the prompt never doubled."""
    doc = pair_document(row)
    assert [m["role"] for m in doc["prompt"]] == want[0]
    assert doc["chosen"] == [{"role": "assistant", "content": want[1]}]
    assert doc["rejected"] == [{"role": "assistant", "content": want[2]}]


@pytest.mark.parametrize("row,words", [
    ({"prompt": "Hi", "chosen": "Hello!"}, "has no rejected"),
    ({"prompt": "Hi", "chosen": "Hello!", "rejected": "Hello!"}, "the same reply"),
    ({"prompt": "Hi", "chosen": "  ", "rejected": "No."}, "the chosen reply is empty"),
    ({"chosen": "Hello!", "rejected": "No."}, "needs a prompt"),
    ({"prompt": "Hi", "chosen": "Hello!", "rejected": [{"role": "assistant", "content": "No."}]}, "must both be strings"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "user", "content": "Hello!"}],
      "rejected": [{"role": "user", "content": "No."}]}, "the chosen reply holds no "
                                                         "assistant turn (it has user)"),
    ({"prompt": "Hi \ud800", "chosen": "Hello!", "rejected": "No."}, "a lone surrogate"),
])
def test_bad_rows_are_refused_in_one_line_naming_the_line(tmp_path, row, words):
    """A row without rejected, identical or empty replies, or no prompt: the preparation must stop with one
    line naming the file, the line and what is wrong (skip_bad_lines leaves such rows out instead)."""
    rows = arithmetic_pairs(5) + [row]
    with pytest.raises(DataError) as e:
        prepared(tmp_path, rows)
    message = str(e.value)
    assert words in message and "pairs.jsonl line 6" in message and "--skip_bad_lines" in message


def test_a_parquet_source_of_conversational_pairs_reads_as_the_same_jsonl_does(tmp_path):
    """TRL's conversational pairs in parquet (lists of message structs, as the Hub's preference splits store
    them) must tokenize to the very tokens of the same rows in JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = arithmetic_pairs(30)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    table = prepare(DataConfig(sources=[str(tmp_path / "pairs.parquet")], cache_dir=str(tmp_path / "cache_pq"),
                               val_fraction=0.1, tokenizer=prepared(tmp_path, rows).tokenizer_path), 320, 128,
                    log=lambda *a: None)
    lines = prepared(tmp_path, rows)
    assert table.meta["has_pairs"] and table.stream("train")[:].tolist() == lines.stream("train")[:].tolist()


def test_preference_rows_mixed_with_plain_rows_are_refused(tmp_path, capsys):
    """Pairs train by preference and chats by next-token loss: one source holding both must be refused by the
    trainer in one error line, exit 2, before anything trains."""
    import gpu_training_optimized as trainer
    rows = arithmetic_pairs(5) + [{"messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello"}]}]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        trainer.run(["--preset", "tiny", "--sources", src, "--cache_dir", str(tmp_path / "cache"),
                     "--run_dir", str(tmp_path / "run"), "--max_steps", "1", "--compile", "off"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert "among preference rows" in err[0] and "mixed.jsonl line 6" in err[0]


def test_replies_follow_the_prompt_ids_with_no_shift_at_the_boundary(tmp_path):
    """trl#2054: tokenizing prompt + reply as one text can merge tokens across the boundary, so the reply's
    log-probability is taken over other tokens than the model generates after the prompt. In the cache each
    sequence must be exactly the prompt's own ids (what the generator feeds to reply) followed by the reply's
    ids encoded alone, and chosen and rejected must share the prompt's ids."""
    rows = arithmetic_pairs(40)
    data = prepared(tmp_path, rows)
    tok = Tokenizer.from_file(data.tokenizer_path)
    loader = PairBatches(data, "train", 1, 128, 0)
    texts = {json.dumps(r["prompt"]): r for r in rows}
    checked = 0
    for p in range(loader.plan.pairs):
        seqs = [loader.tokens[int(s):int(s + n)].tolist() for s, n in zip(loader.plan.start[p], loader.plan.length[p])]
        prompt_text = tok.decode(seqs[0], skip_special_tokens=False).split("<|im_start|>assistant")[0]
        row = next(r for r in texts.values() if prompt_text.endswith(r["prompt"][0]["content"] + "<|im_end|>\n"))
        prompt = chat_prompt_ids(tok, row["prompt"])
        for seq, side in zip(seqs, ("chosen", "rejected")):
            reply = encode_segments(tok, [[(row[side][0]["content"], True, False), ("<|im_end|>", True, True),
                                           ("\n", False, False)]])[0][0]
            assert seq == prompt + reply
        checked += 1
    assert checked == loader.plan.pairs > 20


def test_pairs_pack_several_per_window_and_slots_mark_only_replies(tmp_path):
    """Packed, not padded: windows hold several whole pairs, each its prompt and chosen reply from position 0,
    then its rejected reply branching off the prompt's last token; read back, the two are the cached
    sequences. The slots mark exactly the learned reply tokens, chosen (even) beside rejected (odd) of the
    same pair."""
    data = prepared(tmp_path, arithmetic_pairs(60))
    loader = PairBatches(data, "train", 2, 128, 0)
    batch = loader.get(0, 0)
    assert batch.pairs >= 4  # 2 windows of 128 tokens hold several pairs of about 30 tokens
    assert torch.equal(batch.slot >= 0, batch.y != -100)
    pairs = iter(batch.pair_ids.tolist())
    for x, pos in zip(batch.x.tolist(), batch.pos.tolist()):
        cuts = [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
        segments = [(x[a:b], pos[a]) for a, b in zip([0] + cuts, cuts)]
        for (trunk, at), (branch, at_branch) in zip(segments[0::2], segments[1::2]):  # the padding's last, alone
            p, seq = next(pairs), lambda side: loader.tokens[int(loader.plan.start[p][side]):][  # noqa: E731
                :int(loader.plan.length[p][side])].tolist()
            assert at == 0 and 0 < at_branch < len(trunk)
            assert trunk == seq(0) and trunk[:at_branch] + branch == seq(1)
    assert next(pairs, None) is None
    for i in range(batch.pairs):  # each pair's two replies: chosen and rejected both present
        assert (batch.slot == 2 * i).any() and (batch.slot == 2 * i + 1).any()
    assert len(set(batch.pair_ids.tolist())) == batch.pairs


def test_a_prompt_longer_than_the_window_is_cut_from_the_left_and_counted(tmp_path):
    """A pair that does not fit must lose prompt tokens from its left, the same in both sequences, keep its
    replies whole, and be counted; a pair whose replies alone overflow is left out and counted."""
    long = "word " * 60
    rows = arithmetic_pairs(10) + [{"prompt": long + "What is 1 plus 1?", "chosen": "2.", "rejected": "3."}] * 1
    rows += [{"prompt": "Hi", "chosen": "yes " * 80, "rejected": "no " * 80}]
    data = prepared(tmp_path, rows, seq_len=64)
    plans = [packing.pair_plan(data.stream(s), data.stream(s, masks=True), data.meta["eot_id"], 64, None)
             for s in ("train", "val")]
    assert sum(p.cut for p in plans) == 1 and sum(p.dropped for p in plans) == 1
    for plan, split in zip(plans, ("train", "val")):
        assert (plan.sizes()[plan.pair_ids] <= 64).all()
        masks = data.stream(split, masks=True)
        for p in plan.pair_ids.tolist():  # a sequence starts in its prompt: only prompt tokens were cut
            for (s, n) in zip(plan.start[p], plan.length[p]):
                assert masks[int(s):int(s) + 1][0] == 0 and masks[int(s):int(s + n + 1)].sum() > 0


@pytest.mark.parametrize("objective,pairs,init_from,words", [
    ("lm", True, "runs/chat", "--objective lm trains by next-token loss"),
    ("dpo", False, "runs/chat", "--objective dpo trains on preference pairs"),
    ("auto", True, "", "pass --init_from"),
])
def test_an_objective_the_data_cannot_train_is_refused(objective, pairs, init_from, words):
    """Pairs trained by next-token loss, a preference objective on text, or pairs without a model to tune:
    each a ConfigError (one line, exit 2) before a model is built."""
    from config import Config, TrainConfig
    from llm.base.errors import ConfigError
    from llm.train.fine_tuning import fill_preference
    cfg = Config(train=TrainConfig(objective=objective, init_from=init_from))
    with pytest.raises(ConfigError, match=words):
        fill_preference(cfg, pairs, None)


def test_preference_defaults_scale_only_the_automatic_rates():
    """dpo for pairs at beta 0.1 (simpo 2.5), and the rates fill_fine_tuning filled scaled by 1/20 (TRL's DPO
    and SFT defaults), a rate given by the user left as given; plain data stays lm, its rates untouched. The
    chosen rates get one "automatic" line, with the rates the run trains at (once two lines gave 2e-5, then
    1e-6)."""
    from config import Config, TrainConfig
    from llm.train.fine_tuning import fill_fine_tuning, fill_preference
    given = Config(train=TrainConfig(init_from="runs/chat", muon_lr=0.002))
    cfg, chosen = fill_fine_tuning(given, {"optimizer": "adamw", "learning_rate": 2e-5, "muon_lr": 0.004})
    assert chosen.fields == ("optimizer", "learning_rate")  # muon_lr was given
    filled, lines = fill_preference(cfg, True, chosen)
    t = filled.train
    assert (t.objective, t.beta, t.muon_lr) == ("dpo", 0.1, 0.002) and t.learning_rate == pytest.approx(1e-6)
    assert "trained by dpo" in lines[0]
    assert [line for line in lines if "automatic" in line] == [lines[1]]
    assert "learning_rate=1e-06" in lines[1] and "x 0.05" in lines[1] and "2e-05" not in lines[1]
    simpo = fill_preference(Config(train=TrainConfig(init_from="x", objective="simpo")), True, None)[0].train
    assert simpo.beta == 2.5
    plain, lines = fill_preference(cfg, False, chosen)
    assert plain.train.objective == "lm" and plain.train.learning_rate == 2e-5
    assert len(lines) == 1 and "learning_rate=2e-05" in lines[0] and "muon_lr" not in lines[0]  # AdamW: no Muon rate


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_lora_adapters_of_a_downloaded_model_tune_at_5e_5(objective):
    """At 1e-5 (a twentieth of the LoRA fine-tuning rate) SmolLM2's adapters moved no greedy reply in 120 DPO
    steps and solved no more held-out problems after 60 GRPO steps; at 5e-5 both did (docs/fine-tuning.md)."""
    from config import Config, TrainConfig
    from llm.train.fine_tuning import fill_fine_tuning, fill_grpo, fill_preference
    cfg, chosen = fill_fine_tuning(Config(train=TrainConfig(init_from="hf:x", lora_rank=16, objective=objective)))
    filled, lines = fill_preference(cfg, True, chosen) if objective == "dpo" else \
        fill_grpo(cfg, 100, 10, 128, chosen)
    assert filled.train.learning_rate == pytest.approx(5e-5)
    assert any("learning_rate=5e-05" in line and "x 0.25" in line for line in lines)


def test_a_muon_fine_tune_names_both_rates_and_an_adamw_one_only_its_own():
    """The automatic line names only the rates the run uses: Muon runs read muon_lr and learning_rate (for the
    embeddings and norms), AdamW runs learning_rate alone."""
    from config import Config, TrainConfig
    from llm.train.fine_tuning import fill_fine_tuning
    cfg = Config(train=TrainConfig(init_from="runs/base"))
    muon, chosen = fill_fine_tuning(cfg, {"optimizer": "muon", "learning_rate": 0.006, "muon_lr": 0.02})
    assert chosen.lines(muon.train) == [
        "automatic: optimizer=muon, learning_rate=0.006, muon_lr=0.02 (fine-tuning every weight of the "
        "pretrained --init_from model; the peak rates the --init_from run trained at)"]
    adamw, chosen = fill_fine_tuning(cfg, None)  # a downloaded model: the SmolLM2-measured AdamW rates
    assert chosen.lines(adamw.train) == [
        "automatic: optimizer=adamw, learning_rate=2e-05 (fine-tuning every weight of the pretrained "
        "--init_from model; the presets' rates are for training from scratch)"]


def test_an_eager_runs_windows_lose_only_their_padding(tmp_path, tiny_config):
    """trim (the eager step's loader) cuts a micro-batch after its windows' last filled position, rounded up
    to TRIM_STEP: what it cuts is padding alone (no label, no slot), the rest is the uncut batch's, and a
    float64 model gives every reply token the log-probability it gives in the full windows."""
    from llm.train.preference import token_logps
    from modern_llm import Transformer
    data = prepared(tmp_path, arithmetic_pairs(40), seq_len=512)  # three windows, the last about a third full
    full, cut = PairBatches(data, "train", 2, 512, 0), PairBatches(data, "train", 2, 512, 0)
    cut.trim = True
    plan = full.plan
    fills = [plan.sizes()[plan.pair_ids[plan.first[w]:plan.first[w + 1]]].sum() for w in range(plan.windows)]
    emptiest, fuller = np.argsort(fills)[:2]
    assert cut.of_windows([emptiest, fuller]).x.shape[1] == min(512, -(-fills[fuller] // TRIM_STEP) * TRIM_STEP)
    a, b = full.of_windows([emptiest]), cut.of_windows([emptiest])
    filled, last = b.x.shape[1], fills[emptiest]
    assert filled == -(-last // TRIM_STEP) * TRIM_STEP < 512
    assert all(torch.equal(u[:, :filled], v) for u, v in zip(a[:4], b[:4]))
    assert (a.y[:, last:] == -100).all() and (a.slot[:, last:] == -1).all()
    assert ((a.pos[:, last] == 0) & (a.pos[:, last - 1] > 0)).any()  # a sequence ends there, the padding after it
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=data.meta["vocab_size"], max_seq_len=512)).double()
    with torch.no_grad():
        want, got = token_logps(model, a)[:, :filled], token_logps(model, b)
    assert (want != 0).any() and (got - want).abs().max() < 1e-9
