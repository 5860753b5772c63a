"""Preference tuning end to end on the tests' tiny model: a run fine-tuned on chats, then tuned by DPO on
pairs whose chosen reply is right and rejected reply wrong; it learns with the defaults, and a resumed run
repeats the losses of an uninterrupted one."""

import json
import os
import random
import subprocess
import sys

import pytest

import gpu_training_optimized as trainer
from conftest import killed_after_a_checkpoint, stopped_after
from llm.formats import checkpoint as ckpt_io
from llm.reports.monitor import read_metrics

WORDS = "apple river stone cloud tiger lamp green paper music orange window silver garden candle".split()
TINY = ["--vocab_size", "512", "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
        "--num_key_value_heads", "2"]


def repeat_task(path, n: int, pairs: bool, seed: int) -> str:
    """"Repeat WORD N times." as chats answered right, or as pairs: chosen right, rejected one word short or
    long."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            word, count = rng.choice(WORDS), rng.randint(1, 6)
            wrong = count + rng.choice([-1, 1]) if count > 1 else 2
            prompt = [{"role": "user", "content": f"Repeat {word} {count} times."}]
            right = [{"role": "assistant", "content": " ".join([word] * count)}]
            row = {"prompt": prompt, "chosen": right,
                   "rejected": [{"role": "assistant", "content": " ".join([word] * wrong)}]} if pairs else \
                {"messages": prompt + right}
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny model trained on the task's chats (60 steps), and 600 preference pairs of the same task."""
    base = tmp_path_factory.mktemp("preference")
    chats = repeat_task(base / "chats.jsonl", 1500, pairs=False, seed=0)
    run = base / "sft"
    assert trainer.main(["--preset", "tiny", *TINY, "--max_seq_len", "64", "--sources", chats, "--cache_dir",
                         str(base / "cache"), "--run_dir", str(run), "--max_steps", "60", "--micro_batch_size", "8",
                         "--compile", "off", "--eval_batches", "2", "--log_interval", "20"]) == 0
    return {"run": str(run), "pairs": repeat_task(base / "pairs.jsonl", 600, pairs=True, seed=1),
            "cache": str(base / "cache")}


def dpo_argv(chat_run, run_dir, *extra):
    """A preference run from the chat run with every preference setting and rate left at its default."""
    return ["--init_from", chat_run["run"], "--sources", chat_run["pairs"], "--cache_dir", chat_run["cache"],
            "--run_dir", str(run_dir), "--max_seq_len", "128", "--micro_batch_size", "4", "--val_fraction", "0.1",
            "--compile", "off", "--log_interval", "1", *map(str, extra)]


@pytest.mark.slow
def test_dpo_learns_the_preference_on_held_out_pairs(chat_run, tmp_path, capsys):
    """With the defaults (dpo, beta 0.1, NLL weight 1, the scaled fine-tuning rates), held-out pairs' reward
    accuracy must go from about chance to at least 0.9, and the chosen replies' log-probability must not fall
    (the NLL term's job, trl#800); the start report says the data trains by preference; metrics.jsonl, the
    bar's evaluation lines and the summary carry the rewards."""
    run = tmp_path / "dpo"
    assert trainer.main(dpo_argv(chat_run, run, "--max_steps", 14, "--eval_interval", 1, "--eval_batches", 16)) == 0
    out = capsys.readouterr().out
    assert "preference: the sources hold pairs of a chosen and a rejected reply, trained by dpo (beta 0.1" in out
    assert "preference, validation pairs: reward accuracy" in out
    evals = read_metrics(str(run), "eval")
    first, last = evals[0], evals[-1]
    assert first["step"] == 1 and first["val_reward_accuracy"] < 0.75 and last["val_reward_accuracy"] >= 0.9
    assert last["val_reward_margin"] > first["val_reward_margin"]
    assert last["val_chosen_logp"] >= first["val_chosen_logp"] - 1e-3
    train = read_metrics(str(run), "train")
    assert all(k in train[-1] for k in ("loss", "reward_chosen", "reward_rejected", "reward_margin",
                                        "reward_accuracy"))
    assert abs(train[0]["pair_loss"] - 0.6931) < 0.01  # step 0: the policy is the reference, log 2 per pair


