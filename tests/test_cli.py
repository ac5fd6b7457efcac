"""``dspark-jax``'s dispatch: errors from a command's ``run`` and the environment it checks first."""

import argparse
import importlib
import os
import pathlib
import re
import sys
import types

import pytest

from dspark_jax import cli
from dspark_jax.bundled import TARGET_DIR
from dspark_jax.cli import SEED_MAX, check_environment, loading, main, number_flag

PACKAGE = pathlib.Path(cli.__file__).parent


def _variables() -> list[str]:
    """Every ``DSPARK_JAX_*`` name the package spells as a string literal (the names it reads)."""
    found = {
        m for path in PACKAGE.glob("*.py") for m in re.findall(r"[\"'](DSPARK_JAX_[A-Z_]+)[\"']", path.read_text())
    }
    return sorted(found)


@pytest.fixture
def fake_command(monkeypatch):
    """Registers command ``fake``, whose ``run`` raises what the test sets (or returns 0)."""
    module = types.ModuleType("fake_command")
    module.add_arguments = lambda parser: parser.add_argument("--n", type=int, default=1)
    module.error = None

    def run(args):
        if module.error is not None:
            raise module.error
        return 0

    module.run = run
    monkeypatch.setitem(sys.modules, "fake_command", module)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "a command for the tests"))
    return module


@pytest.mark.parametrize("error", [ValueError("--n=0 is invalid: must be >= 1"), TypeError("--n=x is invalid")])
def test_a_value_or_type_error_from_run_is_one_line_with_status_2(fake_command, capsys, error):
    """Before, a ``ValueError`` naming the flag came out as a Python traceback with status 1."""
    fake_command.error = error
    assert main(["fake"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"dspark-jax fake: error: {error}\n" and captured.out == ""


def test_a_warning_while_a_command_runs_is_one_plain_line(fake_command, capsys):
    """The interrupted-save notice came out as Python's ``path:line: UserWarning: …`` and the code line."""
    import warnings

    def run(args):
        warnings.warn("checkpoint folder 'd': finished a save that was cut short", stacklevel=2)
        return 0

    fake_command.run = run
    shown = warnings.showwarning
    assert main(["fake"]) == 0
    want = "dspark-jax fake: warning: checkpoint folder 'd': finished a save that was cut short\n"
    assert capsys.readouterr().err == want
    assert warnings.showwarning is shown  # restored once the command returned


def test_other_exceptions_from_run_keep_their_traceback(fake_command):
    fake_command.error = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["fake"])
    fake_command.error = None
    assert main(["fake", "--n", "2"]) == 0


def test_a_real_command_reports_its_validation_error_by_flag(capsys):
    assert main(["bench", "--shapes", "tiny", "--iters", "0"]) == 2
    assert capsys.readouterr().err == "dspark-jax bench: error: --iters=0 is invalid: must be >= 1\n"


def test_the_environment_check_covers_every_variable_the_package_reads(monkeypatch):
    """Each variable's bad value is refused naming the variable, the value and the choices;
    its documented values (any case, empty) pass."""
    variables = _variables()
    assert len(variables) == 7 and "DSPARK_JAX_FOLDED_SAMPLING" in variables, variables
    for variable in variables:
        monkeypatch.delenv(variable, raising=False)
    check_environment()
    for variable in variables:
        for good in ("AUTO", " auto ", ""):
            monkeypatch.setenv(variable, good)
            check_environment()
        monkeypatch.setenv(variable, "bogus")
        with pytest.raises(ValueError, match=rf"^{variable}='bogus' is invalid: must be one of .*auto"):
            check_environment()
        monkeypatch.delenv(variable)
    for variable, good in (("DSPARK_JAX_BACKBONE_GEMM", "cublas"), ("DSPARK_JAX_FOLDED_SAMPLING", "Force")):
        monkeypatch.setenv(variable, good)
        check_environment()
    monkeypatch.setenv("DSPARK_JAX_BACKBONE_GEMM", "pallas")
    with pytest.raises(ValueError, match=r"DSPARK_JAX_BACKBONE_GEMM='pallas' is invalid: .*'cublas'"):
        check_environment()


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("demo", []),
        ("generate", ["--target", "t", "--draft", "d", "--prompt", "p"]),
        ("train-target", ["--out", "o"]),
        ("train-draft", ["--target", "t", "--out", "o"]),
        ("eval", []),
        ("bench", ["--shapes", "tiny"]),
    ],
)
def test_every_command_refuses_a_bad_variable_before_it_runs(monkeypatch, capsys, command, argv):
    """``DSPARK_JAX_GREEDY=bogus`` passed silently where no greedy kernel was traced, and the other
    variables failed only once a kernel was traced (after the checkpoints loaded, or after the
    bench's compile stage)."""
    module = importlib.import_module(cli.COMMANDS[command][0])
    monkeypatch.setattr(module, "run", lambda args: 0)  # reached only if nothing refused the variable
    monkeypatch.setenv("DSPARK_JAX_GREEDY", "bogus")
    assert main([command, *argv]) == 2
    says = "DSPARK_JAX_GREEDY='bogus' is invalid: must be one of ('auto', 'xla', 'pallas')"
    assert capsys.readouterr().err == f"dspark-jax {command}: error: {says}\n"


