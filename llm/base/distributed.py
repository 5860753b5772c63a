"""Several processes under torchrun: the process group, DDP or FSDP2 wrapping, and the collectives the loop
needs.

    torchrun --nproc_per_node=4 gpu_training_optimized.py ...                        # DDP
    torchrun --nproc_per_node=4 gpu_training_optimized.py --data_parallel fsdp ...   # FSDP2
Started without torchrun, every method here is a no-op on one device, so the loop has one code path.
Under FSDP2 parameters, gradients and optimizer state are DTensors sharded by rows over the ranks;
full_state() and shard_as() convert between them and the whole tensors checkpoints hold.
"""

import atexit
import datetime
import functools
import inspect
import os
import time

import torch
import torch.distributed as torch_dist
from torch.distributed.elastic.multiprocessing.errors import record as elastic_record
from torch.nn.parallel import DistributedDataParallel

from llm.base.errors import ConfigError

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch built without distributed support: nothing is ever sharded
    DTensor = FSDPModule = ()

# A rank that dies mid-collective leaves the others waiting; this turns that wait into an error. Under
# torchrun on one node the agent kills the other workers as soon as one exits non-zero, so this matters across
# nodes.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# barrier() waits through the rendezvous store, not a collective, so rank 0 may build a large data cache
# meanwhile; it gives up after this long.
BARRIER_TIMEOUT_S = 6 * 3600


