"""Device meshes named by their axes: `make_mesh("data=2,model=4")`.

A spec_jax mesh always has the two axes `data` (batch rows) and `model` (heads, MLP width,
vocabulary), in that order, so one set of `ShardingRules` fits every mesh. A spec may name one
axis only ("model=8"); the other gets size 1.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from spec_jax.models.config import ModelConfig

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"data=2,model=4" (or {"data": 2, "model": 4}) -> {"data": 2, "model": 4}.

    Unknown axis names, repeated axes and sizes that are not positive integers raise ValueError.
    """
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, size = part.partition("=")
            if not sep:
                raise ValueError(
                    f"Bad mesh spec {spec!r}: write axis=size pairs such as 'data=2,model=4'."
                )
            items.append((name.strip(), size.strip()))
    if not items:
        raise ValueError(f"Empty mesh spec {spec!r}: write e.g. 'data=2,model=4'.")
    shape: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(
                f"Unknown mesh axis {name!r} in {spec!r}: spec_jax meshes have the axes "
                f"{list(MESH_AXES)} (e.g. 'data=2,model=4')."
            )
        if name in shape:
            raise ValueError(f"Mesh axis {name!r} given twice in {spec!r}.")
        try:
            value = int(size)
        except (TypeError, ValueError):
            raise ValueError(f"Mesh axis {name}={size!r} in {spec!r} is not an integer.") from None
        if value < 1 or value != float(size):
            raise ValueError(f"Mesh axis {name}={size!r} in {spec!r} must be a positive integer.")
        shape[name] = value
    return {axis: shape.get(axis, 1) for axis in MESH_AXES}


def default_mesh_shape(num_devices: int, cfg: ModelConfig | None = None) -> dict[str, int]:
    """All devices on `model` when that fits the model, else all on `data`.

    "Fits" means every device gets whole attention heads: `num_heads` and `num_kv_heads` are both
    multiples of the device count (vocabulary and MLP width are then almost always fine too). A
    model whose heads do not split (SmolLM2: 9 heads, 3 KV heads) runs data-parallel by default;
    ask for `model=M` explicitly to shard its vocabulary and MLP anyway (heads stay replicated).
    Without a config every device goes on `model`.
    """
    fits = cfg is None or (cfg.num_heads % num_devices == 0 and cfg.num_kv_heads % num_devices == 0)
    return {DATA: 1, MODEL: num_devices} if fits else {DATA: num_devices, MODEL: 1}


def make_mesh(
    spec: str | Mapping[str, int] | None = None,
    *,
    cfg: ModelConfig | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, model) mesh over `devices` (default: `jax.devices()`, all processes).

    spec: "data=D,model=M" (a dict works too); the product must equal the device count.
    None picks `default_mesh_shape(len(devices), cfg)`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = default_mesh_shape(len(devices), cfg) if spec is None else parse_mesh_spec(spec)
    product = shape[DATA] * shape[MODEL]
    if product != len(devices):
        raise ValueError(
            f"Mesh data={shape[DATA]},model={shape[MODEL]} needs {product} devices but "
            f"{len(devices)} are available; pick sizes whose product is {len(devices)}."
        )
    # jax.make_mesh orders devices along the physical topology (TPU rings/tori). Auto axes let
    # XLA propagate shardings through the loop from the parameter and input shardings.
    return jax.make_mesh(
        (shape[DATA], shape[MODEL]),
        MESH_AXES,
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices,
    )


def mesh_spec_string(mesh: Mesh) -> str:
    """The inverse of `parse_mesh_spec` for a spec_jax mesh: "data=2,model=4"."""
    return ",".join(f"{axis}={mesh.shape[axis]}" for axis in MESH_AXES)
