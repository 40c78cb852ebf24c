"""The training loop shared by every drafter: optax optimizer, jitted step, orbax checkpoints.

A run is a pure function of (initial params, data, TrainConfig): batches are chosen by step number
and random draws are `fold_in(seed, step)`, so a run resumed from a checkpoint reaches exactly the
state an uninterrupted run reaches. Checkpoints are orbax's (written to a temporary directory and
renamed when complete, so an interrupted save never replaces a good one).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 320
    learning_rate: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0
    save_every: int = 200
    eval_every: int = 0  # 0 = only at the end
    log_every: int = 10

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps, batch_size must be >= 1 and seq_len >= 2.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay to 10%, and global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 1)),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay),
    )


@struct.dataclass
class TrainState:
    step: jax.Array  # [] int32
    params: Any
    opt_state: Any


# loss_fn(params, frozen, batch, key) -> (loss, metrics dict of scalars)
LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, seed: int):
    """A jitted step; the frozen weights (the target) are an argument, the state is donated."""

    def step(state: TrainState, frozen: Any, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        key = jax.random.fold_in(jax.random.key(seed), state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, frozen, batch, key
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(step, donate_argnums=(0,))


class Checkpointer:
    """Orbax checkpoints of a TrainState under `directory/checkpoints`, plus the run's config.

    `restore` checks the saved run config against the current one and the saved tree against the
    expected shapes, and raises a clear error on a corrupt or mismatched checkpoint.
    """

    def __init__(self, directory: str | Path, run_config: dict[str, Any], max_to_keep: int = 2):
        self.directory = Path(directory).absolute() / "checkpoints"
        self.run_config = run_config
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState) -> None:
        step = int(state.step)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                run=ocp.args.JsonSave(self.run_config),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint under {self.directory}.")
        try:
            run = self.manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise ValueError(
                f"Checkpoint {self.directory}/{step} is corrupt or unreadable ({type(e).__name__}: "
                f"{e}); delete it or start a fresh --out directory."
            ) from e
        if run != json.loads(json.dumps(self.run_config)):
            diff = {
                k: (run.get(k), self.run_config.get(k))
                for k in set(run) | set(self.run_config)
                if run.get(k) != self.run_config.get(k)
            }
            raise ValueError(
                f"Checkpoint {self.directory}/{step} belongs to a different run (saved vs now: "
                f"{diff}); use a fresh --out directory or the same settings to resume."
            )
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )["state"]
        except Exception as e:
            raise ValueError(
                f"Checkpoint {self.directory}/{step} does not match this model ({type(e).__name__}: "
                f"{e}); it was written for another drafter shape. Use a fresh --out directory."
            ) from e
        return restored

    def close(self) -> None:
        self.manager.close()


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict[str, float]]  # one entry per logged step
    evals: list[dict[str, float]]
    seconds: float


def train(
    loss_fn: LossFn,
    init_params: Any,
    frozen: Any,
    batches: Callable[[int], Iterator[Any]],
    cfg: TrainConfig,
    out_dir: str | Path | None,
    run_config: dict[str, Any] | None = None,
    evaluate: Callable[[Any, int], dict[str, float]] | None = None,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train from scratch or resume from the latest checkpoint in `out_dir`.

    batches(start_step) yields the batches for steps start_step, start_step + 1, ...
    stop_after: end (after saving) at this step, as if interrupted (used by the resume test).
    """
    from tqdm.auto import tqdm

    optimizer = make_optimizer(cfg)
    init_params = jax.tree_util.tree_map(jnp.array, init_params)  # the step donates its state
    state = TrainState(
        step=jnp.zeros((), jnp.int32), params=init_params, opt_state=optimizer.init(init_params)
    )
    checkpointer = None
    if out_dir is not None:
        checkpointer = Checkpointer(out_dir, {**(run_config or {}), "train": dataclasses.asdict(cfg)})
        if checkpointer.latest_step() is not None:
            abstract = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state
            )
            state = checkpointer.restore(abstract)
    step_fn = make_train_step(loss_fn, optimizer, cfg.seed)
    start = int(state.step)
    end = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    t0 = time.perf_counter()
    bar = tqdm(total=end, initial=start, desc="train", unit="step", disable=not progress)
    batch_iter = batches(start)
    for step in range(start, end):
        state, metrics = step_fn(state, frozen, next(batch_iter))
        done = step + 1
        if done % cfg.log_every == 0 or done == end:
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            row["step"] = done
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row.get('accuracy', 0.0):.3f}")
        if checkpointer is not None and (done % cfg.save_every == 0 or done == end):
            checkpointer.save(state)
        if evaluate is not None and cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            evals.append({"step": done, **evaluate(state.params, done)})
            if progress:  # the held-out numbers as they come, not only in the final log
                bar.write(_eval_line(evals[-1]))
        bar.update(1)
    bar.close()
    if evaluate is not None and end == cfg.steps:
        evals.append({"step": end, **evaluate(state.params, end)})
        if progress:
            print(_eval_line(evals[-1]), file=sys.stderr)
    if checkpointer is not None:
        checkpointer.close()
    return TrainResult(state=state, history=history, evals=evals, seconds=time.perf_counter() - t0)


def _eval_line(row: dict[str, float]) -> str:
    return f"step {row['step']}: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross-entropy (float32) of logits [..., V] against int labels [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def kl_to_teacher(student_logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """Per-position KL(teacher || student), both [..., V]."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1)


def history_summary(history: list[dict[str, float]]) -> dict[str, float]:
    if not history:
        return {}
    last = history[-1]
    return {"final_loss": last["loss"], "final_accuracy": last.get("accuracy", float("nan"))}


def numpy_batch(batch: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, batch)
