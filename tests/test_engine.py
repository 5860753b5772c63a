"""Tests of engine.py: cached batched generation against full forwards, eos and stop strings read back in
chunks, per-row settings, seeds, the compiled decode step against the eager one, and transformers' greedy.

The model and tokenizer are the tiny checkpoint of conftest.py, loaded as the generator loads it.
"""

import copy
import os
from dataclasses import replace

import pytest
import torch
from test_sampling import sample_next

from config import SampleConfig
from conftest import CODE as TEXT
from llm.generate import decode, decode_compile, engine, sampling
from llm.generate.inference import load_for_inference, quantize_int8

GREEDY = SampleConfig(temperature=0.0, max_new_tokens=12, seed=0)


def compiled(model, mode: str = "default"):
    """A copy of model whose generation compiles, as for_inference sets a loaded one; model itself stays
    eager."""
    twin = copy.deepcopy(model)
    assert decode_compile.use_compile(twin, mode)
    return twin


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_greedy_matches_full_forward_argmax(tiny_loaded):
    """The cached decode must equal argmax over a full forward per step (catches cache/position bugs)."""
    model, tok = tiny_loaded
    prompt = ids_of(tok, "def push(self")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    first = engine.generate(model, [prompt], GREEDY)
    assert first == [ids[len(prompt):]]
    assert engine.generate(model, [prompt], GREEDY) == first  # deterministic


def test_top_k_one_is_greedy(tiny_loaded):
    """top_k=1 must pick the argmax whatever the temperature (an off-by-one in the k-th value breaks it)."""
    model, tok = tiny_loaded
    prompt = [ids_of(tok, "class Stack")]
    sampled = engine.generate(model, prompt, replace(GREEDY, temperature=1.5, top_k=1, top_p=1.0, seed=3))
    assert sampled == engine.generate(model, prompt, GREEDY)
    logits = torch.randn(5, 50)
    assert torch.equal(sample_next(logits, 2.0, top_k=1), logits.argmax(-1, keepdim=True))


def test_repetition_penalty_counts_prompt_and_generated_tokens(tiny_loaded):
    """With a huge penalty, greedy never repeats a token of the prompt or of its own output."""
    model, tok = tiny_loaded
    prompt = ids_of(tok, "return n")
    out = engine.generate(model, [prompt], replace(GREEDY, repetition_penalty=1e6, max_new_tokens=20))[0]
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_batch_of_different_lengths_equals_one_by_one(tiny_loaded):
    """Right-padded prefill with input_lengths must not let padding or other rows change any row."""
    model, tok = tiny_loaded
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    batched = engine.generate(model, prompts, GREEDY)
    assert batched == [engine.generate(model, [p], GREEDY)[0] for p in prompts]


