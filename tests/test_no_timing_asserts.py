"""No test asserts on how long something took: CI runs on a machine that may be busy, where a
correct program is slow. Overlap and order are checked by events (what the program reports,
the order things arrive in); timings live in ``benchmarks/``. This test reads every test
module's syntax tree and fails on an ``assert`` (or an ``if`` that raises or calls
``pytest.fail``) that compares

- a difference or ratio of clock readings (``time.monotonic() - tic < 20``, ``b / a > 2``),
  or a name computed from one (``busy = sum(last - first ...)``), or a name that says it is
  one (``elapsed``, ``duration``, ``took``, ``speedup``, ``latency``);
- a clock reading outside a loop (``assert time.monotonic() < deadline`` after an action: how
  long the action took, in other words).

A deadline inside a loop passes: ``while not ready(): assert time.monotonic() < deadline``
bounds a wait, a safety net that a correct program on a slow machine never reaches when the
bound is generous. So does a timeout given to a call (``proc.wait(timeout=30)``,
``t.join(timeout=120)``): the call's own safety net, not an assertion. (``assert
time.monotonic() - tic < 20`` after a SIGTERM, which the server's test had, is a duration
asserted as the result: the wait before it was already bounded, and that the stop cut the
answer off is an event, the stream breaking off unfinished.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {
    "monotonic",
    "monotonic_ns",
    "perf_counter",
    "perf_counter_ns",
    "time",
    "time_ns",
    "process_time",
    "process_time_ns",
    "now",
}
CLOCK_MODULES = {"time", "datetime"}
DURATION_WORDS = re.compile(r"elapsed|duration|took|speedup|latency", re.I)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
LOOPS = (ast.While, ast.For, ast.AsyncFor)


def _is_clock(node: ast.AST) -> bool:
    """``time.monotonic()``, ``datetime.now()``, ``perf_counter()``, ..."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in CLOCKS:
        base = f.value
        return isinstance(base, ast.Name) and base.id in CLOCK_MODULES
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time", "now"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _target_names(target: ast.AST) -> set[str]:
    """The names an assignment binds (``x``, ``a, b``, ``d[k]`` -> d, ``o.attr`` -> o)."""
    while isinstance(target, (ast.Subscript, ast.Attribute)):
        target = target.value
    if isinstance(target, ast.Name):
        return {target.id}
    return {n for e in getattr(target, "elts", []) for n in _target_names(e)}


def _pairs(target: ast.AST, value: ast.AST) -> list[tuple[set[str], ast.AST]]:
    """(names, expression) bound by ``target = value``, element by element where both are
    tuples of one length (``a, b = x, time.monotonic()`` binds only b to the clock)."""
    if (
        isinstance(target, (ast.Tuple, ast.List))
        and isinstance(value, (ast.Tuple, ast.List))
        and len(target.elts) == len(value.elts)
    ):
        return [p for t, v in zip(target.elts, value.elts, strict=True) for p in _pairs(t, v)]
    return [(_target_names(target), value)]


class _Clocks:
    """Which names of one function hold clock readings (``points``) and which hold differences
    or ratios of them (``durations``), followed through assignments, loops, comprehensions and
    ``append``/``extend``/``insert``."""

    def __init__(self, scope: ast.AST):
        self.points: set[str] = set()
        self.durations: set[str] = set()
        flows = []  # (names bound, expression they come from)
        for node in ast.walk(scope):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    flows += _pairs(target, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor)):  # a comprehension's: its own scope
                flows.append((_target_names(node.target), node.iter))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
            ):
                for arg in node.args:
                    flows.append((_target_names(node.func.value), arg))
        changed = True
        while changed:
            changed = False
            for names, value in flows:
                kind = self.durations if self.is_duration(value) else None
                if kind is None and self.is_point(value):
                    kind = self.points
                if kind is not None and not names <= kind:
                    kind |= names
                    changed = True

    def _local(self, node: ast.AST) -> set[str]:
        """The names the comprehensions in ``node`` bind to clock readings."""
        local: set[str] = set()
        comps = [n for n in ast.walk(node) if isinstance(n, ast.comprehension)]
        while True:
            more = {
                name
                for c in comps
                if self.is_point(c.iter, local)
                for name in _target_names(c.target)
            } - local
            if not more:
                return local
            local |= more

    def is_point(self, node: ast.AST, local: set[str] | None = None) -> bool:
        points = self.points | (self._local(node) if local is None else local)
        return any(_is_clock(n) for n in ast.walk(node)) or bool(_names(node) & points)

    def is_duration(self, node: ast.AST) -> bool:
        local = self._local(node)
        for n in ast.walk(node):
            if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Sub, ast.Div, ast.FloorDiv)):
                if self.is_point(n.left, local) or self.is_point(n.right, local):
                    return True
            if isinstance(n, ast.Name) and n.id in self.durations:
                return True
            name = n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)
            if isinstance(name, str) and DURATION_WORDS.search(name):
                return True
        return False


