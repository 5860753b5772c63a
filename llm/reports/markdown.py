"""Names that reach Markdown (report.md, an export's README.md) as text, never as markup: a run or source name
can hold `<img onerror=...>`, a backtick or a `|`, which would otherwise become HTML, end a code span or break
a table. And a file meant for upload names a local file by its name alone, never by the path it has here.
"""

import html
import os
import re

SPECIAL = re.compile(r"([\\`*_\[\]{}()#+!|~>-])")  # characters Markdown may read as markup


def text(value) -> str:
    """value as literal Markdown text on one line: HTML escaped, markup characters backslash-escaped."""
    one_line = " ".join(str(value).split())
    return SPECIAL.sub(r"\\\1", html.escape(one_line, quote=False))


def code(value) -> str:
    """value as an inline code span on one line, whatever backticks it holds; `|` escaped (tables end at it).
    """
    one_line = " ".join(str(value).split()).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", one_line)), default=0) + 1)
    pad = " " if one_line.startswith("`") or one_line.endswith("`") else ""
    return f"{fence}{pad}{one_line}{pad}{fence}"


def shared_name(path) -> str:
    """How a file meant for upload names a source or model: a local path by its last part (where it lives here
    tells nobody anything and may say too much), a Hub name or URL as it is."""
    value = str(path)
    if "://" in value or value.startswith("hf:"):
        return value
    return os.path.basename(os.path.normpath(value)) or value
