"""README's fine-tuning recipe, step by step as a user runs it: a Hugging Face Qwen3 folder (here one that
transformers builds) -> fine-tuned on chats (whole conversations per window) -> a chat that stops at <|im_end|>
-> an export whose transformers `generate` replies the same and stops there too."""

import pytest

import export_hf
import gpu_training_optimized as trainer
from conftest import write_greetings
from llm.tokens.tokenizer import IM_END
from text_generator import TextGenerator


@pytest.mark.slow
def test_import_fine_tune_chat_export(qwen3_folder, tmp_path):
    chats = write_greetings(tmp_path / "chats.jsonl", 400)
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
