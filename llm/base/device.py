"""Where and in what precision the model runs: device choice, autocast dtype, torch.compile helpers.

Every script picks its device and precision here, so training, generation and the benchmarks agree:
CUDA, then Apple MPS, then CPU; bf16 where the hardware computes it natively, else fp16 with loss
scaling on CUDA and fp32 elsewhere. Nothing here knows about models or data.
"""

import contextlib
import ctypes
import functools
import os

import psutil
import torch

from llm.base.errors import CompileError, ConfigError
from llm.base.sizing import Machine

# Compile modes that capture CUDA graphs: each step must start with cudagraph_mark_step_begin().
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
PRECISION_NAMES = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + loss scaling",
                   None: "fp32"}


def precision_label(precision: str, amp_dtype, model: torch.nn.Module) -> str:
    """What a run computes in, for its start report and its checkpoints' model card: under fp8, how many of
    the model's linear layers compute in FP8 (those whose shape pays for it)."""
    if precision != "fp8":
        return PRECISION_NAMES[amp_dtype]
    return "fp8 in {} of {} linear layers + ".format(*fp8_layers(model)) + PRECISION_NAMES[amp_dtype]


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """CUDA, then Apple MPS, then CPU for "auto"; the named device otherwise (CUDA: this local rank's GPU)."""
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if cuda else "mps" if mps else "cpu"
    if (name == "cuda" and not cuda) or (name == "mps" and not mps):
        raise ConfigError(f"device={name} is not available on this machine, use --device auto or cpu")
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        enable_tf32()
        return torch.device("cuda", local_rank)
    return torch.device(name)


def enable_tf32():
    """TF32 tensor cores for what runs in fp32 (--precision fp32, the optimizer's matmuls): several times the
    fp32 rate on Ampere and newer, with a 10-bit mantissa on the inputs; autocast regions are unaffected. Set
    through the one API Inductor reads: setting the per-backend fp32_precision instead makes Inductor's GEMM
    autotuning (max-autotune) fail on "a mix of the legacy and new APIs" in torch 2.14 and older."""
    torch.set_float32_matmul_precision("high")