@pytest.mark.slow
def test_a_resumed_lora_simpo_run_repeats_the_uninterrupted_losses(chat_run, tmp_path):
    """8 steps, an interruption (as SIGTERM), --resume for 8 more: the losses and rewards of 16 steps in one
    run, bit for bit, for LoRA adapters trained by SimPO (a full fine-tune's DPO resume, on the reference
    stored beside the token cache, is the kill -9 test's; a LoRA run's DPO reference is its base, adapters
    off, as at the start)."""
    common = ("--max_steps", 16, "--eval_interval", 8, "--save_interval", 8, "--eval_batches", 2, "--lora_rank", 4,
              "--objective", "simpo")
    full = tmp_path / "full"
    assert trainer.main(dpo_argv(chat_run, full, *common)) == 0
    reference = [(r["loss"], r["reward_margin"]) for r in read_metrics(str(full), "train")]
    broken = tmp_path / "broken"
    stopped_after(trainer, 8, dpo_argv(chat_run, broken, *common))
    assert ckpt_io.latest_checkpoint(str(broken)).endswith("step_000008")
    assert trainer.main(dpo_argv(chat_run, broken, *common, "--resume")) == 0
    resumed = [(r["loss"], r["reward_margin"]) for r in read_metrics(str(broken), "train")]
    assert len(resumed) == 16 and resumed == reference



@pytest.mark.slow
def test_a_dpo_run_killed_with_kill_9_resumes_to_the_uninterrupted_losses(chat_run, tmp_path):
    """kill -9 (no chance to save) once a checkpoint is written: --resume from it must log the losses and
    rewards of an uninterrupted run, bit for bit, the reference read back from beside the token cache."""
    common = ("--max_steps", 16, "--eval_interval", 8, "--save_interval", 4, "--eval_batches", 2)
    full = tmp_path / "full"
    assert trainer.main(dpo_argv(chat_run, full, *common)) == 0
    reference = [(r["loss"], r["reward_margin"]) for r in read_metrics(str(full), "train")]
    killed = tmp_path / "killed"
    step = killed_after_a_checkpoint(dpo_argv(chat_run, killed, *common), killed)
    assert 4 <= step < 16  # killed mid-run, after a checkpoint
    assert trainer.main(dpo_argv(chat_run, killed, *common, "--resume")) == 0
    resumed = [(r["loss"], r["reward_margin"]) for r in read_metrics(str(killed), "train")]
    assert len(resumed) == 16 and resumed == reference


# TRL renders a conversation's last assistant turn with the newline after <|im_end|>, and learns it as part of
# the reply; a reply here ends at <|im_end|>, where generation stops. The exported template, that newline left
# out after a last assistant turn (and only there), gives TRL the same completion tokens.
TRL_TEMPLATE = ("{%- for message in messages -%}"
                "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' -}}"
                "{%- if not (loop.last and message['role'] == 'assistant') -%}{{- '\\n' -}}{%- endif -%}"
                "{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.mark.slow
def test_first_step_loss_equals_trls_dpo_trainer_on_the_exported_model(chat_run, tmp_path, capsys):
    """TRL's DPOTrainer (loss types sigmoid + sft, beta 0.1, weights 1 and 1) on our chat run exported to
    Hugging Face, every training pair in its one batch, must log the first-step loss ours logs for the same
    pairs in one micro-batch, within 1e-5: the prompt rendered and tokenized alike, the reply tokens alike,
    the model alike."""
    pytest.importorskip("trl")
    import export_hf
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from llm.data.pairs import pair_document
    from llm.data.token_cache import is_val
    pairs = repeat_task(tmp_path / "pairs.jsonl", 40, pairs=True, seed=7)
    assert export_hf.main([chat_run["run"], str(tmp_path / "hf")]) == 0
    common = ["--init_from", chat_run["run"], "--sources", pairs, "--cache_dir", str(tmp_path / "cache"),
              "--max_seq_len", "128", "--val_fraction", "0.1", "--compile", "off", "--precision", "fp32",
              "--log_interval", "1", "--max_steps", "1", "--eval_batches", "1", "--weight_average", "0"]
    capsys.readouterr()
    # The probe counts the windows; a cache of its own, so that ours computes its reference in its one
    # micro-batch: SDPA's rounding depends on the rows' padded length, and step 0's ties (margins of 0,
    # accuracy 0) need the reference and the step alike to the last bit.
    probe = ["--run_dir", str(tmp_path / "probe"), "--micro_batch_size", "1", "--cache_dir", str(tmp_path / "probe-cache")]
    assert trainer.main(common + probe) == 0
    windows = int(capsys.readouterr().out.split(" train pairs in ")[1].split()[0])
    assert trainer.main(common + ["--run_dir", str(tmp_path / "ours"), "--micro_batch_size", str(windows)]) == 0
    ours = read_metrics(str(tmp_path / "ours"), "train")[0]

    rows = [json.loads(line) for line in open(pairs, encoding="utf-8")]
    held = [is_val(pair_document(r), 1234, 0.1) for r in rows]  # the cache's split (its last document, if none)
    train_rows = [r for r, v in zip(rows, held) if not v] if any(held) else rows[:-1]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    tok.chat_template = TRL_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="float32")
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(train_rows), max_steps=1,
                     logging_steps=1, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0],
                     report_to="none", use_cpu=True, save_strategy="no", max_length=None, bf16=False)
    trl_run = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(train_rows), processing_class=tok)
    trl_run.train()
    first = trl_run.state.log_history[0]
    assert abs(ours["loss"] - first["loss"]) < 1e-5
    assert ours["reward_accuracy"] == first["rewards/accuracies"] and abs(ours["reward_margin"]) < 1e-5


