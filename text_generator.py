"""Load a checkpoint and generate text: an interactive REPL, one-shot prompts, and the generate() API.

    python text_generator.py                       # REPL on the newest checkpoint of runs/default
    python text_generator.py runs/mine --temperature 0.7 --top_k 40
    python text_generator.py --prompt "def fib(n):" --max_new_tokens 64 --seed 1
    printf 'import os\\nclass A:\\n' | python text_generator.py runs/mine   # one completion per line
    python text_generator.py --list                # runs and checkpoints under runs/
"""

import json
import os
import shlex
import sys
import time
import weakref
from dataclasses import fields, replace

import torch
import torch.nn.functional as F

from checkpoint import (HOW_TO_MAKE_ONE, TOKENIZER, WEIGHTS, CheckpointError, list_checkpoints,
                        load_model_config, load_weights, resolve_checkpoint)
from config import ConfigError, SampleConfig, TrainConfig, count_parameters, error_exit, parse_sections
from modern_llm import Transformer

EOT_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BATCH_SAMPLES = 4  # samples the `batch` command shows when num_return_sequences is 1
SETTABLE = [f.name for f in fields(SampleConfig) if f.name not in ("checkpoint", "device", "compile")]


# ----------------------------------------------------------------------------- loading

def pick_device(name: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU for "auto"; the named device otherwise."""
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if cuda else "mps" if mps else "cpu"
    if (name == "cuda" and not cuda) or (name == "mps" and not mps):
        raise ConfigError(f"device={name} is not available on this machine, use --device auto or cpu")
    return torch.device(name)


def load_tokenizer(path: str):
    """A PreTrainedTokenizerFast from tokenizer.json, with <|endoftext|> as its eos token when it has one."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    try:
        raw = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for missing and malformed files alike
        raise CheckpointError(f"{path} is missing or not a tokenizer ({str(e).splitlines()[0]}), "
                              f"{HOW_TO_MAKE_ONE}") from None
    eos = EOT_TOKEN if raw.token_to_id(EOT_TOKEN) is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos)


def load_for_inference(path: str = "", device=None):
    """(model, tokenizer, model_config, checkpoint folder) from a checkpoint, run or exported folder.

    path "" means the newest checkpoint of runs/default; device None or "auto" picks CUDA, MPS or CPU.
    The model is in eval mode, in bf16 on CUDA GPUs that support it, else fp32. Raises CheckpointError.
    """
    device = device if isinstance(device, torch.device) else pick_device(device or "auto")
    path = path or TrainConfig().run_dir
    tokenizer_path = None
    if os.path.isfile(os.path.join(path, "config.json")):  # a Hugging Face export? (run folders have one too)
        import export_hf  # imported only here: it pulls in the data module
        if export_hf.is_hf_folder(path):
            cfg, state, tokenizer_path = export_hf.load_hf_folder(path)
            if not tokenizer_path:
                raise CheckpointError(f"{path} has no {TOKENIZER}, copy the model's tokenizer.json into it")
    if tokenizer_path:
        ckpt = path
        with torch.device(device):
            model = Transformer(cfg)
        model.load_state_dict(state, strict=False)  # load_hf_folder checked every name and shape
    else:
        ckpt = resolve_checkpoint(path)
        with torch.device(device):  # initialise on the device: fast even for large models on a GPU
            model = Transformer(load_model_config(ckpt))
        load_weights(ckpt, model)
        tokenizer_path = os.path.join(ckpt, TOKENIZER)
    cfg = model.config
    tokenizer = load_tokenizer(tokenizer_path)
    if len(tokenizer) > cfg.vocab_size:
        raise CheckpointError(f"{ckpt}: the tokenizer has {len(tokenizer)} tokens but the model only "
                              f"{cfg.vocab_size}, the checkpoint mixes two runs; {HOW_TO_MAKE_ONE}")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        for p in model.parameters():  # parameters only: the RoPE tables stay fp32, as in training
            p.data = p.data.to(torch.bfloat16)
    return model.eval().requires_grad_(False), tokenizer, cfg, ckpt


# ----------------------------------------------------------------------------- sampling

