"""Tests of device.py: the precision chosen for each kind of hardware, decided with the hardware stubbed."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from llm.base import device
from llm.base.errors import ConfigError


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float16)], ids=["A100", "V100"])
def test_automatic_precision_on_gpus_with_and_without_native_bf16(monkeypatch, native, expected):
    """GPUs without bf16 tensor cores (V100, T4, RTX 20xx) must train in fp16 with loss scaling: torch reports
    bf16 as supported there through emulation, which is several times slower."""
    asked = {}

    def is_bf16_supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return native or including_emulation  # what torch answers on each kind of GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert device.pick_precision("auto", torch.device("cuda", 0)) == expected
    assert asked == {"including_emulation": False}
    assert device.inference_dtype(torch.device("cuda", 0)) == (torch.bfloat16 if native else torch.float32)


def test_automatic_precision_on_cpus(monkeypatch):
    """CPUs use bf16 only where the processor computes it natively; fp16 is refused off CUDA."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.pick_precision("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.pick_precision("auto", cpu) is None and device.pick_precision("bf16", cpu) == torch.bfloat16
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        device.pick_precision("fp16", cpu)


def test_a_device_that_is_not_there_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device=cuda is not available"):
        device.pick_device("cuda")
    assert device.pick_device("auto").type in ("cpu", "mps")


