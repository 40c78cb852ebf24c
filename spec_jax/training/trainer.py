"""The training loop shared by every drafter: optax optimizer, jitted step, orbax checkpoints.

A run is a pure function of (initial params, data, TrainConfig): batches are chosen by step number
and random draws are `fold_in(seed, step)`, so a run resumed from a checkpoint reaches exactly the
state an uninterrupted run reaches. Checkpoints are orbax's (written to a temporary directory and
renamed when complete, so an interrupted save never replaces a good one).
"""

from __future__ import annotations

import dataclasses
import json
import os
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
        """Every setting is checked here, before data, features or checkpoints are touched."""
        from spec_jax.decoding.validation import SEED_MAX, check_int, check_real

        for name, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("warmup_steps", 0),
                              ("save_every", 1), ("eval_every", 0), ("log_every", 1)):
            check_int(name, getattr(self, name), minimum=minimum)
        check_int("seed", self.seed, minimum=0, maximum=SEED_MAX)
        for name in ("weight_decay", "clip_norm"):
            check_real(name, getattr(self, name), minimum=0.0)
        if not check_real("learning_rate", self.learning_rate) > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")


class TargetModelLoss:
    """Base of the frozen drafter-loss dataclasses: their `target_model` field may be given as a
    built-in ModelConfig, wrapped here in Decoder (the loss talks to the target interface only)."""

    def __post_init__(self):
        from spec_jax.models.resolve import as_target_model

        object.__setattr__(self, "target_model", as_target_model(self.target_model))


# Settings that change how often a run saves, evaluates and logs, not what it computes: a run
# resumed with other values is the same run.
SCHEDULE_ONLY = ("save_every", "eval_every", "log_every")
# Identity fields that checkpoints written before them lack: such a checkpoint resumes, with a warning.
LATER_IDENTITY_FIELDS = ("target_sha256", "data_sha256")


def run_identity(run_config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the run config as JSON values (tuples become
    lists), without the schedule-only settings."""
    identity = json.loads(json.dumps(run_config))
    if isinstance(identity.get("train"), dict):
        identity["train"] = {k: v for k, v in identity["train"].items() if k not in SCHEDULE_ONLY}
    return identity


def _path_name(path: tuple) -> str:
    """A pytree path as "params/layers/0/wq", the same for a state and orbax's metadata of it
    (which has dicts where the state has dataclass fields and named tuples)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _short(error: BaseException, limit: int = 200) -> str:
    """One line of an exception (orbax and TensorStore errors can run to kilobytes)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: " + (text if len(text) <= limit else text[:limit] + " ...")


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


class CheckpointCorrupt(ValueError):
    """A saved step cannot be read back (damaged files, not another run or shape)."""


class Checkpointer:
    """Orbax checkpoints of a TrainState under `directory/checkpoints`, plus the run's config and
    its log (history and evals so far, so a resumed run's report covers the whole run).

    `restore` checks the saved run config against the current one (`run_identity`) and the saved
    tree against the expected shapes. A step whose files are damaged is moved aside to
    `directory/checkpoints-corrupt/` and the previous step is used, with a warning; another run's
    or another shape's checkpoint is a clear error.
    """

    def __init__(self, directory: str | Path, run_config: dict[str, Any], max_to_keep: int = 2):
        self.directory = Path(directory).absolute() / "checkpoints"
        self.run_config = run_config
        self.max_to_keep = max_to_keep
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "run": ocp.JsonCheckpointHandler(),
                           "log": ocp.JsonCheckpointHandler()},
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, log: dict[str, Any] | None = None) -> None:
        step = int(state.step)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                run=ocp.args.JsonSave(self.run_config),
                log=ocp.args.JsonSave(log or {"history": [], "evals": []}),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        return self.restore_with_log(abstract_state, step)[0]

    def restore_with_log(self, abstract_state: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """(state, log) of `step` (default: the newest readable step, see the class doc)."""
        steps = sorted(self.manager.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise FileNotFoundError(f"No checkpoint under {self.directory}.")
        damaged = []
        for candidate in steps:
            try:
                restored = self._restore_step(abstract_state, candidate)
            except CheckpointCorrupt as e:
                if step is not None:
                    raise
                damaged.append((candidate, e))
                continue
            if damaged:
                self._set_aside(damaged, candidate)
            return restored
        raise CheckpointCorrupt(
            f"Every checkpoint under {self.directory} is damaged (" + "; ".join(str(e) for _, e in damaged)
            + "); delete that directory to start this run over, or use a fresh --out directory."
        )

    def _set_aside(self, damaged: list, resumed: int) -> None:
        """Move damaged steps out of orbax's directory (kept for inspection) and say so."""
        import warnings

        aside = self.directory.parent / "checkpoints-corrupt"
        aside.mkdir(exist_ok=True)
        for bad, error in damaged:
            target = aside / f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.directory / str(bad), target)
            warnings.warn(f"spec_jax: {error} Resuming from step {resumed}; the damaged step was moved to {target}.")
        self.manager.close()
        self.manager = self._manager()

    def _restore_step(self, abstract_state: TrainState, step: int) -> tuple[TrainState, dict]:
        where = f"Checkpoint {self.directory}/{step}"
        try:
            run = self.manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise CheckpointCorrupt(f"{where} is damaged ({_short(e)}).") from e
        saved, now = run_identity(run), run_identity(self.run_config)
        added = [k for k in LATER_IDENTITY_FIELDS if k in now and k not in saved]
        saved.update({k: now[k] for k in added})
        if saved != now:
            diff = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
            raise ValueError(
                f"{where} belongs to a different run (saved vs now: {diff}); use a fresh --out directory "
                "or the same settings to resume."
            )
        if added:
            import warnings

            warnings.warn(f"spec_jax: {where} predates the record of {', '.join(added)}; resuming it on the "
                          "assumption that it was trained on this target and data.")
        self._check_shapes(abstract_state, step, where)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )["state"]
        except Exception as e:
            raise CheckpointCorrupt(f"{where} is damaged ({_short(e)}).") from e
        try:
            log = self.manager.restore(step, args=ocp.args.Composite(log=ocp.args.JsonRestore()))["log"]
        except Exception:  # a checkpoint written before logs were saved with it
            log = {"history": [], "evals": []}
        return restored, log

    def _check_shapes(self, abstract_state: TrainState, step: int, where: str) -> None:
        """A saved tree of other paths or shapes is another drafter shape, not damage."""
        try:
            saved = self.manager.item_metadata(step)["state"]
            saved_shapes = {_path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
        except Exception as e:
            raise CheckpointCorrupt(f"{where} is damaged ({_short(e)}).") from e
        wanted = {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
        differs = sorted(k for k in set(saved_shapes) | set(wanted) if saved_shapes.get(k) != wanted.get(k))
        if differs:
            k = differs[0]
            raise ValueError(
                f"{where} does not match this model: {k} is {saved_shapes.get(k, 'absent')} there, "
                f"{wanted.get(k, 'absent')} here ({len(differs)} weights differ); it was written for another "
                "drafter shape. Use a fresh --out directory, or the settings that made it."
            )

    def close(self) -> None:
        self.manager.close()


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict[str, float]]  # one entry per logged step, from the run's start (resumes included)
    evals: list[dict[str, float]]
    seconds: float  # this process's training time
    start_step: int = 0  # the step this process resumed from (0: a fresh run)

    @property
    def summary(self) -> str:
        """What this process did: "trained 60 steps" or "resumed from step 45, trained 15 steps"."""
        done = int(self.state.step) - self.start_step
        resumed = f"resumed from step {self.start_step}, " if self.start_step else ""
        return f"{resumed}trained {done} steps in {self.seconds:.0f}s"


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
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    if out_dir is not None:
        checkpointer = Checkpointer(out_dir, {**(run_config or {}), "train": dataclasses.asdict(cfg)})
        if checkpointer.latest_step() is not None:
            abstract = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state
            )
            state, log = checkpointer.restore_with_log(abstract)
            history = [h for h in log.get("history", []) if h["step"] <= int(state.step)]
            evals = [e for e in log.get("evals", []) if e["step"] <= int(state.step)]
    step_fn = make_train_step(loss_fn, optimizer, cfg.seed)
    start = int(state.step)
    end = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
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
        if evaluate is not None and cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            evals.append({"step": done, **evaluate(state.params, done)})
            if progress:  # the held-out numbers as they come, not only in the final log
                bar.write(_eval_line(evals[-1]))
        if checkpointer is not None and (done % cfg.save_every == 0 or done == end):
            checkpointer.save(state, {"history": history, "evals": evals})  # this step's eval included
        bar.update(1)
    bar.close()
    if evaluate is not None and end == cfg.steps:
        evals.append({"step": end, **evaluate(state.params, end)})
        if progress:
            print(_eval_line(evals[-1]), file=sys.stderr)
    if checkpointer is not None:
        checkpointer.close()
    return TrainResult(state=state, history=history, evals=evals, seconds=time.perf_counter() - t0,
                       start_step=start)


