"""Settings dataclasses behind the CLIs (``train``, ``generate``): each field is one setting,
with its help text, aliases (mlx-lm's names) and choices in its metadata, so that the
command line, its help and a YAML ``--config`` all come from the one definition. Defaults:
the dataclass; then the file; then the flags."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import field, fields

import yaml


def opt(help: str, *aliases: str, default=None, **kw):
    """A setting: ``help``, mlx-lm's ``aliases``, and ``choices`` / ``const`` (the value of
    the bare flag, making its value optional) in ``kw``."""
    return field(default=default, metadata={"help": help, "aliases": aliases, **kw})


# a setting's declared type ("list": of strings, a flag given once per value)
TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list}


def _is(kind: str, value) -> bool:
    """Whether ``value`` is a ``kind`` setting's value (an int is a float; a bool is neither)."""
    if kind == "list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    want = (int, float) if kind == "float" else TYPES[kind]
    return isinstance(value, want) and (kind == "bool" or not isinstance(value, bool))


def check_types(settings) -> None:
    """The one check of a settings dataclass's values (TrainConfig, GenerateConfig): each of
    its declared type or None (the default), floats finite. ValueError naming the first that
    is not."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if value is None:
            continue
        if not _is(f.type, value):
            raise ValueError(f"{f.name} must be {f.type}, got {value!r}")
        if f.type == "float" and not math.isfinite(value):
            raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")


def typed(cls, name: str, value):
    """``value`` as the field's type: YAML 1.1 reads ``1e-5`` (no dot) as a string, and
    mlx-lm's configs write learning rates so. ValueError naming the setting otherwise, or
    naming its choices where the value is not one (as the flag's own parser refuses it)."""
    value = _converted(cls, name, value)
    choices = {f.name: f.metadata.get("choices") for f in fields(cls)}[name]
    if choices is not None and value is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def _converted(cls, name: str, value):
    kind = {f.name: f.type for f in fields(cls)}[name]
    if kind == "list":
        value = [value] if isinstance(value, str) else value
        if value is None or _is(kind, value):
            return value
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    convert = TYPES[kind]
    if value is None or (isinstance(value, convert) and _is(kind, value)):
        return value
    if kind in ("bool", "str") or isinstance(value, bool) or (
        kind == "int" and isinstance(value, float)):  # fmt: skip
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None


def names(cls) -> dict[str, str]:
    """Every name a setting of ``cls`` goes by (its own and its aliases) -> its field."""
    out = {f.name: f.name for f in fields(cls)}
    for f in fields(cls):
        for alias in f.metadata["aliases"]:
            out[alias] = f.name
    return out


def make_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of ``cls``'s settings plus ``--config``; flags left out are absent
    from the parsed namespace (so that a file's value is not overwritten by a default)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="a YAML file of these settings")
    for f in fields(cls):
        flags = [f"--{f.name.replace('_', '-')}"]
        flags += [
            f"-{a}" if len(a) == 1 else f"--{a.replace('_', '-')}" for a in f.metadata["aliases"]
        ]
        kwargs = {"dest": f.name, "help": f.metadata["help"], "default": argparse.SUPPRESS}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif f.type == "list":
            kwargs["action"] = "append"
        else:
            kwargs["type"] = {"int": int, "float": float}.get(f.type, str)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "const" in f.metadata:
                kwargs.update(nargs="?", const=f.metadata["const"])
        if f.default is not None and f.type != "bool":
            kwargs["help"] += f" (default: {f.default})"
        p.add_argument(*flags, **kwargs)
    return p


def plain_yaml(cls):
    """A ``from_yaml`` for ``parse`` that takes every setting of ``cls`` by any of its names,
    typed as the field is, and refuses an unknown one."""

    def from_yaml(data: dict, notes: list) -> dict:
        known = names(cls)
        out = {}
        for key, value in data.items():
            key = str(key).replace("-", "_")
            if key not in known:
                raise ValueError(f"unknown setting {key!r}")
            out[known[key]] = typed(cls, known[key], value)
        return out

    return from_yaml


def parse(p: argparse.ArgumentParser, argv, from_yaml) -> tuple[dict, dict]:
    """(the flags given, the settings of the ``--config`` file through ``from_yaml(data,
    notes)``); a file that cannot be read is one line naming it and the problem (exit 2)."""
    args = vars(p.parse_args(argv))
    source, settings, notes = args.pop("config", None), {}, []
    if source:
        try:
            with open(source) as f:
                data = yaml.safe_load(f) or {}
            if not isinstance(data, dict):
                raise ValueError("expected a mapping of settings")
            settings = from_yaml(data, notes)
        except (OSError, ValueError, yaml.YAMLError) as e:
            # one line, not argparse's usage block: YAML's messages span lines of their own
            problem = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            print(f"{p.prog}: error: --config {source}: {' '.join(problem.split())}",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
    for note in notes:
        print(f"note: --config {source}: {note}", file=sys.stderr)
    return args, settings
