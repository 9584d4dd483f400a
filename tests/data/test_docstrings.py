import sys

from qkv.data import docstrings


def test_docstrings_of_source_in_file_order():
    source = (
        '"""Module."""\nclass A:\n    """Class A."""\n'
        '    def f(self):\n        """  f.\n\n        More."""\n'
    )
    assert docstrings.docstrings_of(source) == ["Module.", "Class A.", "f.\n\nMore."]


def test_corpus_is_deterministic_cached_and_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    modules_before = set(sys.modules)
    text = docstrings.stdlib_docstrings(30_000)
    assert 29_000 < len(text) <= 30_000 and text == docstrings.collect(30_000)
    new_modules = set(sys.modules) - modules_before
    assert all(m.startswith("_sysconfigdata") for m in new_modules), new_modules
    cached = list(tmp_path.iterdir())
    assert [p.name for p in cached] == [f"stdlib-docstrings-py{sys.version_info.major}."
                                        f"{sys.version_info.minor}-30000.txt"]
    assert docstrings.stdlib_docstrings(30_000) == text


def test_unparsable_files_are_skipped(tmp_path, monkeypatch):
    good, bad = tmp_path / "a.py", tmp_path / "b.py"
    good.write_text('"""Good."""\n')
    bad.write_text("def (:\n")
    monkeypatch.setattr(docstrings, "stdlib_sources", lambda: [bad, good])
    assert docstrings.collect(100) == "Good."
