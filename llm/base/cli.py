"""The command line of every script, generated from config.py's dataclasses: each field is a flag of the same
name, parsed to its type, with its comment in --help.

Lowest first: the values written in config.py, then --preset NAME, then a JSON or YAML --config file, then
the flags. Unknown names and values of the wrong type are refused with the list of valid names.
"""

import argparse
import json
import math
import os
import sys
from dataclasses import MISSING, fields
from typing import Literal, get_args, get_origin

from config import PRESETS, Config, DataConfig, ModelConfig, TrainConfig
from llm.base.errors import ConfigError
from llm.base.ranges import said

MAX_CONFIG_BYTES = 2**20  # a config file is a few kB: bounds the file, and what its YAML aliases expand to


def _explicit_values(section) -> dict:
    """Field values to layer under the command line; derived fields stay automatic."""
    derived = getattr(section, "_derived", set())
    return {f.name: getattr(section, f.name) for f in fields(section) if f.name not in derived}


def _file_overrides(path: str, types) -> list[str]:
    """Turn a JSON or YAML file of {field: value} (flat, or nested by section) into command-line words."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist, pass the path of a .json or .yaml file")
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES:,} "
                          "bytes, which no file of settings is")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark from a Windows editor is fine
        values = _load_yaml(text, path) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except ConfigError:
        raise
    except ImportError:
        raise ConfigError(f"reading {path} needs PyYAML, pip install pyyaml or use a .json file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte "
                          f"{e.start}), save it as UTF-8") from None
    except Exception as e:
        raise ConfigError(f"config file {path} is not valid: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field names to values")
    sections = {t.__name__.removesuffix("Config").lower() for t in types}
    flat = {}
    for key, value in values.items():
        if key in sections and isinstance(value, dict):
            flat.update(value)  # nested form, as in a run folder's config.json
        else:
            flat[key] = value
    if flat.get("epochs") and "max_steps" in flat:  # a run's config.json: its epochs gave it max_steps
        del flat["max_steps"]
    positional = {f.name for t in types for f in fields(t) if f.metadata.get("positional")}
    words = []
    for key, value in flat.items():
        if key in positional:
            words += [str(value)] if value else []
        elif isinstance(value, list):
            words += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, bool):
            words += [f"--{key}", str(value).lower()]
        else:
            words += [f"--{key}", str(value)]
    return words


def _load_yaml(text: str, path: str):
    """yaml.safe_load, refusing before anything is built a document whose aliases (&name, *name) expand past
    MAX_CONFIG_BYTES: a 'billion laughs' file of ten lines once became a 351 MB config.json and a native
    abort."""
    import yaml  # optional: only YAML config files need PyYAML
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} expands past {MAX_CONFIG_BYTES:,} bytes through its YAML "
                              "aliases (*name), write its values out instead")
        return {} if node is None else loader.construct_document(node)  # an empty file sets nothing
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict) -> float:
    """Characters of a YAML node with every alias written out, each shared node measured once (ids in sizes).
    """
    if id(node) not in sizes:
        sizes[id(node)] = math.inf  # met again inside itself: a recursive alias never ends
        if isinstance(node.value, str):
            size = len(node.value)
        else:  # a sequence's nodes, or a mapping's (key, value) pairs
            children = [n for item in node.value for n in (item if isinstance(item, tuple) else (item,))]
            size = sum(_expanded_size(n, sizes) for n in children)
        sizes[id(node)] = size + 1
    return sizes[id(node)]


def _naming_config_py(e: ConfigError, types) -> ConfigError:
    """e, saying so when the refused value is the one written in config.py (not a flag's or a file's)."""
    written = [t.__dataclass_fields__[e.field].default for t in types if e.field in t.__dataclass_fields__] \
        if hasattr(e, "field") else []
    return ConfigError(f"{e} (as written in config.py)") if written and e.value in written else e


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError where it would print its usage and exit, and knows the names it takes.
    """

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)
        self.names = []  # every --name, in the order added

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest != "help":
            self.names.append(action.dest)
        return action

    def error(self, message: str):
        raise ConfigError(f"{message}, run with --help to see every setting")


