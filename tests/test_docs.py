"""The documentation cannot drift from the code: every command in README.md and docs/ that runs one of the
project's scripts parses with that script's own parser; every workflow keeps its section in the README, with
its commands; every module keeps its row in docs/architecture.md; every link lands on a page and a heading
that exist.

A README rewrite once dropped the sections on the REPL, serving, export and lm-eval without a test noticing.
"""

import glob
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from llm.base.errors import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUN_SCRIPTS = ["gpu_training_optimized", "text_generator", "prepare_data", "serve", "export_hf"]
TOOLS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "*.py")))
# imported by other tools, never run
TOOL_LIBRARIES = ("fake_gpu", "roofline", "compile_workloads", "gpu_generation", "gpu_first_run", "gpu_report", "hub_stand_in")
# What a newcomer looks for, each a section of README.md; a section deleted by mistake fails here.
WORKFLOWS = ["Install", "Quick start", "Run the tests", "Train", "Chat and generate", "Data", "Fine-tune", "Serve",
             "Export", "Evaluate", "Several GPUs", "The GPU check", "Files"]
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", "(", ")"}


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def shell_lines(page: str) -> list[tuple[int, str]]:
    """(line number, command) for every shell command of a page: fenced blocks (not Python ones), indented
    blocks, and inline code that starts with python or torchrun; continuation lines joined."""
    lines, found, fence, pending = read(page).split("\n"), [], None, None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        code = fence is not None and fence != "python" or fence is None and line.startswith("    ") and line.strip()
        if code:
            text = line.strip()
            if pending:
                pending = (pending[0], pending[1] + " " + text)
            else:
                pending = (number, text)
            if not text.endswith("\\"):
                found.append((pending[0], pending[1].replace("\\ ", " ")))
                pending = None
        elif fence is None:
            found += [(number, m) for m in re.findall(r"`((?:python|torchrun)\s[^`]+)`", line)]
    return found


