"""Tests of muon_optimizer.py: the Muon step, Newton-Schulz, the parameter split, checkpoints and schedules.
"""

import copy
import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from config import TrainConfig
from modern_llm import Transformer
from muon_optimizer import Muon, build_optimizer, split_parameters, zeropower_via_newtonschulz

SHAPES = {"square": (48, 48), "tall": (96, 32), "wide": (32, 96)}
RATES = dict(learning_rate=3e-3, muon_lr=0.02)  # config.py leaves both automatic (0); sizing fills them


@pytest.fixture(scope="module")
def tiny_model(tiny_config):
    """The project's model at a size that builds in milliseconds, from seed 0; tiny_model(tie=False) unties.
    """
    def make(tie: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return Transformer(tiny_config(vocab_size=64, hidden_size=32, max_seq_len=16, tie_word_embeddings=tie))
    return make


def random_grads(model: nn.Module, seed: int):
    """Give every parameter a reproducible random gradient."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def reference_newtonschulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration, written plainly in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    X = X.T if G.shape[0] > G.shape[1] else X
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


@pytest.mark.parametrize("rule", ["keller", "moonshot"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_muon_step_matches_float64_reference(shape, rule):
    """Catches a wrong momentum/Nesterov formula, coefficient, transpose, shape scale or decay order."""
    lr, mom, wd = 0.02, 0.95, 0.1
    gen = torch.Generator().manual_seed(1)
    w0 = 0.02 * torch.randn(shape, generator=gen)  # init-sized weights, so fp32 rounding of w stays below the check
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = Muon([p], lr=lr, momentum=mom, weight_decay=wd, shape_rule=rule, ns_dtype=torch.float32)
    rows, cols = shape
    scale = (max(1, rows / cols)) ** 0.5 if rule == "keller" else 0.2 * max(rows, cols) ** 0.5
    w, buf = w0.double(), torch.zeros(shape, dtype=torch.float64)
    for g in grads:  # several steps, so the momentum buffer is exercised
        p.grad = g.clone()
        opt.step()
        buf = mom * buf + g.double()  # classic form: Newton-Schulz makes it equal to the lerp form
        update = g.double() + mom * buf  # Nesterov
        w = w * (1 - lr * wd) - lr * scale * reference_newtonschulz(update)
        torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=2e-5 * lr * scale)


@pytest.mark.parametrize("shape", [*SHAPES.values(), (128, 64)], ids=[*SHAPES.keys(), "near_rank_8"])
def test_newtonschulz_singular_values_in_band(shape):
    """Catches a diverging or under-converged iteration: kept directions end in [0.7, 1.2], tiny ones stay
    tiny."""
    gen = torch.Generator().manual_seed(2)
    G = torch.randn(shape, generator=gen, dtype=torch.float64)
    if shape == (128, 64):  # rank 8 plus noise a millionth of its size
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        G = U[:, :8] @ torch.diag(torch.linspace(1, 4, 8, dtype=torch.float64)) @ Vh[:8] + 1e-6 * G
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    O = zeropower_via_newtonschulz(G.float(), dtype=torch.float32).double()
    assert O.dtype == torch.float64 and torch.isfinite(O).all()
    per_direction = torch.diagonal(U.T @ O @ Vh.T)  # O = U f(S) V^T, so this is f at each input value
    kept = S / G.norm() >= 3e-3  # the quintic lifts anything above this into the band within 5 steps
    assert kept.sum() >= 8
    assert per_direction[kept].min() > 0.65 and per_direction[kept].max() < 1.25
    assert torch.linalg.svdvals(O).max() < 1.25
    if shape == (128, 64):
        assert per_direction[8:].abs().max() < 0.05  # noise is not blown up into full rank


def test_zero_gradient_gives_no_nan():
    """Catches a division by a zero norm: a zero gradient must leave only the weight decay."""
    assert torch.equal(zeropower_via_newtonschulz(torch.zeros(8, 4)), torch.zeros(8, 4))
    p = nn.Parameter(torch.ones(8, 4))
    opt = Muon([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(8, 4)
    opt.step()
    assert torch.equal(p.detach(), torch.full((8, 4), 0.95))


def test_adamw_part_matches_torch_adamw(tiny_model):
    """Catches wrong AdamW hyperparameters or decay groups (embedding decayed, norms not)."""
    cfg = TrainConfig(learning_rate=3e-3, muon_lr=0.02, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-7)
    model = tiny_model()
    ref_model = copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    named = dict(ref_model.named_parameters())
    ref = torch.optim.AdamW([
        {"params": [p for n, p in named.items() if p.ndim == 2 and not n.startswith("layers.")], "weight_decay": 0.1},
        {"params": [p for p in named.values() if p.ndim == 1], "weight_decay": 0.0},
    ], lr=3e-3, betas=(0.8, 0.9), eps=1e-7)
    for step in range(3):
        random_grads(model, step)
        random_grads(ref_model, step)
        opt.step()
        ref.step()
    for name, p in model.named_parameters():
        if not (p.ndim == 2 and name.startswith("layers.")):
            torch.testing.assert_close(p, named[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("tie", [True, False])
def test_every_parameter_in_exactly_one_group(tie, tiny_model):
    """Catches a lost or doubled parameter, a norm or embedding sent to Muon, or decay on norm scales."""
    model = tiny_model(tie)
    names = {id(p): n for n, p in model.named_parameters()}
    block_matrices = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert len(block_matrices) == 2 * 7  # q, k, v, o, gate, up, down per layer

    opt = build_optimizer(model, TrainConfig(**RATES))
    in_groups = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    assert sorted(in_groups) == sorted(names.values())  # each trainable parameter once, tied weight once
    groups = {g["name"]: g for g in opt.param_groups}
    assert {names[id(p)] for p in groups["muon"]["params"]} == block_matrices
    assert {names[id(p)] for p in groups["adamw_decay"]["params"]} == (
        {"embed_tokens.weight"} if tie else {"embed_tokens.weight", "lm_head.weight"})
    assert all(p.ndim == 1 for p in groups["adamw_no_decay"]["params"])
    assert groups["adamw_no_decay"]["weight_decay"] == 0.0 and groups["adamw_decay"]["weight_decay"] == 0.1
    assert "muon" in opt.describe() and "adamw_no_decay" in opt.describe()

    adamw_only = build_optimizer(model, TrainConfig(optimizer="adamw", **RATES))
    groups = {g["name"]: g for g in adamw_only.param_groups}
    assert set(groups) == {"adamw_decay", "adamw_no_decay"} and len(adamw_only.optimizers) == 1
    assert {names[id(p)] for p in groups["adamw_decay"]["params"]} == {n for n, p in model.named_parameters()
                                                                      if p.ndim == 2}
    no_decay = groups["adamw_no_decay"]
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_state_round_trip_is_bit_identical(optimizer, tiny_model):
    """Catches state lost or mangled by a checkpoint: a resumed run must take exactly the same next steps."""
    cfg = TrainConfig(optimizer=optimizer, **RATES)
    model = tiny_model()
    opt = build_optimizer(model, cfg)
    for step in range(3):
        random_grads(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model2 = copy.deepcopy(model)
    opt2 = build_optimizer(model2, cfg)
    opt2.load_state_dict(state)
    for step in range(3, 5):
        for m, o in ((model, opt), (model2, opt2)):
            random_grads(m, step)
            o.step()
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
    other_kind = "adamw" if optimizer == "muon" else "muon"
    other = build_optimizer(copy.deepcopy(model), TrainConfig(optimizer=other_kind, **RATES))
    with pytest.raises(ValueError, match="optimizer setting"):
        other.load_state_dict(state)


def test_lr_multiplier_scales_both_parts(tiny_model):
    """Catches a schedule that reaches only one optimizer or ignores initial_lr."""
    cfg = TrainConfig(learning_rate=1e-3, muon_lr=0.05)
    deltas = []
    for multiplier in (1.0, 0.25):
        model = tiny_model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = build_optimizer(model, cfg)
        assert {g["name"]: g["initial_lr"] for g in opt.param_groups} == {
            "muon": 0.05, "adamw_decay": 1e-3, "adamw_no_decay": 1e-3}
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
        random_grads(model, 0)
        opt.step()
        deltas.append([p.detach() - b for p, b in zip(model.parameters(), before)])
    for (name, _), full, quarter in zip(tiny_model().named_parameters(), *deltas):
        assert full.abs().max() > 0, name
        # atol: the deltas come from fp32 weights near 1 (the norm scales), whose spacing is 1.2e-7
        torch.testing.assert_close(quarter, 0.25 * full, rtol=1e-5, atol=3e-7, msg=name)


def test_grad_scaler_unscales_and_skips_both_parts(tiny_model):
    """Catches a GradScaler that misses one part: finite steps match unscaled ones, an inf skips everything.
    """
    model = tiny_model()
    ref_model = copy.deepcopy(model)
    opt, ref = build_optimizer(model, TrainConfig(**RATES)), build_optimizer(ref_model, TrainConfig(**RATES))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(torch.ones(()))  # the scaler creates its scale tensor lazily
    random_grads(model, 0)
    random_grads(ref_model, 0)
    for p in model.parameters():
        p.grad *= 2.0 ** 12  # what backward of a scaled loss gives; a power of two scales exactly
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)

    before = [p.detach().clone() for p in model.parameters()]
    random_grads(model, 1)
    model.norm.weight.grad[0] = float("inf")  # an overflow in an AdamW-only parameter
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert scaler.get_scale() < 2.0 ** 12


def muon_setup():
    """Matrices whose counts per shape are odd, so a two-rank split needs padding."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(16, 8)] * 3 + [(8, 24)] * 2 + [(12, 12)]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    return params, grads, Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)


def run_muon(params, grads, opt) -> list[torch.Tensor]:
    """Two steps over the given gradients; the weights after them."""
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def distributed_worker(rank: int, init_file: str, out_dir: str):
    """One gloo rank: the same Muon steps, Newton-Schulz spread over the ranks."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.save(run_muon(*muon_setup()), f"{out_dir}/rank{rank}.pt")
        # Both ranks done with gloo before either tears it down: a peer closing mid-exchange aborts the
        # process.
        store = dist.distributed_c10d._get_default_store()
        store.add("finished", 1)
        while store.add("finished", 0) < 2:
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_spread_matches_single_process(tmp_path):
    """Catches ranks that drift apart or a split/gather that reorders matrices."""
    mp.spawn(distributed_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    single = run_muon(*muon_setup())
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for a, b, s in zip(*ranks, single):
        assert torch.equal(a, b)  # every rank ends with identical weights
        torch.testing.assert_close(a, s, rtol=0, atol=1e-6)  # bit-identical here; BLAS blocking may vary


def test_found_inf_skips_both_parts_bit_identically(tiny_model):
    """A step flagged non-finite on the device must leave weights and all optimizer state exactly as they were
    (a NaN that leaked into a momentum buffer or Adam moment would poison every later step)."""
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(**RATES))
    ids = torch.randint(0, 64, (2, 17))

    def step(flag, poison=False):
        _, loss = model(ids[:, :-1], labels=ids[:, 1:])
        (loss * float("nan") if poison else loss).backward()
        opt.step(found_inf=torch.tensor(flag))
        opt.zero_grad(set_to_none=True)

    step(0.0)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    step(1.0, poison=True)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()
    for part in state:
        for pid, slots in state[part]["state"].items():
            for key, value in slots.items():
                assert torch.equal(value, after[part]["state"][pid][key]), (part, key)
    step(0.0)
    assert not torch.equal(weights["layers.0.attn.q_proj.weight"], model.state_dict()["layers.0.attn.q_proj.weight"])


@pytest.mark.slow
def test_compiled_step_equals_eager_skips_on_the_device_and_compiles_once(tiny_model):
    """Muon compiled (the trainer's choice on CUDA) gives the eager step's weights with the schedule's rate
    changing, skips a flagged step on the device, and compiles nothing after its first step."""
    from torch._dynamo.utils import counters
    models = [tiny_model(), tiny_model()]
    opts = [Muon(split_parameters(m)["muon"], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, compiled=compiled)
            for m, compiled in zip(models, (False, True))]
    for step in range(4):
        if step == 1:
            counters.clear()  # the first step compiled each part once
        before = copy.deepcopy(models[1].state_dict())
        for model, opt in zip(models, opts):
            random_grads(model, seed=step)
            opt.param_groups[0]["lr"] = 0.02 * (1 - step / 4)
            opt.step(found_inf=torch.tensor(float(step == 2)))
        eager, compiled = models[0].state_dict(), models[1].state_dict()
        assert all(torch.allclose(eager[k], compiled[k], atol=1e-6, rtol=1e-5) for k in eager)
        changed = [not torch.equal(before[k], compiled[k]) for k in compiled if k.startswith("layers.")]
        assert not any(changed) if step == 2 else any(changed)
    assert counters["stats"]["unique_graphs"] == 0


def test_the_benchmark_times_the_presets_own_matrices():
    """muon_optimizer.py's benchmark once hard-coded a tiny shape the preset no longer had; it now takes the
    shapes from the preset, and they are the model's own Muon matrices."""
    from config import PRESETS
    from modern_llm import Transformer
    from muon_optimizer import block_shapes
    cfg = PRESETS["tiny"]().model
    model = Transformer(cfg)
    ours = sorted(tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)
    assert ours == sorted(block_shapes(cfg) * cfg.num_hidden_layers)
