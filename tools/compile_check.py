"""The GPU path compiled for an H100 (and an RTX 4090, an A100) on a machine with no GPU.

    python tools/gpu_check.py --compile_only              # every configuration; a table; exit 1 on any failure
    python tools/compile_check.py --only train-default    # one configuration
Needs a CUDA build of torch (it brings Triton and its ptxas) and a C compiler; no GPU and no driver.

fake_gpu.py stands in for the CUDA runtime and driver: it answers the device queries with the properties of
the chosen GPU and runs no code; every kernel Triton compiles is checked to be a cubin for that GPU's
architecture, and counted. The model, the optimizer and the data are fake tensors (FakeTensorMode) on device
"cuda", so the trainer's own build() and train_step run: dynamo captures, AOTAutograd and Inductor lower,
Triton compiles to PTX and cubin, and the compiled code then runs as shape propagation on the fake tensors.
Inductor's decisions by timing are made without it (choose_without_timing says how). What this proves: the
step compiles and captures for that GPU, with these shapes, dtypes, kernels and memory. What it cannot:
numbers, speed, or a CUDA graph's replay.
"""

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
import weakref
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from fake_gpu import GPUS, fake_gpu_env, shim_library
from roofline import Roofline

from llm.errors import ConfigError, error_contract

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root


# ----------------------------------------------------------------------------- in the fake GPU's process

class DeviceMemory:
    """A dispatch mode counting the bytes of live CUDA storages as ops create them, and the peak. On fake
    tensors the compiled code runs as its graph before Inductor's fusion, so the peak is an upper bound of
    what the compiled step holds."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.ops.add(getattr(func, "overloadpacket", func).__name__)
                counter.add(out)
                if func is torch.ops.aten._to_copy.default and args[0].untyped_storage() in counter.weights:
                    counter.cast_bytes += args[0].nbytes + out.nbytes  # autocast reading a weight, writing a copy
                return out
        self.mode, self.seen, self.now, self.peak, self.ops = Mode(), WeakIdKeyDictionary(), 0, 0, set()
        self.weights, self.cast_bytes = WeakIdKeyDictionary(), 0

    def add(self, tensors):
        import torch
        from torch.utils._pytree import tree_leaves
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                storage = t.untyped_storage()
                if storage not in self.seen:
                    self.seen[storage] = True
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, n: int):
        self.now -= n


ROOFLINE = None  # the child's Roofline, when it checks a configuration


UNALIGNED = []  # matmuls whose padding Inductor would decide by timing: "MxK @ KxN"


def choose_without_timing():
    """Inductor decides some things by timing kernels on the GPU. Here, with fixed timings instead: GEMM
    autotuning takes the first Triton template (cuBLAS last), which then compiles with the graph; a kernel's
    coordinate-descent variants tie, so the first stays; fusions are not timed; a matmul whose shape is not
    a multiple of the tile alignment is not padded, and is recorded (on a GPU: a timing, then maybe a copy)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.triton import TritonScheduling
    from torch._inductor.fx_passes import pad_mm
    from torch._inductor.select_algorithm import AlgorithmSelectorCache, ExternKernelCaller

    def make_benchmark_fn(cls, choices, *args, **kwargs):
        return lambda choices: {c: 1.0 if isinstance(c, ExternKernelCaller) else 0.1 + i * 1e-3
                                for i, c in enumerate(choices)}

    def should_pad(key: str) -> bool:
        shapes = re.findall(r"Size\(\[([\d, ]+)\]\)", key)[:2]
        UNALIGNED.append(" @ ".join(s.replace(", ", "x") for s in shapes))
        return False
    AlgorithmSelectorCache.make_benchmark_fn = classmethod(make_benchmark_fn)
    TritonScheduling.benchmark_codegened_module = lambda self, mod, *args, **kwargs: (1.0, mod.__file__)
    pad_mm.get_cached_should_pad = should_pad
    inductor_config.benchmark_epilogue_fusion = False
    inductor_config.benchmark_fusion = False


def skip_moves_in_place():
    """Module.to() that returns at once when every parameter already has the device and dtype asked for. PEFT
    moves each new adapter to where it already is; a fake parameter would be swapped for its copy there, which
    fails (fake tensors are weakly referenced), where a real one is left as it is."""
    import torch
    move = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        here = all((device is None or (p.device.type, p.device.index or 0) == (device.type, device.index or 0)) and
                   (dtype is None or p.dtype == dtype) for p in self.parameters())
        return self if here else move(self, *args, **kwargs)
    torch.nn.Module.to = to


