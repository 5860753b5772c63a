"""An exponential moving average of the trained weights over the second half of a run, which the run ends on:
its final evaluation, its last checkpoint and so every export hold the average. Each step's weights carry the
noise of its batch, which the rate schedule alone does not smooth away (docs/training.md#recipe-ablations:
0.007 and 0.010 bits per byte more learned at equal tokens on two seeds, for about 0.5 ms a step over 2.4M
weights on a CPU)."""

import torch

from llm.base.distributed import full_state, local, shard_as
from llm.base.errors import CheckpointError

# the fraction of the run after which weights are averaged: earlier ones are far from where it ends
START = 0.5
# The average spans at most this fraction of the run's steps: beta 0.995 (200 steps) won at 2,300 steps, but
# at 600 it reached back to weights far from the run's end and cost 0.07 bits per byte (docs/training.md).
HORIZON = 0.09


def run_beta(beta: float, total_steps: float) -> float:
    """beta, or less on a run too short for its horizon: a horizon 1 / (1 - beta) of at most HORIZON of its
    steps."""
    return min(beta, max(0.0, 1 - 1 / (HORIZON * total_steps)))


class WeightAverage:
    """The average of the trainable parameters' values after each step from START of the run on, each step
    weighted (1 - beta) and every older one beta times less; beta 0: off. Held in the parameters' own dtype,
    device and sharding (fp32 in training), one more copy of the trained weights."""

    def __init__(self, model: torch.nn.Module, beta: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.beta = beta  # as asked; the run's own (run_beta) is fixed where averaging starts
        self.run_beta = beta
        self.average: list[torch.Tensor] | None = None  # until the run's second half

    @torch.no_grad()
    def update(self, step: int, progress: float):
        """Fold in the weights step (0-based) just made; progress is the fraction of the run done after it."""
        if not self.beta or progress < START:
            return
        if self.average is None:
            # the run's steps, as its clock expects them
            self.run_beta = run_beta(self.beta, (step + 1) / progress)
            self.average = [p.detach().clone() for p in self.params]
        else:
            torch._foreach_lerp_([local(a) for a in self.average], [local(p) for p in self.params],
                                 1 - self.run_beta)

    @torch.no_grad()
    def swap_in(self):
        """Put the average in the weights' place: the run ends on it (the live weights are not needed again).
        """
        if self.average is not None:
            torch._foreach_copy_([local(p) for p in self.params], [local(a) for a in self.average])

    @torch.no_grad()
    def end_on_better(self, loss_of) -> tuple[float, str] | None:
        """Leave in the weights whichever of the average and the last step's weights has the lower loss_of()
        (the validation loss: on a short run the average can be the worse); that loss and a line saying which,
        or None if nothing was averaged."""
        if self.average is None:
            return None
        last_loss, last = loss_of(), [local(p).clone() for p in self.params]
        self.swap_in()
        average_loss = loss_of()
        if average_loss <= last_loss:
            return average_loss, (f"the run ends on its weight average: val loss {average_loss:.4f}, its "
                                  f"last step's weights {last_loss:.4f}")
        torch._foreach_copy_([local(p) for p in self.params], last)
        return last_loss, (f"the run ends on its last step's weights: val loss {last_loss:.4f}, "
                           f"their average {average_loss:.4f}")

    def state_dict(self, keep: bool = True) -> dict | None:
        """The average as whole tensors (gathered under FSDP2; None where keep is False) with its beta, or
        None before it starts. Every rank calls it."""
        return (None if self.average is None
                else {"average": full_state(self.average, keep), "beta": self.run_beta})

    def load_state_dict(self, saved: dict | list | None):
        """Restore what state_dict returned (a list: the average alone, as checkpoints before run_beta held
        it), so a resumed run goes on averaging as the uninterrupted one."""
        if saved is None or not self.beta:  # none saved yet, or averaging is off now
            self.average = None
            return
        average, beta = ((saved.get("average"), saved.get("beta")) if isinstance(saved, dict)
                         else (saved, self.beta))
        if not (isinstance(beta, float) and 0 <= beta < 1) or not isinstance(average, list) or \
                len(average) != len(self.params) or \
                any(not torch.is_tensor(a) or a.shape != p.shape for a, p in zip(average, self.params)):
            raise CheckpointError("the checkpoint's trainer_state.pt holds a weight average that does "
                                  "not match this model's trained weights; resume from another "
                                  "checkpoint, or pass --weight_average 0")
        self.average = [shard_as(a.to(p.device, p.dtype), p) for a, p in zip(average, self.params)]
        self.run_beta = beta
