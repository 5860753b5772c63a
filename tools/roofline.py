"""The GPU step costed without a GPU: a roofline estimate of a training step from what Inductor compiled.

compile_check.py installs a Roofline in each configuration's fake-GPU process; its table then gives the step's
time as an estimate (the model's matmuls, its other kernels, the optimizer) and the MFU it implies. It is the
yardstick for a change that claims GPU speed: the estimate moves when kernels, bytes or casts do. It is a
lower bound of the step, never a measurement."""


# The least time one decode kernel took on an NVIDIA H200 (torch 2.11, the large shape at batch 1, one step
# under the profiler, docs/gpu-check.md): 85 matmuls of 1-13 MB took 0.505 ms (5.9 us each, where their bytes
# need about 1 us), 113 other kernels 0.195 ms (1.7 us). The decode estimate holds each kernel to at least
# these. And the step took 0.82 ms where its 198 kernels ran 0.70: inside a CUDA graph each kernel still waits
# about 0.6 us for the one before it. With both, the estimate of the 165-kernel step the H200 later ran in
# 0.64 ms is 0.63 ms.
DECODE_FLOOR_S = {"matmul": 5.9e-6, "other": 1.7e-6}
DECODE_GAP_S = (0.82e-3 - 0.70e-3) / 198
# What the roofline misses, fitted to the `large` step on that H200 (128 x 384 tokens a micro-step; one step
# under the profiler, docs/gpu-check.md): its matmuls took 167 ms a micro-step where the roofline counts 103
# (0.62 of the datasheet's peak), its other kernels 56 ms where it counts 32.9 (0.59 of the bandwidth), its
# optimizer 35 ms where it counts 18. The calibrated estimate divides by these; `small`, left out of the fit,
# lands within 8%.
MATMUL_EFFICIENCY, BANDWIDTH_EFFICIENCY, OPTIMIZER_FACTOR = 0.62, 0.59, 2.0


def moved_bytes(node) -> int:
    """The bytes one kernel (a scheduler node) reads and writes. Inductor counts what a single node's ranges
    can reach in each buffer, but every buffer of a fused kernel whole: a decode step's embedding lookup,
    fused into the first norm, read the whole table (94 MiB for one row). Here a fused kernel's buffer counts
    what its parts reach, a buffer two parts share once; buffers that never leave the kernel count nothing, as
    before."""
    parts = getattr(node, "snodes", None)
    whole = node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    if not parts:
        return sum(whole.values())
    reach = {}
    for part in parts:
        for name, n in part.get_read_write_buffer_accesses(include_reads=True, include_writes=True).items():
            reach[name] = max(reach.get(name, 0), n)
    return sum(min(n, reach.get(name, n)) for name, n in whole.items())


