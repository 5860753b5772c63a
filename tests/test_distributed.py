"""Multi-process training on CPU: 2 ranks over gloo under torchrun (python -m torch.distributed.run), a tiny
model, with DDP and with FSDP2.

The torchrun runs start the trainer through a small probe script written into tmp_path: it imports the
trainer, records what each rank saw (windows read, weight and optimizer-state hashes, the DDP all-reduces and
the accumulation micro-step each ran in, whether the process group was destroyed at exit) into PROBE_OUT, and
can raise an error or send itself SIGTERM on rank 1 at a given step. The one-process references run in this
process."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed
from safetensors.torch import load_file

import gpu_training_optimized as trainer
from conftest import TINY_MODEL
from llm.data import batches as batches_module
from llm.data.batches import Batches
from llm.reports.monitor import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="needs torch.distributed with gloo")]

PROBE = r'''
import atexit, hashlib, json, os, signal, sys, time
import torch
import torch.distributed
from llm.base import distributed
import gpu_training_optimized as trainer
import muon_optimizer
from llm.data import batches

out, rank = os.environ["PROBE_OUT"], int(os.environ.get("RANK", 0))
fail_step, signal_step = int(os.environ.get("PROBE_FAIL_STEP", -1)), int(os.environ.get("PROBE_SIGNAL_STEP", -1))
log = {"windows": {}, "hashes": {}, "allreduce_in_sync_micro": [], "reduce_scatter_in_sync_micro": [],
       "spread_calls": 0, "group_alive_at_exit": None}
now = {"sync": None}


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        t = distributed.local(t)  # FSDP2: this rank's rows
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def at_exit():  # registered before Ranks's cleanup, so it runs after it
    log["group_alive_at_exit"] = torch.distributed.is_available() and torch.distributed.is_initialized()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


atexit.register(at_exit)

get = batches.Batches.get
def logged_get(self, step, micro_step):
    x, y, pos = get(self, step, micro_step)
    if self.split == "train":
        log["windows"][f"{step}/{micro_step}"] = digest([x])
    return x, y, pos
batches.Batches.get = logged_get

set_grad_sync = distributed.Ranks.set_grad_sync
def logged_set_grad_sync(self, model, sync):
    now["sync"] = sync
    set_grad_sync(self, model, sync)
distributed.Ranks.set_grad_sync = logged_set_grad_sync

wrap = distributed.Ranks.wrap
def hooked_wrap(self, model, *args, **kwargs):
    ddp = wrap(self, model, *args, **kwargs)
    if ddp is not model:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        def hook(state, bucket):  # runs for every bucket DDP all-reduces
            log["allreduce_in_sync_micro"].append(now["sync"])
            return allreduce_hook(None, bucket)
        ddp.register_comm_hook(None, hook)
    return ddp
distributed.Ranks.wrap = hooked_wrap

reduce_scatter = torch.distributed.reduce_scatter_single
def logged_reduce_scatter(*args, **kwargs):  # FSDP2 reduces and shards gradients through this
    log["reduce_scatter_in_sync_micro"].append(now["sync"])
    return reduce_scatter(*args, **kwargs)
torch.distributed.reduce_scatter_single = logged_reduce_scatter

spread = muon_optimizer.Muon._orthogonalize_spread
def counted_spread(self, *args):
    log["spread_calls"] += 1
    return spread(self, *args)
muon_optimizer.Muon._orthogonalize_spread = counted_spread

save = trainer.save
def hashed_save(plan, b, *args):  # every rank calls save; rank 0 alone writes
    tensors = list(b.raw_model.state_dict().values())
    def walk(v):
        if torch.is_tensor(v):
            tensors.append(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
    walk(b.opt.state_dict())
    log["hashes"][str(b.state.step)] = digest(tensors)
    return save(plan, b, *args)
trainer.save = hashed_save

train_step = trainer.train_step
def probed_train_step(b, batches, step, *args):
    if rank == 1 and step == fail_step:
        with open(os.path.join(out, "failed_at"), "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError(f"probe failure on rank 1 at step {step}")
    if rank == 1 and step == signal_step:
        os.kill(os.getpid(), signal.SIGTERM)  # as if the signal reached rank 1 a step before rank 0
    return train_step(b, batches, step, *args)
trainer.train_step = probed_train_step

sys.exit(trainer.run(sys.argv[1:]))
'''


HELPERS = r'''
import datetime, os, time
import torch
import torch.distributed
from llm.base import distributed
from llm.generate.inference import load_for_inference

distributed.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=2)
d = distributed.setup()
if d.rank == 0:
    time.sleep(4)  # rank 0 building the data cache for longer than the collective timeout
d.barrier()
x = torch.ones(())
torch.distributed.all_reduce(x)
votes = [d.stop_vote(d.rank == 1 and i >= 2) for i in range(5)]
print(f"rank {d.rank}: after barrier {x.item():g}, mean {d.mean(torch.tensor(float(d.rank))).item():g}, "
      f"votes {votes}", flush=True)
'''


class AsIfWorld(Batches):
    """One process reading, at micro-step m, the window rank m % 2 reads at micro-step m // 2 under 2 ranks.

    Global micro-batch m = micro * world + rank, so one process with accumulation 2k sees exactly the batches
    of 2 ranks with accumulation k. Validation already numbers its windows that way."""
    WORLD = 2

    def starts(self, step, micro_step):
        if self.split != "train":
            return super().starts(step, micro_step)
        order = self.order
        saved = order.rank, order.world_size, order.accum
        order.rank, order.world_size, order.accum = micro_step % self.WORLD, self.WORLD, order.accum // self.WORLD
        try:
            return super().starts(step, micro_step // self.WORLD)
        finally:
            order.rank, order.world_size, order.accum = saved


@pytest.fixture(scope="module")
def corpus(corpus):
    """The shared corpus (conftest.py), plus the probe and helper scripts the torchrun runs start."""
    probe, helpers = corpus["base"] / "probe.py", corpus["base"] / "helpers.py"
    probe.write_text(PROBE)
    helpers.write_text(HELPERS)
    return {**corpus, "probe": str(probe), "helpers": str(helpers)}


def args_for(corpus, run_dir, accum, *extra):
    return ["--preset", "tiny", "--sources", corpus["src"], "--cache_dir", corpus["cache"], "--run_dir", str(run_dir),
            *(word for name, value in TINY_MODEL.items() for word in (f"--{name}", str(value))),
            "--micro_batch_size", "4", "--compile", "off", "--precision", "fp32", "--muon_precision", "fp32",
            "--log_interval", "1",
            "--warmup_ratio", "0.3", "--max_steps", "6", "--eval_interval", "3", "--save_interval", "3",
            "--eval_batches", "2", "--grad_accum_steps", str(accum), *map(str, extra)]


def torchrun(corpus, out, args, timeout=120, script="probe", **probe_env):
    """2 ranks on gloo through the probe; returns (returncode, stdout + stderr, seconds, per-rank probe logs).
    """
    os.makedirs(out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), PROBE_OUT=str(out), OMP_NUM_THREADS="1",
               **{f"PROBE_{k.upper()}": str(v) for k, v in probe_env.items()})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           corpus[script], *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.monotonic() - start
    logs = {}
    for r in (0, 1):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                logs[r] = json.load(f)
    return proc.returncode, proc.stdout + proc.stderr, seconds, logs


def metrics(run_dir, kind="train"):
    return read_metrics(run_dir, kind)


def weights(run_dir, step):
    return load_file(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "model.safetensors"))


def rewind(src, dst, step):
    """A copy of run folder src whose newest checkpoint is `step`, without the metrics, ready for --resume."""
    shutil.copytree(src, dst)
    root = os.path.join(dst, "checkpoints")
    for name in os.listdir(root):
        if name.startswith("step_") and int(name[5:]) > step:
            shutil.rmtree(os.path.join(root, name))
    with open(os.path.join(root, "LATEST"), "w", encoding="utf-8") as f:
        f.write(f"step_{step:06d}\n")
    os.remove(os.path.join(dst, "metrics.jsonl"))


def assert_losses_close(a, b, rel=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=rel), (x, y)


def assert_weights_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory):
    """2 ranks x accumulation 2 x micro-batch 4, 6 steps, checkpoints at 3 and 6."""
    base = tmp_path_factory.mktemp("two_ranks")
    run = base / "run"
    rc, output, _, logs = torchrun(corpus, base / "probe", args_for(corpus, run, 2))
    assert rc == 0, output[-4000:]
    assert set(logs) == {0, 1}, output[-4000:]
    return {"run": str(run), "output": output, "logs": logs}


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The reference: 1 process x accumulation 4 x micro-batch 4 over the windows the 2 ranks read, eval over
    the same 2 x 2 validation batches."""
    run = tmp_path_factory.mktemp("one_process") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches_module, "Batches", AsIfWorld)
        assert trainer.main(args_for(corpus, run, 4, "--eval_batches", 4)) == 0
    return {"run": str(run)}