def naive_greedy(model, prompt: list[int], n: int, eos: set) -> list[int]:
    """Greedy by a full forward over the whole sequence for every token: no cache, no batch."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < n:
            token = int(model(torch.tensor([ids]))[0][0, -1].argmax())
            if token in eos:
                break
            ids.append(token)
    return ids[len(prompt):]


def test_generate_all_compiled_writes_what_it_writes_eagerly(tiny_loaded):
    """GRPO samples through generate_all from a model set to compile where its step compiles (on CUDA a graph
    of the decode step, not an eager loop): the compiled slot (the whole context, kept between calls, rows
    refilled into it in place) writes each reply the eager one writes, greedy and seeded sampling alike, twice
    in a row (the kept slot's last call leaves nothing behind). Its cache holds the replies' reach: a
    32k-context model's rollouts would otherwise keep gigabytes of cache through training. Fewer prompts than
    its rows (a GRPO run's held-out evaluation) run in that slot, its spare rows idle, not in a graph compiled
    for them."""
    model, tok = tiny_loaded
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x", "class Stack:", "return n")]
    eos = engine.generate(model, prompts[:1], GREEDY)[0][4]
    fast = compiled(model)
    sampled = SampleConfig(temperature=1.0, top_k=0, max_new_tokens=10, seed=7)
    for settings in (GREEDY, sampled, GREEDY):
        eager = engine.generate_all(model, prompts, settings, [eos], rows=2)
        assert engine.generate_all(fast, prompts, settings, [eos], rows=2) == eager
    longest = prompts[1:2]  # the others' reach: the same cache length
    assert engine.generate_all(fast, longest, GREEDY, [eos]) == engine.generate_all(model, longest, GREEDY, [eos])
    (rows, length), = decode_compile._COMPILED[fast].slots  # one compiled slot, reused
    # GRPO's rollouts sample from the whole softmax, and its greedy evaluation runs in their graph: the compiled
    # step is called with the same `ranked` (a graph each)
    rollout = SampleConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10, seed=7)
    slot, ranks = decode_compile._COMPILED[fast].slots[rows, length], set()
    step = slot.decode
    slot.decode = lambda *args: (ranks.add(args[-1]), step(*args))
    for settings in (rollout, GREEDY):
        eager = engine.generate_all(model, prompts, settings, [eos], rows=2)
        assert engine.generate_all(fast, prompts, settings, [eos], rows=2) == eager
    assert ranks == {sampling.UNRANKED}
    assert rows == 2 and length < fast.config.max_seq_len  # its cache: the replies' reach, not the whole context


def test_rows_that_take_the_next_prompt_write_what_one_prompt_alone_writes(tiny_loaded):
    """generate_all through 3 rows: prompts join rows others left (refilled mid-run, at different positions),
    yet each reply equals a full forward's greedy reply; with a repetition penalty, generate() one by one."""
    model, tok = tiny_loaded
    texts = ("import os", "def fibonacci(n):\n    if", "x", "class Stack:", "for name in", "return n", "while True:")
    prompts = [ids_of(tok, t) for t in texts]
    eos = engine.generate(model, prompts[:1], GREEDY)[0][4]  # some replies end early, freeing their row
    ended = []
    replies = engine.generate_all(model, prompts, GREEDY, [eos], rows=3, on_done=lambda i, ids: ended.append(i))
    assert replies == [naive_greedy(model, p, GREEDY.max_new_tokens, {eos}) for p in prompts]
    assert sorted(ended) == list(range(len(prompts))) and any(len(r) < GREEDY.max_new_tokens for r in replies)
    assert engine.generate_all(model, [], GREEDY) == []
    penalised = replace(GREEDY, repetition_penalty=1.5, max_new_tokens=20)
    assert engine.generate_all(model, prompts, penalised, rows=2) == \
        [engine.generate(model, [p], penalised)[0] for p in prompts]


def test_rows_continuing_one_prompt_share_its_prefill_and_draw_replies_of_their_own(tiny_loaded, monkeypatch):
    """GRPO asks generate_all for 8 replies to each prompt: each distinct prompt is prefilled once (the prefill
    forward holds it once) and its cache copied into its rows. Greedy, every row still writes what a full
    forward's greedy reply to its own prompt is (a row given another prompt's cache would not); sampled, the
    rows continuing one prompt each draw a reply of their own."""
    model, tok = tiny_loaded
    p, q = ids_of(tok, "def fibonacci(n):\n    if"), ids_of(tok, "class Stack:")
    prompts, prefilled = [p, q, p, p, q, p], []

    def counted(model, ids, *args):
        prefilled.append(ids.shape[0])
        return decode.prefill_step(model, ids, *args)
    monkeypatch.setattr(engine, "prefill_step", counted)
    replies = engine.generate_all(model, prompts, GREEDY, rows=8)
    assert replies == [naive_greedy(model, x, GREEDY.max_new_tokens, set()) for x in prompts]
    assert prefilled == [2]
    sampled = SampleConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12, seed=3)
    assert len({tuple(r) for r in engine.generate_all(model, [p] * 8, sampled, rows=8)}) > 4


def test_rows_joining_as_others_finish_draw_their_first_tokens_from_the_softmax(tiny_loaded):
    """A seeded generate_all through 64 rows, 4,096 prompts: each join of rows draws its first tokens from
    the call's generator as it goes on. The first tokens' frequencies must be the softmax of a full forward's
    logits at the temperature, each within 4.5 standard errors; a generator seeded again at every join drew
    the same noise 64 joins over (z up to 22.6)."""
    model, tok = tiny_loaded
    prompt, n, temperature = ids_of(tok, "def fibonacci(n):\n    if"), 4096, 2.0
    sampled = SampleConfig(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=1, seed=5)
    firsts = torch.tensor([r[0] for r in engine.generate_all(model, [prompt] * n, sampled, rows=64)])
    with torch.no_grad():
        want = (model(torch.tensor([prompt]))[0][0, -1].double() / temperature).softmax(-1)
    got = torch.bincount(firsts, minlength=want.numel()).double() / n
    likely = want > 0.005
    z = (got - want)[likely].abs() / (want * (1 - want) / n).sqrt()[likely]
    assert likely.sum() >= 20 and z.max() <= 4.5, z.max()


def test_seed_and_counts(tiny_loaded):
    """Same seed, same samples; max_new_tokens and num_return_sequences are respected exactly."""
    model, tok = tiny_loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "for name")]
    s = SampleConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=9, num_return_sequences=3, seed=5)
    a, b = engine.generate(model, prompts, s), engine.generate(model, prompts, s)
    assert a == b and len(a) == 6 and all(len(x) == 9 for x in a)
    assert engine.generate(model, prompts, replace(s, seed=6)) != a
    assert len({tuple(x) for x in a}) > 1  # the sequences of one prompt are different samples


