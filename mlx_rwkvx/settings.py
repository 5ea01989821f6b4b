"""Settings dataclasses behind the commands, and the one way a command starts:
``settings.load(ConfigClass, argv, prog)``.

Each field of a ``Settings`` dataclass is one setting: its type is its annotation (``int``,
``float``, ``bool``, ``str``, ``list[str]``, ``Literal[...]``, each possibly ``| None``), and
``opt(...)`` gives its help text, aliases (mlx-lm's names), choices and limits, so that the
command line, its help, a YAML ``--config`` and the checks all come from the one definition.
Defaults: the dataclass; then the file; then the flags. A value out of its limits is one
``UsageError`` naming the flag: ``--max-tokens must be at least 1, got 0``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Literal, get_args, get_origin, get_type_hints

from mlx_rwkvx.errors import UsageError

from yaml import YAMLError, safe_load

LIMITS = ("ge", "gt", "le", "lt")


def opt(
    help: str,
    *aliases: str,
    default=None,
    choices: tuple | None = None,
    const=None,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    also: tuple = (),
    finite: bool = True,
    required: bool = False,
    positional: bool = False,
    exclusive: str | None = None,
    metavar: str | None = None,
):
    """A setting. ``help``; mlx-lm's names for it (``aliases``; one letter: ``-m``);
    ``choices``; ``const``: the value of the bare flag (its value then optional). Limits, checked
    on every value however it came: ``ge``/``gt``/``le``/``lt`` (bounds), ``also`` (values
    accepted outside them: mlx-lm's ``-1`` for "all"), ``finite`` (floats; on by default).
    ``required``: the command needs it (on the command line or in ``--config``).
    ``positional``: an argument without a flag; ``exclusive``: flags of one group name
    exclude each other."""
    meta = dict(
        help=help,
        aliases=aliases,
        choices=choices,
        const=const,
        also=also,
        finite=finite,
        required=required,
        positional=positional,
        exclusive=exclusive,
        metavar=metavar,
        ge=ge,
        gt=gt,
        le=le,
        lt=lt,
    )
    return field(default=default, metadata=meta)


def help_text(doc: str) -> str:
    """A docstring as ``--help`` shows it: reStructuredText's double backquotes dropped."""
    return doc.replace("``", "")


@dataclass(frozen=True)
class Spec:
    """One setting as the commands see it: its field, its flag, its type and its limits."""

    name: str
    flag: str
    base: type  # int, float, bool, str or list (of strings)
    optional: bool  # None is a value (the default's "not given")
    choices: tuple | None
    meta: dict

    def type_problem(self, value) -> str | None:
        """What is wrong with ``value``'s type (None: nothing). An int is a float; a bool is
        neither."""
        if value is None:
            return None if self.optional else "needs a value"
        want, ok = {
            list: (
                "a list of strings",
                isinstance(value, list) and all(isinstance(v, str) for v in value),
            ),
            bool: ("true or false", isinstance(value, bool)),
            int: ("an integer", isinstance(value, int) and not isinstance(value, bool)),
            float: ("a number", isinstance(value, (int, float)) and not isinstance(value, bool)),
            str: ("a string", isinstance(value, str)),
        }[self.base]
        return None if ok else f"must be {want}, got {value!r}"

    def value_problem(self, value) -> str | None:
        """What is wrong with a value of the right type: not finite, not one of the choices,
        out of its bounds (None: nothing)."""
        if value is None or (value in self.meta["also"] and not isinstance(value, bool)):
            return None
        if self.base is float and self.meta["finite"] and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        return bounds_problem(value, **{k: self.meta[k] for k in LIMITS})

    def problem(self, value) -> str | None:
        return self.type_problem(value) or self.value_problem(value)


def bounds_problem(value, ge=None, gt=None, le=None, lt=None) -> str | None:
    """``value`` against its bounds, in words: ``must be at least 1, got 0`` (None: within
    them). The one wording of every command's ranges and of the library's that share them."""
    low_ok = (ge is None or value >= ge) and (gt is None or value > gt)
    high_ok = (le is None or value <= le) and (lt is None or value < lt)
    if low_ok and high_ok:
        return None
    if ge is not None and le is not None:
        rule = f"be in {_shown(ge)} .. {_shown(le)}"
    elif not low_ok:
        rule = (
            ("not be negative" if ge == 0 else f"be at least {_shown(ge)}")
            if gt is None
            else ("be positive" if gt == 0 else f"be more than {_shown(gt)}")
        )
    else:
        rule = f"be at most {_shown(le)}" if lt is None else f"be less than {_shown(lt)}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a flag's 0 read as a float: shown as it was typed
    return f"must {rule}, got {value}"


def _shown(bound) -> str:
    """A bound as a message writes it: 2^64 - 1 rather than its twenty digits."""
    if isinstance(bound, int) and bound >= 1 << 32:
        for power, tail in ((bound + 1, " - 1"), (bound, "")):
            if power & (power - 1) == 0:
                return f"2^{power.bit_length() - 1}{tail}"
    return str(bound)


@functools.cache
def specs(cls) -> dict[str, Spec]:
    """Every setting of ``cls`` by field name, its type read from its annotation."""
    hints = get_type_hints(cls)
    return {f.name: _spec(cls, f, hints[f.name]) for f in fields(cls)}


def _spec(cls, f, hint) -> Spec:
    optional = False
    if get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(hint) if a is not type(None)]
        optional = len(rest) < len(get_args(hint))
        hint = rest[0] if len(rest) == 1 else None
    choices = f.metadata["choices"]
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        hint = type(choices[0])
    elif get_origin(hint) is list and get_args(hint) == (str,):
        hint = list
    if hint not in (int, float, bool, str, list):
        raise TypeError(
            f"{cls.__name__}.{f.name}: a setting is int, float, bool, str, "
            "list[str] or Literal[...], each possibly | None"
        )
    flag = f.name if f.metadata["positional"] else f"--{f.name.replace('_', '-')}"
    return Spec(f.name, flag, hint, optional, choices, dict(f.metadata))


