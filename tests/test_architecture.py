"""The layering of docs/architecture.md, checked on the source: no import circles, no import
that runs back up a layer, and the purity rules of config/schema.py, models/ and planner/."""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "videodit"

# Bottom to top; a unit imports only from its own layer's named peers or from layers below.
LAYERS = [
    {"errors", "user_files", "quiet"},
    {"config"},
    {"models", "diffusion", "distill", "data"},
    {"toy", "components"},
    {"parallel", "checkpoint", "planner"},
    {"sample", "train", "cache"},
    {"cli"},
    {"__main__"},
]
# Imports inside one layer that the design allows (importer unit -> imported unit).
PEERS = {("components", "toy"), ("planner", "parallel.dims"), ("train", "sample"), ("user_files", "errors")}


def modules() -> dict[str, Path]:
    """Dotted module name (without ``videodit.``) -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or "__init__"] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every ``videodit.X`` module a file imports, at any depth (lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("videodit"):
            base = node.module.removeprefix("videodit").lstrip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("videodit.") for a in node.names if a.name.startswith("videodit."))
    known = modules()
    return {name for name in names if name in known}


def graph() -> dict[str, set[str]]:
    return {name: imports_of(path) for name, path in modules().items()}


def unit(module: str) -> str:
    return module.split(".")[0]


def layer(module: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit(module) in units)


def test_every_module_has_a_layer():
    assert {unit(m) for m in modules()} - {"__init__"} <= set().union(*LAYERS)


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` (module -> imported modules), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep, path + [dep])):
                return circle
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node, [node])):
            return circle
    return None


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles():
    circle = find_circle({m: deps - {m} for m, deps in graph().items()})
    assert circle is None, " -> ".join(circle)


def test_no_import_runs_back_up():
    upward = []
    for module, deps in graph().items():
        if module == "__init__":
            continue
        for dep in deps:
            if unit(dep) == unit(module):
                continue
            same_layer_peer = layer(dep) == layer(module) and (
                (unit(module), unit(dep)) in PEERS or (unit(module), dep) in PEERS)
            if layer(dep) > layer(module) or (layer(dep) == layer(module) and not same_layer_peer):
                upward.append(f"{module} -> {dep}")
    assert not upward, upward


def test_schema_is_a_leaf():
    """The schema reads only its preset table, which reads nothing of videodit."""
    assert imports_of(PACKAGE / "config" / "schema.py") <= {"config.model_presets"}
    assert imports_of(PACKAGE / "config" / "model_presets.py") == set()


def test_models_use_no_torch_distributed():
    def distributed(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.startswith("torch.distributed") for name in names):
                return True
        return False

    assert not [str(p) for p in (PACKAGE / "models").rglob("*.py") if distributed(p)]


def test_planner_imports_no_runtime_code():
    runtime = {"train", "checkpoint", "sample", "cli"}
    for path in (PACKAGE / "planner").rglob("*.py"):
        deps = imports_of(path)
        assert not {d for d in deps if unit(d) in runtime}, path
        assert {d for d in deps if unit(d) == "parallel"} <= {"parallel.dims"}, path


def test_no_file_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long


FAMILIES = sorted(p.name for p in (PACKAGE / "models").iterdir() if (p / "spec.py").is_file())
# Inside models/, besides the family itself: the registry alone (a family's encoders, too, are
# built through its spec: ModelSpec.build_vae / build_text_encoder).
FAMILY_GATES = {"models.families"}


def test_model_families_are_reached_through_their_spec():
    """Nothing outside a family's folder imports it, except the registry (its spec): the trainer,
    parallel/, the planner, checkpoint/, sample.py and the encoder factories talk to the ModelSpec
    (docs/architecture.md, "the model-family seam")."""
    assert {"stdit", "wan"} <= set(FAMILIES)
    leaks = [f"{module} -> {dep}" for module, deps in graph().items() for dep in deps
             for family in FAMILIES if dep.startswith(f"models.{family}")
             and not module.startswith(f"models.{family}") and module not in FAMILY_GATES]
    assert not leaks, leaks
