"""Tests of device.py: the precision chosen for each kind of hardware, decided with the hardware stubbed."""

import pytest
import torch

import device
from config import ConfigError


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
