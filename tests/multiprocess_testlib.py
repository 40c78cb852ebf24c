"""The checks test_multiprocess.py runs twice: on the data=2,model=4 mesh that two processes share
(tests/multiprocess_worker.py), and unsharded in the pytest process; the two must agree.

`run_checks(mesh)`: greedy `generate` with the n-gram drafter and with a tiny DFlash drafter, and
one optax step of the DFlash loss with the target's features computed inside the step (what
`spec-jax train --features per-step` runs). Models, prompts and the training batch come from fixed
seeds, so every process builds the same ones.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_jax.decoding import generate
from spec_jax.drafters.dflash import DFlashDrafter, dflash_weight_specs
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models.weights import is_spec, model_weight_specs
from spec_jax.sharding import DEFAULT_RULES, batch_sharding, gather_to_host, shard_params
from spec_jax.sharding.rules import place
from spec_jax.training.dflash import DFlashLoss
from spec_jax.training.features import WithTargetFeatures
from spec_jax.training.trainer import TrainConfig, TrainState, make_optimizer, make_train_step

from tiny_configs import TINY_DFLASH, TINY_TARGET, VOCAB

MESH = "data=2,model=4"  # `data` spans the two processes (4 devices each), `model` stays in one
MAX_NEW = 10
CAPACITY = 64  # within one 128-slot block: attention reads the cache densely, a smaller program
# 4 rows, 2 per process. Repeats, so the n-gram drafter has matches to propose.
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3],
    [7, 8, 9, 7, 8, 9, 7],
    [10, 20, 30, 40, 10, 20],
    [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5],
]
# No warm-up, so the one step moves the weights.
TRAIN = TrainConfig(steps=10, batch_size=4, seq_len=24, learning_rate=1e-3, warmup_steps=0)


def host_params(specs: Any, seed: int, scale: float = 3.0) -> Any:
    """Random weights for a WeightSpec tree drawn by numpy: normal(0, scale / sqrt(fan-in)), norms
    at one, like `init_params`, without the dozens of small device programs its draws compile in
    each of the three processes."""
    rng = np.random.RandomState(seed)

    def one(spec):
        if spec.init != "normal":
            return np.full(spec.shape, float(spec.init == "ones"), np.float32)
        fan_in = np.prod(spec.shape[:-1]) if spec.axes[-1] == "embed" else spec.shape[0]  # wo: N*D
        return (rng.standard_normal(spec.shape) * scale / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map(one, specs, is_leaf=is_spec)


def train_batch() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(0)
    shape = (TRAIN.batch_size, TRAIN.seq_len)
    return dict(
        tokens=rng.randint(0, VOCAB - 1, shape).astype(np.int32),
        lengths=np.full(shape[:1], TRAIN.seq_len, np.int32),
        prompt_lengths=np.full(shape[:1], 6, np.int32),
    )


def _flat(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def train_step(target_params: Any, drafter_params: Any, mesh: Any) -> dict[str, Any]:
    """One step -> loss, grad norm, and (numpy, by weight path) the updated drafter params and
    Adam's first moment, which after one step is 0.1 x the clipped gradient."""
    loss = WithTargetFeatures(DFlashLoss(TINY_DFLASH, TINY_TARGET, num_anchors=2), TINY_TARGET,
                              TINY_DFLASH.target_layer_ids)
    optimizer = make_optimizer(TRAIN)
    batch = train_batch()
    if mesh is not None:  # weights as their specs say, batch rows over `data`
        drafter_params = shard_params(drafter_params, DFlashDrafter(TINY_DFLASH).weight_specs(), mesh)
        target_params = shard_params(target_params, model_weight_specs(TINY_TARGET), mesh)
        batch = {k: place(v, batch_sharding(mesh, DEFAULT_RULES, v.shape)) for k, v in batch.items()}
    state = TrainState(step=jnp.zeros((), jnp.int32), params=drafter_params,
                       opt_state=optimizer.init(drafter_params))
    state, metrics = make_train_step(loss, optimizer, TRAIN.seed)(state, target_params, batch)
    params, moment, metrics = gather_to_host(
        (state.params, optax.tree_utils.tree_get(state.opt_state, "mu"), metrics)
    )
    return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "params": _flat(params), "moment": _flat(moment)}


def run_checks(mesh: Any) -> dict[str, Any]:
    """Greedy n-gram and DFlash generation and one training step, on `mesh` (None: unsharded)."""
    target_params = host_params(model_weight_specs(TINY_TARGET), seed=0)
    dflash_params = host_params(dflash_weight_specs(TINY_DFLASH), seed=3)
    target, common = (TINY_TARGET, target_params), dict(
        max_new_tokens=MAX_NEW, ignore_eos=True, capacity=CAPACITY, mesh=mesh
    )
    ngram = generate(target, PROMPTS, NGramDrafter(k=3), **common)
    dflash = generate(target, PROMPTS, DFlashDrafter(TINY_DFLASH), dflash_params, **common)
    return {
        "ngram": ngram.generated_ids,
        "ngram_stats": ngram.stats.to_dict(),
        "dflash": dflash.generated_ids,
        "dflash_stats": dflash.stats.to_dict(),
        "train": train_step(target_params, dflash_params, mesh),
    }