def test_eos_ends_a_sequence(tiny_loaded):
    """A sampled eos id ends its row, is not returned, and the other rows go on."""
    model, tok = tiny_loaded
    prompts = [ids_of(tok, "def pop"), ids_of(tok, "import")]
    full = engine.generate(model, prompts, GREEDY)
    eos = full[0][3]
    cut = engine.generate(model, prompts, GREEDY, eos_ids=[eos])
    assert cut[0] == full[0][:full[0].index(eos)]
    assert cut[1] == (full[1][:full[1].index(eos)] if eos in full[1] else full[1])


def test_generation_stops_at_the_context(tiny_loaded):
    """A row that reaches max_seq_len stops there (the cache cannot grow); a too-long prompt is refused."""
    model, tok = tiny_loaded
    ctx = model.config.max_seq_len
    prompt = (ids_of(tok, TEXT) * 4)[:ctx - 5]
    out = engine.generate(model, [prompt, prompt[:10]], replace(GREEDY, max_new_tokens=30))
    assert [len(o) for o in out] == [5, 30]
    with pytest.raises(ValueError, match="context"):
        engine.generate(model, [prompt + prompt[:5]], GREEDY)


def test_stop_strings_stop_and_are_not_printed(tiny_loaded):
    """Generation ends at a stop string spanning tokens; the streamed text ends just before it."""
    model, tok = tiny_loaded
    s = replace(GREEDY, max_new_tokens=30)
    (text,), (ids,) = engine.generate_text(model, tok, ["def push"], s, eos_ids=[])
    stop = text[8:12]  # some text the model does produce
    assert len(stop) == 4 and stop not in text[:11]
    (cut,), (cut_ids,) = engine.generate_text(model, tok, ["def push"], replace(s, stop=["zzz", stop]), eos_ids=[])
    assert cut == text[:text.index(stop)]
    assert tok.decode(cut_ids).startswith(cut + stop) and len(cut_ids) < len(ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_cuda_decode_matches_eager(tiny_checkpoint):
    """The CUDA-graph decode step must give eager's greedy tokens, across calls and batch sizes (a stale
    graph output or a cache whose address changed would show up here)."""
    model, tok, *_ = load_for_inference(tiny_checkpoint, "cuda")  # auto: compiled on CUDA
    plain = load_for_inference(tiny_checkpoint, "cuda", compile="off")[0]
    assert decode_compile.compiles(model) and not decode_compile.compiles(plain)
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "x")]
    eager = engine.generate(plain, prompts, GREEDY)
    for batch in (prompts, prompts[:1], prompts):
        assert engine.generate(model, batch, GREEDY) == eager[:len(batch)]


def test_the_host_reads_tokens_once_per_chunk(tiny_loaded, monkeypatch):
    """No host sync per token: the new ids come back CHUNK steps at a time (the last read may be shorter)."""
    model, tok = tiny_loaded
    reads = []
    original = engine.Outputs.read
    monkeypatch.setattr(engine.Outputs, "read", lambda self, block: (reads.append(len(block[0])),
                                                                     original(self, block))[1])
    out = engine.generate(model, [ids_of(tok, "def f")], replace(GREEDY, max_new_tokens=2 * engine.CHUNK + 3))
    assert len(out[0]) == 2 * engine.CHUNK + 3 and reads == [engine.CHUNK, engine.CHUNK, 3]


