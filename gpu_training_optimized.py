"""Train the model. With no arguments: the `auto` preset (sized to the GPU found; tiny on a CPU) on the
Python standard library's own sources, into runs/default, then `python text_generator.py` samples from it.

    python gpu_training_optimized.py --preset small --max_steps 2000 --micro_batch_size 16
    python gpu_training_optimized.py --resume                     # continue runs/default exactly
    torchrun --nproc_per_node=8 gpu_training_optimized.py --preset medium
`--help` lists every setting. Ctrl-C or SIGTERM finishes the step, saves, and prints how to resume.
"""

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict

import torch
from safetensors.torch import load_file
from tqdm import tqdm

import checkpoint as ckpt_io
import distributed as dist_utils
import export_hf
from config import Config, ConfigError, describe, error_exit, parse_config
from modern_llm import Transformer
from monitor import Monitor, device_report, format_postfix
from muon_optimizer import build_optimizer
from prepare_data import Batches, DataError, prepare

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


# ----------------------------------------------------------------------------- setup

def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """CUDA, then Apple MPS, then CPU, unless config names one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible, use --device auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX512-BF16 or AMX), so bf16 autocast is faster."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"precision=fp16 needs a CUDA device (found {device.type}), use bf16 or fp32")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def compile_model(model: torch.nn.Module, mode: str):
    """torch.compile with fixed shapes, or the model itself when compiling is off."""
    if mode == "off":
        return model
    # dynamic=False: every batch has the same shape, so one static graph and no recompiles.
    return torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)


def is_compile_failure(e: BaseException) -> bool:
    """Errors raised by the compiler stack itself (no C compiler, unsupported backend), not by our code."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def lr_multiplier(step: int, t) -> float:
    """Linear warmup, then cosine (optionally restarting) down to min_lr_ratio, or constant."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    since = step - t.warmup_steps
    if t.lr_schedule == "cosine_restarts":
        period = t.restart_period or max(1, (t.max_steps - t.warmup_steps) // 4)
        progress = (since % period) / period
    else:
        progress = since / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(opt, multiplier: float):
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * multiplier


# ----------------------------------------------------------------------------- one step, eval

def train_step(model, opt, batches, step: int, t, amp, scaler, cudagraphs: bool, dist):
    """One optimizer step over grad_accum_steps micro-batches. Returns device tensors (loss, grad_norm, ok)."""
    device = batches.device
    loss_sum = torch.zeros((), device=device)
    x, y = batches.get(step, 0)
    for micro in range(t.grad_accum_steps):
        last_micro = micro == t.grad_accum_steps - 1
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new replay may reuse the previous outputs' memory
        dist.set_grad_sync(model, last_micro)  # DDP all-reduces once, on the last micro-batch
        with amp:
            _, loss = model(x, labels=y)
            loss = loss / t.grad_accum_steps
        loss_sum += loss.detach()  # read the graph output into a plain tensor before the next replay
        if not last_micro:
            x, y = batches.get(step, micro + 1)  # fetch while the GPU still works on this forward
        (scaler.scale(loss) if scaler else loss).backward()
    params = [p for g in opt.param_groups for p in g["params"]]
    if scaler:
        scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip or float("inf"))  # inf: measure only
    if isinstance(grad_norm, dist_utils.DTensor):  # FSDP2: each rank's share of the squares, summed
        grad_norm = grad_norm.full_tensor()
    ok = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)
    if scaler:
        scaler.step(opt)  # the scaler skips non-finite steps and lowers the scale
        scaler.update()
    else:
        opt.step(found_inf=(~ok).float())  # skipped on the device: no host sync
    opt.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, ok


@torch.no_grad()
def evaluate(model, val_batches, t, amp, cudagraphs: bool, dist) -> float:
    """Mean validation loss over eval_batches fixed micro-batches (averaged over ranks)."""
    model.eval()
    total = torch.zeros((), device=val_batches.device)
    for i in range(t.eval_batches):
        x, y = val_batches.get(0, i)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            _, loss = model(x, labels=y)
        total += loss.float()
    model.train()
    return dist.mean(total / t.eval_batches).item()  # sync point: once per evaluation


# ----------------------------------------------------------------------------- checkpoints

def fit_micro_batch(raw_model, cfg: Config, amp, dist):
    """The largest micro-batch (halving from the whole step's batch) whose forward and backward fit in GPU
    memory; accumulation rises to keep the tokens per step. Probed on the uncompiled model."""
    t = cfg.train
    sequences = t.micro_batch_size * t.grad_accum_steps
    micro = sequences
    device = raw_model.embed_tokens.weight.device
    while True:
        try:
            x = torch.zeros(micro, cfg.model.max_seq_len, dtype=torch.long, device=device)
            with amp:
                _, loss = raw_model(x, labels=x)
            loss.backward()
            break
        except torch.OutOfMemoryError:
            loss = x = None
            raw_model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if micro == 1:
                raise
            micro //= 2
    raw_model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    t.micro_batch_size, t.grad_accum_steps = micro, math.ceil(sequences / micro)
    dist.print(f"auto micro-batch: {micro} sequences x {t.grad_accum_steps} accumulation steps")


def save(cfg: Config, raw_model, opt, scaler, step: int, tokens: int, best_val: float, tokenizer_path: str,
         fingerprint: str, dist) -> str | None:
    """Write a checkpoint (rank 0; DDP keeps every rank's weights identical, FSDP2 shards are gathered to it),
    refusing NaN or Inf. Every rank calls it."""
    weights = dist_utils.full_state(raw_model.state_dict(), keep=dist.is_main)
    opt_state = dist_utils.full_state(opt.state_dict(), keep=dist.is_main)
    if not dist.is_main:
        return None
    state = ckpt_io.weights_state_dict(raw_model, weights)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise FloatingPointError(f"weights {bad[:3]} hold NaN or Inf; the checkpoint was not written")
    trainer_state = {"step": step, "tokens": tokens, "best_val_loss": best_val, "optimizer": opt_state,
                     "scaler": scaler.state_dict() if scaler else {}, "data_fingerprint": fingerprint,
                     "world_size": dist.world_size, "rng_torch": torch.get_rng_state(),
                     "config": json.dumps(cfg.to_dict())}
    return ckpt_io.save_checkpoint(cfg.train.run_dir, step, state, cfg.model, tokenizer_path, trainer_state,
                                   cfg.train.keep_checkpoints)


def apply_init_from(cfg: Config) -> dict:
    """--init_from: take the model shape, tokenizer and weights of a checkpoint, run or Hugging Face folder."""
    path = cfg.train.init_from
    if export_hf.is_hf_folder(path):
        model_cfg, state, tokenizer = export_hf.load_hf_folder(path)
    else:
        ckpt = ckpt_io.resolve_checkpoint(path)
        model_cfg, tokenizer = ckpt_io.load_model_config(ckpt), os.path.join(ckpt, ckpt_io.TOKENIZER)
        state = load_file(os.path.join(ckpt, ckpt_io.WEIGHTS), device="cpu")
    if not tokenizer:
        raise ConfigError(f"--init_from {path} has no tokenizer.json, import it with export_hf.py --tokenizer")
    # Only the weights' shape is taken: context length and memory settings stay this run's.
    cfg.model = dataclasses.replace(model_cfg, max_seq_len=cfg.model.max_seq_len,
                                    gradient_checkpointing=cfg.model.gradient_checkpointing)
    cfg.data.tokenizer = cfg.data.tokenizer or tokenizer  # the data must be tokenized as the model was
    return state


def check_same_shape(cfg: Config, ckpt: str):
    """Refuse to resume into a model of another shape, naming the fields that differ."""
    saved = asdict(ckpt_io.load_model_config(ckpt))
    ours = asdict(cfg.model)
    differ = [f"{k}: checkpoint {saved[k]} vs config {ours[k]}" for k in ours
              if k != "gradient_checkpointing" and saved.get(k) != ours[k]]
    if differ:
        raise ConfigError(f"cannot resume {ckpt}: the model shape differs ({'; '.join(differ)}), "
                          "use the run's own settings or a new --run_dir")


def resume(cfg: Config, raw_model, opt, scaler, dist) -> tuple[int, int, float]:
    """Load the newest checkpoint of the run folder onto the CPU, then into model and optimizer."""
    ckpt = ckpt_io.latest_checkpoint(cfg.train.run_dir)
    if ckpt is None:
        raise ConfigError(f"--resume: {cfg.train.run_dir} has no checkpoint yet, start without --resume")
    check_same_shape(cfg, ckpt)
    try:
        state = ckpt_io.load_trainer_state(ckpt)
        if "optimizer" not in state:
            raise ConfigError(f"{ckpt} holds imported weights only, start a new run with --init_from {ckpt}")
        ckpt_io.load_weights(ckpt, raw_model)  # read on the CPU, then copied into the device's parameters
    except ckpt_io.CheckpointError as e:
        earlier = [os.path.basename(c) for c in ckpt_io.list_checkpoints(cfg.train.run_dir) if c != ckpt]
        hint = f"; to resume from {earlier[-1]}, write that name into {cfg.train.run_dir}/checkpoints/LATEST" \
            if earlier else ""
        raise ckpt_io.CheckpointError(f"{e}{hint}") from None
    peak_lrs = [g["initial_lr"] for g in opt.param_groups]
    opt.load_state_dict(state["optimizer"])
    for group, lr in zip(opt.param_groups, peak_lrs):  # learning rates given now win over the checkpoint's
        group["initial_lr"] = lr
    if scaler and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_torch"])
    dist.print(f"resumed from {ckpt} at step {state['step']}")
    return state["step"], state["tokens"], state["best_val_loss"]


# ----------------------------------------------------------------------------- stopping cleanly

class StopFlag:
    """Ctrl-C or SIGTERM asks the loop to finish its step and save; a second Ctrl-C leaves at once."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            print("\nsecond interrupt: leaving without saving", file=sys.stderr)
            os._exit(130)
        self.requested = True


# ----------------------------------------------------------------------------- main

def start_report(cfg, device, amp_dtype, raw_model, opt, dist, tokens_per_step) -> str:
    t = cfg.train
    dtype = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + loss scaling", None: "fp32"}[amp_dtype]
    n, n_body = raw_model.num_parameters(), raw_model.num_parameters(exclude_embeddings=True)
    return "\n".join([
        f"device: {device_report(device)} | precision: {dtype} | compile: {t.compile} | world size: {dist.world_size}"
        + (f" ({t.data_parallel})" if dist.enabled else ""),
        f"model: {n / 1e6:.2f}M parameters ({n_body / 1e6:.2f}M without embeddings), "
        f"{raw_model.flops_per_token() / 1e6:.1f} MFLOP per token",
        f"batch: {t.micro_batch_size} x {cfg.model.max_seq_len} tokens x {t.grad_accum_steps} accumulation x "
        f"{dist.world_size} ranks = {tokens_per_step:,} tokens per step, {t.max_steps} steps",
        opt.describe(),
        f"run folder: {t.run_dir}",
    ])


@dist_utils.record  # under torchrun: the failing rank's error becomes the 'Root Cause' of torchrun's report
def main(argv=None) -> int:
    cfg, _ = parse_config(argv)
    t = cfg.train
    init_state = apply_init_from(cfg) if t.init_from else None  # before the data: it may set the tokenizer
    dist = dist_utils.setup()
    device = pick_device(t.device if not dist.enabled else ("cuda" if torch.cuda.is_available() else "cpu"),
                         dist.local_rank)
    amp_dtype = pick_precision(t.precision, device)
    if t.data_parallel == "fsdp" and amp_dtype == torch.float16 and dist.enabled:
        raise ConfigError("--data_parallel fsdp needs bf16 or fp32, not fp16 with loss scaling: pass "
                          "--precision fp32, or use --data_parallel ddp on a GPU without bf16")
    amp = autocast(device, amp_dtype)
    dist.print(describe(cfg))

    # Rank 0 builds the cache; the others wait, then find it complete.
    ds = prepare(cfg.data, cfg.model.vocab_size, cfg.model.max_seq_len, log=dist.print) if dist.is_main else None
    dist.barrier()
    ds = ds or prepare(cfg.data, cfg.model.vocab_size, cfg.model.max_seq_len, log=lambda *a: None)
    if ds.meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {ds.meta['vocab_size']} tokens but vocab_size={cfg.model.vocab_size}, "
                          f"set --vocab_size {ds.meta['vocab_size']} or more")
    if dist.is_main:
        if ckpt_io.latest_checkpoint(t.run_dir) and not t.resume:
            raise ConfigError(f"{t.run_dir} already holds checkpoints, pass --resume to continue it "
                              "or --run_dir NEW_FOLDER for a new run")
        os.makedirs(t.run_dir, exist_ok=True)
        with open(os.path.join(t.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=2)

    torch.manual_seed(t.seed)
    with torch.device("meta"):
        raw_model = Transformer(cfg.model)
    raw_model.to_empty(device=device)
    torch.manual_seed(t.seed)
    raw_model.init_weights()  # the same weights on every rank and every device
    if init_state is not None and not t.resume:
        raw_model.load_state_dict(init_state, strict=not cfg.model.tie_word_embeddings)
    if t.auto_micro_batch and device.type == "cuda":
        fit_micro_batch(raw_model, cfg, amp, dist)
    model = dist.wrap(raw_model, t.data_parallel, param_dtype=amp_dtype)
    opt = build_optimizer(raw_model, t)
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    start, tokens, best_val = resume(cfg, raw_model, opt, scaler, dist) if t.resume else (0, 0, float("inf"))
    compiled = compile_model(model, t.compile)
    cudagraphs = t.compile in CUDA_GRAPH_MODES and device.type == "cuda"

    batches = Batches(ds, "train", t.micro_batch_size, cfg.model.max_seq_len, t.seed, dist.rank, device,
                      world_size=dist.world_size)
    val_batches = Batches(ds, "val", t.micro_batch_size, cfg.model.max_seq_len, t.seed, dist.rank, device,
                          world_size=dist.world_size)
    tokens_per_step = t.micro_batch_size * cfg.model.max_seq_len * t.grad_accum_steps * dist.world_size
    monitor = Monitor(t.run_dir, device, raw_model.flops_per_token(), t.tensorboard, t.wandb,
                      cfg.to_dict()) if dist.is_main else None
    dist.print(start_report(cfg, device, amp_dtype, raw_model, opt, dist, tokens_per_step))

    stop = StopFlag()
    bar = tqdm(total=t.max_steps, initial=start, disable=not dist.is_main, dynamic_ncols=True, desc="train")
    window_loss = torch.zeros((), device=device)
    window_ok = torch.zeros((), device=device)
    bad_streak = torch.zeros((), device=device, dtype=torch.long)
    worst_streak = torch.zeros((), device=device, dtype=torch.long)
    last_val, last_ckpt, t0 = None, None, time.perf_counter()
    for step in range(start, t.max_steps + 1):
        last_step = step == t.max_steps
        fresh = step == start  # just started or resumed: this step's eval and save are already done
        stopping = dist.stop_vote(stop.requested)  # every rank stops at the same step, whichever got the signal
        if not fresh and (last_step or step % t.eval_interval == 0):
            val_loss = evaluate(compiled, val_batches, t, amp, cudagraphs, dist)
            best_val = min(best_val, val_loss)
            if monitor:
                last_val = monitor.eval_record(step, val_loss, ds.meta["val_bytes_per_token"])
                bar.write(f"step {step}: val loss {val_loss:.4f}, ppl {last_val['val_ppl']:.2f}, "
                          f"bpb {last_val['val_bpb']:.4f}")
        if not fresh and (last_step or step % t.save_interval == 0 or stopping):
            last_ckpt = save(cfg, raw_model, opt, scaler, step, tokens, best_val, ds.tokenizer_path,
                             ds.path, dist) or last_ckpt
        if last_step or (stopping and not fresh):
            break

        set_lr(opt, lr_multiplier(step, t))
        try:
            loss, grad_norm, ok = train_step(compiled, opt, batches, step, t, amp, scaler, cudagraphs, dist)
        except Exception as e:
            if compiled is model or not (is_compile_failure(e) and step == start):
                raise
            dist.print(f"warning: torch.compile failed ({str(e).splitlines()[0][:200]}); training eagerly")
            opt.zero_grad(set_to_none=True)
            compiled, cudagraphs = model, False
            loss, grad_norm, ok = train_step(compiled, opt, batches, step, t, amp, scaler, cudagraphs, dist)
        window_loss += torch.where(ok, loss, 0.0)
        window_ok += ok
        bad_streak = (bad_streak + 1) * (~ok)  # consecutive non-finite steps, counted on the device
        worst_streak = torch.maximum(worst_streak, bad_streak)
        tokens += tokens_per_step
        bar.update(1)
        if step == start and monitor:
            monitor.reset_clock(step + 1, tokens)  # the first step includes compilation: not timed
        if (step + 1) % t.log_interval == 0 or step + 1 == t.max_steps:
            # sync point: the only per-window host reads of device values
            worst = int(worst_streak.item())
            if worst >= t.max_bad_steps:
                raise FloatingPointError(f"{worst} consecutive steps had a non-finite loss or gradient "
                                         f"(by step {step + 1}); those updates were skipped, no checkpoint holds "
                                         "NaN. Lower --learning_rate or use --precision fp32, then --resume")
            mean_loss = dist.mean(window_loss / window_ok.clamp(min=1)).item()
            if monitor:
                r = monitor.train_record(step + 1, tokens, mean_loss, opt.param_groups[0]["lr"], grad_norm.item())
                bar.set_postfix(format_postfix(r), refresh=False)
            window_loss.zero_()
            window_ok.zero_()
    bar.close()
    if monitor:
        monitor.close()
    if dist.is_main:
        print_summary(cfg, step, tokens, time.perf_counter() - t0, best_val, ds, last_ckpt, device, stopping,
                      dist.launcher())
    dist.barrier()  # no rank closes its connections while another still talks to it (gloo aborts on that)
    dist.cleanup()
    return 0


def print_summary(cfg, step, tokens, seconds, best_val, ds, ckpt, device, interrupted, launcher="python"):
    bpb = best_val / math.log(2) / ds.meta["val_bytes_per_token"] if math.isfinite(best_val) else float("nan")
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else "n/a (CPU)"
    print(f"{'stopped' if interrupted else 'done'}: {step} steps, {tokens:,} tokens, {seconds / 60:.1f} min, "
          f"best val loss {best_val:.4f} ({bpb:.4f} bits per byte), peak memory {peak}")
    if ckpt:
        print(f"checkpoint: {ckpt}")
        print(f"chat with it: python text_generator.py {ckpt}")
    if interrupted:
        print(f"resume with: {launcher} gpu_training_optimized.py {' '.join(sys.argv[1:])} --resume".replace(
            " --resume --resume", " --resume"))


def run(argv=None) -> int:
    """main() with the error contract of DESIGN.md: bad input exits 2, understood failures exit 1."""
    try:
        return main(argv)
    except (ConfigError, DataError, ckpt_io.CheckpointError) as e:
        error_exit(str(e), 2)
    except torch.OutOfMemoryError:
        error_exit("out of GPU memory; lower --micro_batch_size (raise --grad_accum_steps to keep tokens per "
                   "step), lower --max_seq_len, set --gradient_checkpointing true, try --auto_micro_batch true, "
                   "or pick a smaller --preset", 1)
    except FloatingPointError as e:
        error_exit(str(e), 1)


if __name__ == "__main__":
    sys.exit(run())
