"""How config.py declares a setting and checks it: arg() makes a dataclass field that carries its help text
(what `--help` prints beside the default), require() refuses a value in one line naming the field, the value
and the rule. config.py holds the settings themselves, which users edit; this is the machinery they are
written with.
"""

import math
from dataclasses import field, fields
from typing import Literal, get_args, get_origin

from llm.base.errors import ConfigError
from llm.base.ranges import outside


def arg(default, help: str, const=None, positional: bool = False, aliases: dict | None = None,
        repeat: bool = False):
    """A dataclass field whose help text `--help` prints next to its default. With const, the flag may also be
    given bare (`--resume`), meaning that value; positional, it is given without its name (`text_generator.py
    runs/mine`); aliases: older words the command line still takes for some of its values; repeat (a list):
    each time the flag is given adds its values (`--reward a.py:f --reward gsm8k`)."""
    metadata = {"help": help, **({"nargs": "?", "const": const} if const is not None else {}),
                **({"positional": True} if positional else {}), **({"aliases": aliases} if aliases else {}),
                **({"repeat": True} if repeat else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def require(ok: bool, name: str, value, rule: str):
    if not ok:
        error = ConfigError(f"{name}={value!r} is invalid: {rule}")
        error.field, error.value = name, value
        raise error


def require_choices(cfg):
    """Every Literal-typed field holds one of its values (the command line checks too; code may not), every
    float field a finite number (float() reads "inf" and "nan": --lora_alpha inf was once taken), and every
    number lies in its range (llm/base/ranges.py)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if get_origin(f.type) is Literal:
            require(value in get_args(f.type), f.name, value, f"choose one of {', '.join(get_args(f.type))}")
        elif f.type is float:
            require(math.isfinite(value), f.name, value, "must be a finite number")
        if f.type in (int, float) and (why := outside(f.name, value)):
            require(False, f.name, value, why)
