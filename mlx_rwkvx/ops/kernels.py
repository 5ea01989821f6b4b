"""Kernel bodies shipped in ``mlx_rwkvx/metal/``, read with ``importlib.resources``.

Each kernel is one body written over a small macro vocabulary; a prelude per flavour
(``prelude_metal.h``, ``prelude_cuda.h``, ``prelude_cpu.h``) defines that vocabulary.
"""

from __future__ import annotations

from importlib import resources

FLAVOURS = ("metal", "cuda", "cpu")


def kernel_source(name: str) -> str:
    """Text of the kernel file ``name`` (e.g. ``"wkv7.h"``) from the installed package."""
    path = resources.files("mlx_rwkvx").joinpath("metal", name)
    if not path.is_file():
        raise FileNotFoundError(f"no kernel file {name!r} in mlx_rwkvx/metal")
    return path.read_text(encoding="utf-8")


def prelude(flavour: str) -> str:
    """The macro vocabulary of one flavour: ``metal``, ``cuda`` or ``cpu``."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    return kernel_source(f"prelude_{flavour}.h")
