"""The one dispatcher both ops use: an implementation named by the caller (``impl=``) or by
the op's environment variable, else the kernel where the device has one and it passed its
self-check, else the op's own choice among its MLX paths.

A kernel's self-check runs it against the exact MLX path on a tiny problem, outputs and
gradients, once per shape class (head size, dtype). ``prepare()`` runs them all up front (code
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
    picks one. ``self_check(key, impl)`` runs one implementation on the tiny problem of a
    shape class ``key = (size, dtype)`` and returns its outputs and gradients by name (lazy: the
    dispatcher evaluates the kernel's inside its guard); ``kernel_available(key)`` whether the
    device has a kernel (for ``key``, or at all when ``key`` is None). ``results`` holds each
    checked key's verdict, ``reasons`` why each failed one failed. ``workload(key, shape)``
    describes a call for the tuner (``tuning.py``: the fastest exact candidate, measured),
    given the ``shape`` the op passes to ``pick``; without it the fixed rule stands."""

    def __init__(
        self,
        op: str,
        impls: dict[str, Callable],
        *,
        env_var: str,
        fallback: str,
        kernel_available: Callable[[Hashable | None], bool],
        self_check: Callable[[Hashable, Callable], dict[str, mx.array]],
        workload: Callable[[Hashable, Hashable], tuning.Workload] | None = None,
        tuner: tuning.Tuner | None = None,
    ):
        self.op, self.impls, self.env_var, self.fallback = op, impls, env_var, fallback
        self.kernel_available, self._self_check = kernel_available, self_check
        self.results: dict[Hashable, bool] = {}
        self.reasons: dict[Hashable, str] = {}
        self._warned_trace = False
        self.workload, self.tuner = workload, tuner
        DISPATCHERS[op] = self

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
        if name == KERNEL and not self.kernel_available(None):
            here = sorted(n for n in self.impls if n != KERNEL)
            raise UserError(
                f"{self.op}: {source}={name!r}, but this device has no {self.op} "
                f"kernel (no Metal or CUDA backend); it has {here}"
            )
        return name

    def kernel_passes(self, key: Hashable) -> bool:
        """The self-check of ``key``, run once and remembered. Whatever the kernel does --
        raise, return NaN, disagree -- ends here as a False, one warning and its reason."""
        if key not in self.results:
            reason = self._failure(key)
            if reason is not None:
                self.reasons[key] = reason
                warnings.warn(
                    f"mlx_rwkvx: the {self.op} kernel for {shape_class(key)} failed its "
                    f"self-check on this device, the {self.fallback} path is used instead: "
                    + reason,
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.results[key] = reason is None
        return self.results[key]

    def _failure(self, key: Hashable) -> str | None:
        """Why the kernel fails on ``key``'s problem, or None. The exact path runs outside the
        guard: an exception there is a bug of ours and keeps its traceback."""
        try:
            mine = self._self_check(key, self.impls[KERNEL])
            mx.eval(mine)
        except Exception as error:  # any failure of the kernel is a verdict on it
            return raised(error)
        exact = self._self_check(key, self.impls[self.fallback])
        return mismatch(mine, exact, SELF_CHECK_TOL[key[1]], self.fallback)

    def pick(
        self, impl: str | None, key: Hashable, probe: mx.array, default: str, shape=None
    ) -> str:
        """The implementation for one call: forced, else the kernel if it passed its check for
        ``key``, else ``default``; with tuning on and the call's ``shape``, the fastest of
        those measured (``tuned``). ``probe`` (an input) tells whether this is a traced call."""
        name = self.forced(impl)
        if name is not None:
            return name
        if not self.kernel_available(key):
            return self.tuned(key, shape, probe, default, ())
        if key not in self.results and in_transformation(probe):
            if not self._warned_trace:
                self._warned_trace = True
                warnings.warn(
                    f"mlx_rwkvx: the {self.op} kernel is unchecked inside mx.compile: this call "
                    "takes the MLX path; call mlx_rwkvx.ops.prepare() before compiling",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return default
        if self.kernel_passes(key):
            return self.tuned(key, shape, probe, KERNEL, (KERNEL,))
        return self.tuned(key, shape, probe, default, ())

    def tuned(self, key: Hashable, shape, probe: mx.array, rule: str, extra) -> str:
        """The fastest of the op's candidates for this call and ``extra`` (a kernel that
        passed), measured once per shape class and length bucket; ``rule`` where the op
        describes no workload, tuning is off, or a traced call finds nothing remembered."""
        if self.workload is None or shape is None or not tuning.enabled():
            return rule

        def traced() -> bool:
            return in_transformation(probe)

        tuner = self.tuner or tuning.TUNER
        return tuner.choose(self.op, self.workload(key, shape), self.impls, extra, traced, rule)


DISPATCHERS: dict[str, Dispatcher] = {}


def prepare(
    head_sizes: Sequence[int] = HEAD_SIZES, dtypes: Sequence[mx.Dtype] = FLOAT_DTYPES
) -> list[tuple[str, int, mx.Dtype, bool]]:
    """Run every kernel's self-check for these head sizes and dtypes now (nothing where the
    device has no kernel). Returns ``(op, head size, dtype, passed)`` per check. A UserError
    when an op's environment variable names an implementation this device lacks."""
    report = []
    for op, dispatcher in sorted(DISPATCHERS.items()):
        dispatcher.forced(None)  # an environment variable naming what is not here: say so now
        for size in head_sizes:
            for dtype in dtypes:
                if dispatcher.kernel_available((size, dtype)):
                    report.append((op, size, dtype, dispatcher.kernel_passes((size, dtype))))
    return report


def configure_and_prepare() -> list[tuple[str, int, mx.Dtype, bool]]:
    """What every command that runs a model does first: MLX's process settings
    (``mlx_rwkvx.configure``), then every kernel's self-check in float32 and bfloat16
    (``prepare``, whose report it returns), so that a kernel that fails is known before any
    work."""
    configure()
    return prepare(dtypes=PREPARED_DTYPES)
