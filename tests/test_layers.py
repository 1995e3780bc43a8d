"""The layering of ``ninfer`` (docs/architecture.md), checked on the source with ``ast``.

Every import counts, function-level and ``TYPE_CHECKING`` ones included: a layer may import only the
layers ``ALLOWED`` lists for it; modules inside one package import each other without cycles; and no
module takes a private (underscore) name from another file.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ninfer"

# Layer -> the layers it may import (besides itself). api -> runtime -> models -> kernels, downward only;
# quant sits beside models (models use it, it uses kernels, kernels use neither); vision feeds the models;
# config, checkpoint and tokenizer are leaves that every layer may use. "ninfer" is the package's top
# (__init__, llm, cli, ...), which may use everything.
LEAVES = {"config", "checkpoint", "tokenizer"}
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "quant": {"kernels"},
    "models": {"kernels", "quant"},
    "vision": {"models", "kernels"},
    "runtime": {"models", "kernels", "quant", "vision"},
    "api": {"runtime", "models", "kernels", "quant", "vision"},
    "config": set(),
    "checkpoint": set(),
    "tokenizer": set(),
}

# Known exceptions outside the kernels, each with its reason; new code adds none.
# Upward imports: (importing module, imported module).
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("ninfer.api.cli", "ninfer.cli_options"): "the server command shares the engine, model, sampling and template "
                                              "flags of the ninfer commands (ninfer.cli_options imports neither "
                                              "command: no cycle)",
    ("ninfer.api.cli", "ninfer"): "the server command loads the model through ninfer.load",
    ("ninfer.quant.sizes", "ninfer.models.qwen3_5"): "size accounting builds the text model on the meta device "
                                                     "to list its weight shapes",
    ("ninfer.quant.convert", "ninfer.models.qwen3_5"): "convert builds the text model on the meta device to find "
                                                      "the parts of each fused projection",
    ("ninfer.quant.convert", "ninfer.models.mtp"): "likewise for the MTP head's fused projections",
    ("ninfer.vision.prefill", "ninfer.runtime.sequence"): "the vision prefill drives the engine's sequence runner",
}
# Private names taken from another file: (importing module, imported module, name).
KNOWN_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {
}
# Cycles between modules of one package (imports under TYPE_CHECKING do not count: they never run).
KNOWN_CYCLES: dict[frozenset[str], str] = {
    frozenset({"ninfer.llm", "ninfer.async_llm"}): "LLM.generate_async builds the AsyncLLM (function-level import); "
                                                   "AsyncLLM reuses LLM's prompt helpers",
    frozenset({"ninfer.runtime.structured", "ninfer.runtime.structured_schema"}): "the schema checker raises "
                                                   "structured's error type (imported inside its function)",
    frozenset({"ninfer.vision.fetch", "ninfer.vision.media"}): "media calls fetch; fetch imports media's limits and "
                                                                "errors inside its functions",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str | None = None, *, typing_only: bool = True) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of every import in the file, relative imports resolved against ``package``
    (default: the file's own); ``typing_only=False`` leaves out those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if package is None:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    skipped: set[int] = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _target(module: str, names: list[str]) -> list[str]:
    """The ninfer modules an import statement loads: ``from pkg import mod`` names the submodule."""
    if module != "ninfer" and not module.startswith("ninfer."):
        return []
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return subs if subs and len(subs) == len(names) else [module, *subs]


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    return "ninfer"


def test_the_allowed_matrix_names_every_layer() -> None:
    layers = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers <= set(ALLOWED), f"packages missing from ALLOWED: {layers - set(ALLOWED)}"
    assert {p.stem for p in ROOT.glob("*.py")} >= LEAVES
    assert all(allowed <= set(ALLOWED) for allowed in ALLOWED.values())
    assert all(ALLOWED[leaf] == set() for leaf in LEAVES)


def test_layers_import_only_downward() -> None:
    wrong = []
    for name, path in MODULES.items():
        src = _layer(name)
        for module, names, line in _imports(path):
            for target in _target(module, names):
                dst = _layer(target)
                if src == "ninfer" or dst == src or dst in LEAVES or dst in ALLOWED[src]:
                    continue
                if (name, target) in KNOWN_EXCEPTIONS:
                    continue
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {target} ({dst})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_private_names_imported_across_files() -> None:
    wrong = []
    for name, path in MODULES.items():
        for module, names, line in _imports(path):
            if not module.startswith("ninfer"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")
                       and (name, module, n) not in KNOWN_PRIVATE_IMPORTS]
            if private:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: from {module} import {', '.join(private)}")
    assert not wrong, "private names taken from another file:\n" + "\n".join(wrong)


def _package_graph(package: str, typing_only: bool = False) -> dict[str, set[str]]:
    """Imports among the modules of one package (its ``__init__`` excluded: it only re-exports);
    ``typing_only``: those under ``TYPE_CHECKING`` too."""
    members = {m for m in MODULES if m.rpartition(".")[0] == package and m != package}
    graph: dict[str, set[str]] = {m: set() for m in members}
    for m in members:
        for module, names, _ in _imports(MODULES[m], typing_only=typing_only):
            graph[m] |= {t for t in _target(module, names) if t in members and t != m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_inside_a_package() -> None:
    packages = {_module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    cycles = {}
    for pkg in sorted(packages):
        graph = _package_graph(pkg)
        for known in KNOWN_CYCLES:
            if known <= graph.keys():
                for a in known:
                    graph[a] -= known
        if cycle := _cycle(graph):
            cycles[pkg] = cycle
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles.values())


def test_no_back_arrows_in_the_runtime() -> None:
    """The engine's collaborators (runner, scheduler, pauser, speculator, memory plan, ...) never point back at
    the modules that build them, not even for type hints: each gets what it needs at construction."""
    graph = _package_graph("ninfer.runtime", typing_only=True)
    for known in KNOWN_CYCLES:
        if known <= graph.keys():
            for a in known:
                graph[a] -= known
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _calls_and_subscript_writes(path: Path) -> tuple[set[str], set[str]]:
    """Names called (``f(...)``, ``x.f(...)``) and attributes written through a subscript (``x.a[i] = ...``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    written = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute):
                written.add(t.value.attr)
    return called, written


def test_one_batch_constructor_and_one_block_table_writer() -> None:
    """Every ``ForwardBatch`` comes from ``models.batch.make_batch``; the lanes' block tables are written only by
    the model runner (its ``set_pages`` / ``clear``)."""
    builders, writers = [], []
    for name, path in MODULES.items():
        called, written = _calls_and_subscript_writes(path)
        if "ForwardBatch" in called and name != "ninfer.models.batch":
            builders.append(name)
        if written & {"block_tables", "lane_block_tables"} and name != "ninfer.runtime.model_runner":
            writers.append(name)
    assert not builders, f"ForwardBatch built outside make_batch: {builders}"
    assert not writers, f"block tables written outside the model runner: {writers}"


def test_the_checks_see_function_level_and_relative_imports(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ninfer.api import app\n    from . import sibling\n")
    found = _imports(src, package="ninfer.kernels.attention")
    assert ("ninfer.api", ["app"], 2) in found
    assert ("ninfer.kernels.attention", ["sibling"], 3) in found
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
