"""Compiling generation, decided once per model at load (use_compile): the prefill compiled for each prompt
bucket, the decode step in the model's mode (a CUDA graph on CUDA), kept per batch size for the model's life,
and a background compile so that a REPL's or a server's first reply waits for none."""

import os
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch

from config import SampleConfig
from llm.base.device import uses_cuda_graphs
from llm.generate.decode import MIN_BUCKET, Slot, State, decode_step, prefill_step
from llm.generate.sampling import candidates

# graphs of one compiled step: a prompt bucket each (batch sizes have steps of their own)
RECOMPILE_LIMIT = 64


def compile_mode(setting: str, device: torch.device) -> str | None:
    """The one decision whether generation compiles (LoadConfig.compile on this device): the torch.compile
    mode of the decode step, or None for eager. auto: reduce-overhead on CUDA, where CUDA graphs pay back the
    compile, eager elsewhere; never on MPS, where the compiled decode step is not supported as it is on CUDA
    and CPU. Off CUDA a mode that captures CUDA graphs runs as the same mode without them."""
    if setting == "off" or device.type == "mps" or (setting == "auto" and device.type != "cuda"):
        return None
    mode = "reduce-overhead" if setting == "auto" else setting
    if device.type != "cuda":
        return {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
    return mode


@dataclass
class Compiled:
    """A model whose generation compiles: its decode step's mode, its slots and its background compile."""
    mode: str
    slots: dict = field(default_factory=dict)  # (batch size, cache length) -> Slot
    background: threading.Thread | None = None


_COMPILED = weakref.WeakKeyDictionary()  # model -> Compiled, for the models use_compile() set to compile


def use_compile(model, setting: str) -> bool:
    """Set once, at load, whether generate() compiles this model's steps (compile_mode of LoadConfig.compile
    and the model's device); True when it does. Models never set generate eagerly."""
    mode = compile_mode(setting, model.embed_tokens.weight.device)
    if mode is None:
        _COMPILED.pop(model, None)
    elif _COMPILED.get(model) is None or _COMPILED[model].mode != mode:
        _COMPILED[model] = Compiled(mode)
    return mode is not None


def compiles(model) -> bool:
    """Whether generate() compiles this model's steps (use_compile)."""
    return model in _COMPILED


def compiled_slot(model, batch: int, length: int = 0) -> Slot:
    """The compiled slot of `batch` rows and a cache of `length` positions (0: the whole context), built on
    first use and kept: the cache and state at pinned addresses, the prefill compiled, and the decode step
    compiled in the model's mode. With a mode that captures CUDA graphs the first decode calls of a generating
    thread capture the graph and later ones replay it. A length of its own is for callers whose rows never
    reach the context's end (GRPO's replies: a prompt and at most max_completion_length), whose cache would
    otherwise hold it all."""
    steps, device, vocab = _COMPILED[model], model.embed_tokens.weight.device, model.config.vocab_size
    key = (batch, length or model.config.max_seq_len)
    if key in steps.slots:
        return steps.slots[key]
    cache, state = model.make_kv_cache(batch, key[1]), State.empty(batch, vocab, device)
    prefill = torch.compile(prefill_step, dynamic=False)
    if device.type == "cuda":
        for t in (*cache.k, *cache.v, cache.pos, cache.next_mask, *vars(state).values()):
            torch._dynamo.mark_static_address(t)  # written in place by the graph: addresses never change
    mode = None if steps.mode == "default" else steps.mode
    compiled = torch.compile(decode_step, mode=mode, dynamic=False, fullgraph=device.type == "cuda")

    def graph_step(*args):  # a new graph step per call: no output of the last replay is kept
        torch.compiler.cudagraph_mark_step_begin()
        compiled(*args)
    decode = graph_step if uses_cuda_graphs(steps.mode, device) else compiled
    steps.slots[key] = Slot(cache, state, prefill, decode, compiled=True)
    return steps.slots[key]


def rows_to_reuse(model, batch: int, length: int) -> int:
    """Rows for a compiled generate_all of `batch` rows at a cache of `length`: the fewest of a slot already
    built that holds them all, else batch. Its spare rows stay done, and a graph reused costs no compile: a
    GRPO run's greedy evaluation of 4 held-out prompts compiled a graph beside its rollouts' of 32 rows, 27
    MB more peak memory on a CPU, and seconds."""
    built = [rows for rows, cache in _COMPILED[model].slots if cache == length and rows >= batch]
    return min(built, default=batch)


def compile_limits():
    """A context in which a compiled step may compile a graph for each prompt bucket (more than dynamo's
    default 8) and fails loudly past RECOMPILE_LIMIT rather than generating eagerly without a word; the
    process's own settings hold outside it."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)


def compile_in_background(model, settings: SampleConfig, on_error=None) -> threading.Thread:
    """Compile the batch-1 prefill (of the shortest bucket) and decode step of a model set to compile, for
    these settings, in a thread, while generate() runs eagerly: a REPL's or a server's first reply then waits
    for no compile. The thread runs each step once; it never captures a CUDA graph (the first compiled call of
    a generating thread does), so eager generation beside it is safe. A failed compile leaves generation
    eager, with the error kept as `.error` and passed to on_error."""
    def work():
        try:
            with torch.no_grad(), compile_limits():
                slot = compiled_slot(model, 1)
                device = model.embed_tokens.weight.device
                ids = torch.zeros(1, MIN_BUCKET, dtype=torch.long, device=device)
                ranked = candidates([settings], model.config.vocab_size)
                slot.prefill(model, ids, torch.ones(1, dtype=torch.long, device=device), slot.cache,
                             slot.state, ranked)
                slot.decode(model, slot.cache, slot.state, ranked)
        except Exception as e:  # generation stays eager; the caller says so
            thread.error = e
            if on_error:
                on_error(e)
    thread = threading.Thread(target=work, name="compile", daemon=True)
    thread.error = None
    _COMPILED[model].background = thread
    thread.start()
    return thread


def compile_failed(e: BaseException):
    """The warning of a background compile that failed (compile_in_background's on_error for the scripts)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    print(f"warning: compiling the decode step failed ({first[:200]}); generating eagerly", file=sys.stderr,
          flush=True)


def compiling(model) -> bool:
    """Whether the model's steps are still compiling in the background, or failed to: generate eagerly then.
    """
    thread = _COMPILED[model].background if model in _COMPILED else None
    return thread is not None and (thread.is_alive() or thread.error is not None)


def exit_process(code: int):
    """sys.exit(code), or, while a background compile still runs, an exit that skips the interpreter's
    teardown: the teardown stops the compiling thread inside C++, which aborts the process ("terminate called
    without an active exception") and turns the exit status of a reply already given into 134."""
    if any(c.background is not None and c.background.is_alive() for c in list(_COMPILED.values())):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
