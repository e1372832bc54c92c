"""The product's modules import each other without circles, and each layer only downwards.

Every import counts: at module level, inside functions (a lazy import hides a circle, it does
not remove it) and under ``TYPE_CHECKING``. The graph is read from the source with ``ast``, so
nothing is imported to check it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support import PRODUCT_PACKAGES, REPO_ROOT

# What each package may not import: memory/ is below everything else; the processes do not
# import each other (they talk through runtime/protocol/messages.py).
FORBIDDEN = {
    "memory": ("scheduler_proc", "tokenizer_proc", "detokenizer_proc", "launch"),
    "runtime": ("scheduler_proc", "tokenizer_proc", "detokenizer_proc", "launch"),
    "tokenizer_proc": ("scheduler_proc", "detokenizer_proc", "launch"),
    "detokenizer_proc": ("scheduler_proc", "tokenizer_proc", "launch"),
    "scheduler_proc": ("tokenizer_proc", "detokenizer_proc", "launch"),
}

# Inside runtime/, each concern's folder and what it may not import: the protocol is the leaf
# every process shares; checkpoints (what --model-path names) know nothing of model execution;
# the engine runs the model and never reaches the client, the flags or the text side; the
# client needs only the protocol (it never pulls torch).
RUNTIME_CONCERNS = ("protocol", "checkpoints", "engine", "config", "text", "client")
FORBIDDEN_IN_RUNTIME = {
    "runtime.protocol": ("runtime.checkpoints", "runtime.engine", "runtime.config", "runtime.text", "runtime.client"),
    "runtime.checkpoints": ("runtime.engine", "runtime.config", "runtime.text", "runtime.client"),
    "runtime.engine": ("runtime.config", "runtime.text", "runtime.client"),
    "runtime.text": ("runtime.engine", "runtime.config", "runtime.client"),
    "runtime.config": ("runtime.engine", "runtime.client"),
    "runtime.client": ("runtime.checkpoints", "runtime.engine", "runtime.config", "runtime.text"),
}


@functools.cache
def product_modules() -> dict[str, Path]:
    """Dotted name -> file of every product module (``launch`` included)."""
    modules = {"launch": REPO_ROOT / "launch.py"}
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name the module imports: ``import a.b`` gives ``a.b``; ``from a import b``
    gives ``a.b`` where that is a module of ours, else ``a`` (a name defined in ``a``)."""
    modules = product_modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (each name resolved to its longest module prefix)."""
    modules = product_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
        graph[module] = targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_product_modules() -> None:
    graph = import_graph()
    assert len(graph) > 100 and graph["launch"]
    found = cycles(graph)
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_layers_import_only_downwards() -> None:
    wrong = []
    for module, targets in import_graph().items():
        banned = FORBIDDEN.get(module.split(".")[0], ())
        wrong += [f"{module} -> {t}" for t in sorted(targets) if t.split(".")[0] in banned]
    assert wrong == []


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_runtime_concerns_import_only_in_their_direction() -> None:
    wrong = []
    for module, targets in import_graph().items():
        for owner, banned in FORBIDDEN_IN_RUNTIME.items():
            if _within(module, owner):
                wrong += [f"{module} -> {t}" for t in sorted(targets) if any(_within(t, b) for b in banned)]
    assert wrong == []


def test_the_checker_finds_a_wrong_direction_inside_runtime() -> None:
    banned = FORBIDDEN_IN_RUNTIME["runtime.engine"]
    assert any(_within("runtime.client.clients", b) for b in banned)
    assert not any(_within("runtime.checkpoints.model_source", b) for b in banned)


def test_runtime_root_holds_only_its_concern_folders() -> None:
    root = REPO_ROOT / "runtime"
    modules = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert modules == [] and folders == sorted(RUNTIME_CONCERNS)


def test_the_product_imports_no_test_or_benchmark_code() -> None:
    wrong = [
        f"{module}: {name}"
        for module, path in product_modules().items()
        for name in sorted(imported_names(module, path))
        if name.split(".")[0] in ("tests", "bench")
    ]
    assert wrong == []