def _check_sampling(temperature: float, top_k: int, top_p: float):
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 turns it off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 turns it off)")


def filtered_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) probabilities after temperature, top-k and top-p; filtered tokens are 0."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        # Nucleus (Holtzman et al. 2019): drop a token when the tokens ranked above it already reach p;
        # the most likely token has nothing above it, so at least one is always kept.
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, generator=None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids; temperature 0 is argmax. ValueError on out-of-range arguments."""
    if temperature == 0:
        _check_sampling(temperature, top_k, top_p)
        return logits.argmax(-1, keepdim=True)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    # argmax(p / E) with E ~ Exp(1) picks token i with probability p_i and, unlike torch.multinomial on CUDA,
    # needs no host sync (gpt-fast's trick). Exp(1) can draw 0, and the 0/0 = NaN of a filtered token would
    # win the argmax: hence the clamp.
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(-1, keepdim=True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) on (B, V) logits where seen (B, V bool): positive / p, negative * p."""
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


# ----------------------------------------------------------------------------- streaming text

class TextStream:
    """Token ids in, printable text out: never splits a UTF-8 character, and never emits a stop string.

    Byte-level BPE can cut a multi-byte character across tokens; its decoded prefix then ends in U+FFFD,
    so such text waits for the next token. Text that could be the start of a stop string waits too.
    """

    def __init__(self, tokenizer, stops=()):
        # The Rust tokenizer inside a transformers one decodes several times faster, and never tidies spaces.
        self.tokenizer, self.stops = getattr(tokenizer, "backend_tokenizer", tokenizer), [s for s in stops if s]
        self.ids, self.start, self.read = [], 0, 0  # ids[start:read] is decoded context already emitted
        self.pending, self.stopped = "", False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _tail(self) -> str:
        """Text of the ids after `read`, decoded with a little context (text-generation-inference's method)."""
        before, now = self._decode(self.ids[self.start:self.read]), self._decode(self.ids[self.start:])
        return now[len(before):] if len(now) > len(before) else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to print."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        new = self._tail()
        if not new or new.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return ""
        self.start, self.read = self.read, len(self.ids)
        return self._release(self.pending + new)

    def flush(self) -> str:
        """The text still held back, at the end of a generation; an incomplete last character is dropped."""
        if self.stopped:
            return ""
        out = self._release(self.pending + self._tail().rstrip("\ufffd"))
        out, self.pending = out + ("" if self.stopped else self.pending), ""
        return out

    def _release(self, text: str) -> str:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)]
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


# ----------------------------------------------------------------------------- generation

_STATIC = weakref.WeakKeyDictionary()  # model -> {batch size: (full-context cache, compiled step)}


def _forward_last(model, ids, cache):
    """(B, 1) ids -> (B, V) logits of the next token; advances every row of the cache by one position."""
    return model(ids, kv_cache=cache)[0][:, -1]


def _decode_step(model, batch: int, max_len: int, compile: bool):
    """A KV cache for `batch` rows and a step function (B, 1) ids -> (B, V) logits that advances it."""
    if not compile:
        cache = model.make_kv_cache(batch, max_len)
        return cache, lambda ids: _forward_last(model, ids, cache)
    steps = _STATIC.setdefault(model, {})
    if batch not in steps:
        cache = model.make_kv_cache(batch)  # always the full context: one graph serves every prompt length
        if cache.k.device.type != "cuda":  # no CUDA graphs off CUDA: the default mode is the useful one
            steps[batch] = cache, torch.compile(_forward_last, dynamic=False)
        else:
            for t in (cache.k, cache.v, cache.pos):
                torch._dynamo.mark_static_address(t)  # updated in place by the graph; addresses never change
            graph = torch.compile(_forward_last, mode="reduce-overhead", dynamic=False, fullgraph=True)
            steps[batch] = cache, graph
    cache, graph = steps[batch]
    cache.reset()  # stale keys past each row's position are masked out, so nothing else needs clearing
    if cache.k.device.type != "cuda":
        return cache, lambda ids: graph(model, ids, cache)

    def replay(ids):
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's logits were sampled from already
        return graph(model, ids, cache)
    return cache, replay