def test_two_ranks_match_one_process_with_twice_the_accumulation(two_ranks, one_process):
    """DDP's gradient average plus accumulation must equal one process accumulating every rank's
    micro-batches: catches a wrong loss scale (sum instead of mean over ranks, or 1/accum applied twice), a
    missing all-reduce, eval losses not averaged over ranks, and losses logged from rank 0 alone."""
    assert_losses_close(metrics(two_ranks["run"]), metrics(one_process["run"]))
    for a, b in zip(metrics(two_ranks["run"]), metrics(one_process["run"])):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    evals, ref = metrics(two_ranks["run"], "eval"), metrics(one_process["run"], "eval")
    assert [r["step"] for r in evals] == [r["step"] for r in ref] == [3, 6]
    for a, b in zip(evals, ref):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert_weights_close(weights(two_ranks["run"], 6), weights(one_process["run"], 6))


def test_ranks_read_different_windows(two_ranks):
    """Each rank must train on its own windows: catches every rank reading rank 0's data (world size times the
    compute for one rank's worth of data) and a rank that skips micro-steps."""
    w0, w1 = two_ranks["logs"][0]["windows"], two_ranks["logs"][1]["windows"]
    expected = {f"{step}/{micro}" for step in range(6) for micro in range(2)}
    assert set(w0) == set(w1) == expected
    assert not set(w0.values()) & set(w1.values())


