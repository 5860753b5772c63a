"""GRPO through the trainer as a user runs it: a tiny chat run whose answers are right half the time learns to
answer right from a reward alone; a resumed run samples and trains as an uninterrupted one, bit for bit; LoRA
samples with its adapters on and measures its KL to the base; bad prompts, flags and rewards each get one
line."""

import json
import os
import random

import pytest
import torch

import gpu_training_optimized as trainer
from config import SampleConfig
from llm.base.errors import ConfigError, DataError
from llm.formats import checkpoint as ckpt_io
from llm.generate.engine import generate_all
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.scores.rewards import gsm8k
from llm.tokens.tokenizer import chat_prompt_ids, stop_ids


def sums(rng, n):
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]


@pytest.fixture(scope="module")
def half_right(tmp_path_factory):
    """A tiny chat run on sums whose answers are right half the time (else 1 to 3 too high), and prompts of
    new sums with their answers: {"chat": run folder, "prompts": JSONL, "base": folder}."""
    base, rng = tmp_path_factory.mktemp("grpo"), random.Random(0)
    with open(base / "chats.jsonl", "w") as f:
        for a, b in sums(rng, 600):
            said = a + b if rng.random() < 0.5 else a + b + rng.choice([1, 2, 3])
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": str(said)}]}) + "\n")
    with open(base / "prompts.jsonl", "w") as f:
        for a, b in sums(rng, 400):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                                "answer": str(a + b)}) + "\n")
    chat = base / "chat"
    assert trainer.main(["--preset", "tiny", "--sources", str(base / "chats.jsonl"), "--cache_dir",
                         str(base / "cache"), "--run_dir", str(chat), "--max_steps", "80", "--compile", "off"]) == 0
    return {"chat": str(chat), "prompts": str(base / "prompts.jsonl"), "base": base}


def grpo_argv(data, run, *extra):
    return ["--init_from", data["chat"], "--objective", "grpo", "--sources", data["prompts"], "--reward", "gsm8k",
            "--run_dir", str(run), "--compile", "off", "--max_completion_length", "8", "--log_interval", "1",
            *map(str, extra)]


def right_share(model_path, base: str = "") -> float:
    """The share of right answers among 8 replies sampled at temperature 1 to each of 100 sums none was
    trained on, read by gsm8k's reward (itself held to worked answers in test_rewards.py); base: a LoRA run's.
    """
    model, tok, *_ = load_for_inference(model_path, "cpu", base=base)
    asked = sums(random.Random(99), 100)
    ids = [chat_prompt_ids(tok, [{"role": "user", "content": f"What is {a} plus {b}?"}]) for a, b in asked]
    settings = SampleConfig(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, seed=5)
    replies = generate_all(model, [i for i in ids for _ in range(8)], settings, stop_ids(tok))
    got = gsm8k(None, tok.batch_decode(replies, skip_special_tokens=True),
                answer=[str(a + b) for a, b in asked for _ in range(8)])
    return sum(got) / len(got)


@pytest.mark.slow
def test_grpo_raises_the_share_of_right_sampled_replies(half_right, tmp_path):
    """The reward alone (gsm8k: the last number against the answer) must teach what the chats taught half the
    time: a sign error in the advantages, a loss that ignores them or replies sampled from other weights would
    not."""
    before = right_share(half_right["chat"])
    run = tmp_path / "rl"
    assert trainer.main(grpo_argv(half_right, run, "--max_steps", 60)) == 0
    after = right_share(str(run))
    assert 0.3 < before < 0.7 and after >= before + 0.15, (before, after)
    logged = read_metrics(run, "train")
    assert {"reward", "reward/gsm8k", "zero_std_share", "completion_len", "generate_s", "reward_s"} <= set(logged[0])


@pytest.mark.slow
def test_lora_grpo_learns_at_its_automatic_rate(half_right, tmp_path):
    """Adapters at the automatic rate (a quarter of the chat run's) must learn what whole weights do. Measured
    0.50 to 0.75; the rate GRPO once gave adapters (x 0.05) reached 0.66, and on SmolLM2 learned nothing."""
    run = tmp_path / "lora"
    assert trainer.main(grpo_argv(half_right, run, "--max_steps", 60, "--lora_rank", 16)) == 0
    assert right_share(str(run), base=half_right["chat"]) >= right_share(half_right["chat"]) + 0.2


