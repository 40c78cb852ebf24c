"""`spec-jax generate | bench | info` run in-process on a tiny random checkpoint (and once on the
default model): JSON shape, greedy exactness of drafters, user errors exit 2 with one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints import load_target, save_hf_dir
from spec_jax.app import bench
from spec_jax.app.main import main
from spec_jax.models import forward, init_cache, init_params
from tiny_configs import small_llama

VOCAB = 61
# Repetitive prompts so the n-gram drafter finds matches.
PROMPT_A = "5,6,7,8,9,5,6,7,8,9,5,6,7"
PROMPT_B = "11,12,13,11,12,13,11"
TINY_EOS = 14  # greedy: prompt A meets it at new token 18 (of 24), prompt B never
RESULT_KEYS = {"generated_ids", "text", "finish_reason", "stats"}
STATS_KEYS = {"steps", "drafted", "accepted", "tau", "acceptance_histogram"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = small_llama(VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(TINY_EOS,))
    params = init_params(cfg, jax.random.key(0), scale=4.0)
    return str(save_hf_dir(tmp_path_factory.mktemp("tiny") / "model", cfg, params))


def run_json(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # exactly one JSON object: json.loads rejects trailing text


def run_error(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def gen_args(tiny_dir, *extra):
    # float32 on every backend (--dtype auto is bfloat16 on GPU/TPU): the tests compare greedy
    # outputs token for token.
    return ["generate", "--target", tiny_dir, "--prompt-ids", PROMPT_A, "--prompt-ids", PROMPT_B,
            "--max-new-tokens", "12", "--json", "--dtype", "float32", *extra]


def test_generate_json_and_drafters_match_ar(tiny_dir, capsys):
    ar = run_json(capsys, gen_args(tiny_dir, "--ignore-eos"))
    assert set(ar) >= {"results", "timing", "stats"}
    assert set(ar["timing"]) == {"compile_s", "generate_s", "tokens_per_second"}
    assert len(ar["results"]) == 2
    for row in ar["results"]:
        assert set(row) >= RESULT_KEYS
        assert set(row["stats"]) >= STATS_KEYS
        assert len(row["generated_ids"]) == 12 and row["finish_reason"] == "length"
        assert row["text"] is None  # the tiny checkpoint ships no tokenizer
    assert ar["stats"]["drafted"] == 0
    for drafter in (["ngram"], ["self"]):
        spec = run_json(capsys, gen_args(tiny_dir, "--ignore-eos", "--drafter", *drafter, "--k", "3"))
        assert [r["generated_ids"] for r in spec["results"]] == [r["generated_ids"] for r in ar["results"]]
        assert spec["stats"]["drafted"] > 0
    # self drafting under greedy is always accepted
    assert spec["stats"]["accepted"] == spec["stats"]["drafted"]


def test_generate_stops_at_eos_unless_ignored(tiny_dir, capsys):
    # Same shapes as above, so this reuses the compiled AR loop.
    free = run_json(capsys, gen_args(tiny_dir, "--ignore-eos", "--max-new-tokens", "24"))
    stopped = run_json(capsys, gen_args(tiny_dir, "--max-new-tokens", "24"))
    assert any(r["finish_reason"] == "stop" for r in stopped["results"])
    for a, b in zip(free["results"], stopped["results"]):
        ids = a["generated_ids"]
        cut = ids[: ids.index(TINY_EOS) + 1] if TINY_EOS in ids else ids
        assert b["generated_ids"] == cut
        assert b["finish_reason"] == ("stop" if TINY_EOS in ids else "length")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt-ids", ""], "empty"),
        (["--prompt-ids", "1,x"], "token ids"),
        (["--prompt-ids", "1000"], "vocabulary"),
        (["--max-new-tokens", "400"], "too long"),
        (["--drafter", "nonsense"], "unknown drafter"),
        (["--drafter", "draft-model"], "needs a checkpoint"),
        (["--drafter", "ngram+ngram"], "in front of a model drafter"),
    ],
)
def test_generate_user_errors(tiny_dir, capsys, argv, needle):
    base = ["generate", "--target", tiny_dir, "--json"]
    if "--prompt-ids" not in argv:
        base += ["--prompt-ids", "3,4,5"]
    assert needle in run_error(capsys, base + argv)


def test_generate_bad_paths_and_missing_prompts(tiny_dir, tmp_path, capsys):
    assert "does not exist" in run_error(
        capsys, ["generate", "--target", str(tmp_path / "nope.gguf"), "--prompt-ids", "1,2"]
    )
    run_error(capsys, ["generate", "--target", str(tmp_path / "missing_dir"), "--prompt-ids", "1,2"])
    assert "no prompt" in run_error(capsys, ["generate", "--target", tiny_dir])
    assert "tokenizer" in run_error(capsys, ["generate", "--target", tiny_dir, "hello"])
    assert "does not exist" in run_error(
        capsys, ["generate", "--target", tiny_dir, "--prompt-file", str(tmp_path / "none.jsonl")]
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\nnot json\n')
    assert "bad.jsonl:2" in run_error(capsys, ["generate", "--target", tiny_dir, "--prompt-file", str(bad)])


def test_bench_writes_json_and_png(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt_ids": [int(t) for t in p.split(",")]}) for p in (PROMPT_A, PROMPT_B)) + "\n"
    )
    out_dir = tmp_path / "bench"
    report = run_json(capsys, [
        "bench", "--target", tiny_dir, "--prompt-file", str(prompts), "--drafters", "ngram,self",
        "--k", "2", "--max-new-tokens", "8", "--ignore-eos", "--batch-size", "2", "--json",
        "--no-progress", "--out", str(out_dir),
    ])
    methods = [(r["method"], r["k"]) for r in report["results"]]
    assert methods == [("AR", 0), ("ngram", 2), ("self", 2)]
    for row in report["results"][1:]:
        assert row["mismatches"] == []
        assert len(row["acceptance_histogram"]) == 3
    assert json.loads((out_dir / "results.json").read_text())["results"][0]["method"] == "AR"
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --prompt-set both: a report per set, a table and a plot each (the sets are code and chat text)
    code, chat = dict(report, prompt_set="humaneval[:2]"), dict(report, prompt_set="chat[:2]")
    written = bench.write_outputs({"prompt_sets": [code, chat]}, tmp_path / "both")
    assert [p.name for p in written] == ["results.json", "bench-humaneval.png", "bench-chat.png"]
    bench.print_table({"prompt_sets": [code, chat]})
    assert capsys.readouterr().out.count("speedup") == 2
    shipped = bench.chat_prompts(100)
    assert len(shipped) >= 20 and len({p.text for p in shipped}) == len(shipped)
    assert not any("python" in p.text.lower() or "def " in p.text for p in shipped)  # not code


def test_bench_table_and_info(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [3, 4, 5, 3, 4]}) + "\n")
    code = main(["bench", "--target", tiny_dir, "--prompt-file", str(prompts), "--drafters", "ngram",
                 "--max-new-tokens", "4", "--ignore-eos", "--no-progress"])
    out, _ = capsys.readouterr()
    assert code == 0 and "speedup" in out and "ngram" in out
    info = run_json(
        capsys, ["info", "--target", tiny_dir, "--drafter", "self", "--json", "--dtype", "float32"]
    )
    assert info["target"]["params"] == VOCAB * 32 + 2 * (4 * 32 * 8 * 2 + 2 * 2 * 8 * 32 + 3 * 32 * 64 + 2 * 32) + 32
    assert info["target"]["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # float32: 4 bytes
    assert info["drafter"]["params"] == info["target"]["params"]


def test_default_model_uses_the_measured_default_drafter_and_matches_ar(capsys, default_model_installed):
    """No --target, no --drafter: the drafter the measured table names for this backend (DFlash with
    lookup on CPU), with the reason in the JSON, and plain decoding's output: each token is the
    argmax of the default model's logits after the prompt and the tokens before it (one teacher-
    forced forward pass; a plain-decoding run compiled the real model's loop again, ~25 s here,
    and that loop equals transformers' greedy in test_gguf). `--drafter eagle3` says that none
    ships. Each run compiles the real model's loop (about 30 s here), so only the default runs:
    the shipped DFlash alone and the sampled default are not run again (the default runs that
    DFlash, and default_drafter_spec's sampled choice is tested below), and the shipped draft
    model is loaded in test_roofline (its int8 weights dequantized) and decodes exactly like every
    draft model in the decoding tests. K is pinned at the drafter's own 7: the default's adaptive
    depth compiles four steps of the real model (about 70 s more here); CI's first command runs
    it end to end, `default_drafter_spec`'s choice of it is tested below and the loop itself in
    test_adaptive_depth."""
    prompt = [1, 9690, 198, 2683, 359, 253]
    args = ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8", "--json",
            "--dtype", "float32", "--k", "7"]
    out = run_json(capsys, args)
    row = out["results"][0]
    assert 1 <= len(row["generated_ids"]) <= 8
    assert isinstance(row["text"], str)
    assert out["target"].startswith("default:")
    from spec_jax.checkpoints.shipped import default_drafter_choice

    measured = default_drafter_choice(True, None, 1, 0.0)
    assert out["drafter"].startswith(measured[0]) and measured[2] in out["drafter_reason"]
    assert "depth_counts" not in out and out["k"] == 7  # --k pins K: no adaptive depth
    target = load_target(None)  # the CLI's model (float32), loaded once per process
    tokens = prompt + row["generated_ids"]
    logits, _, _ = forward(target.params, target.cfg, jnp.asarray([tokens]), jnp.arange(len(tokens))[None],
                           init_cache(target.cfg, 1, len(tokens)))
    assert np.asarray(logits[0, len(prompt) - 1 : -1]).argmax(-1).tolist() == row["generated_ids"]
    assert "no EAGLE-3 drafter ships" in run_error(capsys, args + ["--drafter", "eagle3"])


# A measured table of the shape of assets/measured_defaults.json, with made-up entries: the tests
# check the rule that reads the table, so a benchmark refresh edits the JSON file only.
TABLE = {
    "drafter": {
        "backends": {"cpu": {
            "greedy": [{"up_to_batch": 1, "kind": "dflash+ngram", "k": None, "why": "one greedy"},
                       {"up_to_batch": 8, "kind": "draft-model+ngram", "k": 2, "why": "up to 8 greedy"},
                       {"up_to_batch": None, "kind": "none", "k": None, "why": "more greedy"}],
            "sampled": [{"up_to_batch": 4, "kind": "ngram", "k": 3, "why": "few sampled"},
                        {"up_to_batch": None, "kind": "none", "k": None, "why": "more sampled"}],
            "engine": [{"up_to_batch": 8, "kind": "ngram", "k": 2, "why": "engine up to 8"},
                       {"up_to_batch": None, "kind": "none", "k": None, "why": "bigger engine"}],
        }},
        "unmeasured": [{"up_to_batch": 1, "kind": "ngram", "k": None, "why": "unmeasured, one"},
                       {"up_to_batch": None, "kind": "none", "k": None, "why": "unmeasured, several"}],
    },
    "tree": {
        "backends": {"cpu": {"greedy": [{"up_to_batch": 1, "tree": 16, "why": "one: tree"},
                                        {"up_to_batch": None, "tree": 0, "why": "bigger batches: chain"}]}},
        "unmeasured": [{"up_to_batch": None, "tree": 0, "why": "unmeasured: chain"}],
    },
    "depth": {
        "backends": {"cpu": {"greedy": [{"up_to_batch": 1, "depth": "adaptive", "why": "one: adaptive"},
                                        {"up_to_batch": None, "depth": "fixed", "why": "bigger: fixed"}]}},
        "unmeasured": [{"up_to_batch": None, "depth": "adaptive", "why": "unmeasured: adaptive"}],
    },
}


@pytest.mark.parametrize(
    "backend, batch, temperature, k, expected",
    [("cpu", 1, 0.0, None, ("dflash+ngram", None, "one greedy")),
     ("cpu", 2, 0.0, None, ("draft-model+ngram", 2, "up to 8 greedy")),  # first entry covering the batch
     ("cpu", 8, 0.0, 5, ("draft-model+ngram", 5, "up to 8 greedy")),  # the caller's K wins
     ("cpu", 9, 0.0, 5, ("none", None, "more greedy")),  # plain decoding has no K
     ("cpu", 4, 0.7, None, ("ngram", 3, "few sampled")),  # temperature > 0: the sampled entries
     ("cpu", 5, 1.0, None, ("none", None, "more sampled")),
     ("gpu", 1, 0.0, None, ("ngram", None, "unmeasured, one")),  # an unmeasured backend falls back
     ("tpu", 2, 0.7, 3, ("none", None, "unmeasured, several"))],
)
def test_default_drafter_choice_reads_the_measured_table(backend, batch, temperature, k, expected):
    from spec_jax.checkpoints.shipped import default_drafter_choice

    kind, chosen_k, reason = default_drafter_choice(True, k, batch, temperature, backend=backend, table=TABLE)
    assert (kind, chosen_k) == expected[:2]
    assert reason == f"default for the default model: {expected[2]}"
    # A target spec_jax ships no drafter for decodes without one, whatever the table says.
    assert default_drafter_choice(False, k, batch, temperature, backend=backend, table=TABLE) == (
        "none", k, "no drafter named and none shipped for this target")


def test_the_engine_reads_its_own_entries():
    """`spec-jax serve`'s engine reads its backend's "engine" entries, by slots, whatever the
    temperature; a backend without them gives the engine the greedy or sampled entries."""
    from spec_jax.checkpoints.shipped import default_drafter_choice

    def choice(batch, temperature=0.0, backend="cpu"):
        return default_drafter_choice(True, None, batch, temperature, backend=backend, table=TABLE, engine=True)

    assert choice(8) == ("ngram", 2, "default for the default model: engine up to 8")
    assert choice(1, 0.7)[:2] == ("ngram", 2) and choice(9)[0] == "none"
    # generate at the same batch keeps its own entry
    assert default_drafter_choice(True, None, 8, 0.0, backend="cpu", table=TABLE)[0] == "draft-model+ngram"
    assert choice(1, backend="gpu")[2].endswith("unmeasured, one")
    no_engine = {"drafter": {"backends": {"cpu": {k: v for k, v in TABLE["drafter"]["backends"]["cpu"].items()
                                                  if k != "engine"}}, "unmeasured": []}}
    assert default_drafter_choice(True, None, 8, 0.0, backend="cpu", table=no_engine, engine=True)[0] == (
        "draft-model+ngram")


def test_default_drafter_spec_follows_the_table(monkeypatch):
    """The CLI's default (no --target, no --drafter) is the table's choice for the batch and
    temperature, with its tree, its depth policy (adaptive unless K is given) and the reasons; a
    named target never gets a default drafter."""
    from spec_jax.app.inputs import default_drafter_spec
    from spec_jax.checkpoints import shipped

    backend = jax.default_backend()
    table = {section: {"backends": {backend: TABLE[section]["backends"]["cpu"]},
                       "unmeasured": TABLE[section]["unmeasured"]} for section in TABLE}
    monkeypatch.setattr(shipped, "measured_defaults", lambda: table)
    one, several = default_drafter_spec(None, None, batch=1), default_drafter_spec(None, None, batch=8)
    assert (one.kind, one.k, one.tree, one.adaptive) == ("dflash+ngram", None, 16, True)
    assert "one greedy" in one.reason and "one: tree" in one.reason and "one: adaptive" in one.reason
    assert (several.kind, several.k, several.tree, several.adaptive) == ("draft-model+ngram", 2, None, False)
    assert "bigger batches: chain" in several.reason and "fixed" not in several.reason
    assert default_drafter_spec(None, 4, batch=8).k == 4
    pinned = default_drafter_spec(None, 4, batch=1)  # --k N pins K
    assert (pinned.k, pinned.adaptive) == (4, False) and "adaptive" not in pinned.reason
    many = default_drafter_spec(None, 4, batch=9)
    assert (many.kind, many.k) == ("none", None) and many.reason.endswith("more greedy")
    sampled = default_drafter_spec(None, None, batch=1, temperature=0.7)
    assert (sampled.kind, sampled.k) == ("ngram", 3) and "unmeasured: chain" in sampled.reason
    assert sampled.adaptive and "unmeasured: adaptive" in sampled.reason
    assert default_drafter_spec("some/model", None, batch=1).kind == "none"
    served = default_drafter_spec(None, None, batch=8, engine=True)  # serve's engine of 8 slots
    assert (served.kind, served.k, served.adaptive) == ("ngram", 2, False) and "engine up to 8" in served.reason


def test_the_log_line_gives_a_defaults_reason_in_brief():
    """The shipped table's reasons carry their figures and RESULTS.md citations (1,800 characters
    for the default model's default): the log line gets each reason's first clause without them,
    `--json` the whole (`drafter_reason`)."""
    from spec_jax.app.inputs import default_drafter_spec, in_brief

    assert in_brief("measured fastest at batch 1 (RESULTS.md, session 28: 1.01x (chat); 1.3x), greedy; "
                    "then more. And more") == "measured fastest at batch 1, greedy"
    assert in_brief("a chain: trees lose (RESULTS.md). The verify pass (T = 33) costs more") == \
        "a chain: trees lose"
    for batch, temperature, engine in [(1, 0.0, False), (8, 0.0, False), (1, 0.7, False), (64, 0.0, False),
                                       (8, 0.0, True)]:
        spec = default_drafter_spec(None, None, batch, temperature, engine=engine)
        assert spec.brief and len(spec.brief) < len(spec.reason) and len(spec.brief) < 400, spec.brief
        assert "(" not in spec.brief and "RESULTS.md" not in spec.brief
        assert spec.brief.startswith("default for the default model: ")
        # One clause per reason: the drafter's, the tree's, the depth's where adaptive.
        parts = 1 if spec.kind == "none" else 2 + spec.adaptive
        assert len(spec.brief.split("; ")) == parts, spec.brief
    pinned = default_drafter_spec(None, 4, 1, 0.0)
    assert len(pinned.brief.split("; ")) == 2 and not pinned.adaptive
    other = default_drafter_spec("some/model", None)
    assert other.brief == other.reason == "no drafter named and none shipped for this target"


def test_the_shipped_measured_table_is_well_formed():
    """Every backend and mode of assets/measured_defaults.json (and its unmeasured fallback) ends
    with an entry for any batch, names registered drafters, and gives each choice its reason."""
    from spec_jax.checkpoints.shipped import measured_defaults
    from spec_jax.drafters import registry

    table = measured_defaults()
    for section, value in (("drafter", "kind"), ("tree", "tree"), ("depth", "depth")):
        lists = [table[section]["unmeasured"]]
        lists += [entries for modes in table[section]["backends"].values() for entries in modes.values()]
        for entries in lists:
            assert entries[-1]["up_to_batch"] is None
            assert all(e["why"] and value in e for e in entries)
            if section == "drafter":
                assert all(e["kind"] in registry.names() for e in entries)
            elif section == "depth":
                assert all(e["depth"] in ("adaptive", "fixed") for e in entries)
            else:
                assert all(e["tree"] >= 0 for e in entries)


def test_default_drafter_api_for_another_target_is_plain_decoding(tiny_dir):
    """`spec_jax.default_drafter`: the CLI's choice from Python; a target spec_jax ships no
    drafter for decodes without one, and `load_drafter` builds any kind by name."""
    import spec_jax

    target = spec_jax.load_target(tiny_dir)
    assert spec_jax.default_drafter(target, batch_size=1, temperature=0.7) == (
        None, None, "no drafter named and none shipped for this target")
    drafter, params = spec_jax.load_drafter("ngram", target, k=3)
    assert isinstance(drafter, spec_jax.NGramDrafter) and drafter.k == 3 and params is None
    with pytest.raises(ValueError, match="needs a checkpoint for this target"):
        spec_jax.load_drafter("dflash+ngram", target)
    with pytest.raises(ValueError, match="unknown drafter"):
        spec_jax.load_drafter("hydra", target)
    with pytest.raises(ValueError, match="medusa.*needs a checkpoint for this target"):
        spec_jax.load_drafter("medusa", target)


def test_dflash_drafter_and_mesh_match_ar(tiny_dir, tmp_path, capsys):
    from spec_jax.checkpoints.dflash import save_dflash
    from spec_jax.drafters.dflash import DFlashConfig, dflash_layers, init_dflash_params

    dcfg = DFlashConfig(layer=dflash_layers(1, 32, 4, 2, 8, 64, vocab_size=VOCAB), block_size=4,
                        target_layer_ids=(1,), mask_token_id=60, num_target_layers=2)
    dflash_dir = str(save_dflash(tmp_path / "dflash", dcfg, init_dflash_params(dcfg, jax.random.key(1))))
    ar = run_json(capsys, gen_args(tiny_dir, "--ignore-eos"))
    ids = [r["generated_ids"] for r in ar["results"]]
    spec = run_json(capsys, gen_args(tiny_dir, "--ignore-eos", "--drafter", f"dflash={dflash_dir}"))
    assert spec["k"] == 3 and spec["stats"]["drafted"] > 0
    assert [r["generated_ids"] for r in spec["results"]] == ids
    looked_up = run_json(capsys, gen_args(tiny_dir, "--ignore-eos", "--drafter", f"dflash+ngram={dflash_dir}"))
    assert looked_up["drafter"].startswith("dflash+ngram:") and looked_up["k"] == 3
    assert [r["generated_ids"] for r in looked_up["results"]] == ids
    sharded = run_json(capsys, gen_args(tiny_dir, "--ignore-eos", "--mesh", "data=1,model=1"))
    assert [r["generated_ids"] for r in sharded["results"]] == ids
    info = run_json(capsys, ["info", "--target", tiny_dir, "--drafter", f"dflash={dflash_dir}", "--json"])
    # The old two-word form is refused with the fix, not read as a prompt.
    assert f"--drafter dflash={dflash_dir}" in run_error(
        capsys, gen_args(tiny_dir, "--drafter", "dflash", dflash_dir)
    )
    assert info["drafter"]["kind"] == "DFlashDrafter" and info["drafter"]["k"] == 3
    assert info["drafter"]["capture_layers"] == [1] and info["drafter"]["params"] > 0
    assert "devices" in run_error(capsys, gen_args(tiny_dir, "--mesh", "data=3"))


def test_bench_names_two_runs_drafter_dirs_apart():
    """Two runs' exports are both called `drafter/`: the bench table names them by run."""
    from spec_jax.app.bench import _method_names
    from spec_jax.app.inputs import parse_drafter_spec

    specs = [parse_drafter_spec(t) for t in ("ngram", "dflash=runs/a/drafter", "dflash=runs/b/drafter",
                                             "eagle3=runs/eagle3/drafter")]
    assert list(_method_names(specs).values()) == ["ngram", "dflash:a/drafter", "dflash:b/drafter",
                                                   "eagle3:drafter"]


def test_info_shows_a_reduced_draft_vocabulary():
    from spec_jax.app.info import drafter_info
    from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_layers
    from spec_jax.drafters.ngram import NGramDrafter

    cfg = DFlashConfig(layer=dflash_layers(1, 32, 2, 1, 16, 64, vocab_size=100), block_size=4,
                       target_layer_ids=(0,), mask_token_id=3, draft_vocab_size=40)
    info = drafter_info(DFlashDrafter(cfg))
    assert info["draft_vocab_size"] == 40 and info["params"] > 32 * 40  # its own head is counted
    assert "draft_vocab_size" not in drafter_info(NGramDrafter(k=3))
