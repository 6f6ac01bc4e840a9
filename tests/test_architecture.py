"""The module graph's three rules, read from the source with `ast` (nothing is imported):

- Layers import only downward. `LAYERS` below declares them once, top to bottom: a module may import
  its own group and any layer below it, never a layer above, nor another group of its own layer.
  Every module of the project belongs to exactly one group (the longest prefix that names it).

- No module uses another module's private (`_name`) name: not `from X import _name`, not `X._name`
  after `import X`. A private module (`_name.py`) is private to its package: its
  siblings may import it, nothing outside. Only project modules are checked: JAX's own private
  `jax._src` is allowed, in the wrappers that need it (`pallas_kernels/interpret.py`, `lowering.py`).
- The import graph among project modules has no cycle, counting every import: at module level,
  inside functions (the hidden kind) and under `TYPE_CHECKING`. A package's `__init__` is a node
  when it is named (`from jaxserve import LLM`), not for every import of a submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "server", "pallas_kernels")


def _module_names() -> dict[str, Path]:
    """Dotted name -> file; tests are top-level modules (conftest puts tests/ on sys.path)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((REPO_ROOT / "tests").glob("*.py")):
        modules[path.stem] = path
    return modules


MODULES = _module_names()

# Top to bottom. A layer is a tuple of groups; a group is a tuple of module prefixes ("jaxserve" itself
# names only the package's `__init__`). Groups of one layer are independent of each other.
LAYERS = (
    (("jaxserve.cli",),),  # the command line: serves, benchmarks, converts
    (("server", "jaxserve", "jaxserve.llm", "jaxserve.bench", "jaxserve.tools"),),  # the public edges
    (("jaxserve.core",),),  # the engine core: requests, scheduler, engine, its loop
    (("jaxserve.spec_decode",), ("jaxserve.distributed",)),  # speculative decoding | scale-out
    (("jaxserve.runner",),),  # the device side of a step
    (("jaxserve.models", "jaxserve.weights", "jaxserve.parallel"),),  # the model, its weights, its sharding
    (("jaxserve.ops", "pallas_kernels"),),  # attention, kernels, the sampler
    (("jaxserve.config", "jaxserve.lora", "jaxserve.errors", "jaxserve.log"),),  # settings, adapters, errors, start-up lines
)


def _layer_of(module: str) -> tuple[int, int] | None:
    """(layer, group) of a project module, by the longest prefix naming it; None for tests."""
    best, best_length = None, -1
    for layer, groups in enumerate(LAYERS):
        for group, prefixes in enumerate(groups):
            for prefix in prefixes:
                names = module == prefix or (prefix != "jaxserve" and module.startswith(prefix + "."))
                if names and len(prefix) > best_length:
                    best, best_length = (layer, group), len(prefix)
    return best


