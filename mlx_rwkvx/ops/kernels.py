"""Kernel bodies shipped in ``mlx_rwkvx/metal/``, read with ``importlib.resources``, and their
assembly per flavour. Never imports mlx: the CuPy harness on a GPU machine without MLX uses it.

Each kernel is one body written over a small macro vocabulary; a prelude per flavour
(``prelude_metal.h``, ``prelude_cuda.h``, ``prelude_cpu.h``) defines that vocabulary. An *entry*
file (e.g. ``wkv7_fwd.h``) is the body of the kernel function itself; its first lines name the
kernel, the body file it calls, and its parameters, from which MLX (or ``standalone_source``, the
same way) writes the signature. Entries take two template arguments: ``InT`` (the input dtype) and
``N`` (an int).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

FLAVOURS = ("metal", "cuda", "cpu")
DTYPES = ("float32", "bfloat16", "float16")
# C names of each dtype: what MLX writes in the signatures it generates, and the CPU storage types.
C_TYPES = {
    "metal": {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t", "int32": "int"},
    "cuda": {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int"},
    "cpu": {"float32": "float", "bfloat16": "kcpu::bf16", "float16": "kcpu::f16", "int32": "int"},
}
# Parameter types an entry may declare: the template dtype, or a fixed one.
_PARAM_DTYPES = {"float": "float32", "int": "int32"}
_TEMPLATE_DTYPE = "InT"


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
    """A kernel entry: its name, body file, parameters ``(name, type)`` and text."""

    kernel: str
    body: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    text: str

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
    ``inputs`` or ``outputs`` line continues the list)."""
    text = kernel_source(name)
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.removeprefix("// ").partition(": ")
        if line.startswith("// ") and sep and key in ("kernel", "body", "inputs", "outputs"):
            fields[key] = f"{fields.get(key, '')} {value}".strip()  # a repeated line continues
    missing = {"kernel", "body", "inputs", "outputs"} - set(fields)
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


def instance_name(e: Entry, dtype: str, n: int) -> str:
    """Name of the standalone function for ``InT = dtype``, ``N = n``: ``wkv7_fwd_float32_64``."""
    return f"{e.kernel}_{dtype}_{n}"


def standalone_source(flavour: str, entries, instances) -> str:
    """One compilable CUDA or C++ file: prelude, bodies, and one ``extern "C"`` function per entry
    and ``(dtype, N)`` in ``instances``, whose signature is the one MLX would write.

    CUDA: a ``__global__`` kernel, launched with grid and block as MLX launches it. CPU: a
    function ``name(unsigned groups, params...)`` that runs ``groups`` threadgroups of N threads.
    """
    if flavour not in ("cuda", "cpu"):
        raise ValueError(f"standalone sources are 'cuda' or 'cpu', got {flavour!r}")
    entries = list(entries)
    types = C_TYPES[flavour]
    parts = [prelude(flavour)]
    for body in dict.fromkeys(e.body for e in entries):
        parts.append(kernel_source(body))
    for e in entries:
        for dtype, n in instances:
            params = [f"const {types[e.dtype_of(t, dtype)]}* {name}" for name, t in e.inputs] + [
                f"{types[e.dtype_of(t, dtype)]}* {name}" for name, t in e.outputs
            ]
            consts = f"    using InT = {types[dtype]};\n    constexpr int N = {n};\n"
            name = instance_name(e, dtype, n)
            if flavour == "cuda":
                parts.append(
                    f'extern "C" __global__ void {name}(\n    '
                    + ",\n    ".join(params)
                    + ") {\n"
                    + consts
                    + e.text
                    + "}\n"
                )
            else:
                parts.append(
                    f'extern "C" void {name}(\n    unsigned groups,\n    '
                    + ",\n    ".join(params)
                    + ") {\n"
                    + consts
                    + "    kcpu::launch(groups, N, [&] {\n"
                    + e.text
                    + "    });\n}\n"
                )
    return "\n".join(parts)