def generate(model, prompts: list[list[int]], settings: SampleConfig, eos_ids=(), tokenizer=None,
             on_text=None) -> list[list[int]]:
    """Continue each prompt (token ids) num_return_sequences times; return the new ids of each sequence.

    Sequences come grouped by prompt: [p0 s0, p0 s1, ..., p1 s0, ...]. All share one right-padded prefill,
    then one cached decode step per token. A sequence ends at an id of eos_ids (not returned), after
    max_new_tokens, when it fills the model's context, or, given a tokenizer, at a string of settings.stop
    (its ids then end with the token that completed the stop string). With a tokenizer, on_text(i, text)
    receives sequence i's printable text as it grows, without the stop string.
    """
    rows = [list(p) for p in prompts for _ in range(settings.num_return_sequences)]
    ctx = model.config.max_seq_len
    for p in rows:
        if not p or len(p) >= ctx:
            raise ValueError(f"a prompt has {len(p)} tokens, it needs 1 to {ctx - 1} (the model's context is "
                             f"{ctx}), shorten it")
    device, B, longest = model.embed_tokens.weight.device, len(rows), max(map(len, rows))
    limits = [min(settings.max_new_tokens, ctx - len(p)) for p in rows]
    generator = torch.Generator(device).manual_seed(settings.seed) if settings.seed >= 0 else None
    streams = [TextStream(tokenizer, settings.stop) for _ in rows] if tokenizer is not None else None
    out, active = [[] for _ in rows], set(range(B))

    def finish(i):
        active.discard(i)
        text = streams[i].flush() if streams else ""
        if text and on_text:
            on_text(i, text)

    with torch.no_grad():
        lengths = torch.tensor([len(p) for p in rows], device=device)
        # Padding repeats each row's last token: the cache ignores it, and the penalty's `seen` stays exact.
        padded = torch.tensor([p + p[-1:] * (longest - len(p)) for p in rows], device=device)
        cache, step = _decode_step(model, B, min(ctx, longest + settings.max_new_tokens), settings.compile)
        logits, _ = model(padded, kv_cache=cache, input_lengths=lengths)
        logits = logits[torch.arange(B, device=device), lengths - 1]  # (B, V) after each row's last token
        seen = None
        if settings.repetition_penalty != 1.0:
            seen = torch.zeros(logits.shape, dtype=torch.bool, device=device).scatter_(1, padded, True)
        while True:
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
            next_ids = sample_next(logits.float(), settings.temperature, settings.top_k, settings.top_p,
                                   generator)  # (B, 1)
            if seen is not None:
                seen.scatter_(1, next_ids, True)
            for i, token in enumerate(next_ids[:, 0].tolist()):  # host sync: streaming and stops need the ids
                if i not in active:
                    continue
                if token in eos_ids:
                    finish(i)
                    continue
                out[i].append(token)
                text = streams[i].push(token) if streams else ""
                if text and on_text:
                    on_text(i, text)
                if len(out[i]) >= limits[i] or (streams and streams[i].stopped):
                    finish(i)
            if not active:
                return out
            logits = step(next_ids)


def stop_ids(tokenizer, chat: bool = False) -> list[int]:
    """Ids that end a generation: <|endoftext|>, and <|im_end|> in chat."""
    names = [EOT_TOKEN, IM_END] if chat else [EOT_TOKEN]
    vocab = tokenizer.get_vocab()
    return [vocab[n] for n in names if n in vocab]


def generate_text(model, tokenizer, prompts: list, settings: SampleConfig, eos_ids=None, on_text=None):
    """Prompts as text (or token ids) -> (completions, new ids), one per sequence, stop strings cut off.

    An empty text prompt starts a fresh document from <|endoftext|>; eos_ids default to stop_ids(tokenizer).
    """
    eos_ids = stop_ids(tokenizer) if eos_ids is None else eos_ids
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) or list(eos_ids[:1])
           for p in prompts]
    texts = [""] * (len(ids) * settings.num_return_sequences)

    def collect(i, text):
        texts[i] += text
        if on_text:
            on_text(i, text)
    return texts, generate(model, ids, settings, eos_ids, tokenizer, collect)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """ChatML ids of a dialogue, ending with the assistant's turn: the data module's template."""
    from prepare_data import chat_prompt_ids  # imported only here: plain generation does not need it
    return chat_prompt_ids(tokenizer, messages)