class Roofline:
    """An estimate of one training step's time on the GPU, from what Inductor compiled (no kernel runs here):
    each node of each compiled graph (a Triton kernel, or a cuBLAS call) at max(its FLOPs at the GPU's dense
    peak for its operand type, its bytes read and written at the memory bandwidth), times the calls a step
    makes of that graph; plus the optimizer's eager kernels (fused AdamW, Muon's foreach updates), which no
    graph holds, by the bytes they move. A lower bound of the step: no launch gaps, no kernel below its
    roofline."""

    def __init__(self, gpu):
        self.tflops, self.bandwidth = gpu.tflops, gpu.mem_clock_khz * 1e3 * 2 * gpu.bus_bits / 8
        self.graphs = {}  # id(compiled graph) -> (seconds in matmul nodes, in the others, FLOPs) of one call
        # (id(graph), called by the optimizer) -> calls in the counted step
        self.calls, self.counting = {}, False
        self.optimizer_s, self.in_optimizer, self.in_ns = 0.0, False, False
        self.missing = []  # why a graph could not be costed

    def install(self):
        """Cost every graph Inductor compiles from here on, and count the calls made while counting is on."""
        from torch._inductor.output_code import CompiledFxGraph
        roof, init, call = self, CompiledFxGraph.__init__, CompiledFxGraph.__call__

        def costed_init(graph_obj, current_callable, graph, *args, **kwargs):
            init(graph_obj, current_callable, graph, *args, **kwargs)
            try:
                roof.graphs[id(graph_obj)] = roof.cost(graph)
            # an estimate never fails a compile: the step's estimate says it is missing
            except Exception as e:
                roof.missing.append(f"{type(e).__name__}: {e}"[:200])

        def counted_call(graph_obj, inputs):
            if roof.counting:  # the optimizer's graphs (Newton-Schulz) apart from the model's
                key = (id(graph_obj), roof.in_optimizer)
                roof.calls[key] = roof.calls.get(key, 0) + 1
            return call(graph_obj, inputs)
        CompiledFxGraph.__init__, CompiledFxGraph.__call__ = costed_init, counted_call

    def peak(self, dtype, scaled: bool) -> float:
        import torch
        kind = "fp8" if scaled else {torch.bfloat16: "bf16", torch.float16: "bf16",
                                     torch.float32: "tf32"}.get(dtype, "fp32")
        return self.tflops[kind] * 1e12

    def cost(self, graph) -> tuple[float, float, float, list]:
        """(seconds in matmul nodes, seconds in the others, FLOPs, [(seconds, is a matmul) of each kernel]) of
        one call of a compiled graph."""
        matmul = other = flops = 0.0
        kernels = []  # (seconds, is a matmul) of each kernel: each scheduler node is one launch
        for node in graph.scheduler.nodes:
            moved = moved_bytes(node) / self.bandwidth
            try:
                f = float(node.estimate_flops() or 0)
            except Exception:  # a node Inductor cannot count (a template, a view): its bytes alone
                f = 0.0
            if not f:
                other += moved
                kernels.append((moved, False))
                continue
            # a fused node (a GEMM template and its epilogue) has none
            inner = node.node or node.get_nodes()[0].node
            kernel = getattr(inner, "python_kernel_name", "") or ""
            seconds = max(f / self.peak(inner.get_dtype(), "scaled_mm" in kernel), moved)
            matmul += seconds
            flops += f
            kernels.append((seconds, True))
        return matmul, other, flops, kernels

    def eager_mode(self):
        """A dispatch mode adding the bytes of the optimizer's eager kernels (outside Newton-Schulz, which is
        compiled on a GPU and costed as a graph) to the optimizer's share, for the step run under it."""
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        roof = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if roof.in_optimizer and not roof.in_ns:
                    moved = sum(t.nbytes for t in tree_leaves((args, kwargs, out))
                                if isinstance(t, torch.Tensor) and t.device.type == "cuda")
                    roof.optimizer_s += moved / roof.bandwidth
                return out
        return Mode()

    def watch_optimizer(self, opt):
        """Mark when opt.step runs, and when inside it Newton-Schulz does."""
        roof, step = self, opt.step

        def marked(fn, flag):
            def run(*args, **kwargs):
                setattr(roof, flag, True)
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(roof, flag, False)
            return run
        opt.step = marked(step, "in_optimizer")
        for part in getattr(opt, "optimizers", []):
            if hasattr(part, "_zeropower"):
                part._zeropower = marked(part._zeropower, "in_ns")

    def decode_step(self) -> dict:
        """The counted calls as one decode step: its kernels, their roofline (bytes or FLOPs alone), and an
        estimate with each kernel held to the least time such a kernel took on a GPU (DECODE_FLOOR_S), plus
        the wait between kernels (DECODE_GAP_S). Inside a CUDA graph launches cost little; small kernels still
        cost their ramp-up and that wait, which is what bounds decode."""
        kernels = [k for (g, _), n in self.calls.items() if g in self.graphs for _ in range(n)
                   for k in self.graphs[g][3]]
        floor = lambda s, mm: max(s, DECODE_FLOOR_S["matmul" if mm else "other"])  # noqa: E731
        return {"decode_kernels": len(kernels), "decode_matmuls": sum(mm for _, mm in kernels),
                "decode_roofline_us": 1e6 * sum(s for s, _ in kernels),
                "decode_estimate_us": 1e6 * (sum(floor(s, mm) for s, mm in kernels)
                                             + len(kernels) * DECODE_GAP_S)}

    def step(self, tokens: int) -> dict:
        """The estimate of one step from the counts: milliseconds of the model's matmuls, of its other
        kernels, of the optimizer (its graphs and its eager kernels), and the MFU it implies: the model's
        FLOPs (as Inductor counts them, attention included; a frozen base computes no weight gradients) at the
        bf16 peak."""
        def seconds(part: int, optimizer: bool) -> float:
            return sum(self.graphs[g][part] * n for (g, opt), n in self.calls.items()
                       if opt == optimizer and g in self.graphs)
        matmul, other, model_flops = seconds(0, False), seconds(1, False), seconds(2, False)
        optimizer = self.optimizer_s + seconds(0, True) + seconds(1, True)
        total = matmul + other + optimizer
        if self.missing:  # a graph left out would make the estimate look faster than it is
            return {"roofline_ms": None, "roofline_missing": self.missing[0]}
        forward_backward = matmul / MATMUL_EFFICIENCY + other / BANDWIDTH_EFFICIENCY
        calibrated = forward_backward + optimizer * OPTIMIZER_FACTOR
        return {"roofline_ms": 1e3 * total, "roofline_matmul_ms": 1e3 * matmul,
                "roofline_other_ms": 1e3 * other, "roofline_optimizer_ms": 1e3 * optimizer,
                "calibrated_ms": 1e3 * calibrated, "calibrated_forward_backward_ms": 1e3 * forward_backward,
                "calibrated_mfu": (model_flops / calibrated / (self.tflops["bf16"] * 1e12)
                                   if calibrated else None),
                "roofline_mfu": model_flops / total / (self.tflops["bf16"] * 1e12) if total else None,
                "roofline_tokens_per_s": tokens / total if total else None}
