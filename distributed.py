"""Several processes under torchrun: the process group, DDP wrapping, and the collectives the loop needs.

    torchrun --nproc_per_node=4 gpu_training_optimized.py ...
Started without torchrun, every method here is a no-op on one device, so the loop has one code path.
"""

import datetime
import os

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel


class Dist:
    """Rank bookkeeping and the few collectives the training loop uses."""

    def __init__(self):
        self.enabled = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # set by torchrun
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0
        if self.enabled and not torch_dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(self.local_rank)
            # A rank that dies leaves the others waiting in a collective; the timeout turns that hang into an error.
            torch_dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))

    def print(self, *args, **kwargs):
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self):
        if self.enabled:
            torch_dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average of a scalar tensor over ranks."""
        if not self.enabled:
            return value
        value = value.detach().clone().float()  # all_reduce works in place; keep the caller's tensor
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.AVG if torch_dist.get_backend() == "nccl"
                              else torch_dist.ReduceOp.SUM)
        return value if torch_dist.get_backend() == "nccl" else value / self.world_size

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP under torchrun (gradients averaged across ranks); the model itself otherwise."""
        if not self.enabled:
            return model
        ids = [self.local_rank] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=ids)

    def set_grad_sync(self, model: torch.nn.Module, sync: bool):
        """Let DDP all-reduce only on the last micro-batch of an accumulation."""
        ddp = getattr(model, "_orig_mod", model)  # the DDP module under torch.compile's wrapper
        if isinstance(ddp, DistributedDataParallel):
            ddp.require_backward_grad_sync = sync

    def cleanup(self):
        if self.enabled and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def setup() -> Dist:
    return Dist()
