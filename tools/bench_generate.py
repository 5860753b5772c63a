"""Decode speed of our engine next to Hugging Face's generate, on the same weights, against the bandwidth bound.

    python tools/bench_generate.py                                   # CPU: the tiny and 12.6M shapes, batch 1 and 8
    python tools/bench_generate.py --threads 2 --batch_sizes 1       # steadier on a shared machine
    python tools/bench_generate.py --shapes large --batch_sizes 1 8 32   # a GPU: bf16, preset shapes
Side by side in one run: ours (engine.generate, compiled: a CUDA graph on CUDA), Hugging Face's generate in
its fastest mode (static cache + torch.compile) and in its default mode, and the bandwidth bound: the bytes a
decode step reads (weights, and the KV cache at the mean position) over the device's memory bandwidth (a
table of datasheet figures for GPUs; measured with a large copy on a CPU). Weights are random: speed does not
depend on them. Before timing, each greedy output must equal ours. Decode tokens/s = batch * (N - 1) /
(time for N new tokens - time for 1), so the prefill cancels out; the time for 1 is the time to the first
token (a compiled prefill of the prompt's bucket and one sampling step). The reps interleave the contenders
and every figure is the median of the reps (the ratio: the median of the reps' ratios, with their range).
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

import torch

from config import PRESETS, ModelConfig, SampleConfig
from llm.base.device import inference_dtype, pick_device
from llm.base.errors import error_contract
from llm.formats.hf_format import hf_twin
from llm.generate.engine import generate
from llm.generate.inference import for_inference
from llm.reports.start_report import stored_bytes
from modern_llm import Transformer

# Dense memory bandwidth in GB/s from the vendors' datasheets; the first name found in the device's wins.
BANDWIDTH_GBS = [("H200", 4800), ("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350), ("GH200", 4000),
                 ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
                 ("L40S", 864), ("L40", 864), ("L4", 300), ("A10G", 600), ("A10", 600), ("RTX 6000 Ada", 960),
                 ("RTX 5090", 1792), ("RTX 4090", 1008), ("RTX 4080", 717), ("RTX 3090", 936), ("V100", 900),
                 ("T4", 320)]
CPU_SHAPES = {  # context 512: a 128-token prompt and 256 new tokens fit
    "tiny": replace(PRESETS["tiny"]().model, max_seq_len=512),
    "12m": ModelConfig(vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                       num_key_value_heads=2, max_seq_len=512),
}


def shape(name: str) -> ModelConfig:
    return CPU_SHAPES[name] if name in CPU_SHAPES else PRESETS[name]().model


def bandwidth(device: torch.device) -> float:
    """The device's memory bandwidth in bytes/s: the datasheet's for a known GPU, else a timed large copy."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbs in BANDWIDTH_GBS:
            if key in name:
                return gbs * 1e9
    src = torch.empty(2**28 // 4, device=device)  # 256 MB: far past every cache
    dst = torch.empty_like(src)
    seconds = min(timed(lambda: dst.copy_(src), device) for _ in range(5))
    return 2 * src.numel() * 4 / seconds  # a copy reads and writes


def bytes_per_step(model, batch: int, mean_position: float) -> float:
    """What one decode step must read: every weight but the embedding rows not looked up, and the KV cache."""
    c = model.config
    weights = sum(stored_bytes(p) for p in model.parameters())  # a tied table counts once: the head
    table = model.embed_tokens.weight
    if table is not model.lm_head.weight:  # an embedding table of its own is read only at the rows looked up
        weights -= stored_bytes(table) * (1 - batch / c.vocab_size)
    kv = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * mean_position * c.head_dim
    return weights + kv * model.embed_tokens.weight.element_size()


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def decode_rates(fns: dict, batch: int, n: int, reps: int, device) -> dict[str, list[tuple[float, float]]]:
    """For each of fns (label -> fn(k) generating k tokens), per rep: (decode tokens/s with the prefill and
    first token subtracted, seconds to the first token). After one warm-up (which compiles), the reps
    interleave the fns, in reversed order every other rep, so a load that comes or goes on a shared machine
    falls on all."""
    for fn in fns.values():
        fn(1), fn(n)
    out = {label: [] for label in fns}
    for r in range(reps):
        items = list(fns.items())
        for label, fn in items if r % 2 == 0 else items[::-1]:
            first = timed(lambda: fn(1), device)
            out[label].append((batch * (n - 1) / (timed(lambda: fn(n), device) - first), first))
    return out


def median_ratio(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> str:
    """The median of the reps' rate ratios, with their range."""
    ratios = sorted(x[0] / y[0] for x, y in zip(a, b))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def ours(model, prompts, n):
    """(B, n) new ids from engine.generate, greedy; compiled as for_inference set the model to."""
    return generate(model, prompts.tolist(), SampleConfig(temperature=0.0, max_new_tokens=n))


def theirs(hf, prompts, n, fastest: bool):
    """(B, n) new ids from transformers' generate, greedy: static cache and compiled forward, or the default.
    """
    kwargs = {}
    if fastest:
        from transformers import CompileConfig
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True  # transformers compiles on its own only on accelerators
        kwargs = dict(cache_implementation="static", compile_config=compile_config)
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, **kwargs)
    return out[:, prompts.shape[1]:].tolist()


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--shapes", nargs="+", default=[], help=f"{', '.join(CPU_SHAPES)} or a preset name; "
                                                           "default: the CPU shapes on a CPU, large on a GPU")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quantize", choices=["none", "int8"], default="none", help="our model's weights in int8")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0: torch's default")
    return p.parse_args(argv)