@pytest.mark.parametrize("run,collective", [("two_ranks", "allreduce"), ("two_ranks_fsdp", "reduce_scatter")])
def test_accumulation_reduces_gradients_only_on_the_last_micro_batch(run, collective, request):
    """DDP must not all-reduce, nor FSDP2 reduce-scatter, on every micro-step of an accumulation: catches
    set_grad_sync not reaching the wrapped module (e.g. under a wrapper), which would double the communication
    at accumulation 2."""
    logs = request.getfixturevalue(run)["logs"]
    for r in (0, 1):
        calls = logs[r][f"{collective}_in_sync_micro"]
        assert calls and len(calls) % 6 == 0, calls  # the same number of buckets in each of the 6 steps
        assert all(c is True for c in calls), calls  # never during a micro-step that asked for no sync


def test_every_rank_ends_each_step_with_identical_weights_and_optimizer_state(two_ranks):
    """Weights, Muon momentum and AdamW moments must be bit-identical on every rank at every checkpoint:
    catches Muon's Newton-Schulz split over ranks applying a rank's own slice without gathering the others,
    and any other rank-local update. The spread path must actually have run. (Slices gathered in the wrong
    order stay identical across ranks; the comparison with one process catches that.)"""
    h0, h1 = two_ranks["logs"][0]["hashes"], two_ranks["logs"][1]["hashes"]
    assert set(h0) == {"3", "6"} and h0 == h1
    assert two_ranks["logs"][0]["spread_calls"] == two_ranks["logs"][1]["spread_calls"] >= 6


def test_rank_zero_alone_prints_and_writes(two_ranks):
    """Only rank 0 may print the report and write metrics and checkpoints: catches one metrics line per rank,
    two writers racing on a checkpoint, and the report printed once per rank. Tokens per step count every
    rank."""
    train = metrics(two_ranks["run"])
    assert [r["step"] for r in train] == list(range(1, 7))
    assert [r["step"] for r in metrics(two_ranks["run"], "eval")] == [3, 6]
    assert train[-1]["tokens"] == 6 * 4 * 64 * 2 * 2
    assert sorted(os.listdir(os.path.join(two_ranks["run"], "checkpoints"))) == ["BEST", "LATEST", "step_000003",
                                                                                  "step_000006"]
    out = two_ranks["output"]
    assert out.count("4 x 64 tokens x 2 accumulation x 2 ranks = 1,024 tokens per step") == 1
    assert out.count("done: 6 steps") == 1 and out.count("world size: 2") == 1


