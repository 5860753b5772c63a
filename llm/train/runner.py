"""The step runner: a training step built once, as the plan's StepSettings say (decided before the model
exists, in plan.py): the model made and given its adapters and execution settings, wrapped (DDP, FSDP2),
compiled or eager, with its optimizer, loss scaler and weight average; the loaders' trim, autocast, and the
objective (next-token, a preference loss, or GRPO's). The trainer asks the Runner; no other module writes the
model's execution settings or the loaders' after it is made.

Eager or compiled is one test, StepSettings.eager, which Runner.eager starts from. A compiler failure at the
first step makes the step eager from then on (fall_back); the settings chosen for the compiled step stay, as
they are valid for both.
"""

from dataclasses import dataclass, replace

import torch

from config import Config
from llm.base.averaging import WeightAverage
from llm.base.device import (autocast, compile_model, eager_or_stop, float8_training, is_compile_failure,
                             keep_freed_memory, keep_grads)
from llm.base.distributed import Ranks
from llm.data.batches import PairBatches
from llm.formats.lora import add_adapters
from llm.formats.trainer_state import TrainingState
from llm.generate.decode_compile import use_compile
from llm.scores.evaluation import next_token_loss, validation_loss
from llm.train import preference, rl
from llm.train.resume import load_into
from llm.train.rollouts import Rollouts
from llm.train.plan import Plan, StepSettings
from modern_llm import Transformer
from muon_optimizer import MuonAdamW, build_optimizer

class NextToken:
    """Language modelling's objective: the model's own mean next-token loss over the batch's labels. It has
    the interface every objective has (preference.Objective's), with no metrics of its own."""

    def __call__(self, model, batch) -> torch.Tensor:
        return next_token_loss(model, batch)[0]

    def evaluate(self, model, amp, val_batches, n: int, ranks, until: float) -> tuple[float, int]:
        loss, read, _ = validation_loss(model, amp, val_batches, n, ranks, until)
        return loss, read

    def take(self, ranks) -> dict:
        return {}

    def kept(self, loss: float) -> dict:
        return {}

    def line(self, metrics: dict) -> str:
        return ""

    def summary(self) -> str:
        return ""


@dataclass
class Runner:
    """The training state (the model uncompiled, its optimizer, scaler and average, the counters) and how a
    step runs on this device: the model wrapped and compiled, autocast, the objective."""
    state: TrainingState
    model: torch.nn.Module  # DDP- or FSDP2-wrapped under torchrun, else the raw model: gradient-sync control
    compiled: torch.nn.Module  # what the step calls: the model compiled, or as it is where eager
    eager: bool  # the step runs the model uncompiled (--compile off, or after a compiler failure)
    amp_dtype: torch.dtype | None
    amp: object  # the autocast context of amp_dtype
    cudagraphs: bool  # the compile mode captures CUDA graphs
    eval_model: torch.nn.Module  # what evaluation calls: raw_model, or its own compiled graph (fp8)
    objective: object  # NextToken, or a preference.Objective
    persistent_grads: bool = False  # .grad in fixed buffers zeroed in place, never None (under CUDA graphs)

    @property
    def raw_model(self) -> torch.nn.Module:  # uncompiled and unwrapped: checkpoints, other shapes, sampling
        return self.state.model

    @property
    def opt(self) -> MuonAdamW:
        return self.state.opt

    @property
    def scaler(self) -> torch.amp.GradScaler | None:  # fp16 only
        return self.state.scaler

    @property
    def average(self) -> WeightAverage:  # of the trained weights, which the run ends on
        return self.state.average

    def loss(self, batch) -> torch.Tensor:
        """The objective's loss of one micro-batch, through the step's model, under autocast."""
        with self.amp:
            return self.objective(self.compiled, batch)

    def fall_back(self, e: Exception, t, ranks: Ranks, doing: str = "training"):
        """After a compiler failure: the step runs the model as it is and the optimizer uncompiled, where
        compile_fallback allows (else CompileError, one line)."""
        if self.eager or not is_compile_failure(e):
            raise e
        ranks.print(eager_or_stop(e, t, self.raw_model, doing))
        self.opt.zero_grad(set_to_none=not self.persistent_grads)
        self.compiled, self.cudagraphs, self.eager = self.model, False, True
        self.opt.use_compile(False)
        use_compile(self.raw_model, "off")  # a GRPO run's sampling too

    def warm_evaluation(self, val_batches, t, ranks: Ranks):
        """Compile evaluation's own graph (FP8 runs) before the loop times anything, eager after a compiler
        failure if allowed."""
        if self.eval_model is self.raw_model:
            return
        try:
            # compiles it
            self.objective.evaluate(self.eval_model, self.amp, val_batches, 1, ranks, float("inf"))
        except Exception as e:
            if not is_compile_failure(e):
                raise
            ranks.print(eager_or_stop(e, t, self.raw_model, "evaluating"))
            self.eval_model = self.raw_model