# ----------------------------------------------------------------------------- command line

def _human(n: float, units=("", "K", "M", "B")) -> str:
    for unit in units[:-1]:
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}{units[-1]}"


def _evals(run: str) -> list[dict]:
    """The eval records of a run's metrics.jsonl, in file order; unreadable lines are skipped."""
    records = []
    try:
        with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(r, dict) and "val_loss" in r and isinstance(r.get("step"), int):
                    records.append(r)
    except OSError:
        pass
    return records


def list_runs(root: str) -> str:
    """A table of the checkpoints under root (a folder of runs, or one run); val figures are the last eval
    at or before each checkpoint's step."""
    if not os.path.isdir(root):
        raise CheckpointError(f"no folder {root}, {HOW_TO_MAKE_ONE}")
    one_run = os.path.isdir(os.path.join(root, "checkpoints"))
    runs = [root] if one_run else sorted(os.path.join(root, d) for d in os.listdir(root))
    lines = [f"{'run':<20} {'step':>7} {'params':>8} {'size':>9} {'val loss':>8} {'bpb':>6}  date"]
    for run in runs:
        evals = _evals(run)
        for ckpt in list_checkpoints(run):
            step = int("".join(c for c in os.path.basename(ckpt) if c.isdigit()) or -1)
            try:
                params = _human(count_parameters(load_model_config(ckpt)))
            except CheckpointError:
                params = "n/a"
            size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
            last = [r for r in evals if r["step"] <= step][-1:] or [{}]
            loss, bpb = (f"{last[0][k]:.4f}" if isinstance(last[0].get(k), (int, float)) else "n/a"
                         for k in ("val_loss", "val_bpb"))
            date = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(os.path.join(ckpt, WEIGHTS))))
            name = os.path.basename(os.path.normpath(run))
            lines.append(f"{name:<20} {step:>7} {params:>8} {_human(size, ('B', 'KB', 'MB', 'GB')):>9} "
                         f"{loss:>8} {bpb:>6}  {date}")
    return "\n".join(lines) if len(lines) > 1 else f"no checkpoints under {root}, {HOW_TO_MAKE_ONE}"


def _unescape(s: str) -> str:
    return s.replace("\\n", "\n").replace("\\t", "\t")  # so `--stop '\n\n'` works from a shell