def test_process_group_destroyed_at_exit(two_ranks):
    """Every rank must destroy its process group before the interpreter exits."""
    assert [two_ranks["logs"][r]["group_alive_at_exit"] for r in (0, 1)] == [False, False]


def test_two_rank_checkpoint_resumes_in_one_process(corpus, two_ranks, tmp_path):
    """A checkpoint written by 2 ranks must resume in 1 process with accumulation 4 and continue exactly as
    the 2 ranks did: catches rank-dependent optimizer state or a DDP 'module.' prefix in the saved weights."""
    assert_one_process_continues(corpus, two_ranks["run"], tmp_path / "run")


def assert_one_process_continues(corpus, two_rank_run, run):
    """Rewind the 2-rank run to step 3 into `run`, resume it in one process with accumulation 4: it must
    continue exactly as the 2 ranks did."""
    rewind(two_rank_run, run, 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches_module, "Batches", AsIfWorld)
        assert trainer.main(args_for(corpus, run, 4, "--eval_batches", 4, "--resume")) == 0
    assert_losses_close(metrics(run), metrics(two_rank_run)[3:])
    assert_weights_close(weights(run, 6), weights(two_rank_run, 6))


def test_one_process_checkpoint_resumes_in_two_ranks(corpus, one_process, tmp_path):
    """A checkpoint written by 1 process must resume under 2 ranks (accumulation halved) and continue exactly
    as the one process did: catches ranks that do not all load it or that resume at different steps."""
    run = tmp_path / "run"
    rewind(one_process["run"], run, 3)
    rc, output, _, logs = torchrun(corpus, tmp_path / "probe", args_for(corpus, run, 2, "--resume"))
    assert rc == 0, output[-4000:]
    assert output.count("resumed from") == 1
    assert_losses_close(metrics(run), metrics(one_process["run"])[3:])
    assert_weights_close(weights(run, 6), weights(one_process["run"], 6))
    assert logs[0]["hashes"]["6"] == logs[1]["hashes"]["6"]


@pytest.fixture(scope="module")
def two_ranks_fsdp(corpus, tmp_path_factory):
    """As two_ranks, with FSDP2: weights, gradients and optimizer state sharded over the 2 ranks."""
    base = tmp_path_factory.mktemp("two_ranks_fsdp")
    run = base / "run"
    rc, output, _, logs = torchrun(corpus, base / "probe", args_for(corpus, run, 2, "--data_parallel", "fsdp"))
    assert rc == 0, output[-4000:]
    assert set(logs) == {0, 1}, output[-4000:]
    return {"run": str(run), "output": output, "logs": logs}


def test_fsdp_two_ranks_match_one_process_with_twice_the_accumulation(two_ranks_fsdp, one_process):
    """FSDP2 must train exactly as one process with every micro-batch: catches Muon orthogonalising one rank's
    rows instead of the whole matrix, a gradient norm over one shard, reduce-scattered gradients summed rather
    than averaged, and a checkpoint holding one rank's rows (it would not even load)."""
    assert "world size: 2 (fsdp)" in two_ranks_fsdp["output"]
    assert_losses_close(metrics(two_ranks_fsdp["run"]), metrics(one_process["run"]))
    for a, b in zip(metrics(two_ranks_fsdp["run"]), metrics(one_process["run"])):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for a, b in zip(metrics(two_ranks_fsdp["run"], "eval"), metrics(one_process["run"], "eval")):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert_weights_close(weights(two_ranks_fsdp["run"], 6), weights(one_process["run"], 6))


