"""Config strings become modules once, in builders: no method of a layer or a model (other
than its constructor and the ``from_*`` loaders) compares a value with a string."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "qkv"
FILES = sorted([*(SRC / "nn").rglob("*.py"), *(SRC / "models").glob("*.py")])


def string_compares(tree: ast.AST) -> list[str]:
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or method.name == "__init__" \
                    or method.name.startswith("from_"):
                continue
            for node in ast.walk(method):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                values = [e for s in sides for e in (s.elts if isinstance(s, ast.Tuple) else [s])]
                if any(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                    found.append(f"{cls.name}.{method.name}:{node.lineno} {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_method_switches_on_a_string(path):
    assert string_compares(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_check_sees_a_switch():
    tree = ast.parse("class F:\n    def forward(self, x):\n"
                     "        return x if self.kind == 'relu' else -x\n")
    assert string_compares(tree) == ["F.forward:3 self.kind == 'relu'"]