def _eval_line(row: dict[str, float]) -> str:
    return f"step {row['step']}: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross-entropy (float32) of logits [..., V] against int labels [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def chained_draft_loss(
    logits: jax.Array, tokens: jax.Array, first_label: jax.Array, lengths: jax.Array, picked: jax.Array,
    decay: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of K drafts per picked position against the data's tokens (Medusa heads,
    MTP chains): logits [B, P, K, V]; draft j (0-based) of position i is scored against
    tokens[b, first_label[b, i] + j] (masked past the sequence's length), weighted decay ** j
    (a draft counts only when all before it were accepted). picked [B, P]: positions that count.
    -> (loss, metrics: ce, acc_j and run_j per draft (1-based: its accuracy, and that of it and
    every draft before it), accuracy (the first draft's), accept_run (expected accepted drafts
    per step under greedy verification))."""
    b, t = tokens.shape
    rows = jnp.arange(b)[:, None]
    num_drafts = logits.shape[2]
    total, weight_sum, metrics, leading = 0.0, 0.0, {}, None
    for j in range(num_drafts):
        label_pos = first_label + j
        labels = tokens[rows, jnp.minimum(label_pos, t - 1)]
        valid = picked & (label_pos < lengths[:, None])
        ce = masked_mean(cross_entropy(logits[:, :, j], labels), valid)
        weight = decay**j
        total, weight_sum = total + weight * ce, weight_sum + weight
        correct = (jnp.argmax(logits[:, :, j], -1) == labels) & valid
        metrics[f"acc_{j + 1}"] = masked_mean(correct, valid)
        leading = correct if leading is None else leading & correct
        metrics[f"run_{j + 1}"] = masked_mean(leading, picked)
    loss = total / weight_sum
    metrics["ce"] = loss
    metrics["accuracy"] = metrics["acc_1"]
    metrics["accept_run"] = sum(metrics[f"run_{j}"] for j in range(1, num_drafts + 1))
    return loss, metrics


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