@pytest.mark.slow
def test_dpo_under_torchrun_logs_the_rewards_of_one_process_on_the_same_pairs(tmp_path):
    """Two ranks on gloo (torchrun), 2 windows of pairs each, must log at the first step the pair loss,
    rewards, accuracy and chosen log-prob of one process reading the same 4 windows (the reference's stored
    log-probs read by both), and train to the end: a rank logging its own means, rewards summed over ranks but
    pairs not, or a rank reading another rank's reference rows would differ."""
    pairs, start = repeat_task(tmp_path / "pairs.jsonl", 240, pairs=True, seed=1), tmp_path / "start"
    assert trainer.main(["--preset", "tiny", *TINY, "--max_seq_len", "64", "--sources", repeat_task(
        tmp_path / "chats.jsonl", 300, pairs=False, seed=0), "--cache_dir", str(tmp_path / "cache"), "--run_dir",
        str(start), "--max_steps", "1", "--compile", "off", "--eval_batches", "1"]) == 0  # a model to tune

    def argv(run, micro):
        return ["--init_from", str(start), "--max_seq_len", "128", "--sources", pairs, "--cache_dir",
                str(tmp_path / "cache"), "--run_dir", str(tmp_path / run), "--micro_batch_size", str(micro),
                "--grad_accum_steps", "1", "--max_steps", "3", "--compile", "off", "--precision", "fp32",
                "--log_interval", "1", "--eval_batches", "1", "--val_fraction", "0.1", "--objective", "dpo"]
    assert trainer.main(argv("one", 4)) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           "gpu_training_optimized.py", *argv("two", 2)], cwd=root, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    one, two = read_metrics(str(tmp_path / "one"), "train"), read_metrics(str(tmp_path / "two"), "train")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for key in ("pair_loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "chosen_logp"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-5, abs=1e-6), key
    # At step 1 the policy is the reference (rewards 0 on both sides unless a rank read another's reference
    # rows); by step 3 it has moved, and the ranks' rewards, from gradients averaged in another order, still
    # match.
    assert one[0]["chosen_logp"] != 0 and one[2]["reward_margin"] != 0
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "chosen_logp"):
        assert two[2][key] == pytest.approx(one[2][key], rel=1e-2, abs=1e-5), key


def test_a_resumed_dpo_run_whose_stored_reference_went_computes_it_again(chat_run, tmp_path, capsys):
    """The token cache's reference folder deleted between sessions once ended a resume with "start the run
    again", while the --init_from run was still there: the resumed run now computes it again from those
    weights, and its losses are the uninterrupted run's to the bit."""
    import shutil
    cache = tmp_path / "cache"
    common = ("--max_steps", 4, "--eval_interval", 4, "--save_interval", 2, "--eval_batches", 1, "--cache_dir", cache)
    full, part = tmp_path / "full", tmp_path / "part"
    assert trainer.main(dpo_argv(chat_run, full, *common)) == 0
    assert stopped_after(trainer, 2, dpo_argv(chat_run, part, *common)) == 143  # SIGTERM: saved at step 2
    folders = [os.path.join(root, "reference") for root, dirs, _ in os.walk(cache) if "reference" in dirs]
    assert folders
    for folder in folders:
        shutil.rmtree(folder)
    capsys.readouterr()
    assert trainer.main(dpo_argv(chat_run, part, *common, "--resume")) == 0
    assert "ready in" in capsys.readouterr().out  # computed, not read
    key = lambda r: (r["step"], r["loss"], r["reward_margin"])  # noqa: E731
    assert [key(r) for r in read_metrics(str(part), "train")] == [key(r) for r in read_metrics(str(full), "train")]
