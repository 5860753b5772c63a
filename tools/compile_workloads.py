"""What each compile-check configuration runs in its fake-GPU process (compile_check.py starts the process and
reads the result): the trainer's own build() and train_step for three steps, or generation's compiled prefill
and decode step, on fake tensors; and what they measure (the memory the step holds, its SDPA backends, its
roofline)."""

import re
import types
import weakref
from dataclasses import replace

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
                    # autocast reading a weight, writing a copy
                    counter.cast_bytes += args[0].nbytes + out.nbytes
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
    coordinate-descent variants tie, so the first stays; fusions are not timed; a matmul whose shape is not a
    multiple of the tile alignment is not padded, and is recorded (on a GPU: a timing, then maybe a copy)."""
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
        here = all((device is None
                    or (p.device.type, p.device.index or 0) == (device.type, device.index or 0))
                   and (dtype is None or p.dtype == dtype) for p in self.parameters())
        return self if here else move(self, *args, **kwargs)
    torch.nn.Module.to = to


def check_config(precision: str, compile_mode: str, preset: str = "large", layers: int = 2, accum: int = 2):
    """By default the `large` preset cut to 2 layers, accumulation 2: every kind of layer, kernel and
    optimizer path of the full model, at a tenth of its compile time. The calibration rows compile a whole
    preset."""
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
    packed: rows of whole examples, attention masked block-diagonally (chat fine-tuning); lora_rank: adapters
    of that rank on a frozen base held as lora_base (auto: bf16); whole: that preset at its full depth, one
    micro-step (a calibration row)."""
    import bench
    import torch

    from gpu_training_optimized import train_step
    from llm.base import distributed
    from llm.base.device import machine, make_deterministic, pick_device
    from llm.base.sizing import training_bytes_estimate
    from llm.train.autofill import fill_automatic
    from llm.train.plan import step_settings
    from llm.train.runner import build
    cfg = (check_config(precision, compile_mode, whole, 0, 1) if whole
           else check_config(precision, compile_mode))
    device, ranks = pick_device("cuda"), distributed.setup()
    cfg.train = replace(cfg.train, lora_rank=lora_rank, lora_base=lora_base)
    if lora_rank:
        skip_moves_in_place()
    cfg, _ = fill_automatic(cfg, machine(device), corpus_bytes=None)
    if deterministic:
        make_deterministic()
    memory = DeviceMemory()
    settings = step_settings(cfg, device)
    if loss_chunk_rows is not None:
        settings = replace(settings, execution=replace(settings.execution, loss_chunk_rows=loss_chunk_rows))
    b = build(cfg, settings, device, ranks)
    batches = bench.FixedBatches(cfg, device, packed)
    if packed == "pairs":  # preference pairs, trained by dpo through the same train_step
        b.objective, batches = dpo_pairs(b, batches)
    if packed == "grpo":  # sampled replies, trained by GRPO's loss with its KL and clipping terms
        b.objective, batches = grpo_replies(b, batches, cfg.train)
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
    memory.add([*b.raw_model.parameters(), *b.raw_model.buffers(), *optimizer_state(b.opt),
                batches.x, batches.y])
    memory.weights.update({p.untyped_storage(): True for p in b.raw_model.parameters()})
    # Dynamo compiles nothing under a dispatch mode: this step runs eagerly, op by op, for the modes to see.
    with torch.compiler.set_stance("force_eager"), memory.mode, ROOFLINE.eager_mode():
        train_step(b, batches, 3, cfg.train, ranks)
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model.max_seq_len
    # the rollouts' decode step, as the run samples: the model with its adapters, a CUDA graph
    if packed == "grpo":
        sampling_step(b.raw_model, cfg.model.vocab_size, device)
    return {**ROOFLINE.step(tokens), "peak_gib": memory.peak / 2**30,
            "estimate_gib": training_bytes_estimate(cfg) / 2**30,
            "sdpa": sdpa_backends(memory.ops), "loss_chunk_rows": b.raw_model.execution.loss_chunk_rows,
            "weight_casts_gib": memory.cast_bytes / 2**30,
            "weight_casts_ms": 1e3 * memory.cast_bytes / bandwidth(device),
            "loss_scaling": b.scaler is not None}


