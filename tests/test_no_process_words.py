"""Comments and docstrings describe the code, not how it came to be: no numbers of issues, no
pull requests, no rounds of review. What the code does and why stays true
as long as the code does; the history of the work lives in git and the issue tracker.

Only comments and docstrings are read (string values a program uses, such as a word list, are
its data), each line of them, from every module of the package, the benchmarks, the scripts and
the tests. A web address is left out first: a link to an upstream bug names that bug's page.
A ``TODO`` may carry the number of the issue it waits on."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("mlx_rwkvx", "benchmarks", "scripts", "tests")
PROCESS_WORDS = re.compile(
    "|".join(
        [
            r"(?<!TODO )(?<!TODO\()\bissues? #?\d+",  # an issue by its number
            r"\b(?:this|that|next|later|earlier|previous|server's|hardening|review) issue\b",
            r"\b(?:the|this|that|a) (?:PR|pull request)\b",
            r"\bfound (?:by|in|during) (?:the )?review\b",
            r"\bfirst step of the\b.*\bissue\b",
            r"\b(?:coordinator|helper session|coding session|earlier note|round \d+ of)\b",
        ]
    ),
    re.I,
)
URL = re.compile(r"https?://\S+")


def _prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a module."""
    lines = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                first = node.lineno
                lines += [(first + i, s) for i, s in enumerate(node.value.value.splitlines())]
    return lines


def process_words(root: Path) -> list[str]:
    """``path:line: text`` of each comment or docstring line under ``root``'s ``FOLDERS`` that
    talks about the work's process."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for line, text in _prose(path.read_text(encoding="utf-8")):
                if PROCESS_WORDS.search(URL.sub("", text)):
                    found.append(f"{path.relative_to(root)}:{line}: {text.strip()}")
    return found


def test_phrases_are_found():
    examples = [
        "# issue 21: the commands' bad inputs",
        '"""The first step of the server issue."""',
        "# found by review: malformed fields",
        "# added in this PR",
    ]
    assert all(PROCESS_WORDS.search(e) for e in examples)
    ordinary = [
        "# a known bug upstream: https://github.com/ml-explore/mlx/issues/1234",
        "# TODO(issue 40): the fused kernel",
        "# the session holds every token fed so far",
        "# the first step of the warm-up already moves",
    ]
    assert not any(PROCESS_WORDS.search(URL.sub("", e)) for e in ordinary)


def test_comments_and_docstrings_describe_the_code():
    found = process_words(ROOT)
    assert not found, "comments or docstrings about the process:\n" + "\n".join(found)