def names(cls) -> dict[str, str]:
    """Every name a setting of ``cls`` goes by (its own and its aliases) -> its field."""
    out = {f.name: f.name for f in fields(cls)}
    for f in fields(cls):
        for alias in f.metadata["aliases"]:
            out[alias] = f.name
    return out


def check_fields(cfg) -> None:
    """Each setting of ``cfg`` of its type and within its declared limits: else one
    ``UsageError`` naming its flag."""
    for name, spec in specs(type(cfg)).items():
        problem = spec.problem(getattr(cfg, name))
        if problem:
            raise UsageError(f"{spec.flag} {problem}")


class Settings:
    """The base of a command's settings dataclass. ``check()`` is its whole check; a class
    adds the rules between its settings in ``check_together()`` and, where its command reads
    more than its fields say, overrides ``from_yaml``, ``combine`` or ``add_flags``."""

    def check(self) -> None:
        """Every setting's type and limits, then the rules between them: ``UsageError``
        naming the flag (a ``ValueError``, as the Python API raises)."""
        check_fields(self)
        self.check_together()

    def check_together(self) -> None:
        """Settings that do not go together (each is within its own limits here)."""

    @classmethod
    def from_yaml(cls, data: dict) -> dict:
        """The settings of a ``--config`` file by field: any name a setting goes by, typed as
        the field is; ValueError naming an unknown or mistyped key."""
        known, out = names(cls), {}
        for key, value in data.items():
            key = str(key).replace("-", "_")
            if key not in known:
                raise ValueError(f"unknown setting {key!r}")
            out[known[key]] = typed(cls, known[key], value)
        return out

    @classmethod
    def combine(cls, flags: dict, found: dict) -> dict:
        """The constructor's arguments from the flags given and the file's settings: the
        flags win."""
        return {**found, **flags}

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Flags of the command that are no setting (mlx-lm's, accepted for its users)."""


def typed(cls, name: str, value):
    """A file's ``value`` as setting ``name``'s type: YAML 1.1 reads ``1e-5`` (no dot) as a
    string, and mlx-lm's configs write learning rates so; a single string is a list of one.
    ValueError naming the setting as the file does otherwise."""
    spec = specs(cls)[name]
    if spec.base is list and isinstance(value, str):
        value = [value]
    elif spec.base in (int, float) and isinstance(value, str):
        try:
            value = spec.base(value)
        except ValueError:
            pass
    elif spec.base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    problem = spec.type_problem(value)
    if problem is None and spec.choices is not None and value is not None:
        problem = spec.value_problem(value)
    if problem:
        raise ValueError(f"{name} {problem}")
    return value


def parser(cls, prog: str, description: str, *, yaml: bool = True) -> argparse.ArgumentParser:
    """The command line of ``cls``'s settings (plus ``--config`` with ``yaml``); flags left out
    are absent from the parsed namespace, so that a file's value is not overwritten by a
    default."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if yaml:
        p.add_argument("--config", help="a YAML file of these settings")
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in fields(cls):
        spec, meta = specs(cls)[f.name], f.metadata
        kwargs = {"help": meta["help"]}
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        if meta["positional"]:
            p.add_argument(f.name, nargs="+" if spec.base is list else None, **kwargs)
            continue
        flags = [spec.flag] + [
            f"-{a}" if len(a) == 1 else f"--{a.replace('_', '-')}" for a in meta["aliases"]
        ]
        kwargs.update(dest=f.name, default=argparse.SUPPRESS)
        if spec.base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif spec.base is list:
            kwargs["action"] = "append"
        else:
            kwargs["type"] = spec.base
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if meta["const"] is not None:
                kwargs.update(nargs="?", const=meta["const"])
        if f.default is not None and spec.base is not bool:
            kwargs["help"] += f" (default: {f.default})"
        if meta["required"] and not yaml:  # no file can give it: argparse says it is missing
            kwargs["required"] = True
        group = meta["exclusive"]
        if group is not None and group not in groups:
            groups[group] = p.add_mutually_exclusive_group()
        (groups[group] if group else p).add_argument(*flags, **kwargs)
    cls.add_flags(p)
    return p


def parse(p: argparse.ArgumentParser, argv, from_yaml) -> tuple[dict, dict]:
    """(the flags given, the settings of the ``--config`` file through ``from_yaml(data)``); a
    file that cannot be read is one line naming it and the problem (exit 2)."""
    args = vars(p.parse_args(argv))
    source, found = args.pop("config", None), {}
    if source:
        try:
            with open(source) as f:
                data = safe_load(f) or {}
            if not isinstance(data, dict):
                raise ValueError("expected a mapping of settings")
            found = from_yaml(data)
        except (OSError, ValueError, YAMLError) as e:
            # one line, not argparse's usage block: YAML's messages span lines of their own
            problem = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            print(
                f"{p.prog}: error: --config {source}: {' '.join(problem.split())}", file=sys.stderr
            )
            sys.exit(2)
    return args, found


def load(
    cls, argv: list[str] | None, prog: str, *, description: str | None = None, yaml: bool = True
):
    """The settings of a command run as ``prog argv``: ``cls``'s defaults, then its YAML
    ``--config`` (with ``yaml``), then the flags; each checked (``cls.check()``).
    ``description``: ``--help``'s text (default: the class's docstring). ``--help`` exits 0; a
    flag argparse refuses or a file that cannot be read exit 2 with their message; a value out
    of its limits, settings that do not go together or a required one missing are one
    ``UsageError`` naming the flag (run it inside ``cli.run``). A required setting given empty
    (``--output ""``) is given: the command's own check of it says what is wrong."""
    description = help_text(inspect.cleandoc(description or cls.__doc__ or ""))
    p = parser(cls, prog, description, yaml=yaml)
    flags, found = parse(p, argv, cls.from_yaml)
    cfg = cls(**cls.combine(flags, found))
    for name, spec in specs(cls).items():
        if spec.meta["required"] and getattr(cfg, name) in (None, []):
            where = " (on the command line or in --config)" if yaml else ""
            raise UsageError(f"{spec.flag} is required{where}")
    cfg.check()
    return cfg