def test_loading_names_the_flag_of_a_loader_error():
    with pytest.raises(ValueError, match=r"^--draft 'd': draft config is missing") as raised, loading("--draft", "d"):
        raise ValueError("draft config is missing the required field 'mask_token_id'")
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(KeyError), loading("--draft", "d"):  # not a loader's refusal: left alone
        raise KeyError("x")


def test_number_flags_refuse_integers_too_large_for_a_float():
    parse = number_flag(int, 0, SEED_MAX)
    with pytest.raises(argparse.ArgumentTypeError, match=r"is invalid: must be in \[0, 4294967295\]"):
        parse("9" * 400)
    assert parse("4294967295") == SEED_MAX


def test_python_dash_m_bench_reports_a_bad_flag_as_one_line():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "dspark_jax.bench", "--shapes", "tiny", "--iters", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "dspark-jax bench: error: --iters=0 is invalid: must be >= 1"


def test_an_empty_output_path_is_refused_by_every_command_that_writes_one(capsys):
    """``--out ''`` trained (or fit) and then failed with FileNotFoundError; ``eval --json ''`` and
    ``bench --out ''`` ran and silently wrote nothing."""
    for command, flag in (
        ("eval", "--json"),
        ("bench", "--out"),
        ("calibrate", "--out"),
        ("train-target", "--out"),
        ("train-draft", "--out"),
    ):
        extra = ["--target", TARGET_DIR] if command == "train-draft" else []
        assert main([command, flag, "", *extra]) == 2, command
        err = capsys.readouterr().err
        assert re.fullmatch(
            f"dspark-jax {command}: error: {flag}[ =]'' is invalid: must be a (file|folder) path\n", err
        )


def test_an_output_file_in_a_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """An unwritable folder passed the check (it only asked that the folder exist), so the
    results were lost to a traceback at the end of the run."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (tmp_path / "taken.json").write_text("{}")
    access = os.access
    locked_paths = {str(locked), str(tmp_path / "taken.json")}
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) not in locked_paths and access(path, mode))
    for path in (locked / "out.json", tmp_path / "taken.json"):
        with pytest.raises(ValueError, match=r"^--json=.* cannot be written: .* is not writable$"):
            cli.check_output_file("--json", str(path))
    cli.check_output_file("--json", str(tmp_path / "new.json"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"^--json=.* is invalid: must be a file path in an existing folder$"):
        cli.check_output_file("--json", str(tmp_path / "afile" / "out.json"))


def test_calibrate_names_the_seq_len_flag_of_a_window_too_long_for_the_models(tmp_path, capsys):
    """The message said ``seq_len=100000 exceeds …``."""
    assert main(["calibrate", "--out", str(tmp_path / "out"), "--seq-len", "100000"]) == 2
    assert "dspark-jax calibrate: error: --seq-len 100000 exceeds max_position_embeddings" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_flag_of_every_command_says_what_it_does(command):
    parser = argparse.ArgumentParser()
    importlib.import_module(cli.COMMANDS[command][0]).add_arguments(parser)
    bare = [a.option_strings or [a.dest] for a in parser._actions if a.help in (None, "")]
    assert not bare, f"{command}: flags without help: {bare}"
