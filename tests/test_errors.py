"""The one error contract (errors.py): every script maps failures to one `error:` line and an exit code in
the same place, bad input exits 2, runtime failures 1, and no script maps error classes by hand."""

import ast
import os
import subprocess
import sys

import pytest
import torch

from llm.base.errors import (CheckpointError, ConfigError, DataError, InputError, RunFailure, WriteError,
                             error_contract, exit_code)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["gpu_training_optimized", "text_generator", "prepare_data", "serve", "export_hf", "bench",
           "bench_generate", "gpu_check", "compile_check", "compare_optimizers"]


def test_every_class_has_one_code():
    """OSError once exited 2 in prepare_data.py and 1 in export_hf.py; the mapping now lives in one place."""
    assert [exit_code(e)[0] for e in (ConfigError("x"), DataError("x"), CheckpointError("x"))] == [2, 2, 2]
    assert [exit_code(e)[0] for e in (WriteError("x"), RunFailure("x"), FloatingPointError("x"))] == [1, 1, 1]
    assert exit_code(OSError(28, "No space left on device", "/x/y"))[0] == 1
    assert exit_code(torch.OutOfMemoryError("CUDA out of memory"))[0] == 1
    assert exit_code(KeyboardInterrupt()) == (130, None)
    assert exit_code(BrokenPipeError()) == (1, None)


def test_a_bug_keeps_its_traceback():
    """text_generator.py once turned every ValueError, a library's bug included, into an `error:` line."""
    with pytest.raises(ValueError, match="a bug"):
        exit_code(ValueError("a bug"))
    with pytest.raises(KeyError):
        error_contract(lambda: {}["missing"])()


def test_the_contract_prints_one_line_and_exits(capsys):
    def fails():
        raise DataError("data.jsonl line 3 is not JSON, fix that line")
    with pytest.raises(SystemExit) as e:
        error_contract(fails)()
    assert e.value.code == 2 and capsys.readouterr().err == "error: data.jsonl line 3 is not JSON, fix that line\n"
    assert error_contract(lambda: 0)() == 0


def test_a_bar_that_cannot_draw_itself_leaves_the_outcome_alone(capsys):
    """Closing the progress bars once raised tqdm's own TypeError (a bar past its total drops the total its
    format printed), which replaced the run's outcome with a traceback: the failure's line and code, or
    success, stay."""
    from tqdm import tqdm
    bars = []  # alive when the contract closes them

    def bar_past_its_total():
        bars.append(tqdm(total=10, bar_format="{n:.0f}/{total:.0f}", mininterval=3600))
        bars[-1].n = 12  # tqdm formats total None from here on

    def fails():
        bar_past_its_total()
        raise DataError("data.jsonl line 3 is not JSON, fix that line")
    with pytest.raises(SystemExit) as e:
        error_contract(fails)()
    assert e.value.code == 2 and "error: data.jsonl line 3" in capsys.readouterr().err
    assert error_contract(lambda: bar_past_its_total() or 0)() == 0
    assert all(bar.disable for bar in bars)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_under_the_contract(script):
    """Each script's `__main__` calls a function decorated with error_contract, and none maps errors by hand
    (the six hand-written mappings had drifted apart)."""
    folder = "" if script in ("gpu_training_optimized", "text_generator", "prepare_data", "serve", "export_hf") \
        else "tools"
    tree = ast.parse(open(os.path.join(ROOT, folder, script + ".py"), encoding="utf-8").read())
    decorated = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and any(getattr(d, "id", None) == "error_contract" for d in f.decorator_list)}
    main_blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    called = {c.func.id for block in main_blocks for c in ast.walk(block)
              if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    assert called & decorated, f"{script}.py: decorate its main with errors.error_contract"
    assert "error_exit(" not in ast.unparse(tree), f"{script}.py: raise an InputError or RunFailure instead"


def test_input_errors_are_value_errors_and_failures_runtime_errors():
    """Library code may keep raising ValueError for bad arguments (STYLE.md); the project's own classes say
    which kind they are."""
    assert issubclass(InputError, ValueError) and issubclass(RunFailure, RuntimeError)
    assert not issubclass(WriteError, ValueError)


@pytest.mark.slow
def test_output_into_a_closed_pipe_is_quiet(tiny_checkpoint):
    """`python text_generator.py --prompt ... | head -c 1` once ended in a BrokenPipeError traceback."""
    command = (f"{sys.executable} text_generator.py {tiny_checkpoint} --prompt 'def' --max_new_tokens 300 "
               f"--temperature 1 --stop '' | head -c 1")
    # Bytes, not text: the one byte kept may be the first of a multi-byte character.
    r = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, timeout=300)
    stderr = r.stderr.decode(errors="replace")
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert len(r.stdout) == 1


def test_library_notices_are_dropped_and_nothing_else():
    """Every start printed torchao's "KernelPreference is an Enum subclass" and, with a CUDA build of torch on
    a CPU, "No CUDA runtime is found": notices a user cannot act on. Exactly those lines go; the same loggers'
    other warnings stay."""
    import logging

    from llm.base.errors import NOTICES

    class Keep(logging.Handler):
        def emit(self, record):
            self.seen.append(record.getMessage())

    error_contract(lambda: None)()
    for name, text in NOTICES:
        # A handler on the logger itself: torch's loggers may not propagate to the root, where caplog listens.
        logger, keep = logging.getLogger(name), Keep(logging.WARNING)
        keep.seen = []
        logger.addHandler(keep)
        try:
            logger.warning(f"<enum 'X'> {text} (a notice)")
            logger.warning("something else went wrong")
        finally:
            logger.removeHandler(keep)
        assert keep.seen == ["something else went wrong"], name


@pytest.mark.slow
def test_a_default_run_prints_no_warning(corpus, tiny_flags, tmp_path):
    """A compiled run of config.py's settings on this CPU (the tiny model, two steps) prints no warning of
    ours or of a library: no torchao notices, no "best val loss inf (nan bits per byte)" before an evaluation.
    """
    r = subprocess.run([sys.executable, "gpu_training_optimized.py", "--sources", corpus["src"], "--cache_dir",
                        corpus["cache"], "--run_dir", str(tmp_path / "run"), *tiny_flags, "--max_steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (r.stdout + r.stderr).splitlines()
    assert not [line for line in lines if "warn" in line.lower() or line[:1] == "W" and line[1:5].isdigit()], lines
    assert not [line for line in lines if " inf " in line or "nan" in line.split()], lines