def check_config(precision: str, compile_mode: str, preset: str = "large", layers: int = 2, accum: int = 2):
    """By default the `large` preset cut to 2 layers, accumulation 2: every kind of layer, kernel and optimizer
    path of the full model, at a tenth of its compile time. The calibration rows compile a whole preset."""
    from config import PRESETS
    cfg = PRESETS[preset]()
    cfg.model = replace(cfg.model, num_hidden_layers=layers or cfg.model.num_hidden_layers)
    cfg.train = replace(cfg.train, compile=compile_mode, precision=precision, grad_accum_steps=accum)
    return cfg


def run_training(precision: str, compile_mode: str, loss_chunk_rows: int | None = None,
                 deterministic: bool = False, packed: bool = False, lora_rank: int = 0, whole: str = "",
                 lora_base: str = "auto") -> dict:
    """Three trainer steps: the first compiles, the next two must compile nothing. loss_chunk_rows: the loss
    in chunks of that many rows, as a GPU short of memory computes it; deterministic: as --deterministic;
    packed: rows of whole examples, attention masked block-diagonally (chat fine-tuning); lora_rank: adapters of
    that rank on a frozen base held as lora_base (auto: bf16); whole: that preset at its full depth, one micro-step
    (a calibration row)."""
    import bench
    import torch

    from gpu_training_optimized import train_step
    from llm.runner import build
    from llm import distributed
    from llm.device import machine, make_deterministic, pick_device
    from llm.autofill import fill_automatic
    from llm.sizing import training_bytes_estimate
    cfg = check_config(precision, compile_mode, whole, 0, 1) if whole else check_config(precision, compile_mode)
    device, ranks = pick_device("cuda"), distributed.setup()
    cfg.train = replace(cfg.train, lora_rank=lora_rank, lora_base=lora_base)
    if lora_rank:
        skip_moves_in_place()
    cfg, _ = fill_automatic(cfg, machine(device), corpus_bytes=None)
    if deterministic:
        make_deterministic()
    memory = DeviceMemory()
    b = build(cfg, device, ranks)
    if loss_chunk_rows is not None:
        b.raw_model.execution = replace(b.raw_model.execution, loss_chunk_rows=loss_chunk_rows)
    batches = bench.FixedBatches(cfg, device, packed)
    if packed == "pairs":  # preference pairs, trained by dpo through the same train_step
        b.objective, batches = dpo_pairs(b, batches)
    evaluates = lambda: evaluation_forward(b, batches)  # noqa: E731  FP8's own graph, warmed before the loop
    if b.eval_model is not b.raw_model:
        evaluates()
    ROOFLINE.watch_optimizer(b.opt)
    train_step(b, batches, 0, cfg.train, ranks)
    torch._dynamo.config.error_on_recompile = True  # "unexpected recompile" is an error from here on
    for step in (1, 2):
        ROOFLINE.counting = step == 1  # the calls of one whole step, compiled
        train_step(b, batches, step, cfg.train, ranks)
        ROOFLINE.counting = False
        evaluates()  # an evaluation between steps compiles nothing (or runs eagerly, without FP8)
    memory.add([*b.raw_model.parameters(), *b.raw_model.buffers(), *optimizer_state(b.opt), batches.x, batches.y])
    memory.weights.update({p.untyped_storage(): True for p in b.raw_model.parameters()})
    # Dynamo compiles nothing under a dispatch mode: this step runs eagerly, op by op, for the modes to see.
    with torch.compiler.set_stance("force_eager"), memory.mode, ROOFLINE.eager_mode():
        train_step(b, batches, 3, cfg.train, ranks)
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model.max_seq_len
    return {**ROOFLINE.step(tokens), "peak_gib": memory.peak / 2**30,
            "estimate_gib": training_bytes_estimate(cfg) / 2**30,
            "sdpa": sdpa_backends(memory.ops), "loss_chunk_rows": b.raw_model.execution.loss_chunk_rows,
            "weight_casts_gib": memory.cast_bytes / 2**30,
            "weight_casts_ms": 1e3 * memory.cast_bytes / bandwidth(device), "loss_scaling": b.scaler is not None}


