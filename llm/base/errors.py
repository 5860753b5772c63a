"""The error contract of every script (DESIGN.md): the project's error classes, and error_contract, the one
place that turns them into an `error:` line and an exit code.

Failures are turned into these classes where they happen (a reader raises DataError naming its file and line);
error_contract only maps classes to codes: bad input exits 2, a runtime failure we understand exits 1, Ctrl-C
130, a reader that closed the pipe leaves quietly. Anything else is a bug and keeps its traceback."""

import functools
import logging
import os
import signal
import sys
import threading


class InputError(ValueError):
    """Bad input from the user: exit 2. The message names the file, field or value and what to do."""


class ConfigError(InputError):
    """A bad setting: the message names the field, the value and what to do."""


class DataError(InputError):
    """Bad data input: the message names the file (and line), the problem and what to do."""


class CheckpointError(InputError):
    """A missing, incomplete or corrupt checkpoint or model folder; the message says which file and what to
    do."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, where a script turns it into an interruption (evaluate.py: the scores so far, then exit 143).
    """


def raise_terminated(signum, frame):
    """A SIGTERM handler: the script stops as at Ctrl-C, with SIGTERM's status."""
    raise Terminated()


class RunFailure(RuntimeError):
    """A runtime failure we understand (out of memory, a non-finite loss): exit 1."""


class WriteError(RunFailure):
    """A write the disk refused (full, failing): a runtime failure, not bad input; nothing half-written stays.
    """


class CompileError(RunFailure):
    """torch.compile failed on this machine (a runtime failure): the message names the error and the way out.
    """


def exit_code(e: BaseException) -> tuple[int, str | None]:
    """The exit code for a failure and the line to print (None: print nothing); raises e again for a bug."""
    torch = sys.modules.get("torch")  # not imported here: config.py imports this file and stays light
    if isinstance(e, InputError):
        return 2, str(e)
    if isinstance(e, (RunFailure, FloatingPointError)):
        return 1, str(e)
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return 1, "out of memory; use a smaller batch or model (the script's --help lists the settings)"
    if isinstance(e, BrokenPipeError):
        return 1, None  # the reader of our output left (`| head`): nobody is listening for a message
    # reads of user input are mapped where they happen; what remains is the system's
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        return 1, f"{e.strerror or e}{where}; check the path, its permissions and the free disk space"
    if isinstance(e, Terminated):
        return 143, None  # SIGTERM: 128 + 15, as a shell shows it
    if isinstance(e, KeyboardInterrupt):
        return 130, None  # Ctrl-C: the user knows; no traceback
    raise e


# Notices other libraries print on every start that say nothing a user of this project can act on: (logger,
# text).
# a CUDA build of torch on a machine without
NOTICES = [("torch.utils.cpp_extension", "No CUDA runtime is found"),
           # a GPU, when Inductor first compiles for the CPU
           # torchao's enums, at import
           ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
           # torchao's optional GPU kernels, built for another torch
           ("torchao", "Could not load this library")]


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_library_notices():
    """Drop exactly the NOTICES lines, nothing else those loggers say; once per process."""
    for name, text in NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.text == text for f in logger.filters):
            logger.addFilter(_Drop(text))


def error_contract(main):
    """Decorates a script's main: it returns what main returns, or prints the failure's one line and exits
    with its code (SystemExit). A bug keeps its traceback. Other libraries' NOTICES are left unprinted."""
    @functools.wraps(main)
    def contracted(*args, **kwargs):
        quiet_library_notices()
        if (signal.getsignal(signal.SIGINT) is signal.SIG_DFL
            and threading.current_thread() is threading.main_thread()):
            # a script's imports are over: Ctrl-C is 130
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            try:
                return main(*args, **kwargs)
            finally:
                _close_progress_bars()
        except (Exception, KeyboardInterrupt) as e:
            code, line = exit_code(e)
            if isinstance(e, BrokenPipeError):
                _silence_stdout()
            if line is not None:
                print(f"error: {line}", file=sys.stderr)
            sys.exit(code)
    return contracted


def _close_progress_bars():
    """An error line then starts on a line of its own, under the bar. A bar that fails to draw itself is
    dropped: it is only a display, and its error once replaced the run's own outcome."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", [])):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a display's failure must not end or mask the run
            bar.disable = True


def _silence_stdout():
    """Python flushes stdout at exit; into a closed pipe that would raise again, so point it at /dev/null."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
