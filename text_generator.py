"""Load a checkpoint and generate text: an interactive REPL, one-shot prompts, and the generate() API.

    python text_generator.py                       # REPL on the newest checkpoint of runs/default
    python text_generator.py runs/mine --temperature 0.7 --top_k 40
    python text_generator.py --prompt "def fib(n):" --max_new_tokens 64 --seed 1
    printf 'import os\\nclass A:\\n' | python text_generator.py runs/mine   # one completion per line
    python text_generator.py --list                # runs and checkpoints under runs/
    python text_generator.py hf:HuggingFaceTB/SmolLM2-135M   # a Hub model, fetched once into the HF cache
"""

import os
import shlex
import signal
import sys
import time
from dataclasses import fields, replace

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
from tqdm import tqdm

from config import DataConfig, LoadConfig, SampleConfig, default_run_dir
from llm.base.cli import parse_sections
from llm.base.errors import CheckpointError, ConfigError, InputError, error_contract
from llm.base.sizing import count_parameters
from llm.data.corpus import corpus_bytes
from llm.data.preparation import split_texts
from llm.formats.checkpoint import (HOW_TO_MAKE_ONE, WEIGHTS, best_checkpoint, checkpoint_step,
                                    list_checkpoints, load_model_config)
from llm.generate.decode_compile import compile_failed, compile_in_background, compiles, exit_process
from llm.generate.engine import CHUNK, generate_text
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.scores.evaluation import (CODE_SETTINGS, bits_per_byte, code_parse_rate, file_pieces, fitted,
                                   text_parts)
from llm.tokens.tokenizer import IM_END, IM_START, can_chat, chat_prompt_ids, stop_ids

BATCH_SAMPLES = 4  # samples the `batch` command shows when num_return_sequences is 1
# what `set` and keyword settings change; the loading is fixed
SETTABLE = [f.name for f in fields(SampleConfig)]


class TextGenerator:
    """Load a model once, then generate from Python as the command line does:

        g = TextGenerator("runs/default")
        print(g.generate("def f(x):", max_new_tokens=64, temperature=0.7))
        texts = g.generate(["import os", "class A:"], temperature=0)      # a batch: one completion each
        reply = g.chat([{"role": "user", "content": "Hi"}])              # chat-trained models

    The constructor's named arguments are LoadConfig's. Keyword settings are SampleConfig's fields
    (max_new_tokens, temperature, top_k, top_p, repetition_penalty, num_return_sequences, seed, stop); given
    to the constructor they last, given to a call they apply to it.
    """

    def __init__(self, path: str = "", device: str = "auto", best: bool = False, quantize: str = "none",
                 compile: str = "auto", base: str = "", **settings):
        load = LoadConfig(checkpoint=path, best=best, base=base, device=device,
                          compile=compile, quantize=quantize)
        self.model, self.tokenizer, self.config, self.path = load_for_inference(load)
        self.load = replace(load, checkpoint=self.path)  # what was loaded
        self.settings = self._with(SampleConfig(), settings)

    @staticmethod
    def _with(base: SampleConfig, changes: dict) -> SampleConfig:
        unknown = sorted(set(changes) - set(SETTABLE))
        if unknown:
            raise ConfigError(f"unknown setting {', '.join(unknown)}, valid names are: {', '.join(SETTABLE)}")
        return replace(base, **changes)

    def generate(self, prompt: str | list[str], **settings) -> str | list[str]:
        """The completion of a prompt (without the prompt), or a list: one per prompt, or num_return_sequences
        per prompt grouped by prompt."""
        s = self._with(self.settings, settings)
        texts, _ = generate_text(self.model, self.tokenizer,
                                 [prompt] if isinstance(prompt, str) else list(prompt), s)
        return texts[0] if isinstance(prompt, str) and s.num_return_sequences == 1 else texts

    def chat(self, messages: list[dict], **settings) -> str:
        """The assistant's reply to a dialogue of {"role", "content"} messages (ChatML models only)."""
        if not can_chat(self.tokenizer):
            raise ConfigError(f"this tokenizer has no {IM_START}/{IM_END} tokens: chat needs a model "
                              "trained on conversations")
        s = replace(self._with(self.settings, settings), num_return_sequences=1)
        texts, _ = generate_text(self.model, self.tokenizer, [chat_prompt_ids(self.tokenizer, messages)], s,
                                 stop_ids(self.tokenizer))
        return texts[0].strip()


# ----------------------------------------------------------------------------- command line

def _human(n: float, units=("", "K", "M", "B")) -> str:
    for unit in units[:-1]:
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}{units[-1]}"


