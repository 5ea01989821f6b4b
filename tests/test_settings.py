"""``settings.load``: the parser, the YAML ``--config`` and the declared limits that every
command's settings come from (real annotations: ``int | None``, ``list[str]``, ``Literal``)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlx_rwkvx import settings
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.settings import Settings, opt

import pytest


@dataclass
class Demo(Settings):
    """A command's settings, one of each kind."""

    name: str | None = opt("a name", required=True)
    count: int | None = opt("how many (default: all)", "n", ge=1, also=(-1,))
    rate: float = opt("a rate", "learning_rate", default=0.5, gt=0, le=1)
    share: float = opt("a share", default=0.0, ge=0, lt=1)
    seed: int = opt("a seed", default=0, ge=0, le=2**64 - 1)
    tags: list[str] | None = opt("a tag (repeatable)")
    kind: Literal["a", "b"] = opt("the kind", default="a")
    loud: bool = opt("say more", default=False)
    window: bool = opt("keep a window", default=True)
    level: str | None = opt("a level (bare: low)", choices=("low", "high"), const="low")

    def check_together(self) -> None:
        if self.loud and self.kind == "b":
            raise UsageError("--loud says nothing of kind b")


def load(*argv):
    return settings.load(Demo, [str(a) for a in argv], "demo")


def write(tmp_path, text):
    (tmp_path / "c.yaml").write_text(text)
    return tmp_path / "c.yaml"


def test_real_types_from_flags():
    cfg = load(
        "--name",
        "x",
        "-n",
        "3",
        "--learning-rate",
        "0.25",
        "--tags",
        "t1",
        "--tags",
        "t2",
        "--kind",
        "b",
        "--no-window",
        "--level",
    )
    assert (cfg.count, cfg.rate, cfg.tags, cfg.kind, cfg.window, cfg.level) == (
        3,
        0.25,
        ["t1", "t2"],
        "b",
        False,
        "low",
    )
    assert load("--name", "x").count is None  # int | None: unset


def test_real_types_from_yaml_and_flags_beat_the_file(tmp_path):
    text = "name: x\nn: 3\nlearning_rate: 1e-5\ntags: one\nkind: b\nwindow: false\n"
    config = write(tmp_path, text)
    cfg = load("--config", config)
    assert (cfg.count, cfg.rate, cfg.tags, cfg.kind, cfg.window) == (3, 1e-5, ["one"], "b", False)
    assert load("--config", config, "--count", "4", "--kind", "a").count == 4
    assert load("--config", write(tmp_path, "name: x\ncount: null\n")).count is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\ncount: 2.5\n", "count must be an integer, got 2.5"),
        ("name: x\nrate: null\n", "rate needs a value"),
        ("name: x\nkind: c\n", "kind must be one of a, b, got 'c'"),
        ("name: x\ntags: [1]\n", r"tags must be a list of strings, got \[1\]"),
        ("name: x\nloud: 1\n", "loud must be true or false, got 1"),
        ("name: x\nwarp: 9\n", "unknown setting 'warp'"),
        ("- 1\n", "expected a mapping of settings"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as e:
        load("--config", write(tmp_path, text))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"demo: error: --config {tmp_path / 'c.yaml'}: ")
    assert re.search(message, err[0]), err


LIMITS = [
    ("count", "0", "--count must be at least 1, got 0"),
    ("count", "-2", "--count must be at least 1, got -2"),
    ("rate", "0", "--rate must be positive, got 0"),
    ("rate", "1.5", "--rate must be at most 1, got 1.5"),
    ("rate", "nan", "--rate must be a finite number, got nan"),
    ("share", "-0.1", "--share must not be negative, got -0.1"),
    ("share", "1", "--share must be less than 1, got 1"),
    ("seed", "-1", r"--seed must be in 0 .. 2\^64 - 1, got -1"),
    ("seed", str(2**64), r"--seed must be in 0 .. 2\^64 - 1, got 18446744073709551616"),
]


@pytest.mark.parametrize(("name", "value", "message"), LIMITS)
def test_each_limit_refuses_from_a_flag(name, value, message):
    with pytest.raises(UsageError, match=f"^{message}$"):
        load("--name", "x", f"--{name}", value)


@pytest.mark.parametrize(("name", "value", "message"), LIMITS)
def test_each_limit_refuses_from_the_file_naming_the_flag(tmp_path, name, value, message):
    config = write(tmp_path, f"name: x\n{name}: {value if value != 'nan' else '.nan'}\n")
    with pytest.raises(UsageError, match=f"^{message}$"):
        load("--config", config)


def test_limits_the_rules_between_and_required():
    assert load("--name", "x", "--count", "-1").count == -1  # also=(-1,): mlx-lm's "all"
    with pytest.raises(UsageError, match="^--loud says nothing of kind b$"):
        load("--name", "x", "--loud", "--kind", "b")
    with pytest.raises(UsageError, match=r"^--name is required \(on the command line or in "):
        load()
    with pytest.raises(UsageError, match="^--rate must be positive, got -1"):
        Demo(name="x", rate=-1).check()  # the Python API: the same check
    with pytest.raises(UsageError, match="^--count must be an integer, got '3'"):
        Demo(name="x", count="3").check()


@dataclass
class Plain(Settings):
    """A command of two lines of help,
    the second indented in its docstring as every docstring is."""

    output: str | None = opt("where to write", required=True)


