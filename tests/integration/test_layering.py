"""The layering of docs/architecture.md, read off the import statements of every module of
the package (at module level and inside functions): which part may import which, the
leaf modules, no import cycles, and function-body imports only for optional
dependencies."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "detr_irpe"

# Part -> the parts it may import (docs/architecture.md, "Layering"). A part that is not
# listed here fails the test: a new part states its place.
# The config and what it checks names and sizes with (registry, sizes, the family
# registry): importable by every part that may import the config.
CONFIG = {"canvas_layouts", "config", "family", "registry", "resize", "sizes"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "structures": set(),
    "irpe": set(),
    # the attention that hosts every encoding (its entries' interface; the iRPE maths of
    # the value terms)
    "attention": {"irpe"},
    "rope": {"attention"},
    # the encoding registry: its entries wrap irpe/ and rope/, entries of the attention
    "encodings": {"attention", "errors", "irpe", "registry", "rope"},
    "utils": {"errors"},
    "sizes": set(),
    # canvas layouts (labels, placement): the size-list parser of sizes
    "canvas_layouts": {"sizes"},
    # the resize rules (detr_irpe/resize.py): test sizes, and the family that gives the rule
    "resize": {"family", "sizes"},
    # the one registry style (name -> entry) of backbones, families and encodings
    "registry": {"errors"},
    "family": {"errors", "registry"},
    "config": {"attention", "errors", "family", "irpe", "registry", "encodings", "resize", "rope", "sizes",
               "utils"},
    "checkpoint": CONFIG | {"attention", "errors", "irpe", "encodings", "rope", "utils"},
    "models": CONFIG | {"attention", "checkpoint", "errors", "irpe", "encodings", "rope", "structures", "utils"},
    "data": CONFIG | {"errors", "structures", "utils"},
    "evaluation": {"data", "errors", "utils"},
    "run_folder": CONFIG | {"checkpoint", "errors", "utils"},
    "engine": CONFIG | {"attention", "checkpoint", "data", "errors", "evaluation", "irpe", "models",
                        "encodings", "rope", "run_folder", "structures", "utils"},
    "export": CONFIG | {"attention", "checkpoint", "errors", "irpe", "models", "encodings", "rope", "structures",
                        "utils"},
    "visualization": CONFIG | {"attention", "checkpoint", "data", "errors", "evaluation", "irpe", "models",
                               "encodings", "rope", "run_folder", "structures", "utils"},
    "inference": CONFIG | {"checkpoint", "data", "errors", "export", "models", "structures",
                           "utils", "visualization"},
    "ablation": CONFIG | {"attention", "checkpoint", "data", "errors", "evaluation", "irpe", "models",
                          "encodings", "rope", "run_folder", "utils"},
    "benchmark": CONFIG | {"attention", "checkpoint", "data", "engine", "errors", "evaluation", "export",
                           "inference", "irpe", "models", "encodings", "rope", "structures",
                           "utils"},
    "cli": CONFIG | {"attention", "ablation", "benchmark", "checkpoint", "data", "engine", "errors", "evaluation",
                     "export", "inference", "irpe", "models", "encodings", "rope", "run_folder",
                     "structures", "utils", "visualization"},
}
# Modules that import nothing of the package but these (the leaves other modules stand on).
LEAVES = {
    "detr_irpe.checkpoint.safe": {"detr_irpe.errors"},
    "detr_irpe.checkpoint.hf_keys": {"detr_irpe.checkpoint.safe", "detr_irpe.errors"},
    "detr_irpe.run_folder.experiment": set(),
}
# What may be imported inside a function: optional dependencies (extras) and a fast path
# that may be missing (torch._inductor: the compiled runtime, private to torch), and the user's reference checkout (benchmark/reference.py), which is
# importable only while it is on sys.path.
OPTIONAL = {"safetensors", "torch.utils.tensorboard", "faster_coco_eval", "onnxruntime",
            "timm", "torchvision.io", "models", "util.misc", "submitit", "wandb",
            "transformers", "supervision", "torch._inductor", "defusedxml"}
# A tool's module (detr_irpe/cli/<tool>.py) imports its program (detr_irpe/cli/programs/)
# inside main, after parsing: --help and argument errors need no torch (docs/architecture.md).
PROGRAMS = "detr_irpe.cli.programs"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imports(path: Path) -> list[tuple[str, bool, ast.stmt]]:
    """``(imported module, inside a function, statement)`` of every import in ``path``."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    in_function = {id(node) for fn in ast.walk(tree)
                   if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from package import submodule" imports the submodule too
            submodules = [f"{target}.{a.name}" for a in node.names
                          if target.startswith("detr_irpe") and _is_module(f"{target}.{a.name}")]
            found += [(t, id(node) in in_function, node) for t in [target, *submodules]]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in in_function, node) for a in node.names]
    return found


def _graph() -> dict[str, list[tuple[str, bool, ast.stmt]]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = _graph()


def test_the_walk_sees_the_package() -> None:
    assert "detr_irpe.run_folder.experiment" in GRAPH and "detr_irpe.engine.runner" in GRAPH
    runner = {target for target, _, _ in GRAPH["detr_irpe.engine.runner"]}
    assert "detr_irpe.run_folder.checkpoints" in runner  # a known edge is found


def test_every_part_imports_only_the_parts_below_it() -> None:
    wrong = defaultdict(set)
    for module, imports in GRAPH.items():
        part = _part(module)
        if not part:
            continue
        assert part in ALLOWED, f"{module}: part {part!r} has no place in the layering"
        for target, _, _ in imports:
            other = _part(target)
            if target.startswith("detr_irpe.") and other != part and other not in ALLOWED[part]:
                wrong[module].add(target)
    assert not wrong, dict(wrong)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_stand_on_nothing_else(leaf: str) -> None:
    inside = {target for target, _, _ in GRAPH[leaf] if target.startswith("detr_irpe")}
    assert inside <= LEAVES[leaf]


def test_no_import_cycles() -> None:
    """Between modules (a package counts as its ``__init__``): e.g. checkpoint.files and
    the Hugging Face modules, which once imported each other inside functions."""
    edges = {module: {t for t, _, _ in imports if t in GRAPH and t != module}
             for module, imports in GRAPH.items()}
    # a package's __init__ importing its own submodules is how packages work; a submodule
    # importing its package back is the cycle that counts
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if module.startswith(f"{target}."):
                continue  # a submodule reaching its own package's __init__ (a re-export)
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_imports_inside_functions_are_optional_dependencies_with_a_reason() -> None:
    """Everything else a module needs is imported at its top, where a reader looks; an
    import inside a function carries a comment (on it or the two lines above) saying why."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text().splitlines()
        for target, in_function, node in _imports(path):
            if not in_function:
                continue
            optional = any(target == name or target.startswith(f"{name}.") for name in OPTIONAL)
            module = _module_name(path)
            if target.split(".")[:3] == PROGRAMS.split(".") and module.startswith("detr_irpe.cli.") and \
                    not module.startswith(f"{PROGRAMS}."):
                optional = True
            said = "#" in " ".join(source[max(node.lineno - 3, 0):node.end_lineno])
            if not (optional and said):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert not wrong, wrong