def make_deterministic():
    """Deterministic kernels only, for runs that must resume bit for bit on a GPU: cuDNN attention (Hopper's
    choice), whose backward accumulates in a varying order, is switched off, as are other non-deterministic
    kernels (an op without a deterministic one raises). cuBLAS needs its workspace fixed before first use."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch._inductor.config.deterministic = True


def machine(device: torch.device) -> Machine:
    """What automatic sizing needs to know of the device: its kind, its name, its memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Machine("cuda", props.name, props.total_memory)
    return Machine(device.type, f"{device.type}, {torch.get_num_threads()} threads, "
                                f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX512-BF16 or AMX), so bf16 autocast is faster."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cuda_has_native_bf16() -> bool:
    """True on GPUs with bf16 tensor cores (Ampere and newer); older ones only emulate it, slowly."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def pick_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training, or None for plain fp32."""
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if cuda_has_native_bf16() else "fp16"
        else:
            precision = "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"precision=fp16 needs a CUDA device (found {device.type}), use bf16 or fp32")
    if precision == "fp8" and not has_fp8(device):
        found = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ConfigError("precision=fp8 needs a GPU with FP8 tensor cores, compute capability 8.9 or newer "
                          f"(H100, L4, RTX 40xx; found {found}), use bf16")
    # fp8: the linear layers' matmuls in FP8 (float8_training), everything around them in bf16 autocast.
    return {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def has_fp8(device: torch.device) -> bool:
    """Whether the device has FP8 tensor cores (Ada, Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def float8_training(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its block linear layers computing in FP8 where their shape pays for it (torchao's float8
    training: dynamic per-tensor scales, bf16 master weights untouched). The output head stays bf16, and so do
    layers whose sizes are not multiples of 16, which FP8 kernels need, and layers too small for FP8's faster
    matmul to pay for the casts and scales around it (`fp8_pays`). The parameters keep their names."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ConfigError("precision=fp8 needs torchao, pip install torchao") from None

    def eligible(module, name: str) -> bool:
        return name.startswith("layers.") and fp8_pays(module.in_features, module.out_features)
    return convert_to_float8_training(model, module_filter_fn=eligible)


def fp8_pays(in_features: int, out_features: int) -> bool:
    """Whether a linear layer trains faster in FP8 with per-tensor scales. Sizes must be multiples of 16; and
    in torchao's H100 measurements a layer of at most 1,024 outputs from at most 4,096 inputs ran slower than
    in bf16 (its casts and scales cost more than the matmul saves), as the keys' and values' projections of a
    GQA model of this size do."""
    if in_features % 16 or out_features % 16:
        return False
    return not (in_features <= 4096 and out_features <= 1024)


def fp8_layers(model: torch.nn.Module) -> tuple[int, int]:
    """(linear layers computing in FP8, linear layers): what a start report and a model card say of
    --precision fp8."""
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return kinds.count("Float8Linear"), len(kinds)


def inference_dtype(device: torch.device) -> torch.dtype:
    """The dtype generation keeps weights in: bf16 on GPUs that compute it natively, else fp32."""
    return torch.bfloat16 if device.type == "cuda" and cuda_has_native_bf16() else torch.float32


def autocast(device: torch.device, dtype: torch.dtype | None):
    """An autocast context for dtype, or a no-op one for fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def uses_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether a compile mode captures CUDA graphs on this device (it never does off CUDA)."""
    return mode in CUDA_GRAPH_MODES and device.type == "cuda"


def keep_grads(opt):
    """Give every parameter a .grad buffer of its own, which backward then adds into. A CUDA graph's outputs
    live in its memory pool and the next replay overwrites them, so with graphs on, a gradient must never be
    such an output (as it is when backward finds .grad None and keeps what it computed)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


def compile_model(model: torch.nn.Module, mode: str, amp_dtype: torch.dtype | None = None):
    """torch.compile with fixed shapes (auto: the default mode), or the model itself when compiling is off.
    amp_dtype: the autocast dtype the compiled model runs under."""
    if mode == "off":
        return model
    if amp_dtype in (torch.bfloat16, torch.float16) and next(model.parameters()).device.type == "cpu":
        narrow_cpu_vectors()
    # dynamic=False: every batch has the same shape, so one static graph and no recompiles.
    return torch.compile(model, mode=None if mode in ("default", "auto") else mode, dynamic=False)


def narrow_cpu_vectors():
    """Inductor's CPU kernels in 256-bit vectors where it would write 512-bit ones, for the whole process.

    Its 512-bit kernels transpose tiles of 16-bit values 32 x 32 with AVX-512 code that GCC 12 at -O3 (its SLP
    vectorizer) miscompiles: on a Xeon with AMX, under torch 2.13 and 2.14.1, the compiled bf16 step's key
    gradients came out wrong and NaN from the first step (tests/test_device.py holds the case). 256-bit
    kernels transpose in plain code, and the tiny model's step measured no slower with them (0.997x on that
    Xeon)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        width = pick_vec_isa().bit_width()
    except InvalidCxxCompiler:
        return  # no working compiler: the compile itself fails where the trainer reports it
    if inductor_config.cpp.simdlen is None and width == 512:
        inductor_config.cpp.simdlen = 256  # AVX2's width; every AVX-512 processor has AVX2


def _glibc():
    """The process's C library when it is glibc, else None (musl, macOS, Windows: their allocators differ)."""
    try:
        os.confstr("CS_GNU_LIBC_VERSION")  # raises where the C library is not glibc
        return ctypes.CDLL("libc.so.6")
    except (ValueError, OSError, AttributeError):
        return None


def keep_freed_memory():
    """Keep the memory a training step frees for the next step, for the whole process (glibc's malloc only).

    By default glibc returns the blocks of a few MB that a CPU step's activations take to the kernel when they
    are freed, and the next step takes them back as fresh pages the kernel must zero: the tiny preset's step
    made about 70,000 page faults and spent a fifth of its time in the kernel. With no threshold for returning
    memory or mapping it apart, the blocks stay in the heap, ready for the next step: 1.24-1.44x tokens/s on a
    2-core Xeon (tools/bench.py, alternating runs). The process's memory stays at its peak, which each step
    reaches anyway.
    """
    libc = _glibc()
    if libc is None:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers, from glibc's malloc.h
    # blocks up to 1 GiB from the heap, not mapped and unmapped each time
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)  # and the heap's free top kept, not handed back


def release_freed_memory():
    """Hand the kernel the host heap's free pages (glibc's malloc_trim; elsewhere nothing), once setup is
    done: what reading the weights and a reference pass freed would otherwise stay in the process's memory all
    run (glibc keeps freed blocks in the middle of the heap, and on a CPU keep_freed_memory keeps the rest).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def is_compile_failure(e: BaseException) -> bool:
    """Errors raised by the compiler stack itself (no C compiler, unsupported backend), not by our code."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def synchronize(device: torch.device):
    """Wait for the device's queued work (CUDA runs asynchronously; CPU work is already done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_or_stop(e: Exception, t, model: torch.nn.Module, doing: str) -> str:
    """The one rule for a compiler failure: a warning, where compile_fallback allows going on eagerly, or a
    CompileError that stops the run saying how to go on."""
    error = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300]
    if not falls_back(t, next(model.parameters()).device):
        raise CompileError(f"torch.compile failed ({error}) while {doing}; pass --compile "
                           "off to run eagerly (much slower), or --compile_fallback true to "
                           "do so whenever compiling fails") from e
    return f"warning: torch.compile failed ({error}); {doing} eagerly"


def falls_back(t, device: torch.device) -> bool:
    """Whether a compile failure becomes an eager run: asked for, or by default off CUDA (where compiling buys
    less, and a machine without a C compiler should still train); on CUDA eager is a fraction of the speed."""
    return t.compile_fallback == "true" or (t.compile_fallback == "auto" and device.type != "cuda")