class Ranks:
    """Rank bookkeeping and the few collectives the training loop uses."""

    def __init__(self):
        self.enabled = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # set by torchrun
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.is_main = self.rank == 0
        self.device = torch.device("cpu")
        self._barriers = 0
        self._vote = self._vote_host = self._vote_done = None  # stop_vote's buffers
        if self.enabled and not torch_dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            device_id = None
            if backend == "nccl":
                if self.local_rank >= torch.cuda.device_count():
                    raise ConfigError(f"local rank {self.local_rank} has no GPU: this node shows "
                                      f"{torch.cuda.device_count()}, so start at most that many processes "
                                      "per node (--nproc_per_node) or fix CUDA_VISIBLE_DEVICES")
                torch.cuda.set_device(self.local_rank)
                self.device = device_id = torch.device("cuda", self.local_rank)  # one GPU per local rank
            # device_id binds the group to this GPU at once: collectives and barriers never guess the device.
            torch_dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
            # Destroy the group however the process ends (return, error exit, exception), not only on success.
            atexit.register(self.cleanup)

    def print(self, *args, **kwargs):
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self):
        """Wait until every rank gets here. Through the rendezvous store rather than a collective, so rank 0
        may take longer than COLLECTIVE_TIMEOUT before it arrives (building the data cache of a large corpus).
        """
        if not self.enabled:
            return
        get_store = getattr(torch_dist.distributed_c10d, "_get_default_store", None)
        if get_store is None:  # a torch without it: a plain barrier, bounded by COLLECTIVE_TIMEOUT
            torch_dist.barrier()
            return
        store = get_store()
        self._barriers += 1
        key = f"train_barrier_{self._barriers}"
        store.add(key, 1)
        deadline, pause = time.monotonic() + BARRIER_TIMEOUT_S, 0.01
        # Polled rather than store.wait(): a Python loop stays interruptible by Ctrl-C and torchrun's signals.
        while int(store.add(key, 0)) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: the other ranks did not reach the barrier within "
                                   f"{BARRIER_TIMEOUT_S / 3600:g} h")
            time.sleep(pause)
            pause = min(1.0, pause * 1.5)  # at most one store request per second per rank on long waits

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average of a scalar tensor over ranks."""
        if not self.enabled:
            return value
        value = value.detach().clone().float()  # all_reduce works in place; keep the caller's tensor
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.AVG if torch_dist.get_backend() == "nccl"
                              else torch_dist.ReduceOp.SUM)
        return value if torch_dist.get_backend() == "nccl" else value / self.world_size

    def maximum(self, values: list[float]) -> list[float]:
        """The element-wise largest of every rank's values (a collective: the host waits for it)."""
        if not self.enabled:
            return list(values)
        agreed = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(agreed, op=torch_dist.ReduceOp.MAX)
        return agreed.tolist()

    def stop_vote(self, requested: bool) -> bool:
        """Whether every rank should stop now: true on all ranks together once any rank asked to stop.

        A signal reaches the ranks at slightly different steps; a rank that leaves the loop alone leaves the
        others in a collective (and a non-zero rank leaving first means rank 0 never saves). Call once per
        step on every rank, before the step is queued. Distributed, the answer is one call late: it reads the
        vote sent by the previous call, which on a GPU finished before the previous step's work began, so the
        host never waits for the step in flight (no pipeline drain, no per-step sync).
        """
        if not self.enabled:
            return requested
        agreed = False
        if self._vote is None:
            self._vote = torch.zeros((), dtype=torch.int32, device=self.device)
            self._vote_host = torch.zeros((), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        else:
            if self._vote_done is not None:
                # waits for the previous vote only, not for the work queued after it
                self._vote_done.synchronize()
            agreed = bool(self._vote_host.item())  # a host tensor: no device sync
        self._vote.fill_(int(requested))  # a kernel, not a host-to-device copy (which would sync)
        torch_dist.all_reduce(self._vote, op=torch_dist.ReduceOp.MAX)  # NCCL: queued, the host does not wait
        self._vote_host.copy_(self._vote, non_blocking=True)
        if self.device.type == "cuda":
            self._vote_done = torch.cuda.Event()
            self._vote_done.record()
        return agreed

    def launcher(self) -> str:
        """How this process was started, for the resume hint: python, or torchrun with this run's shape."""
        if not self.enabled:
            return "python"
        nodes = max(1, self.world_size // max(1, self.local_world_size))
        if nodes == 1:
            return f"torchrun --nproc_per_node={self.local_world_size}"
        return (f"torchrun --nnodes={nodes} --nproc_per_node={self.local_world_size} "
                "--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT (on every node)")

    def wrap(self, model: torch.nn.Module, data_parallel: str = "ddp",
             param_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Under torchrun, DDP (gradients averaged across ranks) or FSDP2 (sharded in place, so the model
        itself comes back); the model untouched otherwise. param_dtype: FSDP2 gathers weights in it."""
        if not self.enabled:
            return model
        if data_parallel == "fsdp":
            return shard_model(model, param_dtype)
        ids = [self.local_rank] if self.device.type == "cuda" else None
        # No buffer broadcast before every forward: the only buffers (RoPE tables) are computed alike on every
        # rank, so it would be a wasted collective per micro-batch. Newer torch names the flag differently.
        params = inspect.signature(DistributedDataParallel).parameters
        keep_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                        else {"broadcast_buffers": False})
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, one gradient-sized copy fewer.
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, **keep_buffers)

    def set_grad_sync(self, model: torch.nn.Module, sync: bool):
        """Let DDP all-reduce (FSDP2 reduce-scatter) only on the last micro-batch of an accumulation."""
        wrapped = getattr(model, "_orig_mod", model)  # the DDP or FSDP module under torch.compile's wrapper
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.require_backward_grad_sync = sync
        elif isinstance(wrapped, FSDPModule):
            wrapped.set_requires_gradient_sync(sync)

    def cleanup(self):
        """Destroy the process group; safe to call more than once (the loop's end, then atexit)."""
        if self.enabled and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2: each block, then the rest (embedding, tied head, final norm), sharded over every rank.

    A block's weights are gathered just before its forward and freed after it (and again for its backward),
    so a GPU holds one block whole at a time. Gradients are reduced in fp32 whatever param_dtype is.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    # The root's weights (embedding and tied head) are needed again at once by the loss: keep them gathered.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor (a view: writing to it writes the DTensor); a plain tensor as is.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def shard_as(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor cut the way `like` is sharded (a DTensor), or `full` itself when `like` is plain.
    Every rank holds `full`, so each keeps its rows with no communication."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def full_state(obj, keep: bool = True):
    """obj (nested dicts and lists of tensors) with every DTensor gathered whole onto the CPU; where keep is
    False the gathered copies are dropped (None), so only the saving rank holds them. Every rank must call it
    with the same structure: each DTensor is an all-gather."""
    if isinstance(obj, DTensor):
        whole = obj.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(obj, dict):
        return {k: full_state(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v, keep) for v in obj)
    return obj


def setup() -> Ranks:
    return Ranks()


def record(fn):
    """Under torchrun, torch's @record: an exception escaping fn on any rank is written where torchrun reads
    it, so its final report names that rank's error as the root cause. Without torchrun, fn as it is."""
    recorded = elastic_record(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return (recorded if "TORCHELASTIC_ERROR_FILE" in os.environ else fn)(*args, **kwargs)
    return wrapper
