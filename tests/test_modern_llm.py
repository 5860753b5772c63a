"""Tests of the model: attention against written-out references, cache, RoPE, counts, learning."""

import math
import os
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import config
from safetensors.torch import load_file

from llm.base.sizing import count_parameters
from llm.generate.inference import RowProductLinear, load_for_inference
from llm.train.runner import new_model
from llm.base.attention import causal_attention
from modern_llm import Execution, Transformer, apply_rope, cross_entropy, is_stored, rope_tables


@pytest.fixture(scope="module")
def tiny(tiny_config):
    """The tiny model with a vocabulary (97) and context (32) of their own, so shapes cannot be confused."""
    return lambda **kw: tiny_config(**{"vocab_size": 97, "max_seq_len": 32, **kw})


def model_of(cfg, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def test_causality(tiny):
    """Changing token t must never change the logits before t (a leak makes training meaningless)."""
    m = model_of(tiny())
    ids = torch.randint(0, 97, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 97
    a, _ = m(ids)
    b, _ = m(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def naive_attention_logits(m: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The whole forward pass in float64 with explicit softmax attention and repeated K/V heads."""
    cfg = m.config
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B, T = ids.shape
    p = {k: v.double() for k, v in m.state_dict().items()}

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(pos, inv)

    def rope(x):  # rotate channel pairs (i, i + hd/2) by angle pos * inv_freq[i]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        c, s = ang.cos(), ang.sin()
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    x = p["embed_tokens.weight"][ids]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        h = rms(x, p[pre + "input_layernorm.weight"])
        q = (h @ p[pre + "attn.q_proj.weight"].T).view(B, T, H, hd)
        k = (h @ p[pre + "attn.k_proj.weight"].T).view(B, T, Hkv, hd)
        v = (h @ p[pre + "attn.v_proj.weight"].T).view(B, T, Hkv, hd)
        if cfg.qk_norm:
            q, k = rms(q, p[pre + "attn.q_norm.weight"]), rms(k, p[pre + "attn.k_norm.weight"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, H * hd)
        x = x + y @ p[pre + "attn.o_proj.weight"].T
        h = rms(x, p[pre + "post_attention_layernorm.weight"])
        gate, up = h @ p[pre + "mlp.gate_proj.weight"].T, h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    head = p.get("lm_head.weight", p["embed_tokens.weight"])
    return rms(x, p["norm.weight"]) @ head.T


@pytest.mark.parametrize("matmul_softmax", [False, True])
@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(4, 4, True), (4, 2, True), (4, 1, True), (4, 2, False)])
def test_attention_matches_float64_reference(heads, kv_heads, qk_norm, matmul_softmax, tiny):
    """SDPA with grouped heads, and attention written out as the compiled CPU step runs it, must equal plain
    multi-head attention (MHA, GQA, MQA; with and without QK-norm)."""
    m = model_of(tiny(num_attention_heads=heads, num_key_value_heads=kv_heads, qk_norm=qk_norm))
    m.execution = Execution(matmul_softmax=matmul_softmax)
    ids = torch.randint(0, 97, (2, 16))
    ours, _ = m(ids)
    ref = naive_attention_logits(m, ids)
    assert torch.allclose(ours.double(), ref, atol=2e-5, rtol=1e-4), (ours.double() - ref).abs().max()


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_written_out_attention_compiled_has_the_kernels_values_and_gradients(kv_heads):
    """The compiled CPU step writes short causal attention out as two matmuls and a softmax (twice as fast as
    the CPU's flash kernel there): compiled, in float64, its output and the gradients of q, k and v are
    SDPA's."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 24, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 3, 24, 8, dtype=torch.float64)
    gqa = kv_heads != 3
    results = []
    for f, on in ((causal_attention, False), (torch.compile(causal_attention, fullgraph=True), True)):
        out = f(q, k, v, gqa, on)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    torch._dynamo.reset()
    for kernel, written in zip(*results):
        assert torch.allclose(kernel, written, atol=1e-12), (kernel - written).abs().max()


def test_kv_cache_decode_matches_full_forward_for_ragged_batch(tiny):
    """Prefill of right-padded prompts then one-token steps must give the full forward's logits per row."""
    m = model_of(tiny())
    ids = torch.randint(0, 97, (3, 14))
    full, _ = m(ids)
    lengths = torch.tensor([9, 5, 2])
    cache = m.make_kv_cache(3)
    padded = ids[:, :9].clone()
    for row, n in enumerate(lengths.tolist()):
        padded[row, n:] = 0  # garbage padding that must never be attended to
    logits, _ = m(padded, kv_cache=cache, input_lengths=lengths)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(logits[row, :n], full[row, :n], atol=1e-5, rtol=1e-5)
    assert cache.pos.tolist() == lengths.tolist()
    for step in range(5):  # every row continues with its own next true token
        nxt = ids[torch.arange(3), lengths + step][:, None]
        logits, _ = m(nxt, kv_cache=cache)
        torch.testing.assert_close(logits[:, 0], full[torch.arange(3), lengths + step], atol=1e-5, rtol=1e-5)
    assert cache.pos.tolist() == (lengths + 5).tolist()


def test_compiled_linear_of_few_rows_on_cpu_multiplies_and_sums():
    """Compiled on a CPU, up to REDUCE_ROWS rows become a multiply and a sum (the fast decode), more rows and
    autocast regions keep F.linear; either way the result is the float64 product's."""
    torch.manual_seed(0)
    lin = RowProductLinear(48, 80, bias=False)

    def ops_of(x, autocast=False):
        graph = []
        record = lambda gm, inputs: (graph.extend(str(n.target) for n in gm.graph.nodes), gm.forward)[1]  # noqa: E731
        torch._dynamo.reset()
        with torch.no_grad(), torch.autocast("cpu", enabled=autocast):
            out = torch.compile(lin, backend=record, fullgraph=True)(x)
        if not autocast:
            assert torch.allclose(out.double(), x.double() @ lin.weight.double().T, atol=1e-5)
        return graph

    assert "sum" in ops_of(torch.randn(1, 1, 48)) and "sum" in ops_of(torch.randn(RowProductLinear.REDUCE_ROWS, 48))
    for graph in (ops_of(torch.randn(2, RowProductLinear.REDUCE_ROWS, 48)), ops_of(torch.randn(1, 48), autocast=True)):
        assert "sum" not in graph and any("linear" in op for op in graph)
    x = torch.randn(3, 48)
    assert torch.allclose(torch.compile(lin)(x).double(), x.double() @ lin.weight.double().T, atol=1e-5)
    torch._dynamo.reset()


def test_the_model_is_plain_and_inference_preparation_swaps_in_the_decode_path(tiny_config):
    """The model once branched on compile state, the device, autocast and torchao's int8 layout in its own
    Linear; it is plain nn.Linear now. Generation once retyped a caller's layers on its first compiled CPU
    call; now for_inference swaps in RowProductLinear (new modules holding the same parameters, the tied head
    still tied) only where the decode step will compile on a CPU, and generate() changes no model."""
    from config import SampleConfig
    from llm.generate.decode_compile import use_compile
    from llm.generate.engine import generate
    from llm.generate.inference import for_inference
    source = open(Transformer.__module__ + ".py", encoding="utf-8").read()
    assert "is_compiling" not in source and "Int8Tensor" not in source
    linears = lambda m: {type(x) for x in m.modules() if isinstance(x, torch.nn.Linear)}  # noqa: E731
    torch.manual_seed(0)
    plain = Transformer(tiny_config(vocab_size=64))
    swapped = Transformer(tiny_config(vocab_size=64))
    swapped.load_state_dict(plain.state_dict())
    plain = for_inference(plain, torch.device("cpu"), compile="off")
    swapped = for_inference(swapped, torch.device("cpu"), compile="default")
    assert linears(plain) == {torch.nn.Linear} and linears(swapped) == {RowProductLinear}
    assert swapped.lm_head.weight is swapped.embed_tokens.weight
    prompts = [[1, 2, 3]]
    greedy = SampleConfig(max_new_tokens=4, temperature=0)
    eager = generate(plain, prompts, greedy)
    assert use_compile(plain, "default")  # the engine alone set to compile it, for_inference not asked again
    compiled = generate(plain, prompts, greedy)
    assert linears(plain) == {torch.nn.Linear}  # generating compiled left the caller's model as it was
    on_swapped = generate(swapped, prompts, greedy)
    assert on_swapped == compiled == eager
    torch._dynamo.reset()


def test_qk_norm_under_autocast_takes_the_fused_kernel(tiny_config):
    """Queries and keys reach their RMSNorm in bf16 under autocast; with a float32 weight F.rms_norm fell back
    to its unfused path and warned "Mismatch dtype" on every run. The norm matches a float64 reference."""
    from modern_llm import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(4, 16).bfloat16()
    out = norm(x)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), ref, rtol=2e-2, atol=1e-2)
    model = Transformer(tiny_config(vocab_size=64))  # 2 layers: 4 norms each with QK-norm, and the final one
    with torch.profiler.profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
    assert [e.name for e in prof.events()].count("aten::_fused_rms_norm") == 9


def test_a_bf16_residual_stream_where_the_trainer_asks_for_it(tiny_config):
    """The embedding's float32 output made every residual add and norm float32 under autocast: twice the bytes
    of each of those kernels and their gradients (the compile check's roofline for `small` on an H200: forward
    and backward 62.8 ms a micro-step, 57.7 ms with the stream in bf16). With Execution.stream_dtype set (the
    trainer sets it on a GPU under bf16) the blocks take and give bf16 and the embedding's weight still gets
    its float32 gradient; unset (a CPU run, where it saved no time and learned a little less) the stream stays
    float32."""
    from llm.base.distributed import setup
    from llm.train.plan import step_settings
    from llm.train.runner import build
    torch.manual_seed(0)
    model, ids = Transformer(tiny_config(vocab_size=64)), torch.randint(0, 64, (2, 16))
    seen = []
    for block in model.layers:
        block.register_forward_hook(lambda m, inputs, out: seen.append((inputs[0].dtype, out.dtype)))

    def stream(dtype):
        seen.clear()
        model.execution = Execution(stream_dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(ids, labels=ids)
        loss.backward()
        return set(seen)
    assert stream(torch.bfloat16) == {(torch.bfloat16, torch.bfloat16)}
    grad = model.embed_tokens.weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
    assert stream(None) == {(torch.float32, torch.float32)}
    cfg = config.PRESETS["tiny"]()
    cfg.train.precision = "bf16"
    assert build(cfg, step_settings(cfg, torch.device("cpu")), torch.device("cpu"), setup()).raw_model.execution.stream_dtype is None


def test_compiled_int8_linear_of_one_row_on_cpu_is_the_dequantized_product():
    """torchao's int8 weight (as --quantize int8 stores it) takes the multiply-and-sum path too, reading the
    int8 values and scales in one pass; the result is the float64 product with the dequantized weight, as
    torchao's is."""
    from llm.generate.inference import quantize_int8
    torch.manual_seed(0)
    lin = quantize_int8(torch.nn.Sequential(RowProductLinear(64, 40, bias=False)))[0]
    x = torch.randn(1, 64)
    reference = x.double() @ lin.weight.dequantize().double().T
    torch._dynamo.reset()
    with torch.no_grad():
        compiled, eager = torch.compile(lin)(x), lin(x)
    assert torch.allclose(compiled.double(), reference, atol=1e-4) and torch.allclose(eager.double(), reference,
                                                                                      atol=1e-2)
    code = torch._inductor.utils.run_and_get_code(torch.compile(lin), x)[1]
    assert "int8_t" in " ".join(code) and "extern_kernels.mm" not in " ".join(code)  # not: dequantize, then BLAS
    torch._dynamo.reset()


def test_rope_scores_depend_on_relative_position_only():
    """Shifting query and key positions together must leave q.k unchanged (the point of RoPE)."""
    hd = 16
    cos, sin = rope_tables(hd, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, hd, dtype=torch.float64), torch.randn(1, 1, 1, hd, dtype=torch.float64)

    def score(pq, pk):
        return (apply_rope(q, cos[pq].double(), sin[pq].double()) * apply_rope(k, cos[pk].double(),
                                                                               sin[pk].double())).sum()
    base = score(5, 2)
    for shift in (1, 7, 40):
        assert torch.allclose(score(5 + shift, 2 + shift), base, atol=1e-5)
    assert not torch.allclose(score(9, 2), base, atol=1e-3)


def test_activation_checkpointing_gives_same_gradients(tiny):
    """Recomputing activations in backward must not change any gradient."""
    ids = torch.randint(0, 97, (2, 16))
    grads = []
    for ckpt in (False, True):
        m = model_of(tiny(gradient_checkpointing=ckpt)).train()
        _, loss = m(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_tied_embeddings_are_one_tensor_and_untie_flag_works(tiny):
    """A tied head must be the embedding itself, also after re-initialisation; the flag unties."""
    m = model_of(tiny())
    assert m.lm_head.weight is m.embed_tokens.weight
    m.init_weights()
    assert m.lm_head.weight is m.embed_tokens.weight
    untied = model_of(tiny(tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert untied.num_parameters() == m.num_parameters() + 97 * 64


@pytest.mark.parametrize("change", [{}, {"tie_word_embeddings": False, "qk_norm": False, "qkv_bias": True}])
def test_a_new_run_draws_its_weights_once_as_init_weights_documents(tiny, change):
    """new_model builds on meta and draws once, after seeding: its weights must be, to the bit, a reference
    drawn here from init_weights' docstring (each matrix Normal(0, init_std), o_proj and down_proj over sqrt(2
    n_layer), in parameter order; biases 0, norm scales 1; a tied head drawn once, as the embedding), and the
    weights the eager path (Transformer(cfg), then init_weights after the same seed) gives. Catches the two
    paths drifting."""
    base = config.PRESETS["tiny"]()
    cfg = replace(base, model=tiny(init_std=0.05, **change), train=replace(base.train, seed=5))
    model = new_model(cfg, torch.device("cpu"))
    eager = Transformer(cfg.model)
    torch.manual_seed(5)
    eager.init_weights()
    torch.manual_seed(5)
    std, n = cfg.model.init_std, cfg.model.num_hidden_layers
    for name, value in ((k, v) for k, v in model.state_dict().items() if is_stored(k, cfg.model)):
        if name.endswith(".bias"):
            expected = torch.zeros_like(value)
        elif value.dim() == 1:
            expected = torch.ones_like(value)
        else:
            scale = math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            expected = torch.empty_like(value).normal_(0.0, std / scale)
        assert torch.equal(value, expected), name
        assert torch.equal(value, eager.state_dict()[name]), name
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.model.tie_word_embeddings
    assert torch.equal(model.rope_cos, eager.rope_cos) and torch.equal(model.rope_sin, eager.rope_sin)


def float64_rope(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_seq_len, head_dim) of plain RoPE in float64, from the formula, for comparing tables.
    """
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_built_for_loading_draws_nothing_and_holds_what_it_loads(tiny, tied):
    """Built on meta and given memory by materialize, a model that load_stored fills must draw no random
    number, keep its head tied, compute its RoPE tables (never stored; empty memory otherwise) and give the
    logits a float64 reference computes from the source's weights. Catches random or uninitialised weights and
    lost tables."""
    source = model_of(tiny(tie_word_embeddings=tied), seed=3)
    state = {k: v.clone() for k, v in source.state_dict().items() if is_stored(k, source.config)}
    rng = torch.get_rng_state()
    with torch.device("meta"):
        model = Transformer(source.config)
    model.materialize("cpu").load_stored(state)
    assert torch.equal(torch.get_rng_state(), rng)  # no weight was drawn only to be overwritten
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    cos, sin = float64_rope(source.config)
    assert torch.allclose(model.rope_cos.double(), cos, atol=1e-5) and torch.allclose(model.rope_sin.double(), sin,
                                                                                      atol=1e-5)
    ids = torch.randint(0, 97, (2, 16))
    ref = naive_attention_logits(source, ids)
    assert torch.allclose(model.eval()(ids)[0].double(), ref, atol=2e-5, rtol=1e-4)


def test_the_generator_loads_the_stored_weights_and_computes_its_rope_tables(tiny_checkpoint):
    """load_for_inference (text_generator.py, serve.py) builds on meta: its model must give the logits a
    float64 reference computes from model.safetensors read here, with RoPE tables from the formula, and draw
    nothing."""
    stored = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    rng = torch.get_rng_state()
    model, _, cfg, _ = load_for_inference(tiny_checkpoint, "cpu", compile="off")
    assert torch.equal(torch.get_rng_state(), rng)
    cos, sin = float64_rope(cfg)
    assert torch.allclose(model.rope_cos.double(), cos, atol=1e-5) and torch.allclose(model.rope_sin.double(), sin,
                                                                                      atol=1e-5)
    reference = Transformer(cfg)  # the eager path: an initialised model, the stored weights copied over it
    reference.load_stored(stored)
    assert all(torch.equal(reference.state_dict()[k], v) for k, v in stored.items())
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    ref = naive_attention_logits(reference, ids)
    assert torch.allclose(model(ids)[0].double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", [name for name in config.PRESETS if name != "auto"])
def test_parameter_count_matches_closed_form_for_every_preset(name):
    """The formula used for presets and MFU must equal what the module really allocates (on meta)."""
    cfg = config.PRESETS[name]().model
    with torch.device("meta"):
        m = Transformer(cfg)
    assert m.num_parameters() == count_parameters(cfg)
    d, v = cfg.hidden_size, cfg.vocab_size
    assert m.num_parameters(exclude_embeddings=True) == count_parameters(cfg) - v * d


def test_loss_is_fp32_mean_over_unmasked_and_zero_when_all_masked():
    """The loss must ignore -100 labels, equal a float64 reference, and never be NaN for an all-masked batch.
    """
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = -100
    ref = F.cross_entropy(logits.double().view(-1, 11), labels.view(-1), ignore_index=-100)
    assert cross_entropy(logits, labels).dtype == torch.float32
    assert torch.allclose(cross_entropy(logits, labels).double(), ref, atol=1e-5)
    masked = torch.full_like(labels, -100)
    logits.requires_grad_(True)
    loss = cross_entropy(logits, masked)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_tiny_model_overfits_one_batch(tiny):
    """A few hundred AdamW steps on one fixed batch must drive the loss below a tenth of its start."""
    torch.manual_seed(0)
    m = Transformer(tiny(vocab_size=64, max_seq_len=32)).train()
    ids = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(200):
        _, loss = m(ids[:, :-1], labels=ids[:, 1:])
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 10, (first, loss.item())


def test_chunked_loss_equals_the_whole_one_with_its_gradients(tiny):
    """With loss_chunk_rows set the loss is computed chunk by chunk, logits recomputed in backward (the fp32
    logits of a 32k vocabulary would not fit beside a large model): same loss, same gradients, masks kept."""
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    labels = ids.roll(-1, 1)
    labels[0, :7] = -100
    results = []
    for rows in (0, 7):  # whole, then chunks of 7 rows (the last one shorter)
        m = model_of(tiny()).train()
        m.execution = Execution(loss_chunk_rows=rows)
        logits, loss = m(ids, labels=labels)
        loss.backward()
        results.append((logits, loss, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (whole_logits, whole, g1), (none, chunked, g2) = results
    assert whole_logits is not None and none is None
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_tied_head_is_stored_once_and_loads_back(tiny_config):
    """The tied-head rule was restated in ten places (checkpoints, exports, imports, --init_from, the
    generator); it is is_stored() and load_stored() now: a tied model's weights without the head load back to
    the same logits, and an untied model refuses a state that lacks its head."""
    from modern_llm import is_stored
    torch.manual_seed(0)
    tied = Transformer(tiny_config(vocab_size=64, tie_word_embeddings=True))
    state = {k: v for k, v in tied.state_dict().items() if is_stored(k, tied.config)}
    assert "lm_head.weight" not in state and "embed_tokens.weight" in state
    again = Transformer(tiny_config(vocab_size=64, tie_word_embeddings=True))
    again.load_stored(state)
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(again(ids)[0], tied(ids)[0]) and again.lm_head.weight is again.embed_tokens.weight
    untied = Transformer(tiny_config(vocab_size=64, tie_word_embeddings=False))
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        untied.load_stored({k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"})


def test_chunked_loss_casts_the_head_once_under_autocast(tiny_config):
    """Under autocast every chunk's F.linear cast the fp32 head weight to bf16 again, and the recompute in
    backward once more: 4.4 GiB a step on the RTX 4090 row of the compile check. The head is cast once a
    forward; the loss and gradients stay those of the whole logits."""
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=96)
    head_shape = (cfg.vocab_size, cfg.hidden_size)

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == head_shape \
                    and out.dtype == torch.bfloat16:
                Casts.n += 1
            return out

    ids = torch.randint(0, 96, (4, 33))
    results = []
    for rows in (0, 16):
        model = Transformer(cfg)
        model.execution = Execution(loss_chunk_rows=rows)
        with Casts():
            Casts.n = 0
            with torch.autocast("cpu", dtype=torch.bfloat16):  # backward outside it, as in the trainer's step
                loss = model(ids[:, :-1], labels=ids[:, 1:])[1]
            loss.backward()
        results.append((Casts.n, loss.item()))
    (whole_casts, whole), (chunk_casts, chunked) = results
    assert chunk_casts <= whole_casts + 1 and chunk_casts <= 2  # 8 chunks: once, not 8 + 8 times
    assert chunked == pytest.approx(whole, rel=1e-2)


@pytest.mark.parametrize("qkv_bias,kv_heads", [(False, 1), (True, 2)])
def test_stacked_projections_compute_the_separate_layers_in_fewer_matmuls(qkv_bias, kv_heads, tiny):
    """Inference stacks q/k/v and gate/up (a decode step made 7 matmuls a block, now 4): in float64 the
    stacked model's logits and cached decode equal the separate layers', biases included."""
    from llm.generate.inference import for_inference
    cfg = tiny(qkv_bias=qkv_bias, num_key_value_heads=kv_heads)
    separate = model_of(cfg).double()
    for p in separate.parameters():  # non-zero biases, so a misplaced one shows
        torch.nn.init.normal_(p, std=0.2) if p.dim() == 1 else None
    fused = model_of(cfg).double()
    fused.load_state_dict(separate.state_dict())
    fused.fuse_projections()
    matmuls = lambda m: sum(isinstance(x, torch.nn.Linear) for x in m.layers[0].modules())  # noqa: E731
    assert (matmuls(separate), matmuls(fused)) == (7, 4)
    assert fused.num_parameters() == separate.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        want, got = separate(ids)[0], fused(ids)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        caches = [m.make_kv_cache(2, dtype=torch.float64) for m in (separate, fused)]
        steps = [[m(ids[:, :8], kv_cache=c)[0] for _ in [0]] + [m(ids[:, 8:9], kv_cache=c)[0]]
                 for m, c in zip((separate, fused), caches)]
    torch.testing.assert_close(steps[1][1], steps[0][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(steps[1][1][:, 0], want[:, 8], rtol=1e-12, atol=1e-12)
    assert matmuls(for_inference(model_of(cfg), torch.device("cpu"), compile="off")) == 4  # what generation runs


def naive_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log_softmax(logits) at each label, float64, gathered from the whole logits; 0 where the label is -100.
    """
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return -lp.masked_fill(labels == -100, 0.0)


@pytest.mark.parametrize("rows", [0, 7])  # the default chunk (one here), and chunks of 7 rows that split rows
@pytest.mark.parametrize("ragged", [False, True])  # every row through the head (compiled), or labelled rows only
def test_per_token_losses_equal_a_naive_float64_gather_with_their_gradients(tiny, rows, ragged):
    """reduction="none" gives each label's loss chunk by chunk, every row or (ragged) only the labelled ones,
    the packed examples then on rows of their own: against log_softmax over the whole logits and a gather, in
    float64, with -100 rows (a whole masked row among them), packed positions and gradients (the model in
    float64, the losses in fp32); a row scattered to the wrong place, a chunk dropped at a boundary or a mask
    ignored changes values or gradients."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 20), generator=g)
    labels = ids.roll(-1, 1)
    labels[0, :7], labels[1, 3:12], labels[2] = -100, -100, -100
    labels[2, 15] = 5  # one labelled token in a row of masks
    pos = torch.cat([torch.arange(8), torch.arange(12)]).expand(3, 20)
    weights = torch.rand(3, 20, generator=g, dtype=torch.float64)  # each token's loss weighed differently
    got = []
    for per_token in (True, False):
        m = model_of(tiny()).double().train()
        m.execution = Execution(loss_chunk_rows=rows, labelled_rows=ragged and per_token)
        if per_token:
            logits, nll = m(ids, labels=labels, positions=pos, reduction="none")
            assert logits is None and nll.shape == labels.shape
        else:
            m.execution = Execution()
            nll = naive_token_nll(m(ids, positions=pos)[0], labels)
        (weights * nll).sum().backward()
        got.append((nll.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (nll, grads), (naive, naive_grads) = got
    assert (nll[labels == -100] == 0).all() and (nll[labels != -100] > 0).all()
    torch.testing.assert_close(nll, naive.float(), rtol=1e-6, atol=1e-6)  # the losses are fp32, as the mean's
    for name in grads:
        torch.testing.assert_close(grads[name], naive_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_packed_examples_attend_on_rows_of_their_own_as_under_the_mask():
    """example_attention (eager) moves each packed example to a row of its own; the masked attention
    (compiled) is its reference here, in float64 with gradients, rows of different example lengths and a row
    that does not start at position 0: a token moved to another example's row, or a padded key seen, changes
    the result. Both written out as matmuls and a softmax (a CPU's) equal it too."""
    from llm.base.attention import example_attention, example_mask, example_rows, packed_attention
    g = torch.Generator().manual_seed(0)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ([5, 11, 1, 7], [3, 21],
                                                                                     [24])])
    pos[2] += 4  # a row that continues an example: its own example all the same
    q = torch.randn(3, 4, 24, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(3, 2, 24, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    mask = example_mask(pos)
    mask[2] = torch.ones(24, 24, dtype=torch.bool).tril()  # the mask reads a row's start as one example too
    w = torch.randn(3, 4, 24, 8, dtype=torch.float64, generator=g)
    results = []
    for attend in (partial(packed_attention, mask=mask), partial(example_attention, at=example_rows(pos)),
                   partial(example_attention, at=example_rows(pos), matmul_softmax=True),
                   partial(packed_attention, mask=mask, matmul_softmax=True)):
        y = attend(q, k, v)
        (y * w).sum().backward()
        results.append((y.detach(), [t.grad.clone() for t in (q, k, v)]))
        for t in (q, k, v):
            t.grad = None
    (ref, ref_grads), *others = results
    for y, grads in others:
        torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def bf16_decode_step():
    """A bf16 KV cache of 8 rows of different lengths (4 query heads over 2 key heads of 64), and a decode
    step's queries, keys and values."""
    from modern_llm import KVCache
    cfg = config.ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, max_seq_len=128)
    torch.manual_seed(0)
    cache = KVCache(cfg, 8, 128, dtype=torch.bfloat16)
    past = torch.randn(8, 2, 127, 64, dtype=torch.bfloat16)
    cache.update(0, past, past.flip(-1), torch.arange(127).expand(8, 127))
    cache.advance(torch.randint(40, 127, (8,)))  # rows of different lengths
    return cache, [torch.randn(8, h, 1, 64, dtype=torch.bfloat16) for h in (4, 2, 2)]


def test_a_cpu_decode_steps_written_out_attention_is_as_close_to_float64_as_the_kernel():
    """A CPU decode step writes its attention out (the flash kernel took 6x as long in bf16 for one query a
    row): in fp32, rounding only the output, so it lies as close to a float64 reference as SDPA's own bf16
    kernel."""
    from llm.base.attention import cached_attention
    cache, (q, k, v) = bf16_decode_step()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", None)  # not the kernel
        got = cached_attention(q, k, v, cache, 0, cache.pos[:, None], cache.next_mask)
    keys, values = cache.k[0].double(), cache.v[0].double()
    want = F.scaled_dot_product_attention(q.double(), keys, values, attn_mask=cache.next_mask.double(), enable_gqa=True)
    kernel = F.scaled_dot_product_attention(q, cache.k[0], cache.v[0], attn_mask=cache.next_mask, enable_gqa=True)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= (kernel.double() - want).abs().max() * 1.01


def test_a_cpu_decode_step_under_autocast_reads_a_bf16_cache_without_copying_it():
    """Under bf16 autocast a decode step's matmuls compute in bf16 whatever their inputs: its written-out
    attention reads a bf16 cache as it is (a cast up to fp32 was cast back: two copies of each layer's keys
    and values a step, 5% of a GRPO rollout's sampling on a CPU), and gives what the fp32 inputs did, to the
    bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llm.base.attention import cached_attention, written_out_attention
    cache, (q, k, v) = bf16_decode_step()

    class Copies(TorchDispatchMode):
        copied = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and \
                    out.numel() >= cache.k[0].numel():
                Copies.copied += 1
            return out
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        with Copies():
            got = cached_attention(q, k, v, cache, 0, cache.pos[:, None], cache.next_mask)
        wide = written_out_attention(q.float(), cache.k[0].float(), cache.v[0].float(), cache.next_mask)
    assert Copies.copied == 0
    assert torch.equal(got, wide.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_step_reading_a_span_of_the_cache_gives_what_the_whole_cache_gives(dtype):
    """An eager decode step reads only the cache's places up to its longest row (cache.span), a slice whose
    rows do not lie end to end; its written-out attention multiplies such keys by the queries. It must
    give what the same keys give whole and contiguous (to the bit in bf16; fp32 sums in another order), and
    what float64 gives within the dtype's rounding."""
    from llm.base.attention import written_out_attention
    torch.manual_seed(0)
    keys, values = (torch.randn(8, 2, 128, 64, dtype=dtype) for _ in range(2))
    q = torch.randn(8, 4, 1, 64, dtype=dtype)
    reach = torch.randint(20, 64, (8,))
    allowed = (torch.arange(64) < reach[:, None])[:, None, None]  # (B, 1, 1, 64): each row's filled places
    span = written_out_attention(q, keys[:, :, :64], values[:, :, :64], allowed, keys_first=True)
    whole = written_out_attention(q, keys[:, :, :64].contiguous(), values[:, :, :64].contiguous(), allowed)
    assert not keys[:, :, :64].is_contiguous()
    torch.testing.assert_close(span, whole, rtol=1e-6, atol=1e-6)
    want = F.scaled_dot_product_attention(q.double(), keys[:, :, :64].double(), values[:, :, :64].double(),
                                          attn_mask=allowed, enable_gqa=True)
    assert (span.double() - want).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)
