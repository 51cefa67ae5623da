"""The package's layering (docs/architecture.md): a layer imports only itself and the layers below it, and no module
imports another module's private names."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "minifloat"
# lowest first; "cli" is the cli package, "" the package's own __init__ (the public API imports every layer)
LAYERS = ["core", "numerics", "fp8", "amp", "safety", "distributed", "optim", "training", "inference", "cli", ""]
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))
MAX_LINES = 420  # "about 400 lines at most" (STYLE.md)


def layer_of(module: str) -> str:
    """'minifloat.fp8.gemm' -> 'fp8'; 'minifloat.cli' -> 'cli'; 'minifloat' and its top-level modules
    ('minifloat.train', the torchrun entry) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else ""


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(imported minifloat module, names taken from it) for every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minifloat"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("minifloat")]
    return out


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_only_go_down(path):
    here = layer_of(module_name(path))
    assert here in LAYERS, f"{module_name(path)} is in no known layer; add its folder to LAYERS and the docs"
    for target, names in imports(path):
        # `from minifloat.fp8 import step` imports the module minifloat.fp8.step: its layer is fp8 either way
        there = layer_of(f"minifloat.{names[0]}" if target == "minifloat" and names else target)
        assert LAYERS.index(there) <= LAYERS.index(here), f"{module_name(path)} ({here}) imports {target} ({there})"


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_no_private_names_across_modules(path):
    for target, names in imports(path):
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert not private, f"{module_name(path)} imports private {private} from {target}"


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{module_name(path)} has {lines} lines"