def test_help_reads_as_written_and_usage_shows_what_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        settings.load(Plain, ["--help"], "plain", yaml=False)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "\nthe second indented in its docstring" in out  # not "    the second"
    assert "usage: plain [-h] --output OUTPUT" in out  # required: no brackets
    with pytest.raises(SystemExit) as e:
        settings.load(Plain, [], "plain", yaml=False)
    assert e.value.code == 2 and "--output" in capsys.readouterr().err
    # given empty, it is given: the command's own check of the path says what is wrong
    assert settings.load(Plain, ["--output", ""], "plain", yaml=False).output == ""


def test_argparse_refuses_what_it_cannot_read(capsys):
    for argv in (["--count", "x"], ["--kind", "c"], ["--level", "mid"]):
        with pytest.raises(SystemExit) as e:
            load("--name", "x", *argv)
        assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_comes_from_the_fields(capsys):
    with pytest.raises(SystemExit):
        load("--help")
    out = capsys.readouterr().out
    assert "A command's settings, one of each kind." in out
    assert "-n COUNT, --count COUNT" in out or "--count COUNT, -n COUNT" in out
    assert "a rate (default: 0.5)" in out and "--no-window" in out


def test_an_annotation_with_no_command_line_form_is_refused():
    @dataclass
    class Odd(Settings):
        pairs: dict | None = opt("no flag can carry this")

    with pytest.raises(TypeError, match="Odd.pairs: a setting is int, float"):
        settings.load(Odd, [], "odd")


# ----- one way to start a command -------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_rwkvx"


def _loops_over_named_settings(tree: ast.AST) -> list[int]:
    """Lines of loops (``for`` or comprehensions) over a literal tuple or list of strings whose
    body reads ``getattr(x, name)`` with the loop's name: the hand-written range check over
    settings by name (``for name in ("max_tokens", "max_cache"): if getattr(cfg, name) < 1``)
    that a declared limit replaces."""
    found = []
    for node in ast.walk(tree):
        pairs = [(node.target, node.iter, node)] if isinstance(node, ast.For) else []
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            pairs = [(g.target, g.iter, node) for g in node.generators]
        for target, iterable, body in pairs:
            names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            literal = isinstance(iterable, (ast.Tuple, ast.List)) and any(
                isinstance(e, ast.Constant)
                and isinstance(e.value, str)
                or isinstance(e, ast.Tuple)
                and e.elts
                and isinstance(e.elts[0], ast.Constant)
                and isinstance(e.elts[0].value, str)
                for e in iterable.elts
            )
            reads = any(
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "getattr"
                and len(n.args) >= 2
                and isinstance(n.args[1], ast.Name)
                and n.args[1].id in names
                for n in ast.walk(body)
            )
            if literal and reads:
                found.append(node.lineno)
    return found


def test_no_command_builds_or_checks_its_settings_by_its_own_code():
    """Every command starts through ``settings.load``: outside settings.py no function is named
    ``config_from`` or ``_check`` (the per-command parse and check loop this replaced), no loop
    runs over settings named in a literal to check them by ``getattr`` in a module of
    settings (a limit is declared on the field: ``opt(..., ge=1)``), and every dataclass of
    ``opt`` fields is a ``Settings``, so that its ``check()`` applies those limits however it
    was made."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        where = path.relative_to(PACKAGE.parent)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
                "config_from",
                "_check",
            ):
                problems.append(f"{where}:{node.lineno}: def {node.name}")
            if (
                isinstance(node, ast.ClassDef)
                and any(
                    isinstance(a, ast.AnnAssign)
                    and isinstance(a.value, ast.Call)
                    and getattr(a.value.func, "id", None) == "opt"
                    for a in node.body
                )
                and "Settings" not in {getattr(b, "id", None) for b in node.bases}
            ):
                problems.append(f"{where}:{node.lineno}: {node.name} is not a Settings")
        if "Settings" in path.read_text():  # a module with settings of its own
            problems += [
                f"{where}:{line}: a check loop over settings by name"
                for line in _loops_over_named_settings(tree)
            ]
    assert not problems, "\n".join(problems)


def _starts(tree: ast.AST) -> tuple[bool, bool, bool]:
    """(whether the module has a top-level ``main``, calls ``settings.load``, builds an
    ``argparse.ArgumentParser`` of its own)."""
    main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
    loads = any(
        isinstance(f, ast.Attribute)
        and f.attr == "load"
        and isinstance(f.value, ast.Name)
        and f.value.id == "settings"
        for f in calls
    )
    parser = any(
        getattr(f, "attr", None) == "ArgumentParser" or getattr(f, "id", None) == "ArgumentParser"
        for f in calls
    )
    return main, loads, parser


def test_every_command_starts_through_settings_load():
    """Every command (a module of the package with a ``main``: the demo too) reads its command
    line through ``settings.load``, and no module but settings.py builds a parser of its own."""
    commands, problems = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        where = path.relative_to(PACKAGE.parent)
        main, loads, parser = _starts(ast.parse(path.read_text()))
        if main:
            commands.append(str(where))
        if main and not loads:
            problems.append(f"{where}: main does not start through settings.load")
        if parser:
            problems.append(f"{where}: builds an argparse.ArgumentParser")
    assert any(c.startswith("mlx_rwkvx/demo") for c in commands) and len(commands) >= 8, commands
    assert not problems, "\n".join(problems)


def test_the_start_rule_catches_its_own_parser():
    old = """
import argparse
def main(argv=None):
    args = argparse.ArgumentParser(prog="x").parse_args(argv)
"""
    assert _starts(ast.parse(old)) == (True, False, True)


def test_the_rule_catches_what_it_forbids():
    old = """
def _check(cfg):
    for name in ("max_tokens", "max_cache"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UsageError(name)
    given = [n for n in ("system", "chat_template") if getattr(cfg, n) is not None]
"""
    assert _loops_over_named_settings(ast.parse(old)) == [3, 6]