def project_calls(command: str) -> list[tuple[str, list[str]]]:
    """(script, its arguments) for each part of a shell command that runs one of the project's scripts."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    words, calls, part = list(lexer), [], []
    for word in words + ["|"]:
        if word not in SHELL_OPERATORS:
            part.append(word)
            continue
        for i, w in enumerate(part):
            name = os.path.basename(w)[:-3] if w.endswith(".py") else None
            launched = i > 0 and ("python" in part[i - 1] or "torchrun" in " ".join(part[:i]))
            if name in RUN_SCRIPTS + TOOLS + ["muon_optimizer"] and launched:
                calls.append(("tools/" + name if name in TOOLS and name not in RUN_SCRIPTS else name, part[i + 1:]))
                break
        part = []
    return calls


def documented_calls(pages=PAGES) -> list[tuple[str, str, list[str]]]:
    return [(f"{page}:{number}", script, argv) for page in pages for number, command in shell_lines(page)
            if ".py" in command for script, argv in project_calls(command)]


def parse(script: str, argv: list[str], tmp_path):
    """The script's own command-line parser on argv (its parse_args, or the trainer's parse_config). A
    --config file the page only names (a run's config.json) is an empty one: its settings are not the page's.
    """
    if "--config" in argv and not os.path.exists(argv[argv.index("--config") + 1]):
        (tmp_path / "config.json").write_text("{}")
        argv = [str(tmp_path / "config.json") if a == argv[argv.index("--config") + 1] else a for a in argv]
    if script == "gpu_training_optimized":
        from llm.base.cli import parse_config
        return parse_config(argv)
    if script == "muon_optimizer":  # python muon_optimizer.py [preset] [layers] [repeats]
        from config import PRESETS
        assert len(argv) <= 3 and (not argv or argv[0] in PRESETS) and all(a.isdigit() for a in argv[1:]), argv
        return argv
    if script.startswith("tools/"):
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        script = script.removeprefix("tools/")
    return importlib.import_module(script).parse_args(argv)


CALLS = documented_calls()


def test_the_documentation_runs_every_script():
    """Each script a user runs has its commands in the README, and every tool somewhere in the docs."""
    in_readme = {script for _, script, _ in documented_calls(["README.md"])}
    assert set(RUN_SCRIPTS) <= in_readme
    runnable = {f"tools/{t}" for t in TOOLS if t not in TOOL_LIBRARIES}
    assert runnable - {"tools/compile_check"} <= {s for _, s, _ in CALLS}  # compile_check: gpu_check --compile_only


@pytest.mark.parametrize("where,script,argv", CALLS, ids=[f"{w} {s}" for w, s, _ in CALLS])
def test_every_documented_command_parses_with_its_scripts_parser(where, script, argv, capsys, tmp_path):
    """Every flag and value of a documented command is one its script takes: a renamed flag, a removed choice
    or a value of the wrong type fails here, naming the page and line."""
    try:
        parse(script, argv, tmp_path)
    except InputError as e:
        pytest.fail(f"{where}: {script} {' '.join(argv)}: {e}")
    except SystemExit as e:  # argparse: --help exits 0, a bad argument 2
        assert e.code == 0, f"{where}: {script} {' '.join(argv)}: {capsys.readouterr().err.strip()}"


def readme_section(title: str) -> str:
    text = read("README.md")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("title", WORKFLOWS)
def test_every_workflow_keeps_its_readme_section(title):
    assert f"\n## {title}\n" in read("README.md"), f"README.md lost its section {title!r}"


def test_every_repl_command_and_export_kind_is_in_the_readme():
    """The REPL's commands are listed where a user looks for them, and every kind of export has its command.
    """
    import export_hf
    import text_generator
    section = readme_section("Chat and generate")
    missing = [c for c in text_generator.COMMANDS if f"`{c}" not in section and f"`/{c}`" not in section]
    assert not missing, f"REPL commands missing from README's Chat and generate: {missing}"
    exports = [argv for _, script, argv in documented_calls(["README.md"]) if script == "export_hf"]
    kinds = {"folder": lambda a: not {"--gguf", "--adapter_only", "--import", "--base"} & set(a),
             "gguf": lambda a: "--gguf" in a, "adapter": lambda a: "--adapter_only" in a,
             "merged LoRA": lambda a: "--base" in a, "import": lambda a: "--import" in a}
    assert not [k for k, has in kinds.items() if not any(has(a) for a in exports)]
    assert all(t in readme_section("Export") for t in export_hf.GGUF_TYPES)


def test_every_module_has_its_row_in_the_architecture_page():
    page = read("docs/architecture.md")
    modules = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "llm", "*", "*.py"))
               + glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "tools", "*.py"))]
    missing = [m for m in modules if not m.endswith("__init__.py") and f"`{m}`" not in page]
    assert not missing, f"docs/architecture.md has no row for {missing}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_land_on_pages_and_headings_that_exist():
    """Every page of docs/ is linked from the README, and every relative link finds its file and its heading.
    """
    readme = read("README.md")
    assert all(f"({page})" in readme for page in PAGES[1:]), "a page of docs/ that the README does not link"
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", read(page)):
            if target.startswith(("http://", "https://")):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else \
                os.path.join(ROOT, page)
            assert os.path.exists(path), f"{page}: a link to {target}, which does not exist"
            if anchor and path.endswith(".md"):
                with open(path, encoding="utf-8") as f:
                    headings = {slug(h) for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
                assert anchor in headings, f"{page}: a link to {target}#{anchor}, which has no such heading"


@pytest.mark.slow
@pytest.mark.parametrize("script", RUN_SCRIPTS + [f"tools/{t}" for t in TOOLS if t not in TOOL_LIBRARIES])
def test_every_script_starts_from_a_clean_checkout(script):
    """The cheap command of every script, its --help, runs as a user would run it."""
    r = subprocess.run([sys.executable, f"{script}.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-2000:]
