"""Decode speed of sampling.generate next to Hugging Face Qwen3ForCausalLM.generate, on the same weights.

    python bench_generate.py                          # tiny preset shape on CPU, batch 1 and 8
    python bench_generate.py --threads 1              # steadier on a shared machine
    python bench_generate.py --device cuda --batch_sizes 1 8 32 --compile
Weights are random (speed does not depend on them). Before timing, both greedy outputs must agree.
Decode tokens/s = batch * (N - 1) / (time for N new tokens - time for 1), so the prefill cancels out.
"""

import argparse
import time

import torch

from config import SampleConfig, preset_tiny
from device import pick_device
from hf_format import hf_twin
from modern_llm import Transformer
from sampling import generate


def to_hf(model: Transformer):
    """The same network as a transformers Qwen3 (Llama without QK-norm), holding a copy of the model's weights."""
    hf = hf_twin(model.config, model.state_dict()).to(model.embed_tokens.weight.device).eval()
    hf.generation_config.eos_token_id = None  # never stop early: both sides generate exactly N tokens
    hf.generation_config.pad_token_id = 0
    return hf


def ours(model, prompts, n, compile=False):
    """(B, n) new ids from sampling.generate, greedy."""
    return generate(model, prompts.tolist(), SampleConfig(temperature=0.0, max_new_tokens=n, compile=compile))


def theirs(hf, prompts, n):
    """(B, n) new ids from Qwen3ForCausalLM.generate, greedy."""
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[:, prompts.shape[1]:].tolist()


def seconds(fn, reps: int) -> float:
    """The fastest of `reps` runs, after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_rate(fn, batch: int, n: int, reps: int) -> float:
    """Decode tokens/s with the prefill and the first token subtracted."""
    return batch * (n - 1) / (seconds(lambda: fn(n), reps) - seconds(lambda: fn(1), reps))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new_tokens", type=int, default=200, help="N; prompt + N must fit the context (256)")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile our decode step (CUDA graphs on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0: torch's default. 1 gives steady "
                                                          "figures on a machine that other jobs share")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    device = pick_device(args.device)
    cfg = preset_tiny().model
    model = Transformer(cfg).to(device).eval().requires_grad_(False)
    hf = to_hf(model)
    print(f"tiny preset: {model.num_parameters() / 1e6:.1f}M parameters, vocab {cfg.vocab_size}, "
          f"{cfg.num_hidden_layers} layers; {device}, {torch.get_num_threads()} threads, fp32, "
          f"torch {torch.__version__}")

    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), device=device)
    a, b = ours(model, prompt, 64, args.compile), theirs(hf, prompt, 64)
    agree = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), 64)
    print(f"greedy check: {agree}/64 tokens identical" + ("" if agree == 64 else ", MISMATCH"))
    if agree < 64:
        raise SystemExit(1)

    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6}   (decode, {args.new_tokens} new tokens)")
    for batch in args.batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device=device)
        mine = decode_rate(lambda n: ours(model, prompts, n, args.compile), batch, args.new_tokens, args.reps)
        hf_rate = decode_rate(lambda n: theirs(hf, prompts, n), batch, args.new_tokens, args.reps)
        print(f"{batch:>5} {mine:>11.0f} {hf_rate:>9.0f} {mine / hf_rate:>5.2f}x")


if __name__ == "__main__":
    main()