def _project_modules() -> list[str]:
    return [m for m, path in MODULES.items() if path.relative_to(REPO_ROOT).parts[0] in PACKAGES]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module):
    """(line, imported project module, name taken from it or None, local name bound) for every import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES or alias.name.split(".")[0] in MODULES:
                    bound = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    yield node.lineno, alias.name, None, (bound, target)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source not in MODULES:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:  # `from jaxserve import weights`: the submodule itself
                    yield node.lineno, submodule, None, (alias.asname or alias.name, submodule)
                else:
                    yield node.lineno, source, alias.name, None


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def _same_package(module: str, private_module: str) -> bool:
    return module.rsplit(".", 1)[0] == private_module.rsplit(".", 1)[0]


def _private_uses(module: str, tree: ast.Module | None = None) -> list[str]:
    tree = _parse(module) if tree is None else tree
    found, bound_modules = [], {}
    where = f"{MODULES[module].relative_to(REPO_ROOT)}"
    for line, imported, name, binding in _imports(module, tree):
        if binding is not None:
            bound_modules[binding[0]] = binding[1]
        private_parts = [p for p in imported.split(".") if _is_private(p)]
        if private_parts and not _same_package(module, imported) and imported != module:
            found.append(f"{where}:{line} imports the private module {imported}")
        if name is not None and _is_private(name) and imported != module:
            found.append(f"{where}:{line} imports {imported}.{name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound_modules:
            continue
        owner = ".".join([bound_modules[value.id], *reversed(chain)])
        if owner in MODULES and owner != module:
            found.append(f"{where}:{node.lineno} uses {owner}.{node.attr}")
    return found


def _import_graph() -> dict[str, set[str]]:
    graph = {module: set() for module in MODULES}
    for module in MODULES:
        for _, imported, _, _ in _imports(module, _parse(module)):
            target = imported if imported in MODULES else imported.split(".")[0]
            if target != module:
                graph[module].add(target)
    return graph


def _upward_imports(module: str, tree: ast.Module | None = None) -> list[str]:
    tree = _parse(module) if tree is None else tree
    here, found = _layer_of(module), []
    for line, imported, _, _ in _imports(module, tree):
        target = imported if imported in MODULES else imported.split(".")[0]
        there = _layer_of(target)
        if there is None or there == here or there[0] > here[0]:
            continue
        why = "a layer above" if there[0] < here[0] else "another group of its layer"
        found.append(f"{MODULES[module].relative_to(REPO_ROOT)}:{line} imports {target} ({why}: "
                     f"layer {there[0]} {LAYERS[there[0]][there[1]]} from layer {here[0]} {LAYERS[here[0]][here[1]]})")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node: str):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_checks_see_what_they_are_meant_to_see():
    """The rules themselves on small graphs and sources, so a silent parser cannot pass the real tree."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "jaxserve.core.engine" in _import_graph()["jaxserve.llm"]
    # server/main.py imports the engine inside serve(): function-level imports are edges too
    assert "jaxserve.core.engine" in _import_graph()["server.main"]
    fake = ast.parse("from jaxserve.weights import _hidden\nimport jaxserve.ops.cpu_ffi as ffi\n"
                     "def f():\n    from jaxserve.config import model_config\n    return ffi._lib, model_config._rope_config\n")
    # an upward import, even inside a function, is reported; one within the group or downward is not
    upward = ast.parse("import jax\nfrom jaxserve.config.engine_config import EngineConfig\n"
                       "from jaxserve.ops import attention\ndef f():\n    from jaxserve.core.engine import LLMEngine\n")
    assert [u.split(" ", 1)[1].split(" (")[0] for u in _upward_imports("jaxserve.ops.sampling", upward)] == \
        ["imports jaxserve.core.engine"]
    sideways = ast.parse("from jaxserve.distributed import multihost\n")
    assert "another group" in _upward_imports("jaxserve.spec_decode.draft_model", sideways)[0]
    assert _layer_of("jaxserve") == (1, 0) and _layer_of("jaxserve.config.model_config") == (7, 0)
    assert _layer_of("jaxserve.core.engine") == (2, 0) and _layer_of("test_engine") is None
    uses = _private_uses("jaxserve.llm", fake)
    assert [u.split(" ", 1)[1] for u in uses] == ["imports jaxserve.weights._hidden", "uses jaxserve.ops.cpu_ffi._lib",
                                                  "uses jaxserve.config.model_config._rope_config"]


def test_no_module_uses_another_modules_private_names():
    found = [use for module in MODULES for use in _private_uses(module)]
    assert not found, "private names used across modules (make them public where they belong):\n" + "\n".join(found)


def test_the_import_graph_has_no_cycles():
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import one another in a cycle (function-level imports included):\n" + \
        "\n".join(map(", ".join, cycles))


def test_every_module_has_one_layer():
    missing = [module for module in _project_modules() if _layer_of(module) is None]
    assert not missing, "modules in no layer (add them to LAYERS):\n" + "\n".join(missing)


def test_layers_import_only_downward():
    found = [use for module in _project_modules() for use in _upward_imports(module)]
    assert not found, "imports against the layer order (move the function to the layer that owns it):\n" + \
        "\n".join(found)
