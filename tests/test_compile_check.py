"""The GPU compile check itself runs in CI with a CUDA build of torch (`gpu_check.py --compile_only`); here, what
a contributor with the CPU build meets, and the pieces that need no CUDA."""

import importlib.util

import compile_check
import fake_gpu
import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="this torch has Triton")
def test_without_a_cuda_build_of_torch_it_says_how_to_get_one(capsys):
    assert compile_check.main(["--only", "train-default"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the compile check needs a CUDA build of torch")


def test_every_configuration_names_a_known_gpu_and_the_table_shows_failures():
    assert {gpu for _, gpu in compile_check.CONFIGS.values()} == set(fake_gpu.GPUS)
    rows = [{"name": "train-default", "gpu": "h100", "ok": False, "problems": ["graph break"]}]
    assert "| train-default | NVIDIA H100 80GB HBM3 | FAILED |" in compile_check.table(rows)
    assert compile_check.row_line(rows[0]) == "  FAILED: graph break"


def test_sdpa_backend_names_come_from_the_ops_that_ran():
    ops = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward", "mm"}
    assert compile_check.sdpa_backends(ops) == "cudnn"
    assert compile_check.sdpa_backends({"mm"}) == "none"