def with_setting(settings: SampleConfig, name: str, text: str) -> SampleConfig:
    """settings with one field parsed from text; ConfigError for unknown names and bad values."""
    if name not in SETTABLE:
        raise ConfigError(f"unknown setting {name!r}, valid names are: {', '.join(SETTABLE)}")
    current = getattr(settings, name)
    try:
        if isinstance(current, list):
            value = [_unescape(w) for w in shlex.split(text)]
        elif isinstance(current, bool):
            value = {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        else:
            value = type(current)(text)
    except (ValueError, KeyError):
        raise ConfigError(f"{name}={text!r} is not a valid {type(current).__name__}") from None
    return replace(settings, **{name: value})


def _write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def run(model, tokenizer, settings, prompt, stream=True, chat=False) -> list[str]:
    """Generate for one prompt (text, or ids in chat), stream sequence 0 to stdout, report tokens/s on stderr."""
    def show(i, text):
        if stream and i == 0:
            _write(text)
    t0 = time.perf_counter()
    texts, new = generate_text(model, tokenizer, [prompt], settings, stop_ids(tokenizer, chat), show)
    seconds, n = time.perf_counter() - t0, sum(map(len, new))
    if stream:
        _write("\n")
    ctx = model.config.max_seq_len
    used = len(prompt) if chat else len(tokenizer.encode(prompt, add_special_tokens=False))
    note = f", stopped at the context of {ctx} tokens" if used + max(map(len, new)) >= ctx else ""
    print(f"[{n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tokens/s{note}]", file=sys.stderr, flush=True)
    return texts


HELP = f"""commands (in chat mode, start them with /):
  TEXT              continue TEXT with the current settings (a line starting with a command word is that command)
  sample TEXT       the same
  greedy TEXT       the most likely continuation (temperature 0)
  batch TEXT        several samples, one under the other (num_return_sequences, or {BATCH_SAMPLES})
  chat              talk to a model trained on conversations; /reset clears the dialogue, /plain leaves
  settings          show the settings
  set NAME VALUE    change a setting: {', '.join(SETTABLE)}
  help              this text
  quit, exit        leave (Ctrl-D too); Ctrl-C stops a generation"""


COMMANDS = ("sample", "greedy", "batch", "chat", "reset", "plain", "settings", "set", "help", "quit", "exit")


class Repl:
    """The interactive loop: parses commands and calls run(); state is the settings and the dialogue."""

    def __init__(self, model, tokenizer, settings: SampleConfig):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.messages, self.chatting = [], False
        vocab = tokenizer.get_vocab()
        self.can_chat = IM_START in vocab and IM_END in vocab

    def loop(self) -> int:
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  line editing and history, where the platform has it
            except ImportError:
                pass
        print("type help for commands, quit to leave" + (", chat to converse" if self.can_chat else ""))
        while True:
            try:
                line = input("you> " if self.chatting else "> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            try:
                if self.handle(line) == "quit":
                    return 0
            except KeyboardInterrupt:
                print("\n(stopped)")
            except ValueError as e:  # ConfigError and CheckpointError too: bad input, the REPL goes on
                print(f"error: {e}", file=sys.stderr, flush=True)
            except torch.OutOfMemoryError:
                print("error: out of memory, lower max_new_tokens or num_return_sequences", file=sys.stderr)

    def handle(self, line: str):
        word, _, rest = line.strip().partition(" ")
        if not word:
            return None
        if self.chatting and not word.startswith("/"):
            return self.chat_turn(line.strip())
        name = word.removeprefix("/")
        if name not in COMMANDS:
            return self.cmd_sample(line)  # a bare line is a prompt
        return getattr(self, "cmd_" + name)(rest.strip())

    def cmd_sample(self, text, settings=None):
        if not text:
            raise ValueError("give a prompt, for example: sample def main():")
        if (settings or self.settings).num_return_sequences > 1:
            return self.cmd_batch(text)
        _write(text)
        run(self.model, self.tokenizer, settings or self.settings, text)

    def cmd_greedy(self, text):
        self.cmd_sample(text, replace(self.settings, temperature=0.0, num_return_sequences=1))

    def cmd_batch(self, text):
        if not text:
            raise ValueError("give a prompt, for example: batch def main():")
        n = self.settings.num_return_sequences if self.settings.num_return_sequences > 1 else BATCH_SAMPLES
        texts = run(self.model, self.tokenizer, replace(self.settings, num_return_sequences=n), text, stream=False)
        for i, t in enumerate(texts, 1):
            print(f"--- {i} ---\n{text}{t}")

    def cmd_settings(self, _=""):
        for f in fields(SampleConfig):
            print(f"  {f.name} = {getattr(self.settings, f.name)!r}")

    def cmd_set(self, rest):
        name, _, value = rest.partition(" ")
        if not name or (not value.strip() and name != "stop"):
            raise ConfigError(f"usage: set NAME VALUE, valid names are: {', '.join(SETTABLE)}")
        self.settings = with_setting(self.settings, name, value.strip())
        print(f"  {name} = {getattr(self.settings, name)!r}")

    def cmd_help(self, _=""):
        print(HELP)

    def cmd_quit(self, _=""):
        return "quit"

    cmd_exit = cmd_quit

    def cmd_chat(self, _=""):
        if not self.can_chat:
            raise ValueError(f"this tokenizer has no {IM_START}/{IM_END} tokens: chat needs a model trained on "
                             "conversations")
        self.chatting, self.messages = True, []
        print("chat mode: type a message; /reset clears the dialogue, /plain returns to plain text")

    def cmd_reset(self, _=""):
        self.messages = []
        print("(dialogue cleared)")

    def cmd_plain(self, _=""):
        self.chatting = False
        print("plain mode")

    def chat_turn(self, text: str):
        """Answer one user message; the oldest exchanges are dropped when the dialogue outgrows the context."""
        ctx = self.model.config.max_seq_len
        room = min(self.settings.max_new_tokens, ctx // 4)  # keep space for at least a short reply
        dialogue = self.messages + [{"role": "user", "content": text}]
        ids = chat_prompt(self.tokenizer, dialogue)
        while len(ids) + room > ctx and len(dialogue) > 1:
            dialogue = dialogue[2:] if len(dialogue) > 2 else dialogue[1:]
            ids = chat_prompt(self.tokenizer, dialogue)
        if len(ids) + room > ctx:
            raise ValueError(f"the message needs {len(ids)} tokens, more than the context of {ctx} allows")
        _write("assistant: ")
        reply = run(self.model, self.tokenizer, replace(self.settings, num_return_sequences=1), ids, chat=True)
        self.messages = dialogue + [{"role": "assistant", "content": reply[0].strip()}]


def parse_args(argv):
    """(SampleConfig, extras) from the command line; extras hold path, prompt, list, interactive."""
    def extra(parser):
        parser.add_argument("path", nargs="?", default="", help="checkpoint or run folder (same as --checkpoint)")
        parser.add_argument("--prompt", default=None, help="generate once for this prompt, print, exit")
        parser.add_argument("--list", action="store_true", help="list the checkpoints under runs/ (or the "
                                                                "folder given) and exit")
        parser.add_argument("--interactive", action="store_true", help="the REPL even when stdin is not a terminal")
    (settings,), extras = parse_sections((SampleConfig,), (SampleConfig(),), argv,
                                         "Generate text with a trained checkpoint.", extra)
    if extras.path and settings.checkpoint and extras.path != settings.checkpoint:
        raise ConfigError(f"two checkpoints given ({extras.path} and --checkpoint {settings.checkpoint}), keep one")
    extras.path = extras.path or settings.checkpoint
    return replace(settings, stop=[_unescape(s) for s in settings.stop]), extras


def main(argv=None) -> int:
    try:
        settings, extras = parse_args(sys.argv[1:] if argv is None else argv)
        if extras.list:
            print(list_runs(extras.path or os.path.dirname(TrainConfig().run_dir)))
            return 0
        model, tokenizer, cfg, ckpt = load_for_inference(extras.path, settings.device)
    except ValueError as e:  # ConfigError and CheckpointError are ValueErrors: bad input, exit 2
        error_exit(str(e))
    weight = model.embed_tokens.weight
    if settings.compile and weight.device.type == "mps":
        settings = replace(settings, compile=False)
        print("note: compile is skipped on MPS", file=sys.stderr)
    elif settings.compile:
        print(f"note: compiling the decode step on first use ({'CUDA graphs' if weight.is_cuda else 'default mode'})",
              file=sys.stderr)
    print(f"loaded {ckpt}: {_human(model.num_parameters())} parameters, context {cfg.max_seq_len} tokens, "
          f"{weight.device.type} {str(weight.dtype).removeprefix('torch.')}", file=sys.stderr)
    if extras.prompt is None and (sys.stdin.isatty() or extras.interactive):
        return Repl(model, tokenizer, settings).loop()
    prompts = [extras.prompt] if extras.prompt is not None else (l.rstrip("\r\n") for l in sys.stdin)
    for prompt in prompts:
        if not prompt.strip() and extras.prompt is None:
            continue  # blank lines of stdin separate prompts; --prompt "" asks for a fresh document
        try:
            texts = run(model, tokenizer, settings, prompt, stream=settings.num_return_sequences == 1)
        except ValueError as e:
            error_exit(str(e))
        except KeyboardInterrupt:
            return 130
        for i, text in enumerate(texts if len(texts) > 1 else [], 1):
            print(f"--- {i} ---\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