def dpo_pairs(b, batches):
    """A dpo Objective (its NLL term, stored reference log-probabilities) and FixedBatches' packed examples read
    as pairs, as batches.PairBatch serves them: a row's first two examples one pair's chosen and rejected replies,
    its third outside any reply (its labels -100), each row one pair."""
    import torch

    from llm.batches import PairBatch
    from llm.preference import Objective, Settings
    x, y, pos = batches.get(0, 0)
    example = (pos == 0).cumsum(1) - 1  # (B, T): which example of its row
    rows = torch.arange(x.shape[0], device=x.device)
    slot = torch.where(example < 2, 2 * rows[:, None] + example, -1)
    pairs = PairBatch(x, y.masked_fill(slot < 0, -100), pos, slot, rows, pairs=x.shape[0])
    ref = {split: torch.zeros(x.shape[0], 2, device=x.device) for split in ("train", "val")}
    served = types.SimpleNamespace(x=pairs.x, y=pairs.y, pos=pos, device=batches.device, get=lambda *_: pairs)
    return Objective(Settings("dpo"), ref, x.device), served


def evaluation_forward(b, batches):
    """What validation_loss() runs, without its host read (a fake tensor has no value): one forward, eval mode."""
    import torch
    b.eval_model.eval()
    with torch.no_grad(), b.amp:
        b.eval_model(batches.x, labels=batches.y, positions=batches.pos)
    b.eval_model.train()


def run_generation() -> dict:
    """The engine's compiled prefill and CUDA-graph decode step at two batch sizes, as generation loads them."""
    import torch

    from llm.startup import new_model
    from llm import decode, decode_compile
    from llm.device import pick_device
    from llm.inference import for_inference
    from llm.sampling import candidates
    from config import PRESETS
    cfg, device = check_config("bf16", "default"), pick_device("cuda")
    cfg.model = PRESETS["large"]().model  # the whole depth: a decode step's kernels are counted per step
    model = for_inference(new_model(cfg, device), device)
    memory = DeviceMemory()
    with torch.no_grad():
        for batch in (1, 4):
            slot = decode_compile.compiled_slot(model, batch)  # for_inference set the model to compile (auto on CUDA)
            ids = torch.zeros(batch, decode.MIN_BUCKET, dtype=torch.long, device=device)
            lengths = torch.full((batch,), decode.MIN_BUCKET - 3, device=device)
            ranked = candidates([0.8] * batch, [50] * batch, cfg.model.vocab_size)
            for steps in range(2):  # the second round must compile nothing
                slot.prefill(model, ids, lengths, slot.cache, slot.state, ranked)
                for i in range(3):
                    ROOFLINE.counting = batch == 1 and steps == 1 and i == 0  # the kernels of one decode step
                    slot.decode(model, slot.cache, slot.state, ranked)
                    ROOFLINE.counting = False
                torch._dynamo.config.error_on_recompile = steps == 0
            torch._dynamo.config.error_on_recompile = False  # a new batch size compiles its own steps
        memory.add([*model.parameters(), *model.buffers(), *slot.cache.k, *slot.cache.v, slot.cache.next_mask,
                    *vars(slot.state).values()])
        with torch.compiler.set_stance("force_eager"), memory.mode:
            decode.prefill_step(model, ids, lengths, slot.cache, slot.state, ranked)
            decode.decode_step(model, slot.cache, slot.state, ranked)
    return {"peak_gib": memory.peak / 2**30, "estimate_gib": None, "sdpa": sdpa_backends(memory.ops),
            **ROOFLINE.decode_step()}


def optimizer_state(opt) -> list:
    """Every tensor the optimizer keeps (moments, momentum buffers)."""
    import torch
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(opt.state_dict()) if isinstance(t, torch.Tensor)]


def bandwidth(device) -> float:
    """Bytes per second the GPU's memory moves: double data rate over the bus."""
    import torch
    props = torch.cuda.get_device_properties(device)
    return props.memory_clock_rate * 1e3 * 2 * props.memory_bus_width / 8


def sdpa_backends(ops: set) -> str:
    found = sorted({m.group(1) for op in ops if (m := re.match(r"_scaled_dot_product_(\w+?)_attention$", op))})
    return ", ".join(found) or ("math" if any("scaled_dot_product" in op for op in ops) else "none")