def list_runs(root: str) -> str:
    """A table of the checkpoints under root (a folder of runs, or one run); val figures are the last eval
    at or before each checkpoint's step."""
    if not os.path.isdir(root):
        raise CheckpointError(f"no folder {root}, {HOW_TO_MAKE_ONE}")
    one_run = os.path.isdir(os.path.join(root, "checkpoints"))
    runs = [root] if one_run else sorted(p for p in (os.path.join(root, d) for d in os.listdir(root))
                                         if os.path.isdir(p))  # a note or a log beside the runs is no run
    lines = [f"{'run':<20} {'step':>7} {'params':>8} {'size':>9} {'val loss':>8} {'bpb':>6}  date"]
    for run in runs:
        evals = [r for r in read_metrics(run, "eval") if isinstance(r.get("step"), int)]
        best = best_checkpoint(run)
        for ckpt in list_checkpoints(run):
            step = checkpoint_step(ckpt)
            try:
                params = _human(count_parameters(load_model_config(ckpt)))
            except CheckpointError:
                params = "n/a"
            size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
            last = [r for r in evals if r["step"] <= step][-1:] or [{}]
            loss, bpb = (f"{last[0][k]:.4f}" if isinstance(last[0].get(k), (int, float)) else "n/a"
                         for k in ("val_loss", "val_bpb"))
            date = time.strftime("%Y-%m-%d %H:%M",
                                 time.localtime(os.path.getmtime(os.path.join(ckpt, WEIGHTS))))
            name = os.path.basename(os.path.normpath(run))
            lines.append(f"{name:<20} {step:>7} {params:>8} {_human(size, ('B', 'KB', 'MB', 'GB')):>9} "
                         f"{loss:>8} {bpb:>6}  {date}" + ("  best" if ckpt == best else ""))
    return "\n".join(lines) if len(lines) > 1 else f"no checkpoints under {root}, {HOW_TO_MAKE_ONE}"


def _unescape(s: str) -> str:
    return s.replace("\\n", "\n").replace("\\t", "\t")  # so `--stop '\n\n'` works from a shell