def test_fp8_is_refused_without_fp8_tensor_cores(monkeypatch):
    """--precision fp8 needs Ada/Hopper tensor cores; anywhere else one line says so (and what to use)."""
    with pytest.raises(ConfigError, match="precision=fp8 needs a GPU with FP8 "
                                          "tensor cores.*found cpu.*use bf16"):
        device.pick_precision("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))  # an A100
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="found NVIDIA A100"):
        device.pick_precision("fp8", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # an H100
    assert device.pick_precision("fp8", torch.device("cuda", 0)) == torch.bfloat16


def test_float8_conversion_keeps_names_and_converts_the_layers_whose_shape_pays(tiny_config):
    """The FP8 conversion swaps the blocks' linear layers only, and every parameter keeps its name, so
    checkpoints, the optimizer's split and exports are unchanged. At the large preset's width the keys' and
    values' projections (1,536 -> 384) stay bf16: FP8's casts cost them more than its matmul saves."""
    pytest.importorskip("torchao")
    from config import PRESETS
    from modern_llm import Transformer
    with torch.device("meta"):
        model = Transformer(replace(PRESETS["large"]().model, num_hidden_layers=2, vocab_size=4096))
    names = [n for n, _ in model.named_parameters()]
    device.float8_training(model)
    assert [n for n, _ in model.named_parameters()] == names
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {n.split(".")[-1] for n, k in kinds.items() if k == "Float8Linear"} == {"q_proj", "o_proj", "gate_proj",
                                                                                   "up_proj", "down_proj"}
    assert kinds["layers.1.attn.k_proj"] == kinds["layers.1.attn.v_proj"] == kinds["lm_head"] == "Linear"
    assert device.precision_label("fp8", torch.bfloat16, model) == "fp8 in 10 of 15 linear layers + bf16 autocast"
    tiny = Transformer(tiny_config())  # 192 wide: no layer pays, and the start report says so
    device.float8_training(tiny)
    assert device.fp8_layers(tiny)[0] == 0


def test_fp8_pays_where_torchaos_own_shape_filter_says_it_does():
    """The shape rule against torchao's filter for its per-tensor recipe, over the shapes of every preset and
    around the thresholds (a private torchao function: skipped where a release lacks it)."""
    torchao_float8 = pytest.importorskip("torchao.float8")
    reference = getattr(torchao_float8, "_auto_filter_for_recipe", None)
    if reference is None:
        pytest.skip("this torchao has no _auto_filter_for_recipe")
    pays = reference("tensorwise", filter_fqns=[])
    sizes = (192, 256, 384, 768, 1000, 1024, 1040, 1536, 2048, 2816, 4096, 4112, 5632, 8192)
    for k in sizes:
        for n in sizes:
            assert device.fp8_pays(k, n) == pays(torch.nn.Linear(k, n, device="meta"), "layers.0.mlp"), (k, n)


def test_the_trainer_takes_the_generators_auto_compile_word_as_default():
    """Training and generation share one --compile vocabulary; auto reached torch.compile as a mode it does
    not know (RuntimeError). For training it is the default mode; no CUDA graphs, so no step markers."""
    from llm.base.cli import parse_config
    assert parse_config(["--compile", "auto"])[0].train.compile == "auto"
    model = torch.nn.Linear(2, 2)
    assert device.compile_model(model, "auto") is not model and device.compile_model(model, "off") is model
    assert not device.uses_cuda_graphs("auto", torch.device("cuda"))


def test_tf32_is_set_through_the_api_inductor_reads():
    """Setting TF32 through the per-backend fp32_precision made torch.get_float32_matmul_precision() raise "a
    mix of the legacy and new APIs", and Inductor's GEMM autotuning reads it: --compile max-autotune failed on
    the first matmul and the run trained eagerly. After enable_tf32 both readers answer, and agree on TF32."""
    before = torch.get_float32_matmul_precision()
    try:
        device.enable_tf32()
        assert torch.get_float32_matmul_precision() == "high"  # raised before the fix
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_deterministic_mode_switches_off_cudnn_attention_and_non_deterministic_kernels(monkeypatch):
    """On Hopper SDPA picks cuDNN attention, whose backward is not bit-deterministic: --deterministic true
    must take it out of the choice and make torch refuse any other non-deterministic kernel."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cuda.cudnn_sdp_enabled(), torch._inductor.config.deterministic)
    try:
        device.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch._inductor.config.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic = before[1]
        torch.backends.cuda.enable_cudnn_sdp(before[2])
        torch._inductor.config.deterministic = before[3]


def test_a_compiled_bf16_step_on_a_cpu_has_the_gradients_of_float64():
    """On a Xeon with AMX (torch 2.13 and 2.14.1, GCC 12), Inductor's 512-bit kernels got a transposed tile of
    bf16 gradients wrong in the backward of the written-out attention: every run of the default command
    stopped on NaN at its first steps. compile_model narrows the CPU's vectors for 16-bit compiles; the
    compiled step's gradients must be float64's to within bf16's rounding, on whatever processor runs the
    tests."""
    from config import ModelConfig
    from modern_llm import Execution, Transformer
    cfg = ModelConfig(vocab_size=256, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_seq_len=64)
    torch.manual_seed(0)
    model, reference = Transformer(cfg), Transformer(cfg).double()
    reference.load_state_dict(model.state_dict())
    model.execution = Execution(matmul_softmax=True)  # as the trainer runs a compiled CPU step of windows this short
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.autocast("cpu", torch.bfloat16):
        device.compile_model(model, "default", torch.bfloat16)(x, labels=y)[1].backward()
    reference(x, labels=y)[1].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        error = (p.grad.double() - q.grad).norm() / q.grad.norm()
        assert error < 0.05, f"{name}: relative error {error:.3g} of its gradient"


def test_memory_a_step_frees_is_kept_for_the_next_one():
    """glibc handed buffers past 32 MB (the tiny step's logits are 67 MB) back to the kernel when they were
    freed, and the next step faulted them in again as zeroed pages: a fifth of a CPU step went to the kernel.
    With keep_freed_memory, once the heap has settled, the next allocation of that size reuses the memory
    without a page fault."""
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        pytest.skip("the C library is not glibc")
    script = ("import resource, sys, torch\n"
              "from llm.base.device import keep_freed_memory\n"
              "if sys.argv[1] == 'kept':\n"
              "    keep_freed_memory()\n"
              "for _ in range(5):\n"  # the heap settles over the first few
              "    torch.ones(16 << 20)\n"  # 64 MB, freed at once
              "for _ in range(10):\n"
              "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
              "    torch.ones(16 << 20)\n"
              "    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def median_faults(mode: str) -> int:
        """The page faults of a typical allocation: the median, since the heap may still grow once (one
        machine faulted a whole 64 MB block again in one of the ten)."""
        out = subprocess.run([sys.executable, "-c", script, mode], cwd=root, capture_output=True, text=True,
                             check=True)
        return sorted(int(n) for n in out.stdout.split())[5]
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert median_faults("default") > pages // 2  # each 64 MB fresh from the kernel
    assert median_faults("kept") < pages // 100
