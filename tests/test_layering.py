"""Package boundaries, read from the sources' imports: the runtime never imports the
benchmarks or the test oracle, models never reach into the kernels, the kernels never into
the engine or the models, and the kernel modules import one another without a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the folder each installed package lives in
PACKAGES = {"rltjax": ROOT / "rltjax", "rltjax.kernels": ROOT / "kernels", "rltjax.checkpoints": ROOT / "checkpoints"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package,) + tuple(p for p in parts if p != "__init__"))
            found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every module name an import statement in ``path`` names (at any depth, lazy ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


ENGINE_LAYERS = ("rltjax.engine", "rltjax.cache", "rltjax.models", "rltjax.kernels", "rltjax.checkpoints")


def test_the_runtime_imports_no_benchmarks_and_the_engine_not_the_oracle():
    """(The CLI may: ``rltjax generate --engine reference`` runs the oracle for a user.)"""
    for name, path in modules().items():
        for imported in imports_of(path):
            assert not under(imported, "benchmarks"), f"{name} imports {imported}"
            if any(under(name, layer) for layer in ENGINE_LAYERS):
                assert not under(imported, "rltjax.reference"), f"{name} imports the oracle: {imported}"
            assert not under(imported, "kernels") and not under(imported, "checkpoints"), \
                f"{name} imports {imported}: the installed names are rltjax.kernels / rltjax.checkpoints"


def test_models_and_kernels_keep_to_their_layers():
    for name, path in modules().items():
        imported = imports_of(path)
        if under(name, "rltjax.models"):
            assert not any(under(i, "rltjax.kernels") or under(i, "rltjax.engine") for i in imported), (name, imported)
        if under(name, "rltjax.kernels"):
            assert not any(under(i, p) for i in imported for p in ("rltjax.models", "rltjax.engine", "rltjax.cache")), \
                (name, imported)


def test_kernel_modules_have_no_import_cycle():
    kernel_modules = {n: p for n, p in modules().items() if under(n, "rltjax.kernels")}
    graph = {n: {i for i in imports_of(p) if i in kernel_modules and i != n} for n, p in kernel_modules.items()}
    done, stack = set(), []

    def visit(n):
        assert n not in stack, f"import cycle: {' -> '.join(stack[stack.index(n):] + [n])}"
        if n in done:
            return
        stack.append(n)
        for m in graph[n]:
            visit(m)
        stack.pop()
        done.add(n)

    for n in graph:
        visit(n)


def test_the_wheel_owns_only_the_rltjax_namespace():
    import tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(under(p, "rltjax") for p in config["packages"])
    assert set(config["package-dir"]) == {"rltjax.kernels", "rltjax.checkpoints"}
    # every runtime package folder is listed (a missing one would not install)
    listed = set(config["packages"])
    for name, path in modules().items():
        if path.name == "__init__.py":
            assert name in listed, f"{name} is not in pyproject's packages"
