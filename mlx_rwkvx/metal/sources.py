"""Kernel bodies shipped in ``mlx_rwkvx/metal/``, read with ``importlib.resources``, and their
assembly for MLX. Never imports mlx: the CuPy harness on a GPU machine without MLX uses it
(tests/kernel_harness/sources.py assembles the standalone CUDA and C++ files the tests compile).

Each kernel is one body written over a small macro vocabulary; a prelude per flavour
(``prelude_metal.h``, ``prelude_cuda.h``, ``prelude_cpu.h``) defines that vocabulary. An *entry*
file (e.g. ``wkv7_fwd.h``) is the body of the kernel function itself; its first lines name the
kernel, the body file it calls, and its parameters, from which MLX (or ``standalone_source``, the
same way) writes the signature. Entries take the template arguments ``InT`` (the input dtype) and
``N`` (an int), and those ints their ``// template:`` line names (``L`` of the chunked WKV7).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

FLAVOURS = ("metal", "cuda", "cpu")
DTYPES = ("float32", "bfloat16", "float16")
# Parameter types an entry may declare: the template dtype, or a fixed one.
_PARAM_DTYPES = {"float": "float32", "int": "int32"}
_TEMPLATE_DTYPE = "InT"
_FIELDS = ("kernel", "body", "inputs", "outputs")


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


@dataclass(frozen=True)
class Entry:
    """A kernel entry: its name, body file, parameters ``(name, type)``, text, and the int
    template arguments it takes after ``InT`` and ``N`` (``ints``, in order)."""

    kernel: str
    body: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    text: str
    ints: tuple[str, ...] = ()

    @property
    def input_names(self) -> list[str]:
        return [name for name, _ in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [name for name, _ in self.outputs]

    def dtype_of(self, param_type: str, dtype: str) -> str:
        """The dtype name of a parameter of type ``param_type`` when ``InT`` is ``dtype``."""
        return dtype if param_type == _TEMPLATE_DTYPE else _PARAM_DTYPES[param_type]


def entry(name: str) -> Entry:
    """Parse the entry file ``name``: lines ``// kernel:``, ``// body:``, ``// inputs:``,
    ``// outputs:`` (parameters as ``name:type``, type ``InT``, ``float`` or ``int``; a repeated
    ``inputs`` or ``outputs`` line continues the list) and, where it takes more int template
    arguments than ``N``, ``// template:`` naming them."""
    text = kernel_source(name)
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.removeprefix("// ").partition(": ")
        if line.startswith("// ") and sep and key in (*_FIELDS, "template"):
            fields[key] = f"{fields.get(key, '')} {value}".strip()  # a repeated line continues
    missing = set(_FIELDS) - set(fields)
    if missing:
        raise ValueError(f"kernel entry {name!r} lacks the line(s) {sorted(missing)}")

    def params(spec: str) -> tuple[tuple[str, str], ...]:
        out = []
        for item in spec.split():
            pname, _, ptype = item.partition(":")
            if ptype != _TEMPLATE_DTYPE and ptype not in _PARAM_DTYPES:
                raise ValueError(f"kernel entry {name!r}: parameter {item!r} has an unknown type")
            out.append((pname, ptype))
        return tuple(out)

    return Entry(
        kernel=fields["kernel"],
        body=fields["body"],
        inputs=params(fields["inputs"]),
        outputs=params(fields["outputs"]),
        text=text,
        ints=tuple(fields.get("template", "").split()),
    )


def mlx_parts(flavour: str, e: Entry) -> tuple[str, str]:
    """``(header, source)`` to pass to ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel``.

    The body's functions need the vocabulary, so the prelude heads the header. Metal's prelude
    heads the source too: MLX declares a thread-position attribute only if ``source`` names it,
    and the entry names them through the prelude's macros.
    """
    if flavour not in ("metal", "cuda"):
        raise ValueError(f"MLX kernels are 'metal' or 'cuda', got {flavour!r}")
    header = prelude(flavour) + "\n" + kernel_source(e.body)
    source = (prelude(flavour) + "\n" if flavour == "metal" else "") + e.text
    return header, source
