"""Training throughput of our model against Hugging Face's Qwen3ForCausalLM of the same shape, in one run.

    python bench.py --preset tiny --compile off            # CPU
    python bench.py --preset large --bench_steps 20        # GPU: bf16, compiled like the trainer
Both models train on the same random tokens with the same batch, precision, compile mode and fused AdamW,
one after the other in the same process; the report gives tokens/s, MFU, peak memory and the ratio.
`--optimizer_share` then times our model with the trainer's own optimizer (Muon + AdamW by default) and
reports the optimizer step's share of the training step, the device drained around it.
Every training setting of config.py applies (--micro_batch_size, --max_seq_len, --precision, ...).
"""

import gc
import json
import time

import torch

from config import error_exit, ConfigError, parse_config
from gpu_training_optimized import autocast, compile_model, pick_device, pick_precision
from modern_llm import Transformer
from monitor import device_report, peak_flops
from muon_optimizer import build_optimizer


def hf_twin(m):
    """An equal-shape transformers Qwen3ForCausalLM with SDPA attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                      max_position_embeddings=m.max_seq_len, rms_norm_eps=m.rms_norm_eps,
                      tie_word_embeddings=m.tie_word_embeddings, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def ours_loss(model):
    def loss_fn(ids):
        _, loss = model(ids[:, :-1], labels=ids[:, 1:])
        return loss
    return loss_fn


def hf_loss(model):
    def loss_fn(ids):
        return model(input_ids=ids[:, :-1], labels=ids[:, :-1], use_cache=False).loss  # HF shifts labels itself
    return loss_fn


def measure(name, model, make_loss, cfg, device, amp_dtype, steps: int, warmup: int) -> dict:
    """Warm up (compile), then time `steps` optimizer steps; tokens/s, MFU and peak memory."""
    t = cfg.train
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cuda", "cpu"))
    step_fn = make_loss(compile_model(model, t.compile))
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.model.max_seq_len + 1), generator=gen)
    batch = batch.to(device)
    amp = autocast(device, amp_dtype)
    cudagraphs = t.compile in ("reduce-overhead", "max-autotune") and device.type == "cuda"

    def one_step():
        for _ in range(t.grad_accum_steps):
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with amp:
                loss = step_fn(batch) / t.grad_accum_steps
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(warmup):
        one_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        last = one_step()
    last.item()  # sync point: wait for the queued steps before stopping the clock
    seconds = time.perf_counter() - start
    tokens = steps * t.grad_accum_steps * t.micro_batch_size * cfg.model.max_seq_len
    return {"model": name, "tokens_per_s": tokens / seconds, "seconds": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def optimizer_share(cfg, device, amp_dtype, steps: int, warmup: int) -> dict:
    """Seconds per step in forward + backward and in the optimizer (cfg.train.optimizer), timed apart."""
    t = cfg.train
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device).train()
    opt = build_optimizer(model, t)
    loss_fn = ours_loss(compile_model(model, t.compile))
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.model.max_seq_len + 1)).to(device)
    amp = autocast(device, amp_dtype)
    drain = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    spent = {"forward_backward_s": 0.0, "optimizer_s": 0.0}
    for i in range(warmup + steps):
        drain()
        start = time.perf_counter()
        for _ in range(t.grad_accum_steps):
            with amp:
                loss = loss_fn(batch) / t.grad_accum_steps
            loss.backward()
        drain()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        drain()
        if i >= warmup:
            spent["forward_backward_s"] += (middle - start) / steps
            spent["optimizer_s"] += (time.perf_counter() - middle) / steps
    spent["share"] = spent["optimizer_s"] / (spent["optimizer_s"] + spent["forward_backward_s"])
    return spent


def main(argv=None):
    def extra(parser):
        parser.add_argument("--bench_steps", type=int, default=10, help="timed optimizer steps per model")
        parser.add_argument("--warmup_steps_bench", type=int, default=3, help="untimed steps first (compile)")
        parser.add_argument("--skip_hf", action="store_true", help="time our model only")
        parser.add_argument("--optimizer_share", action="store_true",
                            help="also time the trainer's optimizer step against forward + backward")
        parser.add_argument("--json", default="", help="also write the results to this file")
    cfg, args = parse_config(argv, extra=extra)
    device = pick_device(cfg.train.device)
    amp_dtype = pick_precision(cfg.train.precision, device)
    torch.manual_seed(0)
    ours = Transformer(cfg.model)
    flops = ours.flops_per_token()
    peak = peak_flops(device)
    print(f"device: {device_report(device)} | precision: {amp_dtype or 'fp32'} | compile: {cfg.train.compile} | "
          f"batch {cfg.train.micro_batch_size} x {cfg.model.max_seq_len} x {cfg.train.grad_accum_steps} | "
          f"{ours.num_parameters() / 1e6:.1f}M parameters")
    results = [measure("ours", ours, ours_loss, cfg, device, amp_dtype, args.bench_steps, args.warmup_steps_bench)]
    del ours
    gc.collect()
    if not args.skip_hf:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(measure("hf_qwen3", hf_twin(cfg.model), hf_loss, cfg, device, amp_dtype, args.bench_steps,
                               args.warmup_steps_bench))
    for r in results:
        r["mfu"] = r["tokens_per_s"] * flops / peak if peak else None  # same shape: our FLOP count serves both
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "n/a"
        print(f"{r['model']:<10} {r['tokens_per_s']:>12,.0f} tokens/s   MFU {mfu:>6}   peak memory {mem}")
    if len(results) == 2:
        print(f"ratio ours / hf: {results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x")
    share = None
    if args.optimizer_share:
        share = optimizer_share(cfg, device, amp_dtype, args.bench_steps, args.warmup_steps_bench)
        print(f"optimizer step ({cfg.train.optimizer}): {1e3 * share['optimizer_s']:.1f} ms, forward + backward "
              f"{1e3 * share['forward_backward_s']:.1f} ms per step: {100 * share['share']:.1f}% of the step")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": cfg.to_dict(), "device": device_report(device), "results": results,
                       "optimizer_share": share}, f, indent=2)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        error_exit(str(e))
