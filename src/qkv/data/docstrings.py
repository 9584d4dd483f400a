"""Real English text on every machine: the docstrings of the Python standard library.

The text is read from the standard library's source files with ``ast``, so nothing is
imported or executed (no side effects such as ``antigravity`` opening a browser); a file
that cannot be read or parsed is skipped. Files are visited in sorted order and collection
stops at ``max_chars``, so the corpus is the same on every run of one Python version. The
result is cached in the user cache folder, written atomically.
"""

from __future__ import annotations

import ast
import inspect
import sys
import sysconfig
from pathlib import Path

from ..cache import cache_dir
from .atomic import write_text_atomic

MAX_CHARS = 1_500_000
SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without test suites and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = set(sys.stdlib_module_names)
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        top = parts[0].removesuffix(".py")
        if top in names and not SKIPPED_PARTS.intersection(parts):
            files.append(path)
    return files


def docstrings_of(source: str) -> list[str]:
    """The module, class and function docstrings of one source file, cleaned, in file order."""
    tree = ast.parse(source)
    nodes = [tree] + [
        n for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    found = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc and doc.strip():
            found.append(inspect.cleandoc(doc))
    return found


def collect(max_chars: int = MAX_CHARS) -> str:
    """Docstrings of the standard library joined by blank lines, at most ``max_chars`` long."""
    pieces: list[str] = []
    size = 0
    for path in stdlib_sources():
        try:
            docs = docstrings_of(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for doc in docs:
            pieces.append(doc)
            size += len(doc) + 2
            if size >= max_chars:
                return "\n\n".join(pieces)[:max_chars]
    return "\n\n".join(pieces)


def stdlib_docstrings(max_chars: int = MAX_CHARS) -> str:
    """The corpus, from the user cache if present, else collected and cached atomically."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir() / f"stdlib-docstrings-py{version}-{max_chars}.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    text = collect(max_chars)
    try:
        write_text_atomic(path, text)
    except OSError:
        pass  # a read-only home still gets the text, only uncached
    return text