def _from_argv(text: str) -> str:
    """argv keeps bytes that are not UTF-8 as surrogates, which the tokenizer refuses: they become U+FFFD, as
    on stdin."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


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
    """Generate for one prompt (text, or ids in chat), stream sequence 0 to stdout, report tokens/s on stderr.
    """
    def show(i, text):
        if stream and i == 0:
            _write(text)
    t0 = time.perf_counter()
    texts, new = generate_text(model, tokenizer, [prompt], settings, stop_ids(tokenizer), show)
    seconds, n = time.perf_counter() - t0, sum(map(len, new))
    if stream:
        _write("\n")
    ctx = model.config.max_seq_len
    used = len(prompt) if chat else len(tokenizer.encode(prompt, add_special_tokens=False))
    note = f", stopped at the context of {ctx} tokens" if used + max(map(len, new)) >= ctx else ""
    print(f"[{n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tokens/s{note}]",
          file=sys.stderr, flush=True)
    return texts


HELP = f"""commands (in chat mode, start them with /):
  TEXT              continue TEXT with the current settings (unless it starts with a command word)
  sample TEXT       the same
  greedy TEXT       the most likely continuation (temperature 0)
  batch TEXT        several samples, one under the other (num_return_sequences, or {BATCH_SAMPLES})
  chat              talk to a model trained on conversations; /reset clears the dialogue, /plain leaves
  settings          show the settings
  set NAME VALUE    change a setting: {', '.join(SETTABLE)}
  help              this text
  quit, exit        leave (Ctrl-D too); Ctrl-C stops a generation"""


COMMANDS = ("sample", "greedy", "batch", "chat", "reset", "plain", "settings", "set", "help", "quit", "exit")
LEAVE = ("quit", "exit")  # leave the REPL in chat mode too, typed alone (/quit as well)


class Repl:
    """The interactive loop: parses commands and calls run(); state is the settings and the dialogue."""

    def __init__(self, model, tokenizer, settings: SampleConfig, load: LoadConfig | None = None):
        self.model, self.tokenizer, self.settings, self.load = model, tokenizer, settings, load
        self.messages, self.chatting = [], False
        self.can_chat = can_chat(tokenizer)

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
            except InputError as e:  # a bad command or setting: one line, the REPL goes on
                print(f"error: {e}", file=sys.stderr, flush=True)
            except torch.OutOfMemoryError:
                print("error: out of memory, lower max_new_tokens or num_return_sequences", file=sys.stderr)

    def handle(self, line: str):
        word, _, rest = line.strip().partition(" ")
        if not word:
            return None
        if self.chatting and line.strip() in LEAVE:  # a message of one such word is meant as the command
            return "quit"
        if self.chatting and not word.startswith("/"):
            return self.chat_turn(line.strip())
        name = word.removeprefix("/")
        if name not in COMMANDS:
            return self.cmd_sample(line)  # a bare line is a prompt
        return getattr(self, "cmd_" + name)(rest.strip())

    def cmd_sample(self, text, settings=None):
        if not text:
            raise ConfigError("give a prompt, for example: sample def main():")
        if (settings or self.settings).num_return_sequences > 1:
            return self.cmd_batch(text)
        _write(text)
        run(self.model, self.tokenizer, settings or self.settings, text)

    def cmd_greedy(self, text):
        self.cmd_sample(text, replace(self.settings, temperature=0.0, num_return_sequences=1))

    def cmd_batch(self, text):
        if not text:
            raise ConfigError("give a prompt, for example: batch def main():")
        n = self.settings.num_return_sequences if self.settings.num_return_sequences > 1 else BATCH_SAMPLES
        texts = run(self.model, self.tokenizer, replace(self.settings, num_return_sequences=n),
                    text, stream=False)
        for i, t in enumerate(texts, 1):
            print(f"--- {i} ---\n{text}{t}")

    def cmd_settings(self, _=""):
        # how it loaded, then `set`'s
        for section in (self.load, self.settings) if self.load else (self.settings,):
            for f in fields(section):
                print(f"  {f.name} = {getattr(section, f.name)!r}")

    def cmd_set(self, rest):
        name, _, value = rest.partition(" ")
        if not name or (not value.strip() and name != "stop"):
            raise ConfigError(f"usage: set NAME VALUE, valid names are: {', '.join(SETTABLE)}")
        self.settings = with_setting(self.settings, name, value.strip())
        print(f"  {name} = {getattr(self.settings, name)!r}")

    def cmd_help(self, _=""):
        print("\n".join(line for line in HELP.splitlines() if self.can_chat or not line.startswith("  chat")))

    def cmd_quit(self, _=""):
        return "quit"

    cmd_exit = cmd_quit

    def cmd_chat(self, _=""):
        if not self.can_chat:
            raise ConfigError(f"this tokenizer has no {IM_START}/{IM_END} tokens: chat needs a model "
                              "trained on conversations")
        self.chatting, self.messages = True, []
        print("chat mode: type a message; /reset clears the dialogue, /plain returns to "
              "plain text, quit (or Ctrl-D) leaves")

    def cmd_reset(self, _=""):
        self.messages = []
        print("(dialogue cleared)")

    def cmd_plain(self, _=""):
        self.chatting = False
        print("plain mode")

    def chat_turn(self, text: str):
        """Answer one user message; the oldest exchanges are dropped when the dialogue outgrows the context.
        """
        ctx = self.model.config.max_seq_len
        room = min(self.settings.max_new_tokens, ctx // 4)  # keep space for at least a short reply
        dialogue = self.messages + [{"role": "user", "content": text}]
        ids = chat_prompt_ids(self.tokenizer, dialogue)
        while len(ids) + room > ctx and len(dialogue) > 1:
            dialogue = dialogue[2:] if len(dialogue) > 2 else dialogue[1:]
            ids = chat_prompt_ids(self.tokenizer, dialogue)
        if len(ids) + room > ctx:
            raise ConfigError(f"the message needs {len(ids)} tokens, more than the context of {ctx} allows")
        _write("assistant: ")
        reply = run(self.model, self.tokenizer, replace(self.settings, num_return_sequences=1),
                    ids, chat=True)
        self.messages = dialogue + [{"role": "assistant", "content": reply[0].strip()}]


def warm_up(model, tokenizer, settings: SampleConfig):
    """Compile the prefill and decode step once, at load, saying so (prompts of longer buckets and larger
    batches compile on first use)."""
    print(f"compiling the decode step{' into a CUDA graph' if model.embed_tokens.weight.is_cuda else ''}...",
          file=sys.stderr, end="", flush=True)
    start = time.perf_counter()
    generate_text(model, tokenizer, [[0]], replace(settings, max_new_tokens=2 * CHUNK, num_return_sequences=1,
                                                   stop=[]), eos_ids=[])
    print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def measure(model, tokenizer, ckpt: str, files: list[str]) -> int:
    """--eval: bits per byte on the files (or the default validation split) and the code metric; one line.
    Files are streamed, a bounded part at a time (twice: once for each figure), under a progress bar on
    stderr."""
    texts = None if files else split_texts(DataConfig())
    pieces = (lambda: file_pieces(files)) if files else (lambda: texts)
    size = corpus_bytes(DataConfig(sources=files)) if files else sum(len(t.encode("utf-8")) for t in texts)
    with tqdm(total=size, unit="B", unit_scale=True, desc="bits per byte", file=sys.stderr,
              dynamic_ncols=True) as bar:
        r = bits_per_byte(model, tokenizer, pieces(), bar=bar)
    parts = (text for _, text in text_parts(pieces()))  # read only until the code metric has its prompts
    rate, n = code_parse_rate(model, tokenizer, parts, fitted(CODE_SETTINGS, model.config.max_seq_len))
    what = ", ".join(files) if files else "the validation split of config.py's data"
    code = f"{round(rate * n)}/{n} Python function bodies parse ({100 * rate:.0f}%)" if n else \
        "no Python function with a docstring to complete"
    print(f"{ckpt}: {r['bits_per_byte']:.4f} bits per byte on {what} ({r['bytes']:,} bytes, {r['tokens']:,} "
          f"tokens, loss {r['loss']:.4f}); {code}")
    return 0


def parse_args(argv):
    """(LoadConfig, SampleConfig, extras) from the command line; extras hold prompt, list, interactive, eval.
    """
    def extra(parser):
        parser.add_argument("--prompt", default=None, help="generate once for this prompt, print, exit")
        parser.add_argument("--list", action="store_true", help="list the checkpoints under runs/ (or the "
                                                                "folder given) and exit")
        parser.add_argument("--interactive", action="store_true",
                            help="the REPL even when stdin is not a terminal")
        parser.add_argument("--eval", action="store_true", help="measure the model instead: bits "
                                                                "per byte and the share of Python "
                                                                "function bodies that parse")
        parser.add_argument("--eval_files", nargs="+", default=[], help="files or folders --eval reads; "
                                                                        "default: the validation split of "
                                                                        "config.py's data")
    (load, settings), extras = parse_sections((LoadConfig, SampleConfig), (LoadConfig(), SampleConfig()),
                                              argv, "Generate text with a trained checkpoint.", extra)
    extras.prompt = None if extras.prompt is None else _from_argv(extras.prompt)
    return load, replace(settings, stop=[_unescape(_from_argv(s)) for s in settings.stop]), extras


@error_contract
def main(argv=None) -> int:
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 become U+FFFD, as in the data path
    load, settings, extras = parse_args(sys.argv[1:] if argv is None else argv)
    if extras.list:
        print(list_runs(load.checkpoint or os.path.dirname(default_run_dir())))
        return 0
    if extras.eval or (extras.prompt is not None and load.compile == "auto"):
        # one reply or a measurement: a compile takes longer than it saves
        load = replace(load, compile="off")
    model, tokenizer, cfg, ckpt = load_for_inference(load)
    load = replace(load, checkpoint=ckpt)  # `settings` in the REPL shows what was loaded
    if extras.eval:
        return measure(model, tokenizer, ckpt, extras.eval_files)
    weight = model.embed_tokens.weight
    print(f"loaded {ckpt}: {_human(model.num_parameters())} parameters, context {cfg.max_seq_len} tokens, "
          f"{weight.device.type} {str(weight.dtype).removeprefix('torch.')}"
          + (", int8 linear weights" if load.quantize == "int8" else ""), file=sys.stderr)
    if compiles(model):
        if extras.prompt is None:  # a REPL or a stream of prompts: compiled replies from when it is ready
            compile_in_background(model, settings, compile_failed)
            print("compiling the decode step in the background; replies are eager until it is ready",
                  file=sys.stderr, flush=True)
        else:  # one reply, a compile asked for by name (docs/generation.md)
            warm_up(model, tokenizer, settings)
    if extras.prompt is None and (sys.stdin.isatty() or extras.interactive):
        return Repl(model, tokenizer, settings, load).loop()
    prompts = [extras.prompt] if extras.prompt is not None else (l.rstrip("\r\n") for l in sys.stdin)
    for prompt in prompts:
        if not prompt.strip() and extras.prompt is None:
            continue  # blank lines of stdin separate prompts; --prompt "" asks for a fresh document
        texts = run(model, tokenizer, settings, prompt, stream=settings.num_return_sequences == 1)
        for i, text in enumerate(texts if len(texts) > 1 else [], 1):
            print(f"--- {i} ---\n{text}")
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: a background compile may still be running
