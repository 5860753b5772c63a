"""The GPU compile check itself runs in CI with a CUDA build of torch (`gpu_check.py --compile_only`); here,
what a contributor with the CPU build meets, and the pieces that need no CUDA."""

import importlib.util

import compile_check
import compile_workloads
import fake_gpu
import pytest
import roofline


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="this torch has Triton")
def test_without_a_cuda_build_of_torch_it_says_how_to_get_one(capsys):
    assert compile_check.main(["--only", "train-default"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the compile check needs a CUDA build of torch")


def test_the_fake_gpus_bf16_peaks_are_the_ones_sizing_plans_with():
    """One peak table (sizing.PEAK_TFLOPS) plans a run and reports its MFU; the fake GPUs the roofline costs a
    step on name theirs by operand type, and their bf16 figure must be the same number."""
    from llm.base.sizing import gpu_peak_flops
    assert {name: gpu.tflops["bf16"] * 1e12 for name, gpu in fake_gpu.GPUS.items()} == \
        {name: gpu_peak_flops(gpu.name) for name, gpu in fake_gpu.GPUS.items()}


def test_every_configuration_names_a_known_gpu_and_the_table_shows_failures():
    assert {gpu for _, gpu in compile_check.CONFIGS.values()} == set(fake_gpu.GPUS)
    rows = [{"name": "train-default", "gpu": "h100", "ok": False, "problems": ["graph break"]}]
    assert "| train-default | NVIDIA H100 80GB HBM3 | FAILED |" in compile_check.table(rows)
    assert compile_check.row_line(rows[0]) == "  FAILED: graph break"


def test_sdpa_backend_names_come_from_the_ops_that_ran():
    ops = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward", "mm"}
    assert compile_workloads.sdpa_backends(ops) == "cudnn"
    assert compile_workloads.sdpa_backends({"mm"}) == "none"


@pytest.mark.slow
def test_the_roofline_costs_kernels_by_hand_counts(monkeypatch):
    """The step estimate's arithmetic against counts made by hand: a matmul of known shape at max(its FLOPs at
    the peak, its bytes at the bandwidth), called twice; an element-wise kernel at its bytes (one read, one
    write), called once. Inductor compiles them for the CPU here; the nodes and their counts are the same
    kinds."""
    import torch
    from torch._inductor.output_code import CompiledFxGraph
    for name in ("__init__", "__call__"):  # install() replaces them: put them back after the test
        monkeypatch.setattr(CompiledFxGraph, name, getattr(CompiledFxGraph, name))
    torch._dynamo.reset()
    gpu = fake_gpu.GPUS["h100"]
    roof = roofline.Roofline(gpu)
    roof.install()
    m, k, n = 256, 512, 1024
    a, b = torch.randn(m, k), torch.randn(k, n)
    matmul, scale = torch.compile(lambda x, y: x @ y), torch.compile(lambda x: x * 2 + 1)
    roof.counting = True
    with torch._inductor.config.patch(fx_graph_cache=False):  # compiled here, not read from a cache
        matmul(a, b)
        matmul(a, b)
        scale(a)
    roof.counting = False
    torch._dynamo.reset()  # the graphs compiled here were costed by the patched class: none is kept
    estimate = roof.step(tokens=m)
    bandwidth = gpu.mem_clock_khz * 1e3 * 2 * gpu.bus_bits / 8  # 3.35 TB/s, the H100's datasheet figure
    assert 3.3e12 < bandwidth < 3.4e12
    one_matmul = max(2 * m * k * n / (gpu.tflops["tf32"] * 1e12), 4 * (m * k + k * n + m * n) / bandwidth)
    assert estimate["roofline_matmul_ms"] == pytest.approx(2e3 * one_matmul, rel=1e-6)
    assert estimate["roofline_other_ms"] == pytest.approx(1e3 * 2 * 4 * m * k / bandwidth, rel=1e-6)
    assert estimate["roofline_mfu"] == pytest.approx(
        2 * 2 * m * k * n / (estimate["roofline_ms"] / 1e3) / (gpu.tflops["bf16"] * 1e12), rel=1e-6)
    # Calibrated: each part divided by the efficiency the roofline fitted to a measured H200 step (read from
    # the module, never copied), then again with other efficiencies, so that the figures must come from them.
    matmul_s, other_s = 2 * one_matmul, 2 * 4 * m * k / bandwidth
    for efficiencies in ((roofline.MATMUL_EFFICIENCY, roofline.BANDWIDTH_EFFICIENCY), (0.5, 0.25), (0.25, 0.5)):
        monkeypatch.setattr(roofline, "MATMUL_EFFICIENCY", efficiencies[0])
        monkeypatch.setattr(roofline, "BANDWIDTH_EFFICIENCY", efficiencies[1])
        assert roof.step(tokens=m)["calibrated_ms"] == pytest.approx(
            1e3 * (matmul_s / efficiencies[0] + other_s / efficiencies[1]), rel=1e-6)
    # As a decode step: three launches, each held to the least time a kernel of its kind took
    # (DECODE_FLOOR_S), each after the wait between kernels (DECODE_GAP_S): the module's figures, floors above
    # every kernel here, and none.
    floors = [(roofline.DECODE_FLOOR_S, roofline.DECODE_GAP_S), ({"matmul": 1e-3, "other": 2e-3}, 1e-4),
              ({"matmul": 0.0, "other": 0.0}, 0.0)]
    for floor, gap in floors:
        monkeypatch.setattr(roofline, "DECODE_FLOOR_S", floor)
        monkeypatch.setattr(roofline, "DECODE_GAP_S", gap)
        step = roof.decode_step()
        assert (step["decode_kernels"], step["decode_matmuls"]) == (3, 2)
        assert step["decode_roofline_us"] == pytest.approx(1e6 * (matmul_s + other_s), rel=1e-6)
        assert step["decode_estimate_us"] == pytest.approx(
            1e6 * (2 * max(one_matmul, floor["matmul"]) + max(other_s, floor["other"]) + 3 * gap), rel=1e-6)
    assert step["decode_estimate_us"] == pytest.approx(step["decode_roofline_us"], rel=1e-6)  # no floor, no wait


def test_a_fused_kernel_that_gathers_rows_moves_the_rows_not_the_table(monkeypatch):
    """A decode step's embedding lookup fused into its first norm: Inductor counts every buffer of a fused
    kernel whole, so a lookup of two rows read the whole table. The roofline counts what the kernel's parts
    reach, by hand: the two ids, two rows, the weight, two sums and two maxima."""
    import torch
    from torch._inductor.output_code import CompiledFxGraph
    monkeypatch.setattr(CompiledFxGraph, "__init__", CompiledFxGraph.__init__)
    init, kernels = CompiledFxGraph.__init__, []

    def kept(graph_obj, current_callable, graph, *args, **kwargs):
        init(graph_obj, current_callable, graph, *args, **kwargs)
        kernels.extend((type(n).__name__, n.get_read_write_buffers_sizes(), roofline.moved_bytes(n))
                       for n in graph.scheduler.nodes)
    CompiledFxGraph.__init__ = kept
    torch._dynamo.reset()
    table, w, ids = torch.randn(4096, 256), torch.randn(256), torch.tensor([7, 9])
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(lambda ids, t, w: (t[ids].sum(-1), (t[ids] * w).amax(-1)))(ids, table, w)
    torch._dynamo.reset()
    [(kind, inductors, ours)] = kernels
    assert kind == "FusedSchedulerNode" and inductors > table.nbytes  # the whole table, as Inductor counts it
    assert ours == ids.nbytes + 2 * 256 * 4 + w.nbytes + 2 * 2 * 4


def test_inductor_settings_are_typed_and_an_unknown_one_is_one_line():
    """--inductor NAME=VALUE (the decode leads' settings, compiled without a GPU): booleans and numbers typed
    as Inductor's config holds them, and a misspelt name refused with exit 2, never compiled without it."""
    assert compile_check.inductor_settings(["coordinate_descent_tuning=True", "combo_kernels=False",
                                            "max_autotune_gemm_backends=TRITON", "compile_threads=4"]) == {
        "coordinate_descent_tuning": True, "combo_kernels": False, "max_autotune_gemm_backends": "TRITON",
        "compile_threads": 4}
    with pytest.raises(SystemExit) as stopped:
        compile_check.main(["--inductor", "cordinate_descent_tuning=True"])
    assert stopped.value.code == 2


def test_the_h200_stand_in_has_the_datasheets_bandwidth_and_memory():
    gpu = fake_gpu.GPUS["h200"]
    assert gpu.mem_clock_khz * 1e3 * 2 * gpu.bus_bits / 8 == pytest.approx(4.8e12, rel=1e-3)
    assert gpu.memory == 143_771 * 2**20  # what nvidia-smi reported on the lent H200