def dpo_pairs(b, batches):
    """A dpo Objective (its NLL term, stored reference log-probabilities) and FixedBatches' packed examples
    read as pairs, as batches.PairBatch serves them: a row's first two examples one pair's chosen and rejected
    replies, its third outside any reply (its labels -100), each row one pair."""
    import torch

    from llm.data.batches import PairBatch
    from llm.train.preference import Objective, Settings
    x, y, pos = batches.get(0, 0)
    example = (pos == 0).cumsum(1) - 1  # (B, T): which example of its row
    rows = torch.arange(x.shape[0], device=x.device)
    slot = torch.where(example < 2, 2 * rows[:, None] + example, -1)
    pairs = PairBatch(x, y.masked_fill(slot < 0, -100), pos, slot, rows, pairs=x.shape[0])
    ref = {split: torch.zeros(x.shape[0], 2, device=x.device) for split in ("train", "val")}
    served = types.SimpleNamespace(x=pairs.x, y=pairs.y, pos=pos, device=batches.device, get=lambda *_: pairs)
    return Objective(Settings("dpo"), ref, x.device), served


def grpo_replies(b, batches, t):
    """A GRPO Objective (dapo loss, beta 0.04 against a reference, PPO clipping against the sampling policy's
    log-probabilities) over FixedBatches' rows read as sampled replies, a reply to a row as a compiled step
    lays them out (rollouts.sharing): the second half of each row a reply."""
    import torch

    from llm.train import grpo, rl
    from llm.train.rollouts import RolloutBatch
    x, y, _ = batches.get(0, 0)
    B, T = x.shape
    labels = torch.where(torch.arange(T, device=x.device) >= T // 2, y, -100)  # the prompt's half is no label
    mask = (labels != -100).float()
    zeros = torch.zeros(B, T, device=x.device)
    settings = grpo.Settings("dapo", t.epsilon, t.epsilon_high, 0.04, t.max_completion_length)
    reply = T - T // 2
    replies = RolloutBatch(x, labels, None, mask, mask / reply, mask, zeros, zeros, float(B * reply),
                           float(B))
    rollouts = types.SimpleNamespace(settings=settings, device=x.device, t=t, take=dict)
    served = types.SimpleNamespace(x=x, y=labels, pos=None, device=batches.device, get=lambda *_: replies)
    return rl.Objective(rollouts, t.grad_accum_steps), served


def sampling_step(model, vocab: int, device):
    """What a GRPO run's rollouts compile (runner.rl_objective sets the model to compile as its step does,
    auto: a CUDA graph): the prefill and decode step of the model being trained, adapters on, at temperature
    1; the second round must compile nothing."""
    import torch

    from llm.generate import decode, decode_compile
    from config import SampleConfig
    from llm.generate.sampling import candidates
    decode_compile.use_compile(model, "auto")
    model.eval()
    with torch.no_grad():
        slot = decode_compile.compiled_slot(model, 8, min(512, model.config.max_seq_len))  # replies' reach
        ids = torch.zeros(8, decode.MIN_BUCKET, dtype=torch.long, device=device)
        lengths = torch.full((8,), decode.MIN_BUCKET - 3, device=device)
        ranked = candidates([SampleConfig(temperature=1.0, top_k=0, top_p=1.0)], vocab)  # GRPO's: unranked
        for round_ in range(2):
            torch._dynamo.config.error_on_recompile = round_ == 1
            slot.prefill(model, ids, lengths, slot.cache, slot.state, ranked)
            for _ in range(3):
                slot.decode(model, slot.cache, slot.state, ranked)
    model.train()


def evaluation_forward(b, batches):
    """What validation_loss() runs, without its host read (a fake tensor has no value): one forward, eval
    mode."""
    import torch
    b.eval_model.eval()
    with torch.no_grad(), b.amp:
        b.eval_model(batches.x, labels=batches.y, positions=batches.pos)
    b.eval_model.train()


def run_generation() -> dict:
    """The engine's compiled prefill and CUDA-graph decode step at two batch sizes, as generation loads them.
    """
    import torch

    from llm.base.device import pick_device
    from llm.generate import decode, decode_compile
    from llm.generate.inference import for_inference
    from llm.generate.sampling import candidates
    from llm.train.runner import new_model
    from config import PRESETS, SampleConfig
    cfg, device = check_config("bf16", "default"), pick_device("cuda")
    cfg.model = PRESETS["large"]().model  # the whole depth: a decode step's kernels are counted per step
    model = for_inference(new_model(cfg, device), device)
    memory = DeviceMemory()
    with torch.no_grad():
        for batch in (1, 4):
            # for_inference set the model to compile (auto on CUDA)
            slot = decode_compile.compiled_slot(model, batch)
            ids = torch.zeros(batch, decode.MIN_BUCKET, dtype=torch.long, device=device)
            lengths = torch.full((batch,), decode.MIN_BUCKET - 3, device=device)
            ranked = candidates([SampleConfig(temperature=0.8, top_k=50)], cfg.model.vocab_size)
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
    found = sorted({m.group(1) for op in ops
                    if (m := re.match(r"_scaled_dot_product_(\w+?)_attention$", op))})
    return ", ".join(found) or ("math" if any("scaled_dot_product" in op for op in ops) else "none")
