"""The package's import graph: no cycles, and no module imports from a layer above its own.

Every import counts, at module level, inside a function or under
TYPE_CHECKING: each is a dependency a reader (and a type checker) follows.
The layers are the picture in docs/design.md, lowest first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "radixrt"

# A module belongs to the layer of the longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    ("radixrt.tree", "radixrt.memory", "radixrt.sampling", "radixrt.sampling.params", "radixrt.paths"),
    ("radixrt.kernels",),
    ("radixrt.model", "radixrt.sampling.sampler", "radixrt.sampling.grammar", "radixrt.config"),
    ("radixrt.engine",),
    ("radixrt.runtime",),
    ("radixrt.lang", "radixrt.server"),
    ("radixrt.scaleout",),
    ("radixrt.demo", "radixrt.cli", "radixrt.benchmarks"),
]


def module_names() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The radixrt modules `name` imports; `from package import module` counts as the module."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name and m != "radixrt"}


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/design.md")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_imports_only_its_own_layer_or_lower(graph):
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph.items()
        if module != "radixrt"
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_only_the_model_layer_reaches_the_cpu_kernels(graph):
    """The executor (the model layer) is the one door to the CPU kernels: the engine, the sampler
    and everything above them hand it plain data."""
    kernel_modules = {m for m in graph if m == "radixrt.kernels.cpu" or m.startswith("radixrt.kernels.cpu.")}
    reaching = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not module.startswith(("radixrt.kernels", "radixrt.model"))
        for target in targets & kernel_modules
    )
    assert not reaching, "\n".join(reaching)


def test_the_model_asks_backends_what_they_can_do_not_which_class_they_are(graph):
    """The model and its executors choose a step's path from `AttentionBackend`'s own properties
    (`reads_pool_in_place`, `attends_segments`), never from a concrete backend's class."""
    backends = {"radixrt.kernels.torch_backend", "radixrt.kernels.triton_backend", "radixrt.kernels.flashinfer_backend"}
    reaching = sorted(f"{module} imports {target}" for module, targets in graph.items()
                      if module.startswith("radixrt.model") for target in targets & backends)  # fmt: skip
    assert not reaching, "\n".join(reaching)


def test_no_import_cycles(graph):
    cycles = strongly_connected_components(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(sorted(c)) for c in cycles)


def strongly_connected_components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm; returns only the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_cycle_and_an_upward_import():
    assert strongly_connected_components({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert layer_of("radixrt.kernels.torch_backend") < layer_of("radixrt.model.llama")
    assert layer_of("radixrt.sampling.sampler") > layer_of("radixrt.sampling")
