"""The reward functions of a GRPO run, with TRL's signature: reward(prompts, completions, **columns) -> list
of floats, one per completion. They come only from the command line (--reward): a built-in by name, or
FILE.py:NAME, a function in the user's own file, which is run as the user's code. Never from data, a
checkpoint, a run folder's config or the Hub: a resumed run is given its --reward flags again.

    gsm8k         1.0 where the completion's last number equals the row's `answer` (its text after "####"
                  where it has one, as GSM8K's answers do), as evaluate.py's GSM8K reads replies; else 0.0
    regex:PATTERN 1.0 where PATTERN is found in the completion (re.search, "." matching newlines; anchor it
                  with ^ and $ for the whole completion), else 0.0

Each function is called with prompts, completions (text, or [{"role": "assistant", "content": ...}] for
prompts given as messages, as TRL passes them), completion_ids, and every other column of the prompts' rows,
as keyword arguments. None for a completion means "not judged by this function" (TRL's convention). An
exception, a wrong count, or a value that is not a finite number or None stops the run in one line naming the
function and the row.
"""

import importlib.util
import math
import numbers
import os
import re
from dataclasses import dataclass

from llm.base.errors import ConfigError, RunFailure
from llm.scores.scoring import last_number, same_number

BUILT_IN = ("gsm8k", "regex:PATTERN")


class RewardError(RunFailure):
    """A reward function failed or returned what is not a reward: the run saves its step and exits 1."""


@dataclass(frozen=True)
class Reward:
    """A reward function and the name it is reported by (the --reward value)."""
    name: str
    fn: object

    def __call__(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> list:
        """The function's values for these completions, checked: floats, or NaN where it returned None."""
        try:
            got = self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # the user's code: any failure is theirs to see, in one line
            raise RewardError(f"reward {self.name} raised {type(e).__name__}: {_short(e)}; "
                              "fix the function, then --resume") from None
        return checked(self.name, got, len(completions))


def checked(name: str, got, count: int) -> list[float]:
    """A reward function's return value as count floats (None as NaN), or RewardError naming what is wrong."""
    try:
        values = list(got)
    except TypeError:
        raise RewardError(f"reward {name} returned {_shown(got)}, not a list of {count} numbers; "
                          "fix the function, then --resume") from None
    if len(values) != count:
        raise RewardError(f"reward {name} returned {len(values)} values for {count} completions; it must "
                          "return one per completion (or None for one it does not judge)")
    out = []
    for row, v in enumerate(values):
        number = math.nan if v is None else _real(v)
        if number is None or math.isinf(number) or (v is not None and math.isnan(number)):
            raise RewardError(f"reward {name} returned {_shown(v)} for completion {row}; a reward is a "
                              "finite number or None; fix the function, then --resume")
        out.append(number)
    return out


def _real(v) -> float | None:
    """v as a float where it is a real number (Python's, numpy's, or a tensor of one value), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    is_tensor = hasattr(v, "numel") and hasattr(v, "dtype")  # torch's, without importing it here
    if is_tensor and v.numel() == 1 and not v.dtype.is_complex and str(v.dtype) != "torch.bool":
        return float(v.item())
    return None


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or "(no message)"


# ----------------------------------------------------------------------------- built in

def reply_text(completion) -> str:
    """A completion's text: as it is, or the content of its messages (TRL's conversational form)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))


def gsm8k_answer(answer) -> str:
    """The number a GSM8K row's answer states: after its "####" where it has one (the worked solution's last
    line)."""
    text = str(answer)
    return text.rsplit("####", 1)[-1].replace(",", "").strip()


def gsm8k(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion's last number equals the row's answer, else 0.0."""
    if answer is None:
        raise ValueError("the prompts have no `answer` column, which this "
                         "reward compares the last number with")
    return [float(same_number(last_number(reply_text(c)), gsm8k_answer(a)))
            for c, a in zip(completions, answer)]


def matches(pattern: str):
    """A reward of 1.0 where pattern is found in the completion, else 0.0."""
    found = re.compile(pattern, re.DOTALL)

    def reward(prompts, completions, **_) -> list[float]:
        return [float(found.search(reply_text(c)) is not None) for c in completions]
    return reward


# ----------------------------------------------------------------------------- from the command line

def load(spec: str) -> Reward:
    """A --reward value as a Reward: gsm8k, regex:PATTERN, or FILE.py:NAME (the user's file, run as their
    code)."""
    if spec == "gsm8k":
        return Reward(spec, gsm8k)
    if spec.startswith("regex:"):
        try:
            return Reward(spec, matches(spec[len("regex:"):]))
        except re.error as e:
            raise ConfigError(f"--reward {spec}: the pattern is not a "
                              f"regular expression ({e}); fix it") from None
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"--reward {spec!r} is not a reward: give one of {', '.join(BUILT_IN)}, or "
                          "FILE.py:NAME, a function in a Python file of yours")
    return Reward(spec, _from_file(path, name, spec))


def _from_file(path: str, name: str, spec: str):
    """The function NAME of the user's file, which is run (imported) once, here."""
    if not os.path.isfile(path):
        raise ConfigError(f"--reward {spec}: {path} is not a file; give the path of your Python file")
    module_name = f"user_reward_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: its failure is said in one line, naming it
        raise ConfigError(f"--reward {spec}: importing {path} raised "
                          f"{type(e).__name__}: {_short(e)}; fix the file") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:8]
        raise ConfigError(f"--reward {spec}: {path} has no function {name} (it "
                          f"has: {', '.join(found) or 'none'})")
    return fn


def load_all(specs: list[str], weights: list[float]) -> tuple[list[Reward], list[float]]:
    """The --reward functions and their --reward_weights (1 each when none are given), checked to match."""
    if not specs:
        raise ConfigError("--objective grpo needs at least one --reward: "
                          "gsm8k, regex:PATTERN or FILE.py:NAME")
    weights = list(weights) or [1.0] * len(specs)
    if len(weights) != len(specs):
        raise ConfigError(f"--reward_weights gives {len(weights)} weights for {len(specs)} rewards; give one "
                          "per --reward, in the same order")
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"--reward_weights {weights} must be finite numbers")
    return [load(s) for s in specs], weights
