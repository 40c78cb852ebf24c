"""Sharded generation checks on 8 fake CPU devices, run in a fresh process by test_sharding.py.

JAX fixes its device count when the backend starts, and the pytest process has already started it
with one CPU device, so these checks run here: XLA_FLAGS is set before jax is imported. Prints one
JSON object (the last stdout line) that the test asserts on.

usage: python tests/sharding_worker.py MODEL CASE[,CASE...]     CASE = DRAFTER@MESH
  MODEL: divisible (8 heads, 4 KV heads) | nondivisible (9 heads, 3 KV heads, like SmolLM2)
         | moe (divisible with a mixture-of-experts layer)
         | default (the real SmolLM2-135M-Instruct)
  DRAFTER: ar | ngram | draft_model | dflash | dflash_vocab | eagle3 | table (a test-only drafter)
           | gemma4_mtp (a Gemma 4 assistant on the tiny Gemma 4 target, whatever MODEL is: the
             case's own target and unsharded baseline) | qwen_mtp (an MTP head on a recurrent,
             Qwen3.5-style target, likewise); DRAFTER+adaptive: that drafter with the adaptive
             depth (K = 0 or 3 per step, `SWITCHING`);  MESH: DxM (data x model), e.g. 2x4
"""

from __future__ import annotations

import fake_devices  # noqa: F401  (first: 8 fake CPU devices, cheap codegen; tests/ is sys.path[0])

import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import importlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from spec_jax.decoding.depth import AdaptiveDepth  # noqa: E402
from spec_jax.decoding.generate import generate  # noqa: E402
from spec_jax.decoding.loop import MAX_STOP_IDS, LoopInputs, prefill  # noqa: E402
from spec_jax.decoding.placement import place_generate_inputs  # noqa: E402
from spec_jax.sampling import SamplingParams# noqa: E402
from spec_jax.models import Decoder, Target  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.models.config import ModelConfig, MoeConfig  # noqa: E402
from spec_jax.models.decoder import init_params  # noqa: E402
from spec_jax.models.weights import model_weight_specs  # noqa: E402
from table_drafter import TableDrafter, table_params  # noqa: E402  (tests/ is sys.path[0])
from tiny_configs import TINY_GEMMA4  # noqa: E402
from spec_jax.sharding import (  # noqa: E402
    bytes_per_device,
    kv_cache_shardings,
    make_mesh,
    shard_params,
    state_shardings,
)

# `spec_jax.decoding.generate` the module (the package re-exports the function under that name).
generate_module = importlib.import_module("spec_jax.decoding.generate")

