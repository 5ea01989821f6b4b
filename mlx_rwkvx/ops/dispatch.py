"""The one dispatcher both ops use: an implementation named by the caller (``impl=``) or by
the op's environment variable, else the fastest, measured (``tuning.py``), of the op's MLX paths
and the kernels the device has that passed their self-check; with tuning off, the first such
kernel, else the op's own choice among its MLX paths.

An op may have several kernels (WKV7: the sequential one and the chunked one at each chunk
length it is built for), each checked on its own. A kernel's self-check runs it against the
exact MLX path on a tiny problem, outputs and gradients, once per shape class (head size,
dtype). ``prepare()`` runs them all up front (code
that compiles calls it first; ``info --selfcheck`` reports it); otherwise a check runs the first
time a shape class is used, but never inside ``mx.compile`` or another function
transformation, where the call takes the MLX path and one warning says to call ``prepare()``
first. A kernel that fails its check is never used again for that shape class, and one warning
says why: it raised (at build -- MLX compiles a custom kernel when it is first evaluated --, at
launch, on a resource limit, in the forward or only in the backward: the exception's type and
the first lines of its message), returned non-finite values, or disagrees (the relative error).
The fallback is always exact, only slower. A kernel forced by ``impl=`` or the environment
variable is not checked: if it fails, the failure is raised, as the user chose it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Sequence

from mlx_rwkvx._runtime import configure
from mlx_rwkvx.errors import UserError
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.ops.common import FLOAT_DTYPES, HEAD_SIZES, SELF_CHECK_TOL

import mlx.core as mx

KERNEL = "kernel"
# The dtypes every command checks its kernels in up front (configure_and_prepare)
PREPARED_DTYPES = (mx.float32, mx.bfloat16)
# A compiler's message runs to pages: the warning keeps its head
MESSAGE_LINES = 5


def mismatch(
    mine: dict[str, mx.array], exact: dict[str, mx.array], tol: float, exact_name: str
) -> str | None:
    """Why the kernel's named outputs and gradients ``mine`` fail against the exact path's
    (named ``exact_name``): non-finite values, or a norm-wise relative error above ``tol``;
    None when they pass."""
    bad = [name for name, x in mine.items() if not mx.all(mx.isfinite(x)).item()]
    if bad:
        return f"returned non-finite values in {', '.join(bad)}"
    for name, x in mine.items():
        x, y = x.astype(mx.float32), exact[name].astype(mx.float32)
        err = (mx.linalg.norm(x - y) / mx.maximum(mx.linalg.norm(y), 1e-30)).item()
        if not err <= tol:
            return (
                f"disagrees with the {exact_name} path: relative error {err:.1e} in {name} "
                f"(tolerance {tol:.0e})"
            )
    return None


def raised(error: Exception) -> str:
    """An exception as a self-check's reason: its type and the first lines of its message."""
    lines = str(error).strip().splitlines()
    if not lines:
        return f"raised {type(error).__name__}"
    more = len(lines) - MESSAGE_LINES
    head = "\n    ".join(lines[:MESSAGE_LINES]) + (f"\n    ({more} more lines)" if more > 0 else "")
    return f"raised {type(error).__name__}: {head}"


def shape_class(key: Hashable) -> str:
    """A self-check's key ``(size, dtype)`` as the warnings and ``info`` write it."""
    size, dtype = key
    return f"size {size} {str(dtype).rsplit('.', 1)[-1]}"


def in_transformation(x: mx.array) -> bool:
    """Whether ``x`` is being traced by ``mx.compile`` (or vmap), where nothing may be read
    back. Evaluates ``x`` otherwise (only ever on a kernel's first use)."""
    try:
        mx.eval(x)
    except ValueError as e:
        if "function transformations" in str(e):
            return True
        raise
    return False