CONFIGS = {  # name -> what runs, and which GPU it is compiled for
    "train-default": (lambda: run_training("bf16", "default"), "h100"),
    "train-reduce-overhead": (lambda: run_training("bf16", "reduce-overhead"), "h100"),
    "train-max-autotune-no-cudagraphs": (lambda: run_training("bf16", "max-autotune-no-cudagraphs"), "h100"),
    "train-max-autotune": (lambda: run_training("bf16", "max-autotune"), "h100"),
    "train-fp8": (lambda: run_training("fp8", "default"), "h100"),
    "train-fp16": (lambda: run_training("fp16", "default"), "h100"),
    "train-deterministic": (lambda: run_training("bf16", "default", deterministic=True), "h100"),
    "train-packed": (lambda: run_training("bf16", "default", packed=True), "h100"),
    "train-lora": (lambda: run_training("bf16", "default", packed=True, lora_rank=16), "h100"),
    "train-lora-nf4": (lambda: run_training("bf16", "default", packed=True, lora_rank=16, lora_base="nf4"), "h100"),
    "generate": (run_generation, "h100"),
    "calibrate-large-h200": (lambda: run_training("bf16", "default", whole="large"), "h200"),
    "calibrate-small-h200": (lambda: run_training("bf16", "default", whole="small"), "h200"),
    "train-chunked-loss-rtx4090": (lambda: run_training("bf16", "default", loss_chunk_rows=2048), "rtx4090"),
    "train-default-a100": (lambda: run_training("bf16", "default"), "a100"),
    "train-dpo": (lambda: run_training("bf16", "default", packed="pairs"), "h100"),
}


def child(name: str, library: str, inductor: dict | None = None) -> dict:
    """Run one configuration in this (fake-GPU) process, under these Inductor settings; what it compiled and what
    went wrong."""
    import torch
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch._inductor.config.wrap_inductor_compiled_regions = True  # compiled code runs as fake propagation
    torch._inductor.config.fx_graph_cache = False  # every graph compiled here, so the roofline costs it
    choose_without_timing()
    global ROOFLINE
    ROOFLINE = Roofline(GPUS[CONFIGS[name][1]])
    ROOFLINE.install()
    start, failure, result = time.time(), None, {}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch._inductor.config.patch(inductor or {}):
            result = CONFIGS[name][0]()
    except Exception as e:  # the point of the check: any failure is reported, by configuration
        traceback.print_exc()  # the whole story on stderr, shown with --verbose
        failure = summary(e)
    fake = ctypes.CDLL(library)
    breaks = sum(counters["graph_break"].values())
    skips = counters["inductor"]["cudagraph_skips"]
    problems = [failure] if failure else []
    problems += [f"{breaks} graph breaks: {dict(counters['graph_break'])}"] if breaks else []
    problems += [f"{counters['frames']['total'] - counters['frames']['ok']} frames not compiled"] \
        if counters["frames"]["total"] != counters["frames"]["ok"] else []
    problems += [f"{fake.fake_gpu_foreign_cubins()} kernels compiled for another GPU"] \
        if fake.fake_gpu_foreign_cubins() else []
    unaligned = sorted(set(UNALIGNED))
    problems += [f"matmuls of unaligned shapes: {', '.join(unaligned)}"] if unaligned and name != "generate" else []
    problems += [f"CUDA graphs skipped {skips} times"] if skips and ("reduce-overhead" in name or "max-autotune"
                                                                   in name and "no-cudagraphs" not in name) else []
    return {"name": name, "gpu": CONFIGS[name][1], "ok": not problems, "problems": problems,
            "graphs": counters["stats"]["unique_graphs"], "kernels": fake.fake_gpu_cubins(), "unaligned": unaligned,
            "seconds": time.time() - start, **result}