@error_contract
def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = inference_dtype(device)
    for name in args.shapes or (list(CPU_SHAPES) if device.type == "cpu" else ["large"]):
        torch.manual_seed(0)
        cfg = shape(name)
        model = Transformer(cfg).to(device)
        prompt_len = min(args.prompt_len, cfg.max_seq_len // 4)
        n = min(args.new_tokens, cfg.max_seq_len - prompt_len - 1)
        print(f"{name}: {model.num_parameters() / 1e6:.1f}M parameters, vocab {cfg.vocab_size}, "
              f"prompt {prompt_len}, {n} new tokens; {device}, {torch.get_num_threads()} threads, "
              f"{str(dtype).removeprefix('torch.')}{', ours int8' if args.quantize == 'int8' else ''}, "
              f"torch {torch.__version__}", flush=True)
        hfs = {} if args.skip_hf else {"hf fastest": True, "hf default": False}
        twin = None if args.skip_hf else hf_twin(cfg, model.state_dict()).to(device, dtype).eval()
        if twin is not None:
            # exactly n tokens
            twin.generation_config.eos_token_id, twin.generation_config.pad_token_id = None, 0
        # As text_generator.py --compile reduce-overhead loads it: compiled, a CUDA graph on CUDA.
        for_inference(model, device, args.quantize, compile="reduce-overhead")
        check = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
        mine = ours(model, check, 32)
        for label, fastest in hfs.items():
            same = theirs(twin, check, 32, fastest) == mine
            print(f"  greedy check, {label}: {'identical' if same else 'DIFFERENT'} for 32 tokens",
                  flush=True)
        peak = bandwidth(device)
        print(f"  {'batch':>5} {'ours tok/s':>11} {'% of bound':>10} {'first token':>11}"
              + "".join(f" {k + ' tok/s':>16}" for k in hfs) + "  ours / hf fastest (median of reps, range)",
              flush=True)
        for batch in args.batch_sizes:
            prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
            fns = {"ours": lambda k: ours(model, prompts, k),
                   **{label: (lambda k, f=f: theirs(twin, prompts, k, f)) for label, f in hfs.items()}}
            runs = decode_rates(fns, batch, n, args.reps, device)
            rate, first = (statistics.median(x[i] for x in runs["ours"]) for i in (0, 1))
            bound = batch * peak / bytes_per_step(model, batch, prompt_len + n / 2)
            rates = {k: statistics.median(x[0] for x in runs[k]) for k in hfs}
            ratio = f"  {median_ratio(runs['ours'], runs['hf fastest'])}" if hfs else ""
            print(f"  {batch:>5} {rate:>11,.0f} {100 * rate / bound:>9.0f}% {1000 * first:>8.1f} ms"
                  + "".join(f" {r:>16,.0f}" for r in rates.values()) + ratio, flush=True)


if __name__ == "__main__":
    sys.exit(main())
