"""The layer rule of docs/architecture.md, checked over every module of commlib, autograd_bridge and ddp.

The table is read from the drawing itself, so the drawing and the rule cannot diverge. Over every
``.py`` of the three packages, every import counts: at module level, inside functions, under
``TYPE_CHECKING``, and ``importlib.import_module("...")``/``__import__("...")`` with a literal name.
Edges go to the module named: ``from pkg import submodule`` is an edge to the submodule, and
importing ``a.b.c`` is an edge to ``a.b.c`` alone, not to ``a`` or ``a.b`` (Python runs their
``__init__`` first, but the importer did not ask for them; counting them would make every module
depend on the package root that re-exports everything).

The rules, each failure naming the file, the line and the rule:

(a) layers: a module imports modules of its own layer and lower layers only;
(b) cycles: no import cycle among the project's modules;
(c) private names: no ``from <project module> import _name`` from another module;
(d) no torch in commlib: commlib knows arrays, never torch;
(e) coverage: every module of the three packages is covered by a row of the table.

The checker is tested on small made-up packages first, so each rule is known to catch what it
names; then it runs on the real code.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("commlib", "autograd_bridge", "ddp")
NO_TORCH = ("commlib",)
LAYERS_HEADING = "## Layers"
# A row name ending in this covers the package's own __init__.py only, not its subpackages.
INIT_ONLY = ".__init__"


# --- the table -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    layer: int
    names: Tuple[str, ...]


def parse_layer_table(markdown: str) -> List[Row]:
    """The rows of the table under ``## Layers``: a layer number, then backticked module names."""
    rows: List[Row] = []
    in_section = False
    for line in markdown.splitlines():
        if line.startswith("## "):
            in_section = line.strip() == LAYERS_HEADING
            continue
        if not in_section or not line.lstrip().startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue  # the header and its rule line
        names = tuple(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", cells[1]))
        rows.append(Row(int(cells[0]), names))
    return rows


class Layers:
    """Which layer a module is in: the most specific row name that covers it wins."""

    def __init__(self, rows: Sequence[Row]):
        self.exact: Dict[str, Tuple[int, str]] = {}
        self.subtree: Dict[str, Tuple[int, str]] = {}
        for row in rows:
            for name in row.names:
                if name.endswith(INIT_ONLY):
                    self.exact[name[: -len(INIT_ONLY)]] = (row.layer, name)
                else:
                    self.subtree[name] = (row.layer, name)

    def of(self, module: str) -> Optional[Tuple[int, str]]:
        """(layer, the row name that placed it), or None when no row covers ``module``."""
        if module in self.exact:
            return self.exact[module]
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            found = self.subtree.get(".".join(parts[:end]))
            if found is not None:
                return found
        return None


# --- the code --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    path: Path
    line: int
    target: str  # the module the statement asks for (a project module or not)
    names: Tuple[str, ...] = ()  # names taken from it with ``from target import ...`` (not submodules)
    by_attribute: bool = False  # ``module._name`` through an alias: a use, not an import statement


def discover_modules(root: Path, packages: Iterable[str]) -> Dict[str, Path]:
    """{dotted module name: file} for every ``.py`` under each package folder."""
    modules: Dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve_relative(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _literal_import_call(node: ast.Call) -> Optional[str]:
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
        return first.value
    return None


def collect_imports(modules: Dict[str, Path]) -> List[Import]:
    imports: List[Import] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports.extend(Import(module, path, node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _resolve_relative(module, is_package, node.level, node.module)
                else:
                    base = node.module or ""
                taken = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        imports.append(Import(module, path, node.lineno, submodule))
                    else:
                        taken.append(alias.name)
                if taken:
                    imports.append(Import(module, path, node.lineno, base, tuple(taken)))
            elif isinstance(node, ast.Call):
                target = _literal_import_call(node)
                if target is not None:
                    imports.append(Import(module, path, node.lineno, target))
        imports.extend(_private_attribute_uses(module, path, tree, modules))
    return imports


def _module_aliases(tree: ast.AST, modules: Dict[str, Path]) -> Dict[str, str]:
    """Local names bound to project modules: ``import a.b`` binds ``a``, ``import a.b as m`` binds
    ``m``, ``from a import b`` binds ``b`` when ``a.b`` is a module."""
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return {name: target for name, target in aliases.items() if _top(target) in {_top(m) for m in modules}}


def _dotted(node: ast.AST) -> Optional[List[str]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _private_attribute_uses(module: str, path: Path, tree: ast.AST, modules: Dict[str, Path]) -> List[Import]:
    """``registry._TABLES`` through a name bound to another project module: a private name taken
    from it, recorded as an import of that name (rule (c) reads both forms)."""
    aliases = _module_aliases(tree, modules)
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        parts = _dotted(node.value)
        if parts is None or parts[0] not in aliases:
            continue
        owner = ".".join([aliases[parts[0]], *parts[1:]])
        if owner in modules and owner != module:
            uses.append(Import(module, path, node.lineno, owner, (node.attr,), by_attribute=True))
    return uses


# --- the rules -------------------------------------------------------------------------------------


def _where(root: Path, item: Import) -> str:
    return f"{item.path.relative_to(root)}:{item.line}"


def _top(name: str) -> str:
    return name.split(".")[0]


def layer_violations(root: Path, imports: List[Import], modules: Dict[str, Path], layers: Layers) -> List[str]:
    found = []
    for item in imports:
        if item.target not in modules or item.target == item.importer or item.by_attribute:
            continue
        mine, theirs = layers.of(item.importer), layers.of(item.target)
        if mine is None or theirs is None:
            continue  # rule (e) names it
        if theirs[0] > mine[0]:
            found.append(f"{_where(root, item)}: rule (a) layers: {item.importer} (layer {mine[0]}, {mine[1]}) "
                         f"imports {item.target} (layer {theirs[0]}, {theirs[1]}); a module may import its own "
                         f"layer and lower layers only")
    return found


def cycle_violations(root: Path, imports: List[Import], modules: Dict[str, Path]) -> List[str]:
    edges: Dict[str, Dict[str, Import]] = {module: {} for module in modules}
    for item in imports:
        if item.target in modules and item.target != item.importer and not item.by_attribute:
            edges[item.importer].setdefault(item.target, item)
    found = []
    for component in _strongly_connected(edges):
        if len(component) < 2:
            continue
        cycle = _a_cycle(component, edges)
        steps = ", ".join(f"{_where(root, edges[a][b])} {a} -> {b}" for a, b in zip(cycle, cycle[1:] + cycle[:1]))
        found.append(f"{_where(root, edges[cycle[0]][cycle[1]])}: rule (b) no import cycles: "
                     f"{' -> '.join(cycle + cycle[:1])} ({steps})")
    return found


def _strongly_connected(edges: Dict[str, Dict[str, Import]]) -> List[List[str]]:
    """Tarjan's algorithm, iterative (the import graph is deep enough to matter for recursion)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _a_cycle(component: List[str], edges: Dict[str, Dict[str, Import]]) -> List[str]:
    """One cycle through the component's first module (breadth first: a shortest one)."""
    members = set(component)
    start = component[0]
    previous: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(edges[node]):
                if successor not in members:
                    continue
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def private_violations(root: Path, imports: List[Import], modules: Dict[str, Path]) -> List[str]:
    found = []
    for item in imports:
        if item.target not in modules or item.target == item.importer:
            continue
        private = [name for name in item.names if name.startswith("_") and not name.startswith("__")]
        if private:
            found.append(f"{_where(root, item)}: rule (c) private names: {item.importer} imports "
                         f"{', '.join(private)} from {item.target}; a name with _ is private to its module "
                         f"(give it a public name and a docstring)")
    return found


def torch_violations(root: Path, imports: List[Import], packages: Iterable[str] = NO_TORCH) -> List[str]:
    found = []
    for item in imports:
        if _top(item.importer) in packages and _top(item.target) == "torch":
            found.append(f"{_where(root, item)}: rule (d) {_top(item.importer)} never imports torch: "
                         f"{item.importer} imports {item.target}")
    return found


def coverage_violations(root: Path, modules: Dict[str, Path], layers: Layers) -> List[str]:
    return [f"{path.relative_to(root)}:1: rule (e) coverage: {module} is in no row of the layer table "
            f"({ARCHITECTURE.relative_to(ROOT)}, {LAYERS_HEADING})"
            for module, path in modules.items() if layers.of(module) is None]


def check(root: Path, packages: Sequence[str], rows: Sequence[Row],
          no_torch: Sequence[str] = NO_TORCH) -> Dict[str, List[str]]:
    """Every violation of every rule, by rule."""
    modules = discover_modules(root, packages)
    imports = collect_imports(modules)
    layers = Layers(rows)
    return {"layers": layer_violations(root, imports, modules, layers),
            "cycles": cycle_violations(root, imports, modules),
            "private": private_violations(root, imports, modules),
            "torch": torch_violations(root, imports, no_torch),
            "coverage": coverage_violations(root, modules, layers)}


# --- the checker on made-up packages ----------------------------------------------------------------

TOY_TABLE = """\
# toy

## Layers
| layer | modules | what |
| ---: | --- | --- |
| 0 | `toy.low` | the bottom |
| 1 | `toy.mid`, `toy.pair` | the middle |
| 2 | `toy.high`, `toy.__init__` | the top |

## Elsewhere
| 3 | `toy.stray` | not a row: another section |
"""


def _write(root: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _toy(tmp_path: Path, files: Dict[str, str]) -> Dict[str, List[str]]:
    base = {"toy/__init__.py": "", "toy/low.py": "", "toy/mid/__init__.py": "", "toy/mid/a.py": "",
            "toy/pair/__init__.py": "", "toy/high.py": ""}
    _write(tmp_path, {**base, **files})
    return check(tmp_path, ["toy"], parse_layer_table(TOY_TABLE), no_torch=["toy"])


def test_the_table_parser_reads_only_the_layers_section():
    rows = parse_layer_table(TOY_TABLE)
    assert rows == [Row(0, ("toy.low",)), Row(1, ("toy.mid", "toy.pair")), Row(2, ("toy.high", "toy.__init__"))]
    layers = Layers(rows)
    assert layers.of("toy.mid.a") == (1, "toy.mid")
    assert layers.of("toy") == (2, "toy.__init__")
    assert layers.of("toy.stray") is None  # toy.__init__ covers the package's __init__ only


def test_clean_toy_package_has_no_violation(tmp_path):
    found = _toy(tmp_path, {"toy/high.py": "import toy.mid.a\nfrom toy import low\nfrom toy.low import name\n",
                            "toy/mid/a.py": "from toy.low import __doc__\n"})
    assert found == {"layers": [], "cycles": [], "private": [], "torch": [], "coverage": []}


def test_an_upward_import_is_named_with_file_line_and_rule(tmp_path):
    found = _toy(tmp_path, {"toy/low.py": "import os\n\n\ndef f():\n    from toy.mid import a\n"})
    assert found["layers"] == [
        ("toy/low.py:5: rule (a) layers: toy.low (layer 0, toy.low) imports toy.mid.a (layer 1, toy.mid); "
        "a module may import its own layer and lower layers only")]


def test_importing_from_the_package_root_is_an_edge_to_the_root(tmp_path):
    # `from toy import name` asks toy/__init__.py (layer 2) for a name: upward from layer 1.
    found = _toy(tmp_path, {"toy/__init__.py": "name = 1\n", "toy/mid/a.py": "from toy import name\n"})
    assert [line.split(": ")[0] for line in found["layers"]] == ["toy/mid/a.py:1"]
    # ...while `import toy.low` is an edge to toy.low only, not to the package root.
    assert _toy(tmp_path, {"toy/mid/a.py": "import toy.low\n"})["layers"] == []


def test_type_checking_and_dynamic_imports_count(tmp_path):
    found = _toy(tmp_path, {"toy/low.py": ("from typing import TYPE_CHECKING\nimport importlib\n"
                                           "if TYPE_CHECKING:\n    from toy.high import thing\n"
                                           "importlib.import_module('toy.pair')\n__import__('toy.mid')\n")})
    assert [line.split(": ")[0] for line in found["layers"]] == ["toy/low.py:4", "toy/low.py:5", "toy/low.py:6"]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    found = _toy(tmp_path, {"toy/mid/a.py": "from toy.pair import b\n",
                            "toy/pair/b.py": "def f():\n    import toy.mid.a\n"})
    assert len(found["cycles"]) == 1
    assert "rule (b) no import cycles: toy.mid.a -> toy.pair.b -> toy.mid.a" in found["cycles"][0]
    assert "toy/pair/b.py:2 toy.pair.b -> toy.mid.a" in found["cycles"][0]


def test_relative_imports_resolve(tmp_path):
    found = _toy(tmp_path, {"toy/mid/a.py": "from ..pair import b\n", "toy/pair/b.py": "from ..mid import a\n"})
    assert len(found["cycles"]) == 1


def test_private_names_across_modules_are_named(tmp_path):
    found = _toy(tmp_path, {"toy/low.py": "_secret = 1\n", "toy/high.py": "from toy.low import _secret, public\n"})
    assert found["private"] == [
        ("toy/high.py:1: rule (c) private names: toy.high imports _secret from toy.low; a name with _ is private "
        "to its module (give it a public name and a docstring)")]


def test_private_names_through_a_module_alias_are_named(tmp_path):
    found = _toy(tmp_path, {"toy/low.py": "_table = {}\n",
                            "toy/high.py": "import toy.low\nfrom toy import low as l\nx = toy.low._table, l._table\n"})
    assert [line.split(": ")[0] for line in found["private"]] == ["toy/high.py:3", "toy/high.py:3"]


def test_torch_is_found_wherever_it_is_imported(tmp_path):
    found = _toy(tmp_path, {"toy/low.py": "def f():\n    import torch.nn\n",
                            "toy/high.py": ("from typing import TYPE_CHECKING\n"
                                            "if TYPE_CHECKING:\n    from torch import Tensor\n")})
    assert [line.split(": ")[0] for line in found["torch"]] == ["toy/high.py:3", "toy/low.py:2"]


def test_a_module_in_no_row_is_named(tmp_path):
    found = _toy(tmp_path, {"toy/stray.py": ""})
    assert found["coverage"] == [("toy/stray.py:1: rule (e) coverage: toy.stray is in no row of the layer table "
                                 "(docs/architecture.md, ## Layers)")]


# --- the real code ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows() -> List[Row]:
    return parse_layer_table(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def violations(rows) -> Dict[str, List[str]]:
    return check(ROOT, PACKAGES, rows)


def test_the_drawing_has_a_well_formed_layer_table(rows):
    assert rows, f"no layer table under {LAYERS_HEADING!r} in {ARCHITECTURE}"
    assert [row.layer for row in rows] == list(range(len(rows))), "layers must be numbered 0, 1, 2, ... in order"
    names = [name for row in rows for name in row.names]
    assert all(row.names for row in rows), "every layer names at least one module"
    assert len(names) == len(set(names)), f"a module in two rows: {sorted(n for n in names if names.count(n) > 1)}"
    assert {_top(name) for name in names} <= set(PACKAGES)


@pytest.mark.parametrize("rule", ["layers", "cycles", "private", "torch", "coverage"])
def test_the_code_follows_the_rule(violations, rule):
    found = violations[rule]
    assert not found, f"{len(found)} violation(s) of the layer rules (docs/architecture.md):\n" + "\n".join(found)