@pytest.mark.parametrize("kl", [(), pytest.param(("--beta", 0.1), marks=pytest.mark.slow)], ids=["", "kl"])
def test_a_resumed_grpo_run_samples_and_trains_as_an_uninterrupted_one(half_right, tmp_path, kl):
    """4 steps, against 2 steps, a resume, and 2 more: every logged loss and reward equal to the bit. The
    replies of a step are drawn from (seed, step) and the step's weights, so a resume samples the same. With a
    KL term on a full fine-tune, the resumed run's reference is still the weights the run started from, not
    the checkpoint's: the KL is equal to the bit too."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert trainer.main(grpo_argv(half_right, whole, "--max_steps", 4, *kl)) == 0
    assert trainer.main(grpo_argv(half_right, part, "--max_steps", 4, "--save_interval", 2, *kl)) == 0
    ckpt = os.path.join(part, "checkpoints", "step_000002")
    resumed = tmp_path / "resumed"
    assert trainer.main(grpo_argv(half_right, resumed, "--max_steps", 4, "--resume", ckpt, *kl)) == 0
    key = lambda r: (r["step"], r["loss"], r["reward"], r["completion_len"], r.get("kl"))  # noqa: E731
    assert [key(r) for r in read_metrics(whole, "train")][2:] == [key(r) for r in read_metrics(resumed, "train")]
    assert not kl or read_metrics(resumed, "train")[-1]["kl"] > 0


def test_a_full_fine_tunes_reference_is_its_starting_weights_swapped_in(half_right):
    """A full fine-tune's KL reference copies the starting weights into the model for its passes: inside, the
    log-probabilities are a separately loaded starting model's; after, every weight is the trained one again,
    bit for bit, in the same storage (a CUDA graph and the optimizer hold it)."""
    from llm.train.rollouts import StartingWeights, token_logps
    model = load_for_inference(half_right["chat"], "cpu")[0]
    start = load_for_inference(half_right["chat"], "cpu")[0]
    reference = StartingWeights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # "trained"
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    x = torch.randint(1, 200, (2, 12))
    y = torch.roll(x, -1, 1)
    with torch.no_grad():
        moved = token_logps(model, x, y)
        with reference.held():
            held = token_logps(model, x, y)
        after = token_logps(model, x, y)
        assert torch.equal(held, token_logps(start, x, y)) and not torch.allclose(held, moved)
    assert torch.equal(after, moved)
    assert all(torch.equal(p, trained[n]) and p.data_ptr() == storage[n] for n, p in model.named_parameters())


def lay_out(rows, ended, adv, micro, group, mask_truncated, seq_len):
    """Rollouts.lay_out of these replies, without a run around it: micro-batches of micro replies."""
    import types

    from llm.train import rollouts
    t = types.SimpleNamespace(mask_truncated=mask_truncated, num_iterations=1, beta=0.0,
                              max_completion_length=8)  # the replies here are 1-8 tokens
    share = rollouts.sharing(micro, group)
    held = types.SimpleNamespace(t=t, share=share, micro=micro, seq_len=seq_len, device="cpu",
                                 row_len=seq_len - 1 + (share - 1) * t.max_completion_length)
    return rollouts.Rollouts.lay_out(held, rows, ended, adv), share


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("ragged", [False, True], ids=["masked", "ragged"])
@pytest.mark.parametrize("micro", [6, 3, 2], ids=["two-groups", "a-group", "no-sharing"])
def test_replies_sharing_a_prompts_row_train_as_rows_of_their_own(loss_type, ragged, micro):
    """The replies laid out as the step reads them, several of a prompt's to a row behind one copy of it, must
    give the loss and gradient of a naive reference: each prompt + reply a row of its own, attended causally,
    one reply to a row in grpo.reduce (within 1e-5, float32). Compiled steps attend through the packed mask,
    eager ones through a row per branch (ragged); a row holds its prompt once, then its replies. A reply cut
    at the limit teaches nothing."""
    from dataclasses import replace

    from config import ModelConfig
    from llm.train import grpo
    from llm.train.rollouts import token_logps
    from modern_llm import Execution, Transformer
    g, group, seq_len = random.Random(3), 3, 24
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=17, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_seq_len=seq_len))
    model.init_weights()
    prompts = [[g.randrange(1, 17) for _ in range(n)] for n in (5, 9, 2, 7)]
    rows = [(p, [g.randrange(1, 17) for _ in range(g.randint(1, 8))]) for p in prompts for _ in range(group)]
    ended = [g.random() < 0.7 for _ in rows]
    adv = torch.tensor([g.uniform(-1, 1) for _ in rows])
    s = grpo.Settings(loss_type, max_completion_length=8)

    # the reference: a row each, padded on the right, the mask over the replies that ended
    T = max(len(p) + len(r) for p, r in rows) - 1
    x, y = torch.zeros(len(rows), T, dtype=torch.long), torch.full((len(rows), T), -100)
    for i, (p, r) in enumerate(rows):
        x[i, :len(p) + len(r) - 1] = torch.tensor((p + r)[:-1])
        y[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(r)
    mask = (y != -100).float() * torch.tensor(ended, dtype=torch.float)[:, None]
    tokens = float(mask.sum())
    per_token, _ = grpo.token_losses(token_logps(model, x, y), None, None, adv, s)
    want = grpo.reduce(per_token, mask, s, tokens, float(len(rows)))
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.execution = replace(Execution(), ragged=ragged)
    batches, share = lay_out(rows, ended, adv, micro, group, True, seq_len)
    assert share == {6: 3, 3: 3, 2: 1}[micro] and len(batches) == len(rows) // micro
    for m, b in enumerate(batches):
        assert b.x.shape == (micro // share, seq_len - 1 + (share - 1) * 8) and (b.pos is None) == (share == 1)
        in_rows = [rows[i:i + share] for i in range(m * micro, (m + 1) * micro, share)]
        # the prompt once (its last token also before each later reply), then the replies
        assert (b.x != 0).sum(1).tolist() == [len(row[0][0]) - 1 + sum(len(r) for _, r in row) for row in in_rows]
    got = 0.0
    for b in batches:
        assert b.tokens == tokens and b.completions == len(rows)
        logps = token_logps(model, b.x, b.y, b.pos)
        per_token, _ = grpo.token_losses(logps, None, None, b.adv, s)
        got = got + grpo.reduce(per_token, b.mask, s, b.tokens, b.completions, b.per_reply)
    got.backward()
    got, want = got.item(), want.item()
    assert abs(got - want) < 1e-5 and abs(want) > 1e-3, (got, want)
    for p, w in zip(model.parameters(), want_grads):
        assert torch.allclose(p.grad, w, atol=1e-5), float((p.grad - w).abs().max())


@pytest.mark.slow
def test_a_full_fine_tune_measures_its_kl_to_its_starting_weights(half_right, tmp_path):
    """--beta on a full fine-tune: the KL starts at 0 (the model is its reference) and grows as it trains."""
    run = tmp_path / "full"
    argv = grpo_argv(half_right, run, "--max_steps", 3, "--beta", 0.1, "--learning_rate", 1e-3)
    assert trainer.main(argv) == 0
    logged = read_metrics(run, "train")
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6) and logged[-1]["kl"] > 1e-4


def test_a_resumed_grpo_run_names_its_rewards_again(half_right, tmp_path):
    run = tmp_path / "run"
    assert trainer.main(grpo_argv(half_right, run, "--max_steps", 1)) == 0
    argv = [w for w in grpo_argv(half_right, run, "--max_steps", 2, "--resume") if w not in ("--reward", "gsm8k")]
    with pytest.raises(ConfigError, match="pass --reward gsm8k"):
        trainer.main(argv)


def test_lora_grpo_samples_with_its_adapters_and_measures_its_kl_to_the_base(half_right, tmp_path):
    """A LoRA run's reference is its base with the adapters off: the KL starts at 0 (the adapters' B is 0) and
    is logged; its checkpoints hold the adapters alone."""
    run = tmp_path / "lora"
    assert trainer.main(grpo_argv(half_right, run, "--max_steps", 3, "--lora_rank", 4, "--beta", 0.04,
                                  "--learning_rate", 1e-2)) == 0
    logged = read_metrics(run, "train")
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6) and logged[-1]["kl"] > 0
    assert os.path.isfile(os.path.join(ckpt_io.latest_checkpoint(str(run)), "adapter_config.json"))


def test_a_reward_that_fails_saves_the_run_and_exits_1(half_right, tmp_path, capsys):
    """A reward function of the user's that raises at its third call: one line naming it, exit 1, and the two
    steps before it saved."""
    mine = tmp_path / "mine.py"
    mine.write_text("calls = []\n\ndef flaky(completions, **kw):\n    calls.append(1)\n"
                    "    if len(calls) == 3:\n        raise KeyError('no such column')\n"
                    "    return [0.0 for _ in completions]\n")
    run = tmp_path / "run"
    argv = grpo_argv(half_right, run, "--max_steps", 4) + ["--reward", f"{mine}:flaky"]
    with pytest.raises(SystemExit) as exited:
        trainer.run(argv)
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: reward {mine}:flaky raised KeyError") and "Traceback" not in "".join(err)
    assert ckpt_io.latest_checkpoint(str(run)).endswith("step_000002")


def test_bad_grpo_settings_are_refused_before_a_model_is_built(half_right, tmp_path):
    with pytest.raises(ConfigError, match="which FSDP's shards are not"):
        trainer.main(grpo_argv(half_right, tmp_path / "a", "--beta", 0.1, "--data_parallel", "fsdp"))
    with pytest.raises(ConfigError, match="at least 2"):
        trainer.main(grpo_argv(half_right, tmp_path / "b", "--num_generations", 1))
    argv = grpo_argv(half_right, tmp_path / "c")
    del argv[:2]  # no --init_from
    with pytest.raises(ConfigError, match="pass --init_from"):
        trainer.main(argv)


def test_a_grpo_runs_memory_and_tokens_are_of_its_rows_not_the_context(half_right, tmp_path, capsys):
    """A step's rows are the longest prompt and the longest reply: the memory estimate and the tokens a step
    are of those rows. Of the context (SmolLM2's 8,192), a LoRA run of a 135M model was once estimated at 52.6
    GiB on this CPU and refused."""
    run = tmp_path / "run"
    assert trainer.main(grpo_argv(half_right, run, "--max_steps", 1, "--max_seq_len", 8192)) == 0
    out = capsys.readouterr().out
    tok = load_for_inference(half_right["chat"], "cpu")[1]
    asked = [json.loads(line)["prompt"] for line in open(half_right["prompts"])]
    longest = max(len(chat_prompt_ids(tok, prompt)) for prompt in asked)
    row = longest + 8  # --max_completion_length 8
    assert f"8 x {row} tokens a forward" in out and "8,192 tokens a forward" not in out
    assert f"batch: 8 x {row} tokens x 4 accumulation x 1 ranks = {4 * 8 * row:,} tokens per step" in out
    saved = json.load(open(run / "config.json"))
    assert saved["model"]["max_seq_len"] == 8192 and saved["train"]["batch_tokens"] == 4 * 8 * row


def test_a_grpo_run_left_at_compile_auto_on_a_cpu_trains_eagerly_and_says_so(half_right, tmp_path, capsys):
    """Off CUDA a compiled GRPO step measured no faster than the eager one and took more memory and minutes
    (autofill.eager_reason): left automatic, the run trains eagerly, its rows shared by a prompt's replies,
    and says so before it starts."""
    argv = grpo_argv(half_right, tmp_path / "run", "--max_steps", 1)
    at = argv.index("--compile")
    assert trainer.main(argv[:at] + argv[at + 2:]) == 0  # compile left at auto
    out = capsys.readouterr().out
    assert "automatic: compile=off (a GRPO step off CUDA" in out and "compile: off" in out
    assert json.load(open(tmp_path / "run" / "config.json"))["train"]["compile"] == "off"


def test_bad_prompt_rows_are_left_out_one_line_each(half_right, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    good = [json.dumps({"prompt": "What is 1 plus 2?", "answer": "3"})] * 3
    prompts.write_text("\n".join(good + ["{not json", json.dumps({"question": "x"}),
                                         json.dumps({"prompt": [{"role": "assistant", "content": "hi"}]})]) + "\n")
    argv = grpo_argv(half_right, tmp_path / "run", "--max_steps", 1)
    argv[argv.index("--sources") + 1] = str(prompts)
    assert trainer.main(argv) == 0
    out = capsys.readouterr().out
    assert f"left out: {prompts} line 4: not JSON" in out and f"{prompts} line 5: no `prompt`" in out
    assert f"{prompts} line 6: the prompt's last message is the assistant's" in out
    prompts.write_text(json.dumps({"question": "x"}) + "\n")
    argv = grpo_argv(half_right, tmp_path / "run2")
    argv[argv.index("--sources") + 1] = str(prompts)
    with pytest.raises(DataError, match="0 usable prompts"):
        trainer.main(argv)


def test_prompts_read_from_parquet_keep_their_columns_for_the_rewards(half_right, tmp_path):
    """A parquet file of TRL's standard form (text prompts) and an extra column: each prompt encoded as it is,
    its column kept for the rewards, the held-out share drawn the same way every time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from config import Config, DataConfig
    from llm.data.prompts import read
    from llm.tokens.tokenizer import load_tokenizer
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"{i} plus 1 is" for i in range(50)], "answer": [str(i + 1) for i in range(50)]}),
                   path)
    tokenizer = os.path.join(ckpt_io.latest_checkpoint(half_right["chat"]), "tokenizer.json")
    cfg = Config(data=DataConfig(sources=[str(path)], tokenizer=tokenizer, val_fraction=0.1))
    data, again = read(cfg, 64), read(cfg, 64)
    assert (len(data.train), len(data.val)) == (45, 5)
    assert [p.prompt for p in data.val] == [p.prompt for p in again.val]
    tok = load_tokenizer(tokenizer)
    for p in data.train:
        assert p.ids == tok.encode(p.prompt, add_special_tokens=False)
        assert p.columns == {"answer": str(int(p.prompt.split()[0]) + 1)}


