"""Muon for the hidden weight matrices and AdamW for every other parameter, behind one optimizer object.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/) takes the Nesterov momentum of the
gradient, replaces it by a near-orthogonal matrix with a quintic Newton-Schulz iteration, scales it by a
shape rule and applies decoupled weight decay. The default rule is "keller", sqrt(max(1, rows/cols));
"moonshot", 0.2 * sqrt(max(rows, cols)) (arXiv 2502.16982), matches AdamW's update RMS, so set muon_lr
near the AdamW rate with it. `python muon_optimizer.py` times a step against torch.optim.Muon.
"""

import math
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from llm.base.device import cpu_has_native_bf16
from llm.base.distributed import DTensor, local, shard_as

# Keller Jordan's quintic: steepest slope at 0 that still converges
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
SHAPE_RULES = ("keller", "moonshot")
NS_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}  # None: default_ns_dtype(device)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores) and on CPUs that compute it natively (1.8x fp32 on an AVX512-BF16 CPU);
    fp32 elsewhere, where bf16 matmuls are emulated and slow."""
    native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
    return torch.bfloat16 if native else torch.float32


def zeropower_via_newtonschulz(G: torch.Tensor, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS,
                               eps: float = NS_EPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """About U V^T for G = U S V^T, of one matrix or a batch (..., rows, cols), returned in the compute dtype.

    The quintic does not converge to 1: singular values end roughly in [0.7, 1.2], which trains as well.
    """
    a, b, c = coefficients
    X = G.to(dtype or default_ns_dtype(G.device)).reshape(-1, *G.shape[-2:])
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # iterate on the wide orientation so the Gram matrix X X^T is the smaller one
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1]; a zero G stays 0.
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return (X.mT if tall else X).reshape(G.shape)


def shape_scale(shape: torch.Size, rule: str) -> float:
    """The factor the orthogonalised update of a (rows, cols) matrix is multiplied by."""
    rows, cols = shape[0], shape[1]
    if rule == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "moonshot":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"muon_shape_rule={rule!r} is invalid: choose one of {', '.join(SHAPE_RULES)}")


class Muon(torch.optim.Optimizer):
    """Muon over 2D parameters; one batched Newton-Schulz call per matrix shape, spread over ranks if
    distributed.

    Written rather than torch.optim.Muon because that one always iterates in bf16, about 50x slower per step
    on a CPU without native bf16 than fp32 here; its math and state layout are the same. The rest of the
    update is a few foreach calls over all matrices, the learning rate and the skip flag 0-D device tensors
    (no host sync); compiled=True (the trainer's choice on CUDA) compiles Newton-Schulz."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, shape_rule: str = "keller", ns_steps: int = NS_STEPS,
                 ns_dtype: torch.dtype | None = None, compiled: bool = False):
        shape_scale((1, 1), shape_rule)  # validates the rule
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        shape_rule=shape_rule)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2D parameters only, got shape {tuple(p.shape)}")
        self.ns_steps, self.ns_dtype = ns_steps, ns_dtype
        self._lrs = {}  # group index -> its learning rate as a 0-D tensor on the group's device
        self.use_compile(compiled)

    def use_compile(self, compiled: bool):
        """Compile Newton-Schulz (one graph per matrix shape), or not. The foreach parts stay eager: compiled,
        they cost minutes at launch for a hundred matrices (117 s cold on 2 CPU cores) and saved nothing."""
        self._zeropower = torch.compile(zeropower_via_newtonschulz, dynamic=False) if compiled \
            else zeropower_via_newtonschulz

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype Newton-Schulz runs in for parameters on this device."""
        return self.ns_dtype or default_ns_dtype(device)

    @torch.no_grad()
    def step(self, closure=None, found_inf: torch.Tensor | None = None):
        """Momentum, orthogonalisation, decoupled weight decay and the scaled update, for every group.

        found_inf: a 0-D device tensor, 1 to skip this step (non-finite gradients) without a host sync:
        momentum and weights then stay exactly as they were.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo, updates = [], []
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # Element-wise work on this rank's rows; under FSDP2 only orthogonalize() needs whole matrices.
            grads = [local(p.grad) for p in params]
            bufs = [local(self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))) for p in params]
            keep = None if found_inf is None else 1 - found_inf.to(grads[0].device, torch.float32)
            updates += momentum_update(grads, bufs, group["momentum"], group["nesterov"], keep)
            if i not in self._lrs:
                self._lrs[i] = torch.zeros((), device=grads[0].device)
            lr = self._lrs[i].fill_(group["lr"])  # a device tensor: the foreach calls read it without a sync
            todo.append((params, group, lr, keep))
        ortho = iter(self.orthogonalize(updates, [p for params, *_ in todo for p in params]))
        for params, group, lr, keep in todo:
            scales = [shape_scale(p.shape, group["shape_rule"]) for p in params]
            apply_update([local(p) for p in params], [next(ortho) for _ in params], scales, lr,
                        group["weight_decay"], keep)
        return loss

    def orthogonalize(self, updates: list[torch.Tensor], params: list[torch.Tensor] | None = None
                      ) -> list[torch.Tensor]:
        """Newton-Schulz of every update, one batched call per shape; each rank does a slice when distributed.

        Under FSDP2 an update holds this rank's rows of its parameter (in params): the whole matrix is
        gathered first, and this rank's rows of the result come back.
        """
        params = params or updates
        # Cast first: Newton-Schulz starts with this cast anyway, and in bf16 the gathers move half the bytes.
        updates = [whole_matrix(u.to(self.compute_dtype(u.device)), p) for u, p in zip(updates, params)]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        by_shape = {}
        for i, u in enumerate(updates):  # insertion order, so every rank builds the same batches
            by_shape.setdefault((tuple(u.shape), u.device, u.dtype), []).append(i)
        out = [None] * len(updates)
        for idx in by_shape.values():
            stack = torch.stack([updates[i] for i in idx])
            ortho = self._orthogonalize_spread(stack, world) if world > 1 else self._newtonschulz(stack)
            for i, o in zip(idx, ortho.unbind(0)):
                out[i] = local(shard_as(o, params[i]))
        return out

    def _newtonschulz(self, stack: torch.Tensor) -> torch.Tensor:
        """Orthogonalise a (n, rows, cols) stack in this optimizer's compute dtype."""
        return self._zeropower(stack, self.ns_steps, dtype=self.compute_dtype(stack.device))

    def _orthogonalize_spread(self, stack: torch.Tensor, world: int) -> torch.Tensor:
        """Rank r orthogonalises slice r of the stack, then an all-gather gives every rank all slices."""
        n, per = stack.size(0), -(-stack.size(0) // world)
        pad = stack.new_zeros(per * world - n, *stack.shape[1:])  # zeros orthogonalise to zeros
        mine = torch.cat([stack, pad])[dist.get_rank() * per:(dist.get_rank() + 1) * per]
        mine = self._newtonschulz(mine).contiguous()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        return torch.cat(parts)[:n]


def momentum_update(grads: list, bufs: list, momentum: float, nesterov: bool, keep=None) -> list:
    """buf <- m buf + (1 - m) g for every matrix, in place (keep, a 0-D tensor, at 0 leaves each
    bit-identical); returns the updates to orthogonalise: Nesterov's lerp(g, buf, m), or buf itself."""
    if keep is None:
        # Lerp form, as Keller's and torch's Muon: (1 - m) times buf = m buf + g, a scale Newton-Schulz drops.
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
    else:
        grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]  # a skipped step may hold NaN
        torch._foreach_add_(bufs, torch._foreach_mul(torch._foreach_sub(grads, bufs), (1 - momentum) * keep))
    return torch._foreach_lerp(grads, bufs, momentum) if nesterov else bufs


