"""The layering the package promises, read from the source (imports inside functions count too):

- drafters never import the decoding loop (they share only `spec_jax.sampling` with it);
- sharding never imports the loop (the loop's placement lives in `spec_jax.decoding.placement`,
  built on sharding's rules), and models import nothing above them;
- training never imports the command-line layer, and no library package imports `spec_jax.app`;
- no import circle among spec_jax's modules, and the target contract (`models/interface.py`)
  imports neither the built-in decoder nor its config;
- `spec_jax` exports its public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spec_jax

PACKAGE = Path(spec_jax.__file__).parent


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Absolute module names a file imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the file's package
                base = path.relative_to(package.parent).with_suffix("").parts[: -node.level]
                out.add(".".join(base + (node.module,)))
            else:
                out.add(node.module)
                # `from spec_jax import launch` imports the submodule spec_jax.launch
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level or inside functions).
    `import pkg` / `from pkg import attribute` mean pkg's `__init__`; `from pkg import module`
    means that module (the parent packages Python also runs on the way are not edges)."""
    modules = {module_name(path, package): path for path in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the file's package
                    parts = path.relative_to(package.parent).with_suffix("").parts[: -node.level]
                    base = ".".join(parts + ((node.module,) if node.module else ()))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    imported.add(submodule if submodule in modules else base)
        graph[name] = (imported & set(modules)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def imports_of(subpackage: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(PACKAGE.parent)): imported_modules(path)
        for path in sorted((PACKAGE / subpackage).rglob("*.py"))
    }


def offending(subpackage: str, forbidden: str) -> list[str]:
    return [
        f"{file} imports {name}"
        for file, names in imports_of(subpackage).items()
        for name in sorted(names)
        if name == forbidden or name.startswith(forbidden + ".")
    ]


def test_drafters_do_not_import_the_decoding_loop():
    assert offending("drafters", "spec_jax.decoding") == []


def test_sharding_does_not_import_the_decoding_loop():
    assert offending("sharding", "spec_jax.decoding") == []


def test_models_import_nothing_above_them():
    for upper in ("spec_jax.decoding", "spec_jax.drafters", "spec_jax.sharding", "spec_jax.training",
                  "spec_jax.checkpoints", "spec_jax.app"):
        assert offending("models", upper) == [], upper


def test_training_does_not_import_the_command_line_layer():
    assert offending("training", "spec_jax.app") == []


def test_no_library_package_imports_the_application_layer():
    for subpackage in ("models", "drafters", "decoding", "sharding", "checkpoints", "training"):
        assert offending(subpackage, "spec_jax.app") == [], subpackage


def test_the_walker_sees_lazy_imports(tmp_path):
    assert "spec_jax.sampling" in imported_modules(PACKAGE / "drafters" / "base.py")
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from spec_jax import decoding\n    import spec_jax.app.main\n")
    assert {"spec_jax.decoding", "spec_jax.app.main"} <= imported_modules(source)


def test_no_import_circle():
    assert find_cycle(module_graph()) is None, " -> ".join(find_cycle(module_graph()))


def test_the_target_contract_imports_no_implementation():
    imported = imported_modules(PACKAGE / "models" / "interface.py")
    assert not {m for m in imported if m.startswith("spec_jax")}, imported


def test_the_circle_check_fails_on_a_circle(tmp_path):
    package = tmp_path / "toy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from toy.sub.b import g\n")
    (package / "a.py").write_text("import json\n\ndef f():\n    from toy.sub import b\n")
    (package / "sub" / "b.py").write_text("def g():\n    pass\n")
    graph = module_graph(package)
    assert graph["toy.a"] == {"toy.sub.b"} and graph["toy.sub"] == {"toy.sub.b"}
    assert find_cycle(graph) is None
    # b now imports a back, lazily and relatively: a circle through a function-level import.
    (package / "sub" / "b.py").write_text("def g():\n    from .. import a\n")
    assert find_cycle(module_graph(package)) == ["toy.a", "toy.sub.b", "toy.a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": set()}) == ["x", "y", "z", "x"]


def test_public_api():
    for name in ("generate", "load_target", "NGramDrafter", "DraftModelDrafter", "DFlashDrafter",
                 "load_dflash", "apply_chat_template", "Drafter", "default_drafter", "load_drafter",
                 "TargetModel", "Target", "make_generate_fn"):
        assert name in spec_jax.__all__ and hasattr(spec_jax, name), name


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_the_house_limit():
    """Long functions are where the package grew sideways before; split one that passes the limit."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], "\n".join(long)