def test_flags_that_would_do_nothing_are_refused_and_rewards_alone_choose_grpo(half_right, tmp_path, capsys):
    """--lora_base nf4 without --lora_rank once ran a full fine-tune, --beta on a next-token run and --reward
    without --objective grpo were ignored without a word. Now each is refused in one line; --reward with the
    objective left automatic trains by GRPO."""
    chats = str(half_right["base"] / "chats.jsonl")
    lm = ["--init_from", half_right["chat"], "--sources", chats, "--cache_dir", str(half_right["base"] / "cache"),
          "--run_dir", str(tmp_path / "lm"), "--max_steps", "1", "--compile", "off"]
    for extra, said in ((["--lora_base", "nf4"], "--lora_base nf4 holds the frozen base of a LoRA run"),
                        (["--beta", "0.5"], "--beta 0.5 scales a preference or GRPO loss"),
                        (["--objective", "lm", "--reward", "gsm8k"], "--reward and --reward_weights are for")):
        with pytest.raises(ConfigError, match=said):
            trainer.main(lm + extra)
    argv = [w for w in grpo_argv(half_right, tmp_path / "auto", "--max_steps", 1) if w not in ("--objective", "grpo")]
    assert trainer.main(argv) == 0
    assert "grpo: 4 prompts x 8 replies a step" in capsys.readouterr().out