MODELS = {
    "divisible": dict(num_heads=8, num_kv_heads=4, hidden_size=64),
    "nondivisible": dict(num_heads=9, num_kv_heads=3, hidden_size=72),
    # "divisible" with experts on layer 1 (8 of width 32, top 2): experts split over `model`.
    "moe": dict(num_heads=8, num_kv_heads=4, hidden_size=64,
                moe=MoeConfig(8, 2, 32, normalize_top_k=True, dense_layers=(0,))),
}
CAPACITY = 64
MAX_NEW = 12
K = 3
# The adaptive cases' policy: an optimistic prior drafts K first; drafts that miss bring K = 0
# steps, with a probe at K after 4 x 1.3 of them (test_adaptive_depth's SWITCHING at this K).
SWITCHING = AdaptiveDepth(depths=(0, K), costs=(1.0, 1.3), prior=0.9, probe_every=4)
# Repetitive prompts so the n-gram drafter finds matches; 4 rows split over data=2 and data=4.
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3],
    [7, 8, 9, 7, 8, 9, 7],
    [10, 20, 30, 40, 10, 20],
    [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5],
]
# Host callbacks, infeed/outfeed and send/recv would each be a host round trip in the loop.
HOST_OPS = re.compile(
    r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(|callback", re.IGNORECASE
)


def model_cfg(kind: str, layers: int = 2) -> ModelConfig:
    m = MODELS[kind]
    return ModelConfig(
        vocab_size=128, intermediate_size=128, num_layers=layers, head_dim=8,
        rope_theta=10000.0, **m,
    )


# A Qwen3.5-style recurrent target: a Gated DeltaNet layer (its state per row, no keys/values),
# then a gated attention layer with q/k norms and partial RoPE; (1 + w) norms.
RECURRENT = model_cfg("divisible").replace(
    architecture="qwen3_5", layer_types=("linear_attention", "full_attention"), linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, attn_output_gate=True,
    qk_norm=True, norm_offset=1.0, partial_rotary_factor=0.5,
)
# Drafters that come with a target of their own (a case of any MODEL's process: one more
# compile there, not one more process): the tiny Gemma 4 (KV sharing, per-layer embeddings,
# k_eq_v full layers with their own head size and KV heads) for its assistant; the recurrent
# target for its MTP head (issue 44).
OWN_TARGETS = {"gemma4_mtp": TINY_GEMMA4, "qwen_mtp": RECURRENT}


def make_drafter(name: str, cfg: ModelConfig, baseline=None):
    """-> (drafter, drafter params)."""
    if name == "ar":
        return None, None
    if name == "gemma4_mtp":  # a random assistant shaped for the target (reads its cache)
        from spec_jax.drafters import gemma4_assistant as g4

        assistant = g4.assistant_config_for_target(cfg, hidden_size=32, num_layers=2, k=K)
        return g4.Gemma4AssistantDrafter(assistant), g4.init_assistant_params(assistant, jax.random.key(7))
    if name == "qwen_mtp":  # a random MTP head of the recurrent target (a pair cache of its own)
        from spec_jax.drafters import qwen_mtp

        head = qwen_mtp.QwenMtpConfig.from_target(cfg)
        return qwen_mtp.QwenMtpDrafter(head, k=K), qwen_mtp.init_mtp_params(head, jax.random.key(7))
    if name == "ngram":
        return NGramDrafter(k=K), None
    if name == "table":
        sequences = [p + b for p, b in zip(PROMPTS, baseline)]
        return TableDrafter(vocab=cfg.vocab_size, k=K), table_params(cfg.vocab_size, sequences)
    if name == "draft_model":
        draft_cfg = cfg.replace(num_layers=1)
        return DraftModelDrafter(draft_cfg, k=K), init_params(draft_cfg, jax.random.key(7))
    if name in ("dflash", "dflash_vocab"):
        from spec_jax.drafters import dflash  # only asked for when the DFlash drafter exists

        reduced = name == "dflash_vocab"  # its own head over the last V - 28 target tokens
        dflash_cfg = dflash.DFlashConfig(
            layer=dflash.dflash_layers(1, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       128, vocab_size=cfg.vocab_size),
            block_size=K + 1, target_layer_ids=(0, 1), mask_token_id=cfg.vocab_size - 1,
            num_target_layers=cfg.num_layers,
            draft_vocab_size=cfg.vocab_size - 28 if reduced else None,
        )
        params = dflash.init_dflash_params(dflash_cfg, jax.random.key(7))
        if reduced:
            params["d2t"] = params["d2t"] + 28
        return dflash.DFlashDrafter(cfg=dflash_cfg, k=K), params
    if name == "eagle3":
        from spec_jax.drafters import eagle3

        eagle_cfg = eagle3.Eagle3Config(
            layer=cfg.replace(num_layers=1), draft_vocab_size=cfg.vocab_size - 28,
            aux_layer_ids=(1, 2),
        )
        return eagle3.Eagle3Drafter(cfg=eagle_cfg, k=K), eagle3.init_eagle3_params(eagle_cfg, jax.random.key(7))
    raise ValueError(name)


def loop_inputs(params, drafter_params) -> LoopInputs:
    """generate_loop's traced inputs, as `generate` builds them (prompt bucket 16)."""
    tokens = np.zeros((len(PROMPTS), 16), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = p
    return LoopInputs(
        target_params=params, drafter_params=drafter_params, prompt_tokens=tokens,
        prompt_lengths=np.array([len(p) for p in PROMPTS], np.int32), key=jax.random.key(0),
        sampling=SamplingParams.create(0.0, 0, 1.0), max_new_tokens=np.int32(MAX_NEW),
        stop_ids=np.full((MAX_STOP_IDS,), -1, np.int32),
    )


def shard_report(cfg: ModelConfig, params, mesh) -> dict:
    sharded = shard_params(params, model_weight_specs(cfg), mesh)
    per_device = bytes_per_device(sharded)
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    wq = sharded["layers"][0]["wq"]
    state = jax.eval_shape(
        lambda p, t, n, k, s, m, st: prefill(
            Target(p, Decoder(cfg)), None, None, t, n, k, s, m, st, CAPACITY
        ),
        params, np.zeros((4, 16), np.int32), np.full((4,), 8, np.int32), jax.random.key(0),
        SamplingParams.create(0.0, 0, 1.0), np.int32(MAX_NEW), np.full((8,), -1, np.int32),
    )
    cache_sh = state_shardings(state, mesh).cache
    return {
        "specs": {
            name: str(sharded["layers"][0][name].sharding.spec) for name in ("wq", "wk", "wo", "w_up")
        }
        | {"embed": str(sharded["embed"].sharding.spec)}
        | {  # the MoE model's last layer: its router and experts
            name: str(sharded["layers"][-1][name].sharding.spec)
            for name in ("router", "experts_w_gate", "experts_w_down") if cfg.moe is not None
        },
        "wq_shard_bytes": [s.data.nbytes for s in wq.addressable_shards],
        "wq_bytes": int(wq.nbytes),
        "param_bytes_total": int(total),
        "param_bytes_per_device": sorted(set(per_device.values())),
        "num_devices_holding": len(per_device),
        "cache_spec": str(cache_sh.k[0].spec),
        "cache_lengths_spec": str(cache_sh.lengths.spec),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kind, cases = sys.argv[1], [c.split("@") for c in sys.argv[2].split(",")]
    if kind == "default":  # the real SmolLM2-135M (9 heads, 3 KV heads; vocab 49152 splits)
        from spec_jax.checkpoints import load_target

        loaded = load_target(None)
        cfg, params = loaded.cfg, loaded.params
    else:
        cfg = model_cfg(kind)
        params = init_params(cfg, jax.random.key(0))
    process_cfg, process_params = cfg, params
    target = (cfg, params)
    out: dict = {"devices": jax.device_count(), "model": kind, "cases": {}, "shards": {}}
    common = dict(max_new_tokens=MAX_NEW, capacity=CAPACITY, ignore_eos=True)
    # The unsharded AR baseline every sharded run must match token for token (unsharded
    # speculative == AR is the loop's own test, so this also means sharded == unsharded).
    t0 = time.perf_counter()
    baseline = generate(target, PROMPTS, **common).generated_ids
    out["baseline_s"] = round(time.perf_counter() - t0, 2)
    out["baseline"] = process_baseline = baseline
    for case_name, mesh_name in cases:
        drafter_name, _, adaptive = case_name.partition("+")
        depth = SWITCHING if adaptive else None
        cfg, params, baseline = process_cfg, process_params, process_baseline
        if drafter_name in OWN_TARGETS:
            cfg = OWN_TARGETS[drafter_name]
            params = init_params(cfg, jax.random.key(0), scale=3.0)
            baseline = generate((cfg, params), PROMPTS, **common).generated_ids
        target = (cfg, params)
        drafter, drafter_params = make_drafter(drafter_name, cfg, baseline)
        data, model = (int(x) for x in mesh_name.split("x"))
        mesh = make_mesh(f"data={data},model={model}")
        if mesh_name not in out["shards"] and drafter_name not in OWN_TARGETS:
            out["shards"][mesh_name] = shard_report(cfg, params, mesh)
        t0 = time.perf_counter()
        result = generate(target, PROMPTS, drafter, drafter_params, mesh=mesh, k=depth, **common)
        compiled = list(generate_module._COMPILED.values())[-1]
        hlo = compiled.as_text()
        expect_cache = kv_cache_shardings(
            mesh, batch=len(PROMPTS), num_kv_heads=cfg.num_kv_heads,
            num_layers=cfg.num_layers, capacity=CAPACITY, head_dim=cfg.head_dim,
        ).k[0]
        per_device_cache = expect_cache.shard_shape(
            (len(PROMPTS), cfg.num_kv_heads, CAPACITY, cfg.head_dim)
        )
        expected_elems = int(np.prod(per_device_cache))
        # Per-device buffers of one layer's cache [b, kv, S, D] in the partitioned HLO. XLA may
        # split the cache further than the rule (e.g. 4 KV heads over model=8 as 4 parts x 2
        # replicas); it must never hold more than the rule's share.
        pattern = rf"f32\[(\d+),(\d+),{CAPACITY},{cfg.head_dim}\]"
        cache_types = sorted(set(re.findall(pattern, hlo)))
        cache_elems = [int(b) * CAPACITY * int(kv) * cfg.head_dim for b, kv in cache_types]
        # The compiled loop again, on inputs committed to the mesh by explicit device_put:
        # with transfers disallowed, any host round trip in the loop would raise.
        inputs = loop_inputs(params, drafter_params)
        if depth is not None:
            inputs = inputs.replace(depth_costs=np.asarray(depth.costs, np.float32))
        inputs = place_generate_inputs(inputs, Decoder(cfg), drafter, mesh)
        with jax.transfer_guard("disallow"):
            again = compiled(inputs)
            jax.block_until_ready(again)
        again_ids = [
            [int(t) for t in row[len(p): len(p) + MAX_NEW]]
            for row, p in zip(np.asarray(again.tokens), PROMPTS)
        ]
        out["cases"][f"{case_name}@{mesh_name}"] = {
            "depths": sorted(set(result.depth_trace or [])),
            "equal": result.generated_ids == baseline,
            "guarded_equal": again_ids == baseline,
            "compile_s": round(result.compile_s, 2),
            "total_s": round(time.perf_counter() - t0, 2),
            "host_ops": sorted(set(m.group(0) for m in HOST_OPS.finditer(hlo))),
            "has_while": " while(" in hlo,
            "cache_per_device": list(per_device_cache),
            "cache_types_in_hlo": cache_types,
            "cache_within_rule": bool(cache_elems) and max(cache_elems) <= expected_elems,
            "accepted": result.stats.accepted,
            "drafter_table_spec": (
                str(inputs.drafter_params["table"].sharding.spec)
                if isinstance(drafter, TableDrafter) else None
            ),
            "drafter_table_shard_rows": (
                inputs.drafter_params["table"].addressable_shards[0].data.shape[0]
                if isinstance(drafter, TableDrafter) else None
            ),
            "drafter_wq_spec": (
                str(inputs.drafter_params["layers"][0]["wq"].sharding.spec)
                if isinstance(inputs.drafter_params, dict) and "layers" in inputs.drafter_params
                else None
            ),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