def test_fsdp_checkpoint_resumes_in_one_process_and_loads_in_the_generator(corpus, two_ranks_fsdp, tmp_path):
    """A checkpoint of an FSDP2 run holds whole tensors: one process resumes it and continues as the 2 ranks
    did (optimizer state included), and the generator loads it as it is."""
    from llm.generate.inference import load_for_inference
    assert_one_process_continues(corpus, two_ranks_fsdp["run"], tmp_path / "run")
    model = load_for_inference(two_ranks_fsdp["run"], torch.device("cpu"))[0]
    saved = weights(two_ranks_fsdp["run"], 6)
    for prefix in {k.rsplit(".", 3)[0] for k in saved if ".attn." in k}:  # as generation stacks them
        for fused, parts in ((".attn.qkv_proj", ("q", "k", "v")), (".mlp.gate_up_proj", ("gate", "up"))):
            owner = prefix + fused.rsplit(".", 1)[0]
            saved[prefix + fused + ".weight"] = torch.cat([saved.pop(f"{owner}.{p}_proj.weight") for p in parts])
    assert_weights_close({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, saved)


def test_one_process_checkpoint_resumes_under_fsdp(corpus, one_process, tmp_path):
    """A whole-tensor checkpoint of one process must resume under FSDP2, each rank taking its rows of weights,
    Muon momentum and Adam moments, and continue exactly as the one process did."""
    run = tmp_path / "run"
    rewind(one_process["run"], run, 3)
    rc, output, _, _ = torchrun(corpus, tmp_path / "probe", args_for(corpus, run, 2, "--resume",
                                                                      "--data_parallel", "fsdp"))
    assert rc == 0, output[-4000:]
    assert_losses_close(metrics(run), metrics(one_process["run"])[3:])
    assert_weights_close(weights(run, 6), weights(one_process["run"], 6))


def test_error_on_one_rank_stops_every_rank_with_its_message(corpus, tmp_path):
    """An exception on rank 1 must end both processes promptly with rank 1's message in the output: catches
    rank 0 waiting in a collective until the process-group timeout (10 minutes)."""
    out = tmp_path / "probe"
    rc, output, _, logs = torchrun(corpus, out, args_for(corpus, tmp_path / "run", 2, "--max_steps", 50),
                                   fail_step=2)
    ended = time.time()
    assert rc != 0
    # torchrun's closing report (its failures and root cause, ordered by the second each was recorded in) must
    # carry rank 1's error, not only the collective error it caused on rank 0.
    assert "RuntimeError: probe failure on rank 1 at step 2" in output.split("Failures:")[-1]
    with open(out / "failed_at", encoding="utf-8") as f:
        assert ended - float(f.read()) < 60, output[-4000:]  # far below the 10-minute collective timeout
    assert logs[1]["group_alive_at_exit"] is False  # the failing rank destroyed its group on the way out


def test_signal_on_one_rank_stops_every_rank_at_the_same_step(corpus, tmp_path):
    """A stop request seen by one rank first (signals reach ranks at different steps) must stop every rank at
    the same step with a checkpoint and a clean exit: catches a rank leaving the loop alone, so that the
    others fail in their next collective (and rank 0 may never save)."""
    run = tmp_path / "run"
    rc, output, _, logs = torchrun(corpus, tmp_path / "probe", args_for(corpus, run, 1, "--max_steps", 40,
                                                                      "--save_interval", 100), signal_step=3)
    assert rc != 0, output[-4000:]  # 143 from each rank: torchrun reports the run as not finished
    saved = sorted(logs[0]["hashes"])
    assert saved == sorted(logs[1]["hashes"]) and len(saved) == 1 and 3 < int(saved[0]) < 40
    assert logs[0]["hashes"] == logs[1]["hashes"]
    step = int(saved[0])
    assert os.path.isdir(os.path.join(run, "checkpoints", f"step_{step:06d}"))
    assert f"stopped: {step} steps" in output
    assert "resume with: torchrun --nproc_per_node=2 gpu_training_optimized.py" in output


def test_barrier_outlasts_the_collective_timeout_and_stop_vote_agrees(corpus, tmp_path):
    """The barrier that holds the other ranks while rank 0 builds the data cache must not be bounded by the
    process-group timeout (a large corpus takes longer than 10 minutes to tokenize); stop_vote must turn one
    rank's request into the same answer on every rank, one call later; mean must average over ranks."""
    rc, output, _, _ = torchrun(corpus, tmp_path, [], script="helpers")
    assert rc == 0, output[-4000:]
    for r in (0, 1):
        assert f"rank {r}: after barrier 2, mean 0.5, votes [False, False, False, True, True]" in output, output
