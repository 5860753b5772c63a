"""Fixtures shared by the test modules that train."""

import argparse
import textwrap

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small folder of real Python text and one cache folder per test module, so preparation runs once."""
    base = tmp_path_factory.mktemp("corpus")
    src = base / "src"
    src.mkdir()
    text = open(argparse.__file__, encoding="utf-8").read()  # the standard library's own source as training text
    (src / "a.py").write_text(text[: len(text) // 2])
    (src / "b.py").write_text(text[len(text) // 2:])
    (src / "c.py").write_text(open(textwrap.__file__, encoding="utf-8").read())
    return {"src": str(src), "cache": str(base / "cache"), "base": base}