def summary(e: BaseException) -> str:
    """An exception in one line: its type and its first lines that say something (a compiler error wraps the
    real one after 'raised:')."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.strip().endswith("raised:")]
    return f"{type(e).__name__}: {' '.join(lines[:2])[:400]}"


# ----------------------------------------------------------------------------- the command

def run_all(names: list[str], inductor: list[str] = ()) -> int:
    """Each configuration in a fresh fake-GPU process (under --inductor's settings), one after the other; the
    table; 1 if any failed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        print("error: the compile check needs a CUDA build of torch (with Triton): pip install torch (the default "
              "wheel on Linux), in a virtual environment of its own if this one keeps the CPU build",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_check_") as cache:
        for name in names:
            try:
                library = shim_library(GPUS[CONFIGS[name][1]])
            except (OSError, subprocess.CalledProcessError) as e:  # no gcc, or it failed
                detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[:1]
                print(f"error: building the fake GPU library needs gcc ({' '.join(detail)}); install gcc",
                      file=sys.stderr)
                return 2
            out = os.path.join(cache, f"{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", out, "--inductor", *inductor]
            print(f"{name}: compiling for {GPUS[CONFIGS[name][1]].name}...", flush=True)
            done = subprocess.run(cmd, env=fake_gpu_env(library, cache), cwd=HERE, capture_output=True, text=True)
            if os.path.isfile(out):
                with open(out, encoding="utf-8") as f:
                    rows.append(json.load(f))
            else:  # the child died before it could report (a crash in the shim or in torch)
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"name": name, "gpu": CONFIGS[name][1], "ok": False,
                             "problems": [f"exit {done.returncode}: {tail[0][:300]}"]})
            print(row_line(rows[-1]), flush=True)
    print(table(rows))
    failed = [r["name"] for r in rows if not r["ok"]]
    if failed:
        print(f"error: the GPU compile check failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"compile check: {len(rows)} configurations compiled for the GPU, no graph break, no recompile")
    return 0


def roofline_text(r: dict) -> str:
    """The step's roofline estimate in a few words (a decode step's for generation), or n/a."""
    if "decode_kernels" in r:
        return (f"decode step {r['decode_kernels']} kernels ({r['decode_matmuls']} matmuls), roofline "
                f"{r['decode_roofline_us']:.0f} us, estimate {r['decode_estimate_us']:.0f} us")
    if r.get("roofline_ms") is None:
        return f"not costed ({r['roofline_missing']})" if r.get("roofline_missing") else "n/a"
    mfu = f", MFU {r['roofline_mfu']:.0%}" if r.get("roofline_mfu") else ""
    calibrated = f"; calibrated {r['calibrated_ms']:.1f} ms (forward and backward " \
        f"{r['calibrated_forward_backward_ms']:.1f}), MFU {r['calibrated_mfu']:.0%}" if r.get("calibrated_mfu") else ""
    return (f"{r['roofline_ms']:.1f} ms (matmul {r['roofline_matmul_ms']:.1f}, other {r['roofline_other_ms']:.1f}, "
            f"optimizer {r['roofline_optimizer_ms']:.1f}){mfu}{calibrated}")


def row_line(r: dict) -> str:
    if not r["ok"]:
        return f"  FAILED: {'; '.join(r['problems'])}"
    casts = f", weight casts {r['weight_casts_gib']:.2f} GiB a step ({r['weight_casts_ms']:.2f} ms)" \
        if "weight_casts_gib" in r else ""
    roof = f", roofline estimate {roofline_text(r)}" if r.get("roofline_ms") is not None or "decode_kernels" in r \
        else ""
    return f"  ok: {r['kernels']} kernels, {r['graphs']} graphs, SDPA {r['sdpa']}{casts}{roof}, {r['seconds']:.0f} s"


def table(rows: list[dict]) -> str:
    lines = ["| configuration | GPU | result | Triton kernels (cubin) | graphs | SDPA backend | fake-tensor peak GiB "
             "| sizing estimate GiB | weight casts a step | step time, roofline estimate | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        est = f"{r['estimate_gib']:.2f}" if r.get("estimate_gib") is not None else "n/a"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "n/a"
        casts = f"{r['weight_casts_gib']:.2f} GiB, {r['weight_casts_ms']:.2f} ms" if "weight_casts_gib" in r else "n/a"
        lines.append(f"| {r['name']} | {GPUS[r['gpu']].name} | {'ok' if r['ok'] else 'FAILED'} | "
                     f"{r.get('kernels', 'n/a')} | {r.get('graphs', 'n/a')} | {r.get('sdpa', 'n/a')} | {peak} | "
                     f"{est} | {casts} | {roofline_text(r)} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), default=list(CONFIGS), help="configurations to check")
    p.add_argument("--inductor", nargs="*", default=[], metavar="NAME=VALUE",
                   help="Inductor settings to compile every configuration under, as the GPU check's decode leads "
                        "try them: --only generate --inductor coordinate_descent_tuning=True")
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    settings = inductor_settings(args.inductor)
    if args.child:
        result = child(args.child, os.environ["LD_PRELOAD"], settings)
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    return run_all(args.only, args.inductor)


def inductor_settings(pairs: list[str]) -> dict:
    """--inductor's NAME=VALUE pairs as Inductor settings: True, False, a whole number, else the text.
    ConfigError on a name Inductor does not have."""
    import torch
    known, settings = torch._inductor.config.get_config_copy(), {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if name not in known:
            raise ConfigError(f"--inductor {pair}: Inductor has no setting {name!r} (torch {torch.__version__})")
        settings[name] = {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)
    return settings


if __name__ == "__main__":
    sys.exit(main())
