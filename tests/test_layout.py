"""Tests of the project's shape (DESIGN.md): the root holds what a user runs or edits and the package folder
the rest, imports flow one way, nothing in the core imports a tool, each format has one reader, and no file
outgrows a screenful of screens."""

import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "llm"
# The package's wings (folders of llm/) in the flow's order, each module in its wing's order: a module imports
# only the wings before its own and the modules before it in its wing. The root files the package builds on
# (config, modern_llm, muon_optimizer) take their place in the flow; the trainer sits on top of the last wing.
WINGS = {
    "base": ["errors", "ranges", "fields", "config", "cli", "atomic", "fit", "sizing", "device", "distributed",
             "averaging", "attention", "modern_llm", "muon_optimizer"],
    "tokens": ["tokenizer", "tiktoken_bpe"],
    "hub": ["hub_client"],
    "data": ["readers", "chat_formats", "pairs", "hf_datasets", "corpus", "packing", "token_cache", "corpus_totals",
             "prompts", "arrival", "window_order", "batches", "preparation"],
    "formats": ["hf_families", "hf_format", "lora", "gguf_format", "gguf_reader", "hf_hub", "checkpoint",
                "trainer_state", "loading"],
    "generate": ["sampling", "decode", "decode_compile", "engine", "inference", "openai_api", "worker"],
    "scores": ["tasks", "samples", "scoring", "lm_eval_tasks", "evaluation", "rewards"],
    "reports": ["markdown", "monitor", "start_report", "report_chart", "model_card", "report_card"],
    "train": ["fine_tuning", "autofill", "schedule", "resume", "preference", "grpo",
              "rollouts", "rl", "plan", "runner", "startup", "gpu_training_optimized"],
}
CORE = [m for modules in WINGS.values() for m in modules]
WING_OF = {m: wing for wing, modules in WINGS.items() for m in modules}
WING_PACKAGES = {f"{PACKAGE}.{wing}" for wing in WINGS}
PEERS = {"device", "distributed"}  # side by side in the flow: neither imports the other
# Run by users, on the core, imported by nothing.
SCRIPTS = ["prepare_data", "text_generator", "export_hf", "serve", "evaluate"]
TOOLS = ["ablate", "bench", "bench_eval", "bench_generate", "bench_lora", "bench_packing", "bench_preference", "bench_grpo",
         "bench_prepare",
         "compare_optimizers", "compare_scores", "diff_samples",
         "finetune_check", "grpo_check", "nf4_gap",
         "compile_check", "compile_workloads", "fake_gpu", "gpu_check", "gpu_first_run", "gpu_generation",
         "gpu_report", "hub_stand_in", "roofline", "what_fits"]  # in tools/
# A tool may build on another only where declared here.
TOOL_BASES = {"gpu_check": {"bench", "compile_check", "gpu_first_run", "gpu_generation", "gpu_report"},
              "gpu_first_run": {"gpu_generation", "hub_stand_in"},
              "gpu_generation": {"bench", "bench_generate"}, "compile_check": {"compile_workloads", "fake_gpu", "roofline"},
              "compile_workloads": {"bench"},
              "bench_lora": {"bench"}, "bench_grpo": {"bench"}, "bench_preference": {"bench"},
              "nf4_gap": {"finetune_check"}, "grpo_check": {"finetune_check"}}
MAX_LINES = 460  # DESIGN.md: past about 450 lines a file gives one concern to a new module
# What a user runs, edits or reads first stays at the root; every other module lives in its wing's folder.
AT_ROOT = ["config", "modern_llm", "muon_optimizer", "gpu_training_optimized", "text_generator", "prepare_data",
           "serve", "export_hf", "evaluate"]
# The root files the package may import: the settings, the network, and its optimizer (the step's runner
# builds it).
ROOT_SHARED = {"config", "modern_llm", "muon_optimizer"}


def path(module: str) -> str:
    folder = "tools" if module in TOOLS else "" if module in AT_ROOT else os.path.join(PACKAGE, WING_OF[module])
    return os.path.join(ROOT, folder, module + ".py")


