"""README's fine-tuning recipe, step by step as a user runs it: a Hugging Face Qwen3 folder (here one that
transformers builds) -> fine-tuned on chats (whole conversations per window) -> a chat that stops at <|im_end|>
-> an export whose transformers `generate` replies the same and stops there too."""

import json
import random

import pytest
import torch

import export_hf
import gpu_training_optimized as trainer
from text_generator import TextGenerator
from tokenizer import IM_END, SPECIAL_TOKENS, train_tokenizer

NAMES = ["Ada", "Ben", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal"]


def question(rng) -> tuple[str, str]:
    """A question whose answer follows a rule the model can learn: the greeting names the person asked about."""
    name = rng.choice(NAMES)
    return f"Greet {name}.", f"Hello, {name}!"


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A randomly initialised transformers Qwen3 model with a ChatML tokenizer, saved as a download would be."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    folder = tmp_path_factory.mktemp("qwen3")
    rng = random.Random(0)
    texts = [f"{q} {a}" for q, a in (question(rng) for _ in range(200))]
    tok = train_tokenizer(texts, "bpe", 300)
    assert tok.token_to_id(IM_END) == SPECIAL_TOKENS.index(IM_END)
    tok.save(str(folder / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_import_fine_tune_chat_export(qwen3_folder, tmp_path):
    rng = random.Random(1)
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w", encoding="utf-8") as f:
        for _ in range(400):
            q, a = question(rng)
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    run = tmp_path / "run"
    assert trainer.main(["--init_from", str(qwen3_folder), "--sources", str(chats), "--run_dir", str(run),
                         "--cache_dir", str(tmp_path / "cache"), "--epochs", "6", "--micro_batch_size", "8",
                         "--learning_rate", "3e-3", "--muon_lr", "0.02", "--compile", "off"]) == 0

    generator = TextGenerator(str(run))
    reply = generator.chat([{"role": "user", "content": "Greet Eve."}], temperature=0, max_new_tokens=40)
    assert reply == "Hello, Eve!"  # learned, and stopped at <|im_end|> (more tokens would follow it otherwise)

    out = tmp_path / "export"
    assert export_hf.main([str(run), str(out)]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(str(out)), AutoModelForCausalLM.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Greet Eve."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    ids = model.generate(**prompt, max_new_tokens=40, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert ids[-1].item() == tok.convert_tokens_to_ids(IM_END) and len(ids) < 40  # the export stops there too
    assert tok.decode(ids[:-1]) == reply