@pytest.mark.slow
def test_the_first_step_equals_trls_grpo_trainer_on_fixed_replies(half_right, tmp_path, monkeypatch):
    """TRL 1.16's GRPOTrainer (dapo, no std scaling, beta 0, fp32, one step) on our chat run exported to
    Hugging Face, its replies given by rollout_func, must log the first step's loss and gradient norm ours
    logs for the same replies to the same prompts with the same reward: the model, the advantages, the masks
    and the normaliser alike. The replies are fixed ids of several lengths, none ending at an end id, so
    neither side cuts them."""
    pytest.importorskip("trl")
    import export_hf
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from config import Config, DataConfig
    from llm.data.prompts import read as read_prompts
    from llm.tokens.tokenizer import load_tokenizer
    from llm.train import rollouts
    G, P = 4, 2
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
            for a, b in ((3, 4), (5, 2))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))  # 6 rows: 2 to train on after the hold-out
    tok_path = os.path.join(ckpt_io.latest_checkpoint(half_right["chat"]), "tokenizer.json")
    tok = load_tokenizer(tok_path)
    digits = {str(d): tok.encode(str(d), add_special_tokens=False) for d in range(20)}
    filler = tok.encode(" and so", add_special_tokens=False)

    def fixed(prompt_ids: list[int], k: int) -> list[int]:
        """Reply k to a prompt (both prompts' answer is 7): 7, 8 or 9, then k pieces of filler (at most 16
        tokens, max_completion_length), so lengths differ and the token-level loss is not 0."""
        return (digits[str(7 + k % 3)] + filler * k)[:16]

    def ours_generate(model, prompt_list, *args, **kwargs):  # engine.generate_all's place: the fixed replies
        seen, out = {}, []
        for ids in prompt_list:
            k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
            out.append(fixed(ids, k))
        return out
    monkeypatch.setattr(rollouts, "generate_all", ours_generate)
    ours = tmp_path / "ours"
    argv = ["--init_from", half_right["chat"], "--objective", "grpo", "--sources", str(prompts), "--reward", "gsm8k",
            "--run_dir", str(ours), "--compile", "off", "--precision", "fp32", "--max_completion_length", "16",
            "--num_generations", str(G), "--prompts_per_step", str(P), "--max_steps", "1", "--log_interval", "1",
            "--val_fraction", "0.3", "--micro_batch_size", str(G * P), "--weight_average", "0"]
    assert trainer.main(argv) == 0
    first = read_metrics(ours, "train")[0]
    assert export_hf.main([half_right["chat"], str(tmp_path / "hf")]) == 0

    # The rows our run trained on, with the prompt ids it fed the model: TRL gets the same through
    # rollout_func.
    train_rows = read_prompts(Config(data=DataConfig(sources=[str(prompts)], tokenizer=tok_path, val_fraction=0.3)),
                              200).train

    def rollout_func(prompt_list, trainer_):
        seen, prompt_ids, completion_ids = {}, [], []
        for p in prompt_list:
            ids = next(r.ids for r in train_rows if r.prompt == p)
            k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
            prompt_ids.append(ids)
            completion_ids.append(fixed(ids, k))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="float32")
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=G * P, num_generations=G,
                      max_completion_length=16, max_steps=1, logging_steps=1, beta=0.0, loss_type="dapo",
                      scale_rewards="none", report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                      learning_rate=1e-6)
    trl_run = GRPOTrainer(model=model, reward_funcs=[gsm8k], args=args, processing_class=hf_tok,
                          train_dataset=Dataset.from_list([{"prompt": r.prompt, "answer": r.columns["answer"]}
                                                           for r in train_rows]), rollout_func=rollout_func)
    trl_run.train()
    theirs = trl_run.state.log_history[0]
    assert abs(first["loss"] - theirs["loss"]) < 1e-5 and abs(first["loss"]) > 1e-3, (first["loss"], theirs["loss"])
    assert first["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), (first["grad_norm"], theirs)
    assert first["reward"] == pytest.approx(theirs["reward"], abs=1e-9) and first["grad_norm"] > 0


@pytest.mark.slow
def test_prompts_from_the_hub_train_as_local_ones(half_right, tmp_path, monkeypatch):
    """The issue's command, `--sources "hf://datasets/ORG/NAME/main/train-*.parquet" --reward gsm8k`, against
    the stand-in Hub on 127.0.0.1: a parquet of conversational prompts and GSM8K-style answers ending "#### N"
    comes down once and trains two steps, the gsm8k reward reading the "####" answers; a second run reads it
    offline from the cache and samples and scores the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hub_stand_in import Hub
    from test_hf_datasets import point_at
    rng = random.Random(3)
    rows = [(a, b) for a, b in sums(rng, 60)]
    table = pa.table({"prompt": [[{"role": "user", "content": f"What is {a} plus {b}?"}] for a, b in rows],
                      "answer": [f"{a} and {b} make {a + b}.\n#### {a + b}" for a, b in rows]})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    server = Hub({"tiny-org/sums": {"main/train-00000-of-00001.parquet": buffer.getvalue().to_pybytes()}})
    try:
        point_at(monkeypatch, tmp_path / "hf_home", server.url)
        source = "hf://datasets/tiny-org/sums/main/train-*.parquet"
        argv = ["--init_from", half_right["chat"], "--sources", source, "--reward", "gsm8k", "--compile", "off",
                "--max_completion_length", "8", "--log_interval", "1", "--max_steps", "2"]
        assert trainer.main([*argv, "--run_dir", str(tmp_path / "rl")]) == 0
        logged = read_metrics(str(tmp_path / "rl"), "train")
        assert len(logged) == 2 and all(0 <= r["reward"] <= 1 for r in logged)
        point_at(monkeypatch, tmp_path / "hf_home", server.url, offline=True)
        assert trainer.main([*argv, "--run_dir", str(tmp_path / "rl_offline")]) == 0
        assert [r["reward"] for r in read_metrics(str(tmp_path / "rl_offline"), "train")] == \
            [r["reward"] for r in logged]  # the same prompts, seeds and replies
    finally:
        server.stop()
