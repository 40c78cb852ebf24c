"""Do the existing families still compile to the same program? Lowers the decoder's passes for tiny
Llama, Qwen3, Qwen2, Mistral and Gemma 3 configs at a base commit and in the working tree, and
compares the StableHLO text (no location metadata).

Every family difference is a static `ModelConfig` switch that defaults off; this is the check that
a new switch really is off for the families that predate it. Lowering only (no XLA compile), so
it takes seconds.

    python benchmarks/stablehlo_unchanged.py --base 7384947      # exit 1 if any program differs

What is lowered per family: a one-token step, an 8-token pass under a tree mask with captured
layers (the verify pass of DFlash/EAGLE-3), the LM head, and a tree commit.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen3", "qwen2", "mistral", "gemma3")


def family_configs():
    """Tiny configs with each family's switches on (fields that exist since the family work)."""
    from spec_jax.models import ModelConfig
    from spec_jax.models.config import LinearRopeScaling

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16)
    sliding_full = ("sliding_attention", "full_attention")
    return {
        "llama": ModelConfig(**base, tie_embeddings=True),
        "qwen3": ModelConfig(**base, qk_norm=True, architecture="qwen3"),
        "qwen2": ModelConfig(**base, qkv_bias=True, layer_types=sliding_full, sliding_window=5,
                             architecture="qwen2"),
        "mistral": ModelConfig(**base, layer_types=("sliding_attention",) * 2, sliding_window=5,
                               architecture="mistral"),
        "gemma3": ModelConfig(
            **base, qk_norm=True, norm_offset=1.0, sandwich_norms=True, mlp_activation="gelu_tanh",
            scale_embeddings=True, query_pre_attn_scalar=24, tie_embeddings=True,
            layer_types=sliding_full, sliding_window=5, rope_theta=100_000.0,
            rope_scaling=LinearRopeScaling(4.0), sliding_rope_theta=1_000.0, architecture="gemma3"),
    }


def lowered_programs(cfg) -> dict[str, str]:
    import jax
    import jax.numpy as jnp

    from spec_jax.models.decoder import Decoder, init_params

    model = Decoder(cfg)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    cache = jax.eval_shape(lambda: model.init_cache(2, 256))
    i32 = jnp.int32

    def spec(shape, dtype=i32):
        return jax.ShapeDtypeStruct(shape, dtype)

    step = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c))
    tree_pass = jax.jit(lambda p, t, pos, c, m: model.forward(p, t, pos, c, mask=m, capture=(0, 1)))
    head = jax.jit(model.logits)
    tree_commit = jax.jit(model.commit)
    programs = {
        "step": step.lower(params, spec((2, 1)), spec((2, 1)), cache),
        "tree_pass": tree_pass.lower(params, spec((2, 8)), spec((2, 8)), cache, spec((2, 8, 8), bool)),
        "lm_head": head.lower(params, spec((2, 8, cfg.hidden_size), jnp.dtype(cfg.dtype))),
        "tree_commit": tree_commit.lower(cache, spec((2,)), spec((2, 4))),
    }
    return {name: strip_locations(low.as_text()) for name, low in programs.items()}


def strip_locations(text: str) -> str:
    text = re.sub(r"\s*loc\([^\n]*?\)(?=\s*$)", "", text, flags=re.M)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def dump(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for family, cfg in family_configs().items():
        for name, text in lowered_programs(cfg).items():
            Path(out_dir, f"{family}.{name}.mlir").write_text(text)


def dump_tree(source_root: Path, out_dir: Path) -> None:
    """Run this script's --dump with `source_root`'s spec_jax first on the path."""
    env = dict(os.environ, PYTHONPATH=str(source_root), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, __file__, "--dump", str(out_dir)], check=True, env=env,
                   cwd=source_root)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the commit to compare the working tree against")
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        dump(args.dump)
        return 0
    if not args.base:
        parser.error("give --base COMMIT")
    with tempfile.TemporaryDirectory() as tmp:
        base_src, base_out, head_out = Path(tmp, "src"), Path(tmp, "base"), Path(tmp, "head")
        base_src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base, "spec_jax"],
                                 check=True, capture_output=True).stdout
        archive_path = Path(tmp, "base.tar")
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(base_src, filter="data")
        dump_tree(base_src, base_out)
        dump_tree(REPO, head_out)
        changed = []
        for path in sorted(base_out.iterdir()):
            before, after = path.read_text(), (head_out / path.name).read_text()
            same = before == after
            print(f"{path.stem:28s} {'identical' if same else 'DIFFERS'}")
            if not same:
                changed.append(path.stem)
                diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=1)
                print("\n".join(list(diff)[:30]))
        print(f"{len(changed)} of {len(list(base_out.iterdir()))} programs differ from {args.base}")
        return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
