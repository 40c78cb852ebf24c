"""What the compiled programs contain, checked in the programs themselves (no timing):

- Weights are per-layer arrays, and nothing inside the generate loop's `while` slices, copies or
  transposes a weight (XLA:GPU materialised every slice of a stacked [L, ...] weight as a copy,
  about three times the memory traffic of a decode step). Checked in the optimized HLO for the
  default model's weight shapes (4 of its 30 layers) with the DFlash drafter and with the draft
  model.
- Float32 models compute every dot in float32, on the decode, verify, draft and training paths:
  at HIGHEST precision on GPU/TPU (TF32 or bfloat16 passes otherwise), at DEFAULT on CPU, where
  that is already exact float32 (checked bit for bit) and HIGHEST only picks a slower kernel;
  bfloat16 models keep the default. Checked in the lowered StableHLO.

Weights are abstract (`jax.ShapeDtypeStruct`): the default model's shapes are compiled without
loading it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # hlo_text

import spec_jax
from hlo_text import INSTRUCTION, while_body_computations  # noqa: F401 - test_live_attention imports it here
from spec_jax.decoding.loop import abstract_inputs, generate_jit
from spec_jax.sampling import SamplingParams
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_layers, dflash_weight_specs
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import Decoder
from spec_jax.models.presets import preset_config
from spec_jax.models.weights import abstract_from_specs, is_spec, model_weight_specs
from spec_jax.training.dflash import DFlashLoss
from spec_jax.training.draft_model import DraftModelLoss

ASSETS = Path(spec_jax.__file__).parent / "assets"
DEFAULT_SHAPES = preset_config("smollm2-135m")  # the default model's config, tested equal elsewhere


def shipped_dflash_config(dtype: str = "float32") -> DFlashConfig:
    from spec_jax.checkpoints.dflash import read_dflash_config  # either checkpoint format

    return read_dflash_config(ASSETS / "smollm2_dflash", dtype=dtype)


def shipped_draft_config(dtype: str = "float32") -> ModelConfig:
    hf = json.loads((ASSETS / "smollm2_draft_model" / "config.json").read_text())
    return ModelConfig.from_hf_config(hf, dtype=dtype)


def lower_loop(cfg: ModelConfig, drafter, drafter_specs, *, batch=1, prompt_len=16, capacity=256):
    model = Decoder(cfg)
    inputs = abstract_inputs(
        model, drafter_specs, batch=batch, prompt_len=prompt_len,
        sampling=SamplingParams.create(0.7, 0, 1.0),
    )
    return generate_jit.lower(inputs, model=model, drafter=drafter, capacity=capacity)


# ----------------------------------------------------------------------------- HLO parsing
# benchmarks/hlo_text.py reads the program text: computations, the while bodies and what they call.


def _elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape).group(1)
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def weight_touches(bodies: list[list[str]], weight_shapes: set[str], num_layers: int) -> list[str]:
    """Instructions that copy or transpose an operand shaped like a weight (or like a stack of
    `num_layers` weights), or slice a real part of one: any slice of a stacked weight, or a slice
    of a weight that keeps more than a few rows. An embedding lookup (a gather, or a dynamic-slice
    of one row) moves only what it reads and is not flagged."""
    stacked = {s.replace("[", f"[{num_layers},", 1) for s in weight_shapes}
    watched = weight_shapes | stacked
    bad = []
    for lines in bodies:
        parsed = [m for m in map(INSTRUCTION.match, lines) if m]
        shape_of = {m.group("name"): re.sub(r"\{[^}]*\}", "", m.group("type")) for m in parsed}
        for m in parsed:
            op = m.group("op")
            if op not in {"slice", "dynamic-slice", "copy", "transpose"}:
                continue
            operands = m.group("rest").split(")", 1)[0]
            hit = {shape_of.get(n) for n in re.findall(r"%([\w.\-]+)", operands)} & watched
            if not hit:
                continue
            source = hit.pop()
            if op in ("slice", "dynamic-slice") and source not in stacked:
                if _elements(m.group("type")) * 64 < _elements(source):
                    continue  # a few rows: a lookup, not a copy of the weight
            bad.append(f"{op} of {source}: %{m.group('name')} = {m.group('type')}")
    return bad


def hlo_shapes(specs, dtype: str = "f32", min_elements: int = 4096) -> set[str]:
    """HLO shape strings of the (large) weights in a WeightSpec tree."""
    out = set()
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        n = 1
        for d in spec.shape:
            n *= d
        if n >= min_elements:
            out.add(f"{dtype}[{','.join(map(str, spec.shape))}]")
    return out


# ----------------------------------------------------------------------------- per-layer weights
def test_weights_are_per_layer_arrays():
    specs = model_weight_specs(DEFAULT_SHAPES)
    assert isinstance(specs["layers"], list) and len(specs["layers"]) == 30
    assert specs["layers"][0]["wq"].shape == (576, 9, 64)
    assert all("layers" not in s.axes for s in jax.tree.leaves(specs, is_leaf=is_spec))
    dflash = dflash_weight_specs(shipped_dflash_config())
    assert len(dflash["layers"]) == shipped_dflash_config().num_layers


def test_parser_finds_a_stacked_weight_slice():
    """The checker itself: a scan over stacked weights inside a while loop is flagged."""
    stacked = jax.ShapeDtypeStruct((3, 64, 96), jnp.float32)

    def loop(w, x):
        def body(carry):
            i, x = carry
            x, _ = jax.lax.scan(lambda x, w_l: (jnp.tanh(x @ w_l[:, :64]), None), x, w)
            return i + 1, x

        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1]

    hlo = jax.jit(loop).lower(stacked, jax.ShapeDtypeStruct((1, 64), jnp.float32)).compile().as_text()
    assert weight_touches(while_body_computations(hlo), {"f32[64,96]"}, 3)


# The default model's target with 4 of its 30 layers: every weight keeps its shape (what XLA's
# slices and copies depend on) and each layer's program is the one the 30-layer loop repeats;
# the two cases' CPU time 64 s -> 21 s on this 2-core CPU (issue 39).
LOOP_LAYERS = 4


@pytest.mark.parametrize("drafter_kind", ["dflash", "draft_model"])
def test_no_weight_slice_or_copy_inside_the_loop_default_model_shapes(drafter_kind):
    cfg = DEFAULT_SHAPES.replace(num_layers=LOOP_LAYERS)
    if drafter_kind == "dflash":
        # The shipped drafter's 4 feature layers (1, 10, 18, 27 of 30) are the 4 target layers:
        # the same fc weight [4H, H].
        drafter_cfg = dataclasses.replace(shipped_dflash_config(), target_layer_ids=tuple(range(LOOP_LAYERS)),
                                          num_target_layers=LOOP_LAYERS)
        drafter, drafter_specs = DFlashDrafter(drafter_cfg), dflash_weight_specs(drafter_cfg)
        drafter_layers = drafter_cfg.num_layers
    else:
        drafter_cfg = shipped_draft_config()
        drafter, drafter_specs = DraftModelDrafter(drafter_cfg, k=4), model_weight_specs(drafter_cfg)
        drafter_layers = drafter_cfg.num_layers
    hlo = lower_loop(cfg, drafter, drafter_specs).compile().as_text()
    body = while_body_computations(hlo)
    assert any(" dot(" in line for lines in body for line in lines)  # the step is in there
    bad = weight_touches(body, hlo_shapes(model_weight_specs(cfg)), cfg.num_layers)
    bad += weight_touches(body, hlo_shapes(drafter_specs), drafter_layers)
    assert bad == [], "\n".join(bad)


# ----------------------------------------------------------------------------- precision
_DOT = re.compile(r"stablehlo\.dot_general[^\n]*")


def dot_precisions(stablehlo: str) -> list[tuple[str, str]]:
    """(precision attribute or 'DEFAULT', operand types) of every dot_general."""
    out = []
    for line in _DOT.findall(stablehlo):
        m = re.search(r"precision = \[([A-Z_, ]+)\]", line)
        types = line.rsplit(":", 1)[-1]
        out.append((m.group(1) if m else "DEFAULT", types.strip()))
    return out


TINY = ModelConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, qk_norm=True, eos_token_ids=(1,),
)
TINY_DFLASH = DFlashConfig(
    layer=dflash_layers(2, 32, 4, 2, 8, 64, vocab_size=128),
    block_size=4, target_layer_ids=(0, 1), mask_token_id=127,
)
TINY_DRAFT = TINY.replace(num_layers=1)


def lowered_texts(dtype: str) -> dict[str, str]:
    cfg = TINY.replace(dtype=dtype)
    dflash_cfg = dataclasses.replace(TINY_DFLASH, layer=TINY_DFLASH.layer.replace(dtype=dtype))
    draft_cfg = TINY_DRAFT.replace(dtype=dtype)
    out = {
        "ar": lower_loop(cfg, None, None).as_text(),
        "dflash": lower_loop(cfg, DFlashDrafter(dflash_cfg), dflash_weight_specs(dflash_cfg)).as_text(),
        "draft_model": lower_loop(
            cfg, DraftModelDrafter(draft_cfg, k=3), model_weight_specs(draft_cfg)
        ).as_text(),
    }
    # Training: value and gradient of both drafter losses (the backward dots too).
    b, t = 2, 24
    batch = {
        "tokens": jax.ShapeDtypeStruct((b, t), jnp.int32),
        "lengths": jax.ShapeDtypeStruct((b,), jnp.int32),
        "prompt_lengths": jax.ShapeDtypeStruct((b,), jnp.int32),
        "captured": jax.ShapeDtypeStruct((b, t, 2 * cfg.hidden_size), jnp.dtype(dtype)),
        "final": jax.ShapeDtypeStruct((b, t, cfg.hidden_size), jnp.dtype(dtype)),
    }
    target_params = abstract_from_specs(model_weight_specs(cfg), jnp.dtype(dtype))
    losses = {
        "train_dflash": (DFlashLoss(dflash_cfg, cfg, num_anchors=2, kl_weight=0.5), dflash_weight_specs(dflash_cfg)),
        "train_draft_model": (DraftModelLoss(draft_cfg, cfg, positions=4), model_weight_specs(draft_cfg)),
    }
    for name, (loss, specs) in losses.items():
        grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
        params = abstract_from_specs(specs, jnp.dtype(dtype))
        out[name] = grad.lower(params, target_params, batch, jax.random.key(0)).as_text()
    return out


def test_float32_dots_are_full_precision_and_bfloat16_dots_are_not(monkeypatch):
    # Lowered as for an accelerator (lowering compiles nothing, so this runs on any host).
    # Traces are cached: clear them so neither policy's programs are reused under the other.
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    try:
        _check_float32_highest_bfloat16_default()
    finally:
        jax.clear_caches()


def _check_float32_highest_bfloat16_default():
    for name, text in lowered_texts("float32").items():
        dots = dot_precisions(text)
        assert dots, name
        weak = [d for d in dots if d[0] != "HIGHEST, HIGHEST"]
        assert weak == [], (name, weak[:3])
    for name, text in lowered_texts("bfloat16").items():
        dots = dot_precisions(text)
        assert dots, name
        fast = {"DEFAULT", "DEFAULT, DEFAULT"}
        assert all(d[0] in fast for d in dots), (name, [d for d in dots if d[0] not in fast][:3])
        if not name.startswith("train"):  # backward dots mix in float32 cotangents
            assert all("bf16" in d[1] for d in dots), name


def test_cpu_float32_dots_use_the_exact_default_kernel():
    """On CPU the float32 programs ask for DEFAULT precision, and that dot is bit-identical to
    HIGHEST (both exact float32), on the shapes of a batched decode step."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU precision policy")
    jax.clear_caches()
    for name, text in lowered_texts("float32").items():
        assert all(d[0] in {"DEFAULT", "DEFAULT, DEFAULT"} for d in dot_precisions(text)), name
    rng = np.random.RandomState(0)
    x, w = rng.randn(32, 576).astype(np.float32), rng.randn(576, 1536).astype(np.float32)
    default = jax.jit(lambda x, w: jnp.einsum("mh,hf->mf", x, w))(x, w)
    highest = jax.jit(lambda x, w: jnp.einsum("mh,hf->mf", x, w, precision="highest"))(x, w)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(highest))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(np.asarray(default) - exact).max() < 1e-6 * np.abs(exact).max() * 576
