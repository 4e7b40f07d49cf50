"""
The package's imports go one way: no circle between nanotrain's modules, counting imports inside functions (which
Python resolves lazily, so a circle through them runs without error and stays hidden until it is drawn); and the core
(the top-level modules of nanotrain/) imports nothing from the periphery (PERIPHERY's folders).
"""

import ast
import os

import pytest

PERIPHERY = ("report", "evaluation", "sandbox", "export", "serve")  # folders of nanotrain/ the core never imports
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanotrain")


def module_name(path, root=ROOT):
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def import_graph(root=ROOT):
    """{module: set of nanotrain modules it imports anywhere in its file (top level, functions, `if` blocks)}. An
    `import a.b.c` or `from a.b import c` counts as importing the deepest of a.b.c, a.b that is a module of the
    package (a `from package import module` names the module)."""
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".py"):
                files[module_name(os.path.join(d, n), root)] = os.path.join(d, n)
    graph = {}
    for mod, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # a relative import: from .x import y
                    parts = mod.split(".")[:len(mod.split(".")) - node.level + (path.endswith("__init__.py"))]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t != "nanotrain":
                    deps.add(t)
                    break
        graph[mod] = deps
    return graph


def find_circle(graph):
    """A list of modules [a, b, ..., a] that import each other in a circle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def core_reaching_out(graph):
    """[(core module, periphery module it imports)] of an import_graph: a core module is a top-level module of the
    package (nanotrain.x, not nanotrain.x.y), a periphery module one under a PERIPHERY folder."""
    periphery = tuple(f"nanotrain.{p}" for p in PERIPHERY)
    return sorted((m, d) for m, deps in graph.items() if m.count(".") == 1 for d in deps
                  if d in periphery or d.startswith(tuple(p + "." for p in periphery)))


@pytest.mark.unit
def test_no_import_circle_in_the_package():
    """Walks every import of every nanotrain module, top level and inside functions. Catches: a low-level helper
    written into a high-level module that a leaf then imports back from inside a function (a hidden circle)."""
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.unit
def test_the_circle_finder_sees_a_circle_through_a_function(tmp_path):
    """The check is not vacuous: a two-module package whose second module imports the first inside a function (and
    a third module doing it with a relative import) is reported as a circle."""
    pkg = tmp_path / "nanotrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from nanotrain.high import g\n    return g\n")
    (pkg / "high.py").write_text("from nanotrain.low import f\n\ndef g():\n    return f\n")
    graph = import_graph(str(pkg))
    assert graph["nanotrain.low"] == {"nanotrain.high"} and graph["nanotrain.high"] == {"nanotrain.low"}
    assert find_circle(graph) in (["nanotrain.high", "nanotrain.low", "nanotrain.high"],
                                  ["nanotrain.low", "nanotrain.high", "nanotrain.low"])
    (pkg / "high.py").write_text("def g():\n    return 1\n")
    (pkg / "sub" / "a.py").write_text("from .b import x\n")
    (pkg / "sub" / "b.py").write_text("def x():\n    from . import a\n    return a\n")
    graph = import_graph(str(pkg))
    assert graph["nanotrain.sub.a"] == {"nanotrain.sub.b"} and graph["nanotrain.sub.b"] == {"nanotrain.sub.a"}
    assert find_circle(graph) is not None


@pytest.mark.unit
def test_the_core_imports_nothing_from_the_periphery(tmp_path):
    """No top-level module of nanotrain/ imports (anywhere in its file) from report/, evaluation/, sandbox/, export/
    or serve/. Catches: a training-core module reaching up into the periphery, e.g. run.py importing the report card
    inside a function, or engine.py importing the server's batch engine: the check reports exactly such a module in a
    small package built here (and not a periphery module importing the core, nor a core module importing another)."""
    assert core_reaching_out(import_graph()) == []
    pkg = tmp_path / "nanotrain"
    (pkg / "report").mkdir(parents=True)
    (pkg / "serve").mkdir()
    for f in ("__init__.py", "report/__init__.py", "serve/__init__.py", "common.py"):
        (pkg / f).write_text("")
    (pkg / "report" / "card.py").write_text("from nanotrain.common import *\n")
    (pkg / "serve" / "batch_engine.py").write_text("import nanotrain.engine\n")
    (pkg / "engine.py").write_text("from nanotrain import common\n")
    (pkg / "run.py").write_text("def finish():\n    from nanotrain.report.card import write\n    return write\n")
    assert core_reaching_out(import_graph(str(pkg))) == [("nanotrain.run", "nanotrain.report.card")]
    (pkg / "engine.py").write_text("from nanotrain.serve import batch_engine\n")
    assert core_reaching_out(import_graph(str(pkg)))[0] == ("nanotrain.engine", "nanotrain.serve.batch_engine")