def test_each_row_of_a_batch_may_have_its_own_settings(tiny_loaded):
    """A batch mixing greedy, seeded sampling and a repetition penalty (as the server batches requests) gives
    every row what it gets alone."""
    model, tok = tiny_loaded
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if", "class Stack")]
    settings = [GREEDY, replace(GREEDY, temperature=1.0, top_k=20, top_p=0.9, seed=7, max_new_tokens=9),
                replace(GREEDY, repetition_penalty=3.0, max_new_tokens=15)]
    together = engine.generate(model, prompts, settings)
    assert together == [engine.generate(model, [p], s)[0] for p, s in zip(prompts, settings)]
    assert [len(o) for o in together] == [12, 9, 15]


@pytest.mark.slow
def test_compiled_decode_matches_eager_on_cpu(tiny_loaded):
    """The compiled prefill (bucketed) and decode step give the eager path's tokens for ragged prompts, two
    batch sizes, greedy and seeded sampling, and two models of one shape taking turns: each step after the
    first skips dynamo's guards, so a step that ran another batch's, setting's or model's graph would show up
    here."""
    model, tok = tiny_loaded
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(-1.0)  # tied: the embedding too
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if n < 2:\n        return", "x")]
    greedy = replace(GREEDY, max_new_tokens=20)
    sampled = replace(greedy, temperature=0.9, top_k=30, seed=11)
    twins = {id(model): compiled(model), id(other): compiled(other)}
    runs = [(m, batch, s) for s in (greedy, sampled) for batch in (prompts, prompts[:1]) for m in (model, other)]
    outputs = [engine.generate(twins[id(m)], batch, s) for m, batch, s in runs + runs]
    for (m, batch, s), out, again in zip(runs, outputs, outputs[len(runs):]):
        assert out == again == engine.generate(m, batch, s)
    assert len({str(out) for out in outputs[:len(runs)]}) == len(runs)  # every run differs from every other


@pytest.mark.slow
def test_mixed_batch_sizes_reuse_a_few_compiled_graphs(tiny_loaded):
    """Every new batch size once compiled its own prefill and decode step: under the server a request mix of
    sizes 1-5 stalled every request for a compile per size, and past dynamo's limit generation went eager
    without a word. Batches now pad to powers of two: sizes 1-5 compile for 1, 2, 4 and 8 only, a second round
    compiles nothing, and each padded batch gives the tokens of the eager, unpadded one."""
    from torch._dynamo.utils import counters
    eager, tok = tiny_loaded
    model = compiled(eager)  # a model of its own: no compiled steps from other tests
    prompts = [ids_of(tok, t) for t in ("import os", "def f(x):", "class A:", "x = 1", "for i in")]
    settings = replace(GREEDY, max_new_tokens=10)
    sizes = (3, 1, 5, 2, 4)
    first = [engine.generate(model, prompts[:n], settings) for n in sizes]
    graphs = counters["stats"]["unique_graphs"]
    again = [engine.generate(model, prompts[:n], settings) for n in sizes]
    assert counters["stats"]["unique_graphs"] == graphs  # the second round compiled nothing
    assert sorted(decode_compile._COMPILED[model].slots) == [(b, model.config.max_seq_len) for b in (1, 2, 4, 8)]
    for n, out, out_again in zip(sizes, first, again):
        assert out == out_again == engine.generate(eager, prompts[:n], settings)


@pytest.mark.slow
def test_int8_weights_decode_compiled_as_eager_and_near_fp32(tiny_loaded):
    """--quantize int8: the compiled decode step (reading the int8 values itself) gives torchao's eager
    tokens, and the int8 model's next-token distributions stay near fp32's."""
    model, tok = tiny_loaded
    int8 = quantize_int8(copy.deepcopy(model))
    prompts = [ids_of(tok, t) for t in ("import os", "def fibonacci(n):\n    if")]
    settings = replace(GREEDY, max_new_tokens=16)
    eager = engine.generate(int8, prompts, settings)
    assert engine.generate(compiled(int8), prompts, settings) == eager
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        p, p8 = model(ids)[0].softmax(-1), int8(ids)[0].softmax(-1)
    assert 0 < (p - p8).abs().sum(-1).max() / 2 < 0.05  # total variation distance at every position (2% seen)


