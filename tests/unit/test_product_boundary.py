"""The product and the lab apart, read from the source with ``ast``: no module under ``muse_stack/``
imports the lab (``benchmarks/``, imported as ``lab``) or the tests; every module under
``muse_stack/`` is reached by imports from the product's entry points (``[project.scripts]`` in
``pyproject.toml``, and ``python -m`` of such a package: its ``__main__``), so nothing there is used
only by benchmarks or tests; the imports between product modules form no cycle; and neither do the
imports between its packages (the folders directly under ``muse_stack/``, each root module its own):
the packages form layers, each importing only those below it.

An import is any ``import`` statement, at module level or inside a function (lazy), and any string
constant other than a docstring that spells a dotted module path (``importlib.import_module``'s
names, ``"module:attribute"`` references; not a logger's name such as ``getLogger("muse_stack.run")``).
Importing ``a.b.c`` runs the packages ``a`` and ``a.b`` too, so they count as reached. Imports under
``if TYPE_CHECKING:`` reach nothing at run time but are a dependency all the same: they count for
cycles, not for reachability. A string naming a module (a module loaded by name when it is needed, as
the engine option table names each option's install function) reaches that module but imports
nothing when its own module is imported: it counts for reachability, not for cycles.

The check is by module: a public function of a reached module that only the lab calls is not seen.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = "muse_stack"
#: top-level names of what is not the product: the lab's package, its folder, the tests' folder
LAB = {"lab", "benchmarks", "tests"}
#: a dotted module path (a string naming one: at least one dot, so a bare word such as "tests" is no import)
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Import:
    name: str  #: the absolute dotted name as written (a module, or a module's attribute)
    line: int
    typing_only: bool  #: under ``if TYPE_CHECKING:``
    by_name: bool = False  #: a string naming the module, loaded by that name at run time


def product_modules(root: Path, package: str = PRODUCT) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by its dotted name (a package by its own)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path) -> list[Import]:
    """What the module ``name`` at ``path`` imports, lazily or not, and the module names its
    non-docstring string constants spell."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    out: list[Import] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger":
            return  # a logger's name ("muse_stack.run") is no import
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            out.extend(Import(a.name, node.lineno, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.extend(Import(f"{base}.{a.name}" if a.name != "*" else base, node.lineno, typing_only)
                       for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            target = node.value.split(":")[0]
            if _DOTTED.fullmatch(target) and target.split(".")[0] in {PRODUCT, *LAB}:
                out.append(Import(target, node.lineno, typing_only, by_name=True))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return out


def _module_of(dotted: str, modules: dict[str, Path]) -> str | None:
    """The deepest product module a dotted name lies in (``a.b.f`` -> ``a.b``), or None."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph(root: Path, *, typing_imports: bool, packages: bool, by_name: bool = True) -> dict[str, set[str]]:
    """Each product module's imported product modules. ``packages``: with the packages an import
    runs on the way (``a`` and ``a.b`` for ``a.b.c``); ``by_name``: with the modules strings name."""
    modules = product_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imp in imports_of(name, path):
            if (imp.typing_only and not typing_imports) or (imp.by_name and not by_name):
                continue
            target = _module_of(imp.name, modules)
            while target:
                if target != name:
                    edges.add(target)
                target = _module_of(target.rpartition(".")[0], modules) if packages else None
        graph[name] = edges
    return graph


def entry_points(root: Path) -> list[str]:
    """The modules of the product's console scripts (``[project.scripts]``)."""
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    return sorted({target.split(":")[0] for target in scripts.values()})


def unreached(root: Path) -> list[str]:
    """Product modules no chain of run-time imports from the entry points reaches (an entry point
    that is a package is also run by ``python -m``, which runs its ``__main__``)."""
    graph = import_graph(root, typing_imports=False, packages=True)
    seen: set[str] = set()
    todo = [*entry_points(root), *(f"{e}.__main__" for e in entry_points(root) if f"{e}.__main__" in graph)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return sorted(set(graph) - seen)


def lab_imports(root: Path) -> list[str]:
    """``module:line name`` for every import of the lab or the tests from a product module."""
    return [f"{name}:{imp.line} {imp.name}" for name, path in product_modules(root).items()
            for imp in imports_of(name, path) if imp.name.split(".")[0] in LAB]


def _dependencies(root: Path) -> dict[str, set[str]]:
    """What a cycle is made of: every import, TYPE_CHECKING ones included, but not a module a string names."""
    return import_graph(root, typing_imports=True, packages=False, by_name=False)


def package_of(module: str) -> str:
    """The package a product module belongs to: the folder directly under ``muse_stack/`` it lies in
    (``muse_stack.plan`` for ``muse_stack.plan.cost``), or a module at the root itself (``muse_stack``,
    ``muse_stack.x`` for ``muse_stack/x.py``)."""
    return ".".join(module.split(".")[:2])


def package_graph(root: Path) -> dict[str, set[str]]:
    """Each package's imported packages (:func:`package_of` of each end of each module's imports)."""
    graph: dict[str, set[str]] = {}
    for module, targets in _dependencies(root).items():
        edges = graph.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(module))
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    return _cycles(_dependencies(root))


def package_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one package, each sorted."""
    return _cycles(package_graph(root))


def imports_between(root: Path, packages: list[str]) -> list[str]:
    """``module:line name`` for each import from one of ``packages`` into another (what makes a cycle)."""
    modules = product_modules(root)
    out = []
    for name, path in modules.items():
        for imp in imports_of(name, path):
            target = None if imp.by_name else _module_of(imp.name, modules)
            if target and package_of(name) in packages and package_of(target) in packages \
                    and package_of(target) != package_of(name):
                out.append(f"{name}:{imp.line} {imp.name}")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):  # the recursion is at most as deep as the graph has nodes
        if v not in index:
            connect(v)
    return sorted(cycles)


# -- the product ---------------------------------------------------------------------------------
def test_the_product_never_imports_the_lab():
    assert lab_imports(ROOT) == [], "product modules importing the lab or the tests: move the code they need " \
                                    "into muse_stack/, or the module into benchmarks/lab/"


def test_the_entry_points_are_the_cli():
    assert entry_points(ROOT) == ["muse_stack.cli"]


def test_every_product_module_is_reached_from_the_entry_points():
    assert unreached(ROOT) == [], "modules under muse_stack/ that no command imports (used only by benchmarks " \
                                  "or tests): move them into benchmarks/lab/, or have the product use them"


def test_no_import_cycle_between_product_modules():
    assert import_cycles(ROOT) == []


def test_no_import_cycle_between_product_packages():
    cycles = package_cycles(ROOT)
    assert cycles == [], "packages importing each other, through: " + "; ".join(
        ", ".join(imports_between(ROOT, cycle)) for cycle in cycles) + \
        ": move what the lower package needs down into it (or below it), or the importing module up"


# -- the checker, on a small tree of its own -----------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n[project.scripts]\nx = "muse_stack.cli:main"\n')
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_a_lab_import_an_orphan_and_a_cycle(tmp_path):
    root = _tree(tmp_path, {
        "muse_stack/__init__.py": "",
        "muse_stack/cli.py": '"""muse_stack.orphan"""\nimport importlib\n'
                             'AREAS = ["muse_stack.area.commands"]\n'
                             "def main():\n    from muse_stack import lazy\n",
        "muse_stack/area/__init__.py": "",
        "muse_stack/area/commands.py": "from . import a\n",
        "muse_stack/area/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from muse_stack.area.b import B\n    import muse_stack.typed_only\n",
        "muse_stack/area/b.py": "def f():\n    from muse_stack.area.a import g\n    import lab.benchio\n"
                                "import logging\nlog = logging.getLogger('muse_stack.orphan')\n",
        "muse_stack/lazy.py": "def g():\n    from .area.b import f\n",
        "muse_stack/orphan.py": "",
        "muse_stack/typed_only.py": "",
    })
    assert lab_imports(root) == ["muse_stack.area.b:3 lab.benchio"]
    # b is reached through the lazy import in lazy.py; a TYPE_CHECKING import reaches nothing
    assert unreached(root) == ["muse_stack.orphan", "muse_stack.typed_only"]
    assert import_cycles(root) == [["muse_stack.area.a", "muse_stack.area.b"]]
    assert package_cycles(root) == []  # a cycle inside one package is the module check's


def test_the_checker_passes_a_clean_tree(tmp_path):
    root = _tree(tmp_path, {
        "muse_stack/__init__.py": "",
        "muse_stack/cli.py": "import importlib\nimportlib.import_module('muse_stack.area.commands')\n",
        "muse_stack/area/__init__.py": "",
        "muse_stack/area/commands.py": "from muse_stack.area.a import f\n",
        "muse_stack/area/a.py": "def f():\n    import muse_stack.util.x\n",
        "muse_stack/util/__init__.py": "",
        # a module named by a string (loaded by name when needed) reaches it but makes no import cycle
        "muse_stack/util/x.py": 'INSTALL = "muse_stack.area.a:f"\n',
    })
    assert (lab_imports(root), unreached(root), import_cycles(root), package_cycles(root)) == ([], [], [], [])


def test_the_checker_finds_a_cycle_between_packages_that_no_module_cycle_shows(tmp_path):
    root = _tree(tmp_path, {
        "muse_stack/__init__.py": "",
        "muse_stack/cli/__init__.py": "from muse_stack import tool\nfrom muse_stack.high import top\n"
                                      "from muse_stack.low import base\n",
        "muse_stack/cli/__main__.py": "from muse_stack.cli import main\n",
        "muse_stack/low/__init__.py": "",
        # an import for the type checker only runs back up all the same
        "muse_stack/low/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from muse_stack.high.top import Top\n",
        "muse_stack/low/plain.py": "",
        "muse_stack/high/__init__.py": "",
        "muse_stack/high/top.py": "from muse_stack.low import plain\n",
        # a root module is a package of its own
        "muse_stack/tool.py": "from muse_stack.mid.a import f\n",
        "muse_stack/mid/__init__.py": "",
        "muse_stack/mid/a.py": "def f():\n    pass\n",
        "muse_stack/mid/b.py": "def g():\n    from muse_stack.tool import h\n",
    })
    # python -m muse_stack.cli runs its __main__; mid.b is imported by nothing
    assert unreached(root) == ["muse_stack.mid.b"]
    assert import_cycles(root) == []
    assert package_cycles(root) == [["muse_stack.high", "muse_stack.low"], ["muse_stack.mid", "muse_stack.tool"]]
    assert imports_between(root, ["muse_stack.high", "muse_stack.low"]) == [
        "muse_stack.high.top:1 muse_stack.low.plain", "muse_stack.low.base:3 muse_stack.high.top.Top"]