def new_model(cfg: Config, device: torch.device) -> Transformer:
    """The model initialised from cfg.train.seed on `device`: built on meta (no memory, no draws), given
    memory there (never whole on the CPU first), then drawn once."""
    with torch.device("meta"):
        raw_model = Transformer(cfg.model)
    raw_model.materialize(device)
    torch.manual_seed(cfg.train.seed)
    raw_model.init_weights()  # the same weights on every rank and every device
    return raw_model


def build(cfg: Config, settings: StepSettings, device: torch.device, ranks: Ranks,
          raw_model: torch.nn.Module | None = None, init_state: dict | None = None) -> Runner:
    """Model, wrapping, optimizer, loss scaler and compiled step for cfg on device as `settings` say
    (plan.step_settings), with the next-token objective. raw_model replaces our Transformer (the benchmarks
    pass a transformers twin); init_state holds weights to start from."""
    t, amp_dtype, eager = cfg.train, settings.amp_dtype, settings.eager
    if device.type == "cpu":
        keep_freed_memory()  # before the steps' first allocations
    raw_model = new_model(cfg, device) if raw_model is None else raw_model.to(device)
    if init_state is not None:
        raw_model.load_stored(init_state)
    if t.lora_rank:  # freezes the base: only the adapters train
        raw_model = add_adapters(raw_model, t, amp_dtype, settings.lora_base)
    if t.precision == "fp8":
        raw_model = float8_training(raw_model)  # before sharding and compiling, as torchao asks
    model = ranks.wrap(raw_model, t.data_parallel, param_dtype=amp_dtype)
    opt = build_optimizer(raw_model, t)
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    if settings.cudagraphs:
        keep_grads(opt)
    average = WeightAverage(raw_model, t.weight_average)  # of the parameters as wrapped (FSDP's shards)
    if isinstance(raw_model, Transformer):  # read at each forward: set before the first, which compiles
        raw_model.execution = settings.execution
    # Eager FP8 layers cast and scale in unfused kernels: evaluation gets a graph of its own, warmed before
    # timing.
    eval_model = compile_model(raw_model, "default") if t.precision == "fp8" and not eager else raw_model
    state = TrainingState(raw_model, opt, scaler, average)
    return Runner(state=state, model=model,
                  compiled=model if eager else compile_model(model, t.compile, amp_dtype),
                  eager=eager, amp_dtype=amp_dtype, amp=autocast(device, amp_dtype),
                  cudagraphs=settings.cudagraphs, eval_model=eval_model, objective=NextToken(),
                  persistent_grads=settings.cudagraphs)


def start(plan: Plan) -> tuple[Runner, Plan]:
    """The plan's Runner: build() for it, its objective and loaders (the pair loaders' trim; a GRPO run's
    Rollouts, which sample from the model just built), and the state a --resume continues (a new run's at step
    0); and the plan without --init_from's weights, which the model holds now (their read copy goes with the
    caller's old plan), with its training loader as the step reads it."""
    cfg, t = plan.cfg, plan.cfg.train
    runner = build(cfg, plan.settings, plan.device, plan.ranks, init_state=plan.init_state)
    if t.objective == "grpo":
        runner.objective, batches = rl_objective(plan, runner)
    else:
        runner.objective, batches = token_objective(plan, runner), plan.batches
    load_into(runner.state, plan.ckpt, plan.saved, t.run_dir)
    return runner, replace(plan, init_state=None, batches=batches)


def token_objective(plan: Plan, runner: Runner):
    """The objective of a run on the token cache: a preference loss on pairs (its loaders trimmed where the
    step is eager; dpo's reference computed before a checkpoint loads, from the weights the run starts from),
    else NextToken."""
    t, loaders = plan.cfg.train, {"train": plan.batches, "val": plan.val_batches}
    for loader in loaders.values():
        if isinstance(loader, PairBatches):
            loader.trim = runner.eager  # an eager step's shapes may change: pair windows lose their padding
    objective = preference.objective_for(t, plan.data, loaders, runner.raw_model, runner.amp,
                                         plan.settings, plan.init_fingerprint, plan.ranks.print)
    return objective or NextToken()


def rl_objective(plan: Plan, runner: Runner):
    """A GRPO run's objective and its training loader, the Rollouts that sample from the model being trained.
    """
    t, rewards = plan.cfg.train, plan.rewards
    # Sampling compiles where the step does, in the training mode's vocabulary: auto is a CUDA graph on CUDA
    # and eager on a CPU, where a compile does not pay back (decode_compile.compile_mode).
    use_compile(runner.raw_model, "off" if runner.eager else t.compile)
    # Made before a resumed checkpoint loads: the model holds --init_from's weights now, the KL's reference.
    rollouts = Rollouts(plan.data, runner.raw_model, runner.amp, *rewards, t, plan.row,
                        plan.device, plan.ranks.rank, plan.ranks.world_size, compiled=not runner.eager)
    return rl.Objective(rollouts, t.grad_accum_steps), rollouts