def test_compile_auto_means_cuda_graphs_on_cuda_and_never_mps():
    """The one decision whether generation compiles (LoadConfig.compile and the device): auto compiles into
    CUDA graphs on CUDA only; a mode named compiles everywhere but MPS, off CUDA without graphs; off never
    does."""
    mode = lambda setting, kind: decode_compile.compile_mode(setting, torch.device(kind))  # noqa: E731
    kinds = ("cuda", "cpu", "mps")
    assert [mode("auto", k) for k in kinds] == ["reduce-overhead", None, None]
    assert [mode("reduce-overhead", k) for k in kinds] == ["reduce-overhead", "default", None]
    assert [mode("default", k) for k in kinds] == ["default", "default", None]
    assert [mode("max-autotune", k) for k in kinds] == ["max-autotune", "max-autotune-no-cudagraphs", None]
    assert [mode("off", k) for k in kinds] == [None, None, None]


def test_a_model_compiles_as_it_was_set_to_at_load(tiny_loaded):
    """Whether generate() compiles is decided once per model (use_compile, from for_inference): a loaded CPU
    model with compile auto stays eager, one set to a mode compiles its steps, and off undoes it."""
    model = copy.deepcopy(tiny_loaded[0])
    assert not decode_compile.compiles(tiny_loaded[0]) and not decode_compile.compiles(model)
    assert decode_compile.use_compile(model, "default") and decode_compile.compiles(model)
    assert not decode_compile.use_compile(model, "off") and not decode_compile.compiles(model)


def test_the_engine_leaves_dynamos_settings_to_the_process(tiny_loaded):
    """Importing engine once raised dynamo's recompile limit and made reaching it fatal for the whole process
    (a user's own torch.compile too); the engine's limits now hold only while it generates."""
    import subprocess
    import sys
    code = ("import torch; c = torch._dynamo.config; before = (c.recompile_limit, "
            "c.fail_on_recompile_limit_hit); import llm.generate.engine, llm.generate.inference; "
            "print(before == (c.recompile_limit, c.fail_on_recompile_limit_hit))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True).stdout == "True\n"
    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    seen = []
    model, tok = tiny_loaded
    real_decode = decode.decode_step
    try:
        decode.decode_step = lambda *a: seen.append((config.recompile_limit, config.fail_on_recompile_limit_hit)) \
            or real_decode(*a)
        engine.generate(model, [[1, 2]], SampleConfig(max_new_tokens=3, temperature=0))
    finally:
        decode.decode_step = real_decode
    assert seen and set(seen) == {(max(before[0], decode_compile.RECOMPILE_LIMIT), True)}
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


def test_generation_is_eager_while_its_steps_compile_in_the_background(tiny_loaded, monkeypatch):
    """The REPL once waited 22 s on an H200 for its decode step to compile before the first token. Now the
    steps compile in a thread and generate() runs eagerly until they are ready: a reply comes while the
    compile is held back, then the compiled steps give the same tokens; a compile that fails leaves generation
    eager."""
    import threading
    prompts = [ids_of(tiny_loaded[1], "def fibonacci(n):")]
    want = engine.generate(tiny_loaded[0], prompts, GREEDY)
    model = compiled(tiny_loaded[0])  # a model of its own: its compiled steps are kept per model
    release, slot = threading.Event(), decode_compile.compiled_slot
    def held(model, batch):  # a compile that lasts until the test releases it
        release.wait(60)
        return slot(model, batch)
    monkeypatch.setattr(decode_compile, "compiled_slot", held)
    thread = decode_compile.compile_in_background(model, GREEDY)
    assert decode_compile.compiling(model)
    got = engine.generate(model, prompts, GREEDY)
    assert got == want and not decode_compile._COMPILED[model].slots  # replied eagerly: nothing compiled yet
    release.set()
    thread.join(120)
    assert not decode_compile.compiling(model) and thread.error is None and (1, model.config.max_seq_len) in decode_compile._COMPILED[model].slots
    assert engine.generate(model, prompts, GREEDY) == want  # the compiled steps now
    failing, errors = compiled(tiny_loaded[0]), []
    def broken(model, batch):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(decode_compile, "compiled_slot", broken)
    decode_compile.compile_in_background(failing, GREEDY, errors.append).join(60)
    assert [str(e) for e in errors] == ["no compiler"] and decode_compile.compiling(failing)  # stays eager
    assert engine.generate(failing, prompts, GREEDY) == want
    torch._dynamo.reset()