class Dispatcher:
    """One op's implementations (name -> function taking checked arguments) and the rule that
    picks one. Some of them are kernels (``kernel_names``, in the order the fixed rule prefers
    them); ``kernels(key)`` names those the device has for a shape class ``key = (size,
    dtype)`` (with ``key`` None: for any shape class). ``self_check(key, impl)`` runs one
    implementation on the tiny problem of ``key`` and returns its outputs and gradients by name
    (lazy: the dispatcher evaluates a kernel's inside its guard). ``results`` holds the verdict
    of each checked ``(kernel, key)``, ``reasons`` why each failed one failed.
    ``workload(key, shape)`` describes a call for the tuner (``tuning.py``: the fastest exact
    candidate, measured), given the ``shape`` the op passes to ``pick``; without it the fixed
    rule stands."""

    def __init__(
        self,
        op: str,
        impls: dict[str, Callable],
        *,
        env_var: str,
        fallback: str,
        kernel_names: Sequence[str],
        kernels: Callable[[Hashable | None], Sequence[str]],
        self_check: Callable[[Hashable, Callable], dict[str, mx.array]],
        workload: Callable[[Hashable, Hashable], tuning.Workload] | None = None,
        tuner: tuning.Tuner | None = None,
    ):
        self.op, self.impls, self.env_var, self.fallback = op, impls, env_var, fallback
        self.kernel_names, self.kernels = tuple(kernel_names), kernels
        self._self_check = self_check
        self.results: dict[tuple[str, Hashable], bool] = {}
        self.reasons: dict[tuple[str, Hashable], str] = {}
        self._warned_trace = False
        self._exact: dict[Hashable, dict[str, mx.array]] = {}  # the fallback's self-check
        self.workload, self.tuner = workload, tuner
        DISPATCHERS[op] = self

    def label(self, kernel: str) -> str:
        """How messages name ``kernel``: ``the wkv7 kernel chunked_kernel_16``, or ``the wkv7
        kernel`` for the one named ``kernel``."""
        return f"the {self.op} kernel" + ("" if kernel == KERNEL else f" {kernel}")

    def forced(self, impl: str | None) -> str | None:
        """The implementation named by ``impl`` or else the environment variable, or None. A
        forced kernel is the user's explicit choice: it is not self-checked, and its failure is
        raised, not contained."""
        name = impl or os.environ.get(self.env_var) or None
        if name is None:
            return None
        source = "impl" if impl else self.env_var
        if name not in self.impls:
            raise UserError(f"{self.op}: {source}={name!r}: expected one of {sorted(self.impls)}")
        kernels = self.kernels(None)
        if name in self.kernel_names and name not in kernels:
            here = sorted(n for n in self.impls if n not in self.kernel_names or n in kernels)
            raise UserError(
                f"{self.op}: {source}={name!r}, but this device has no "
                f"{self.label(name).removeprefix('the ')} (no Metal or CUDA backend); it has "
                f"{here}"
            )
        return name

    def kernel_passes(self, key: Hashable, kernel: str | None = None) -> bool:
        """The self-check of ``kernel`` (default: the op's first) on ``key``, run once and
        remembered. Whatever the kernel does -- raise, return NaN, disagree -- ends here as a
        False, one warning and its reason."""
        kernel = kernel or self.kernel_names[0]
        if (kernel, key) not in self.results:
            reason = self._failure(key, kernel)
            if reason is not None:
                self.reasons[kernel, key] = reason
                if len(self.kernels(key)) == 1:
                    instead = f"the {self.fallback} path is used instead"
                else:
                    instead = "the op's other implementations are used instead"
                warnings.warn(
                    f"mlx_rwkvx: {self.label(kernel)} for {shape_class(key)} failed its "
                    f"self-check on this device, {instead}: " + reason,
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.results[kernel, key] = reason is None
        return self.results[kernel, key]

    def _failure(self, key: Hashable, kernel: str) -> str | None:
        """Why ``kernel`` fails on ``key``'s problem, or None. The exact path runs outside the
        guard: an exception there is a bug of ours and keeps its traceback."""
        try:
            mine = self._self_check(key, self.impls[kernel])
            mx.eval(mine)
        except Exception as error:  # any failure of the kernel is a verdict on it
            return raised(error)
        if key not in self._exact:  # one exact run per shape class, whatever the kernels
            self._exact[key] = self._self_check(key, self.impls[self.fallback])
            mx.eval(self._exact[key])
        return mismatch(mine, self._exact[key], SELF_CHECK_TOL[key[1]], self.fallback)

    def pick(
        self, impl: str | None, key: Hashable, probe: mx.array, default: str, shape=None
    ) -> str:
        """The implementation for one call: forced, else the first kernel that passed its check
        for ``key``, else ``default``; with tuning on and the call's ``shape``, the fastest of
        those and every kernel that passed, measured (``tuned``). ``probe`` (an input) tells
        whether this is a traced call."""
        name = self.forced(impl)
        here = tuple(self.kernels(key))
        if name is not None:
            if name in self.kernel_names and name not in here:
                source = "impl" if impl else self.env_var
                raise UserError(
                    f"{self.op}: {source}={name!r} has no form for {shape_class(key)}; the "
                    f"kernels there: {list(here) or 'none'}"
                )
            return name
        if not here:
            return self.tuned(key, shape, probe, default, ())
        unchecked = any((kernel, key) not in self.results for kernel in here)
        if unchecked and in_transformation(probe):
            if not self._warned_trace:
                self._warned_trace = True
                warnings.warn(
                    f"mlx_rwkvx: the {self.op} kernels are unchecked inside mx.compile: this "
                    "call takes the MLX path or a kernel checked before; call "
                    "mlx_rwkvx.ops.prepare() before compiling",
                    RuntimeWarning,
                    stacklevel=3,
                )
            here = tuple(kernel for kernel in here if (kernel, key) in self.results)
        passed = tuple(kernel for kernel in here if self.kernel_passes(key, kernel))
        return self.tuned(key, shape, probe, passed[0] if passed else default, passed)

    def tuned(self, key: Hashable, shape, probe: mx.array, rule: str, extra) -> str:
        """The fastest of the op's candidates for this call and ``extra`` (the kernels that
        passed), measured once per shape class and length bucket; ``rule`` where the op
        describes no workload, tuning is off, or a traced call finds nothing remembered."""
        if self.workload is None or shape is None or not tuning.enabled():
            return rule

        def traced() -> bool:
            return in_transformation(probe)

        tuner = self.tuner or tuning.TUNER
        return tuner.choose(self.op, self.workload(key, shape), self.impls, extra, traced, rule)

    def candidates(self, key: Hashable, shape) -> list[str]:
        """What the tuner times for a call of ``shape`` on ``key``: the op's exact MLX
        candidates there (its workload's) and every kernel that passed its self-check."""
        names = list(self.workload(key, shape).candidates)
        return names + [k for k in self.kernels(key) if self.kernel_passes(key, k)]


DISPATCHERS: dict[str, Dispatcher] = {}


def prepare(
    head_sizes: Sequence[int] = HEAD_SIZES, dtypes: Sequence[mx.Dtype] = FLOAT_DTYPES
) -> list[tuple[str, str, int, mx.Dtype, bool]]:
    """Run every kernel's self-check for these head sizes and dtypes now (nothing where the
    device has no kernel). Returns ``(op, kernel, head size, dtype, passed)`` per check. A
    UserError when an op's environment variable names an implementation this device lacks."""
    report = []
    for op, dispatcher in sorted(DISPATCHERS.items()):
        dispatcher.forced(None)  # an environment variable naming what is not here: say so now
        for size in head_sizes:
            for dtype in dtypes:
                for kernel in dispatcher.kernels((size, dtype)):
                    passed = dispatcher.kernel_passes((size, dtype), kernel)
                    report.append((op, kernel, size, dtype, passed))
    return report


def configure_and_prepare() -> list[tuple[str, str, int, mx.Dtype, bool]]:
    """What every command that runs a model does first: MLX's process settings
    (``mlx_rwkvx.configure``), then every kernel's self-check in float32 and bfloat16
    (``prepare``, whose report it returns), so that a kernel that fails is known before any
    work."""
    configure()
    return prepare(dtypes=PREPARED_DTYPES)