def _raises(body: list[ast.stmt]) -> bool:
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Raise):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "fail"
        ):
            return True
    return False


def _checks(scope: ast.AST, in_loop: bool = False):
    """(check's test expression, inside a loop) for each assert, and each ``if`` that raises,
    in ``scope`` but not in the functions nested in it (they are scopes of their own)."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, FUNCTIONS):
            continue
        if isinstance(child, ast.Assert):
            yield child, child.test, in_loop
        elif isinstance(child, ast.If) and _raises(child.body):
            yield child, child.test, in_loop
        yield from _checks(child, in_loop or isinstance(child, LOOPS))


def timing_checks(source: str) -> list[tuple[int, str]]:
    """(line, why) of each check in ``source`` that compares a duration, or a clock reading
    outside a loop."""
    tree = ast.parse(source)
    found = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)]
    for scope in scopes:
        clocks = _Clocks(scope)
        for node, test, in_loop in _checks(scope):
            for compare in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
                operands = [compare.left, *compare.comparators]
                if any(clocks.is_duration(o) for o in operands):
                    found.append((node.lineno, "compares a duration or a ratio of durations"))
                elif not in_loop and any(clocks.is_point(o) for o in operands):
                    found.append((node.lineno, "compares a clock reading outside a wait loop"))
    return sorted(set(found))


def test_no_test_asserts_on_a_duration():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if "gpu" in path.relative_to(TESTS).parts[:1]:  # timed kernels on a lent machine
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for line, why in timing_checks("\n".join(lines)):
            found.append(f"{path.relative_to(TESTS)}:{line}: {why}: {lines[line - 1].strip()}")
    assert not found, "tests that depend on the machine's speed:\n" + "\n".join(found)


CAUGHT = {
    "tic = time.monotonic()\nstop()\nassert time.monotonic() - tic < 20": "duration",
    "a = time.perf_counter()\nx()\nb = time.perf_counter()\nassert (b - a) / 2 > 0.1": "duration",
    "t = []\nfor _ in r:\n    t.append(time.monotonic())\nspan = t[-1] - t[0]\nassert span < 3": (
        "duration"
    ),
    "spans = {}\nspans[0] = (time.monotonic(), time.monotonic())\n"
    "busy = sum(b - a for a, b in spans.values())\nassert busy > 0.36": "duration",
    "assert elapsed < 5": "duration",
    "assert stats.speedup > 1.5": "duration",
    "deadline = time.monotonic() + 5\nwork()\nassert time.monotonic() < deadline": "clock",
    "if time.time() - t0 > 9:\n    pytest.fail('slow')": "duration",
}
PASSED = [
    "deadline = time.monotonic() + 10\nwhile not ready():\n"
    "    assert time.monotonic() < deadline\n    time.sleep(0.02)",
    "deadline = time.time() + 120\nwhile not done() and time.time() < deadline:\n    pass",
    "proc.wait(timeout=30)\nassert proc.returncode == 0",
    "for i in range(3):\n    if time.monotonic() > deadline:\n        raise RuntimeError('x')",
    "tokens = [1, 2]\nassert len(tokens) - 1 == 1",
]


def test_the_scan_tells_durations_from_safety_nets():
    for source, kind in CAUGHT.items():
        found = timing_checks(source)
        assert found and all(kind in why for _, why in found), (source, found)
    for source in PASSED:
        assert timing_checks(source) == [], source
