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
from dataclasses import asdict, fields

from config import PRESETS, Config, ConfigError, DataConfig, ModelConfig, TrainConfig

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
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES:,} bytes, which no file of settings is")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark from a Windows editor is fine
        values = _load_yaml(text, path) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except ConfigError:
        raise
    except ImportError:
        raise ConfigError(f"reading {path} needs PyYAML, pip install pyyaml or use a .json file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}), save it as UTF-8") from None
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
    words = []
    for key, value in flat.items():
        if isinstance(value, list):
            words += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, bool):
            words += [f"--{key}", str(value).lower()]
        else:
            words += [f"--{key}", str(value)]
    return words


def _load_yaml(text: str, path: str):
    """yaml.safe_load, refusing before anything is built a document whose aliases (&name, *name) expand past
    MAX_CONFIG_BYTES: a 'billion laughs' file of ten lines once became a 351 MB config.json and a native abort."""
    import yaml  # optional: only YAML config files need PyYAML
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} expands past {MAX_CONFIG_BYTES:,} bytes through its YAML aliases "
                              "(*name), write its values out instead")
        return {} if node is None else loader.construct_document(node)  # an empty file sets nothing
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict) -> float:
    """Characters of a YAML node with every alias written out, each shared node measured once (ids in sizes)."""
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


def parse_sections(types, defaults, argv, description: str, extra=None):
    """Parse argv into fresh instances of `types`, with `defaults` (instances) under the command line.

    `extra` adds script-specific arguments; it is called with the parser and its values come back as a
    Namespace. Raises ConfigError for unknown names and bad values.
    """
    from transformers import HfArgumentParser  # imported here: config.py stays light to import

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(list(types), description=description, exit_on_error=False,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="", help="JSON or YAML file of field values, applied before "
                                                     "the command line")
    if extra:
        extra(parser)
    for d in defaults:
        parser.set_defaults(**_explicit_values(d))
    if known.config:
        rest = _file_overrides(known.config, types) + rest
    valid = sorted({a.dest for a in parser._actions if a.dest != "help"})
    try:
        out = parser.parse_args_into_dataclasses(rest, return_remaining_strings=False, look_for_args_file=False)
    except ConfigError as e:
        raise _naming_config_py(e, types) from None
    except ValueError as e:
        if "not used by the HfArgumentParser" in str(e):
            bad = [w for w in rest if w.startswith("--") and w[2:].split("=")[0] not in valid]
            raise ConfigError(f"unknown setting {' '.join(bad) or rest}, valid names are: "
                              + ", ".join(valid)) from None
        raise ConfigError(str(e)) from None
    except argparse.ArgumentError as e:
        raise ConfigError(f"{e}, run with --help to see every setting") from None
    # Arguments that belong to no dataclass come back as one Namespace after the sections.
    sections = list(out[:len(types)])
    extras = out[len(types)] if len(out) > len(types) else argparse.Namespace()
    return sections, extras


def parse_config(argv=None, extra=None) -> tuple[Config, argparse.Namespace]:
    """The training command line: --preset NAME, --config FILE, then any field of any section."""
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
    (model, data, train), extras = parse_sections(
        types, (base.model, base.data, base.train), argv,
        "Train a GQA/RoPE/SwiGLU transformer. Every field below can be set as --name value.", add_preset)
    return Config(model=model, data=data, train=train), extras


def describe(cfg) -> str:
    """A compact one-line-per-section summary of a config's values."""
    parts = []
    for name, section in ((n, getattr(cfg, n)) for n in ("model", "data", "train")):
        items = " ".join(f"{k}={v}" for k, v in asdict(section).items())
        parts.append(f"{name}: {items}")
    return "\n".join(parts)