def apply_update(weights: list, ortho: list, scales: list[float], lr: torch.Tensor,
                 weight_decay: float, keep=None):
    """w <- (1 - lr wd) w - lr scale o for every matrix, in place; lr and keep are 0-D tensors (keep 0: no
    step)."""
    lr = lr if keep is None else lr * keep
    torch._foreach_mul_(weights, 1 - lr * weight_decay)
    torch._foreach_add_(weights, torch._foreach_mul(torch._foreach_mul(ortho, scales), -lr))


def whole_matrix(rows: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole matrix whose local rows, sharded like `param`, are `rows` (an all-gather under FSDP2)."""
    if not isinstance(param, DTensor):
        return rows
    return DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


class MuonAdamW:
    """Muon and AdamW stepped, zeroed, scheduled and checkpointed as one optimizer.

    `param_groups` lists the groups of both parts, so the schedule's `lr = initial_lr * multiplier` and
    torch.amp.GradScaler's unscale_/step (one inf check for both parts) reach everything.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        self.optimizers = list(parts.values())

    @property
    def param_groups(self) -> list[dict]:
        """Every group of every part; the dicts are the parts' own, so edits reach them."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients of every part."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None, found_inf: torch.Tensor | None = None):
        """Step every part; a closure, if given, is evaluated once.

        found_inf: a 0-D device tensor, nonzero to skip the whole step. Muon and fused AdamW skip on the
        device; AdamW's foreach kernels cannot, so there it costs one host sync.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            if found_inf is None:
                opt.step()
            elif isinstance(opt, Muon):
                opt.step(found_inf=found_inf)
            elif all(g.get("fused") for g in opt.param_groups):
                opt.found_inf, opt.grad_scale = found_inf, None  # the attributes GradScaler uses to skip
                try:
                    opt.step()
                finally:
                    del opt.found_inf, opt.grad_scale
            elif not found_inf.item():  # sync point: foreach AdamW has no device-side skip
                opt.step()
        return loss

    def use_compile(self, compiled: bool):
        """Compile Muon's Newton-Schulz, or not (AdamW's fused kernels are already one launch per group)."""
        for opt in self.optimizers:
            if isinstance(opt, Muon):
                opt.use_compile(compiled)

    def state_dict(self) -> dict:
        """Each part's state dict under its name; tensors, numbers, strings and containers only."""
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict: dict):
        """Restore every part's state (moments, momentum buffers, step counts). The settings stay this run's:
        learning rates, decay, betas and the fused/foreach choice come from the config given now."""
        if set(state_dict) != set(self.parts):
            raise ValueError(f"optimizer state holds {sorted(state_dict)} but this run "
                             f"uses {sorted(self.parts)}, resume with the optimizer "
                             "setting the checkpoint was trained with")
        for name, opt in self.parts.items():
            settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(state_dict[name])
            for g, kept in zip(opt.param_groups, settings):
                g.update(kept)
            for p, slots in opt.state.items():  # checkpoints hold whole tensors; FSDP2 keeps its rows of each
                for key, value in slots.items():
                    if torch.is_tensor(value) and value.ndim and value.shape == p.shape:
                        slots[key] = shard_as(value, p)

    def lrs(self) -> dict[str, float]:
        """The current learning rate of each part, by name ("muon", "adamw")."""
        return {name: opt.param_groups[0]["lr"] for name, opt in self.parts.items()}

    def describe(self) -> str:
        """A few lines: per group, tensors, parameters, peak lr, weight decay and the method's settings."""
        lines = ["optimizer: " + " + ".join(type(opt).__name__ for opt in self.optimizers)]
        for opt in self.optimizers:
            for g in opt.param_groups:
                count = sum(p.numel() for p in g["params"])
                if isinstance(opt, Muon):
                    dtype = str(opt.compute_dtype(g["params"][0].device)).removeprefix("torch.")
                    extra = (f"momentum {g['momentum']:g}{' nesterov' if g['nesterov'] else ''}, "
                             f"shape rule {g['shape_rule']}, Newton-Schulz {opt.ns_steps} steps in {dtype}")
                else:
                    impl = "fused" if g.get("fused") else "foreach"
                    extra = f"betas ({g['betas'][0]:g}, {g['betas'][1]:g}), eps {g['eps']:g}, {impl}"
                lines.append(f"  {g['name']:<15}{len(g['params']):>4} tensors{count:>13,} params  "
                             f"peak lr {g['initial_lr']:g}  wd {g['weight_decay']:g}  {extra}")
        return "\n".join(lines)