def project_imports(module: str) -> set[str]:
    """The project modules that module.py imports, at any depth of the file."""
    with open(path(module), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {_module(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in WING_PACKAGES:
            names |= {a.name for a in node.names}  # from llm.base import atomic
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(_module(node.module))
    return names & set(CORE + SCRIPTS + TOOLS)


def _module(dotted: str) -> str:
    """The project module a dotted import names: llm.generate.engine -> engine, config -> config."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else parts[0]


def test_every_python_file_is_listed():
    """A new module must take its place in the flow (and in README's table); the root holds what a user runs,
    edits or reads, the package's wings the modules they import, tools/ the measurements."""
    assert {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} == set(AT_ROOT)
    package = os.path.join(ROOT, PACKAGE)
    assert {f for f in os.listdir(package) if f != "__pycache__"} == set(WINGS) | {"__init__.py"}
    for wing, modules in WINGS.items():
        found = {f[:-3] for f in os.listdir(os.path.join(package, wing)) if f.endswith(".py")}
        assert found == set(modules) - set(AT_ROOT) | {"__init__"}, f"llm/{wing}/"
    assert {f[:-3] for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py")} == set(TOOLS)


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_says_what_it_does_and_imports_nothing(wing):
    """A wing's __init__.py is its sign: what it holds and the wings it builds on, no code, so importing one
    module of it loads no other."""
    with open(os.path.join(ROOT, PACKAGE, wing, "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    assert ast.get_docstring(tree) and len(tree.body) == 1, f"llm/{wing}/__init__.py: a docstring alone"


def test_the_root_shows_what_a_user_runs_or_edits():
    """`ls` once showed 35 modules and a page side by side, the five files a user works with lost among them.
    """
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    top = {line.split("/")[0] for line in tracked.splitlines() if not line.startswith(".")}
    assert top == {f"{m}.py" for m in AT_ROOT} | {PACKAGE, "tools", "tests", "docs", "README.md", "requirements.txt",
                                                  "requirements-test.txt", "requirements-extra.txt"}
    assert os.path.isfile(os.path.join(ROOT, PACKAGE, "generate", "chat_page.html"))  # beside the server's code


@pytest.mark.parametrize("module", sorted(set(CORE) - set(AT_ROOT)))
def test_the_package_imports_from_the_root_only_the_settings_and_the_network(module):
    """The package once reached up into the scripts (batches imported prepare_data, the server the REPL's
    loader): a module the scripts import builds on config.py, modern_llm.py and muon_optimizer.py alone of the
    root's files."""
    assert project_imports(module) & set(AT_ROOT) <= ROOT_SHARED


@pytest.mark.parametrize("module", CORE)
def test_core_imports_flow_one_way(module):
    """No import goes back up the flow: not to a later wing (the wings stack as their folders are listed in
    WINGS), nor to a later module of its own wing (a cycle, or the model importing the optimizer), and none
    reaches a tool (the trainer and generator once loaded weights through the export tool)."""
    rank, wings = CORE.index(module), list(WINGS)
    for imported in project_imports(module):
        assert imported not in TOOLS + SCRIPTS, f"{module} imports the tool {imported}"
        assert wings.index(WING_OF[imported]) <= wings.index(WING_OF[module]), \
            f"{module} ({WING_OF[module]}) imports {imported} of the later wing {WING_OF[imported]}"
        assert CORE.index(imported) < rank, f"{module} imports {imported}, which comes after it in {WING_OF[module]}"
        assert not (module in PEERS and imported in PEERS), f"{module} imports its peer {imported}"


@pytest.mark.parametrize("module", SCRIPTS + TOOLS)
def test_tools_sit_on_the_core_only(module):
    assert not project_imports(module) & set(SCRIPTS + TOOLS) - {module} - TOOL_BASES.get(module, set())


def test_the_step_runner_alone_sets_how_the_step_runs():
    """Eager or compiled once had four owners, by two tests: the trainer, a fallback, preference.py setting
    the model's ragged rows after the build, batches.py trimming pair windows by the config. Now it is
    decided once, with the plan (plan.step_settings), and the runner alone sets it (llm/train/runner.py): no
    other module of the core writes the model's execution settings or the loaders' trim."""
    writes = re.compile(r"\.(execution|trim)\s*=[^=]")
    for module in CORE + SCRIPTS:
        if module in ("runner", "modern_llm"):  # the model's own default, and the one owner
            continue
        with open(path(module), encoding="utf-8") as f:
            assert not writes.search(f.read()), f"{module} sets the model's execution or a loader's trim"


def test_the_runner_builds_the_step_the_plan_decided():
    """How the step runs (autocast, eager or compiled, CUDA graphs, the LoRA base's format, the model's
    execution settings) was once decided inside build(), again by the preference objective, and the base's
    format in three places. plan.step_settings decides it before any model exists; the runner calls none of
    the rules it is decided by, and only reads the settings."""
    rules = {"pick_precision", "written_out_is_faster", "loss_chunk_rows", "uses_cuda_graphs", "base_dtype",
             "held_base", "machine"}
    for module in ("runner", "preference", "rollouts", "rl"):
        with open(path(module), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
        called = {f.id if isinstance(f, ast.Name) else f.attr for f in calls
                  if isinstance(f, (ast.Name, ast.Attribute))}
        assert not rules & called, f"{module} decides how the step runs: {sorted(rules & called)}"


def test_weights_and_metrics_have_one_reader():
    """safetensors files are read only by checkpoint.py (and hf_format.py for Hugging Face folders, on its
    behalf); metrics.jsonl only by monitor.py."""
    for module in CORE + SCRIPTS + TOOLS:
        with open(path(module), encoding="utf-8") as f:
            source = f.read()
        if module not in ("checkpoint", "hf_format"):
            assert "load_file(" not in source and "safe_open(" not in source, module
        if module != "monitor":
            assert '"metrics.jsonl"' not in source, module


@pytest.mark.parametrize("module", CORE + SCRIPTS + TOOLS)
def test_files_stay_small(module):
    with open(path(module), encoding="utf-8") as f:
        assert len(f.readlines()) <= MAX_LINES, f"{module}.py: move one self-contained concern into its own module"


def test_readme_lists_the_wings_in_the_flows_order():
    """README's Files table has a row per wing, in the order the imports flow, as docs/architecture.md's."""
    for page in ("README.md", os.path.join("docs", "architecture.md")):
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        rows = re.findall(r"^\| `(?:llm/)?(\w+)/?` \|", text, re.M)
        assert [r for r in rows if r in WINGS] == list(WINGS), page


def test_ci_runs_exactly_the_test_command_readme_gives():
    """A new user runs README's command; CI must run the same one, or a broken install step goes unseen."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    command = readme.split("Run the tests")[1].split("```bash\n")[1].split("\n```")[0].strip()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().strip().splitlines()
    assert command in ci and "pytest" in command and "--durations=15" in command
    assert any("tools/gpu_check.py --compile_only" in line for line in ci[ci.index(command):])  # then the compile check


def test_error_classes_are_imported_from_their_own_module():
    """config.py once re-exported the error classes, so modules imported them from both homes."""
    errors = {"InputError", "ConfigError", "DataError", "CheckpointError", "RunFailure", "WriteError", "CompileError"}
    for module in CORE + SCRIPTS + TOOLS:
        with open(path(module), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "config":
                assert not {a.name for a in node.names} & errors, f"{module} imports error classes from config"