def _boolean(text: str) -> bool:
    value = {"true": True, "t": True, "yes": True, "y": True, "1": True,
             "false": False, "f": False, "no": False, "n": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value


def add_fields(parser: argparse.ArgumentParser, section, shown: set[str] | None = None):
    """One flag per field of the dataclass `section`, named as the field (or with dashes) and parsed to its
    annotated type: bool takes true/false (bare: true), a Literal its values (or their aliases), a list its
    values (none: empty). A positional field is a word without a name instead. shown: the fields --help lists
    (all)."""
    for f in fields(section):
        default = f.default_factory() if f.default is MISSING else f.default
        listed = shown is None or f.name in shown
        help_text = " ".join(filter(None, [f.metadata.get("help"),
                                           said(f.name) if f.type in (int, float) else ""]))
        kind, options = f.type, {"help": help_text if listed else argparse.SUPPRESS, "default": default}
        if kind is bool:
            options.update(type=_boolean, nargs="?", const=True, metavar="true|false")
        elif get_origin(kind) is Literal:
            aliases = f.metadata.get("aliases", {})  # checked against the choices after the alias is replaced
            options.update(choices=get_args(kind),
                           **({"type": lambda w, a=aliases: a.get(w, w)} if aliases else {}))
        elif get_origin(kind) is list and f.metadata.get("repeat"):
            options.update(type=get_args(kind)[0], nargs="+", action="extend")  # each --flag adds its values
        elif get_origin(kind) is list:
            options.update(type=get_args(kind)[0], nargs="*")
        else:
            options.update(type=kind)
        if "nargs" in f.metadata:  # a flag that may be given bare (`--resume`)
            options.update(nargs=f.metadata["nargs"], const=f.metadata["const"])
        if f.metadata.get("positional"):  # given without its name: at most one word, the field's value
            parser.add_argument(f.name, nargs="?", **options)
            continue
        dashed = [f"--{f.name.replace('_', '-')}"] if "_" in f.name else []  # --max-new-tokens as well
        parser.add_argument(f"--{f.name}", *dashed, **options)


def parse_sections(types, defaults, argv, description: str, extra=None, shown: set[str] | None = None):
    """Parse argv into fresh instances of `types`, with `defaults` (instances) under the command line.

    `extra` adds script-specific arguments; it is called with the parser and its values come back as a
    Namespace. shown: the fields --help lists, where not all. Raises ConfigError for unknown names and bad
    values."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default="")
    known, rest = pre.parse_known_args(argv)
    parser = Parser(description=description)
    for section in types:
        add_fields(parser, section, shown)
    parser.add_argument("--config", default="", help="JSON or YAML file of field values, applied before "
                                                     "the command line")
    if extra:
        extra(parser)
    for d in defaults:
        parser.set_defaults(**_explicit_values(d))
    if known.config:
        rest = _file_overrides(known.config, types) + rest
    values, unknown = parser.parse_known_args(rest)
    if unknown:
        bad = [w for w in unknown if w.startswith("-")] or unknown
        raise ConfigError(f"unknown setting {' '.join(bad)}, valid names are: "
                          + ", ".join(sorted(parser.names)))
    values = vars(values)
    try:
        sections = [t(**{f.name: values.pop(f.name) for f in fields(t)}) for t in types]
    except ConfigError as e:
        raise _naming_config_py(e, types) from None
    values.pop("config")
    return sections, argparse.Namespace(**values)


def parse_config(argv=None, extra=None, description: str = "Train a GQA/RoPE/SwiGLU transformer. Every field "
                 "below can be set as --name value.",
                 shown: set[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The training command line: --preset NAME, --config FILE, then any field of any section; shown: the
    fields --help lists, where a script reads only some (prepare_data.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="auto")
    known, _ = pre.parse_known_args(argv)
    if known.preset not in PRESETS:
        raise ConfigError(f"unknown preset {known.preset!r}, choose one of {', '.join(PRESETS)}")

    def add_preset(parser):
        parser.add_argument("--preset", default="auto", choices=list(PRESETS),
                            help="a model size with its batch and rates, over config.py's values; auto: "
                                 "config.py as written, its automatic fields sized for this machine")
        if extra:
            extra(parser)

    types = (ModelConfig, DataConfig, TrainConfig)
    try:
        base = PRESETS[known.preset]()
    except ConfigError as e:
        raise _naming_config_py(e, types) from None
    (model, data, train), extras = parse_sections(types, (base.model, base.data, base.train), argv,
                                                  description, add_preset, shown)
    return Config(model=model, data=data, train=train), extras


def describe(cfg) -> str:
    """The settings this run changes from config.py's defaults, a line per section (every value goes to the
    run's config.json); a section left as written says so."""
    parts = []
    for name in ("model", "data", "train"):
        section = getattr(cfg, name)
        changed = [f"{f.name}={getattr(section, f.name)}" for f in fields(section)
                   if getattr(section, f.name) != (f.default_factory() if f.default is MISSING
                                                   else f.default)]
        parts.append(f"{name}: {' '.join(changed) if changed else 'as config.py writes it'}")
    return "\n".join(parts)