def split_parameters(model: nn.Module, use_muon: bool = True) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by group: block matrices to Muon, other matrices decayed, vectors not."""
    groups = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    for name, p in model.named_parameters():  # yields a tied embedding/head weight once
        if not p.requires_grad:
            continue
        # Block matrices: ours are layers.N.*, a transformers twin's model.layers.N.* (compiled or wrapped
        # too).
        in_block = name.startswith("layers.") or ".layers." in name
        if use_muon and p.ndim == 2 and in_block:
            groups["muon"].append(p)
        else:
            groups["adamw_decay" if p.ndim >= 2 else "adamw_no_decay"].append(p)
    return groups


def build_optimizer(model: nn.Module, cfg) -> MuonAdamW:
    """The optimizer for `model` (uncompiled) from a config.TrainConfig: Muon + AdamW, or AdamW alone; "auto"
    is Muon here (the trainer's sizing turns it into adamw for a fine-tuning run first)."""
    if cfg.optimizer not in ("auto", "muon", "adamw"):
        raise ValueError(f"optimizer={cfg.optimizer!r} is invalid: choose muon or adamw")
    if not (cfg.learning_rate > 0 and cfg.muon_lr > 0):
        raise ValueError(f"learning_rate={cfg.learning_rate} and muon_lr={cfg.muon_lr} must be positive: "
                         "fill the automatic ones (autofill.fill_automatic) before building the optimizer")
    groups = split_parameters(model, use_muon=cfg.optimizer != "adamw")
    parts = {}
    if groups["muon"]:
        parts["muon"] = Muon([{"name": "muon", "params": groups["muon"], "initial_lr": cfg.muon_lr}],
                             lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                             shape_rule=cfg.muon_shape_rule, ns_dtype=NS_DTYPES[cfg.muon_precision],
                             # CPU: not worth its compile
                             compiled=cfg.compile != "off" and groups["muon"][0].is_cuda)
    adam_groups = [{"name": name, "params": groups[name],
                    "initial_lr": cfg.learning_rate, "weight_decay": wd}
                   for name, wd in (("adamw_decay", cfg.weight_decay), ("adamw_no_decay", 0.0))
                   if groups[name]]
    if adam_groups:
        params = groups["adamw_decay"] + groups["adamw_no_decay"]
        # Fused kernels exist for CUDA and CPU (equal to foreach within float rounding); foreach elsewhere.
        fused = all(p.device.type in ("cuda", "cpu") for p in params) and len({p.device for p in params}) == 1
        parts["adamw"] = torch.optim.AdamW(adam_groups, lr=cfg.learning_rate, eps=cfg.adam_eps,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           fused=fused or None, foreach=None if fused else True)
    opt = MuonAdamW(parts)
    seen = sorted(id(p) for g in opt.param_groups for p in g["params"])
    assert seen == sorted({id(p) for p in model.parameters()
                           if p.requires_grad}), "a parameter is lost or doubled"
    return opt


def block_shapes(m) -> list[tuple[int, int]]:
    """The shapes of one block's matrices for a ModelConfig: q, k, v, o, gate, up, down."""
    d, q, kv, inter = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, \
        m.intermediate_size
    return [(q, d), (kv, d), (kv, d), (d, q), (inter, d), (inter, d), (d, inter)]


def _benchmark(preset: str = "tiny", layers: int = 0, repeats: int = 3):
    """Time one Muon step over a preset's block matrices: torch.optim.Muon against this file's Muon."""
    from config import PRESETS  # the benchmark alone reads the presets: the optimizer itself needs no config
    m = PRESETS[preset]().model
    shapes, n_layers = block_shapes(m), layers or m.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) * 0.02 for s in shapes * n_layers]
    grads = [torch.randn(s, generator=gen) for s in shapes * n_layers]
    makers = {"torch.optim.Muon (bf16, per matrix)": lambda ps: torch.optim.Muon(ps, lr=0.02,
                                                                                 weight_decay=0.1),
              "ours, bf16 (batched)": lambda ps: Muon(ps, weight_decay=0.1, ns_dtype=torch.bfloat16),
              "ours, fp32 (batched, CPU default)": lambda ps: Muon(ps, weight_decay=0.1,
                                                                   ns_dtype=torch.float32)}
    print(f"{preset} preset, {n_layers} layers, {len(weights)} matrices, {torch.get_num_threads()} threads; "
          f"seconds per Muon step, best of {repeats} after one warm-up")
    times = {}
    for label, make in makers.items():
        ps = [nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = make(ps)
        opt.step()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            runs.append(time.perf_counter() - start)
        times[label] = min(runs)
    base = times[next(iter(times))]
    for label, t in times.items():
        print(f"  {label:<36}{t:9.3f} s   {base / t:7.1f}x")


if __name__ == "__main__":
    # python muon_optimizer.py [a preset: tiny, small, ...] [layers, 0: the preset's] [timed repeats]
    _benchmark(sys.argv[1] if len(sys.argv) > 1 else "tiny", *(int(a) for a in sys.argv[2:4]))
