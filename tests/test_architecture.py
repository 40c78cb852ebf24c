"""The layering the package promises, read from the source (imports inside functions count too):

- drafters never import the decoding loop (they share only `spec_jax.sampling` with it);
- sharding never imports the loop (the loop's placement lives in `spec_jax.decoding.placement`,
  built on sharding's rules), and models import nothing above them;
- training never imports the command-line layer, and no library package imports `spec_jax.app`;
- `spec_jax` exports its public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spec_jax

PACKAGE = Path(spec_jax.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the file's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                out.add(".".join(base + (node.module,)))
            else:
                out.add(node.module)
                # `from spec_jax import launch` imports the submodule spec_jax.launch
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


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


def test_public_api():
    for name in ("generate", "load_target", "NGramDrafter", "DraftModelDrafter", "DFlashDrafter",
                 "load_dflash", "apply_chat_template", "Drafter", "default_drafter", "load_drafter",
                 "TargetModel", "Target", "make_generate_fn"):
        assert name in spec_jax.__all__ and hasattr(spec_jax, name), name
