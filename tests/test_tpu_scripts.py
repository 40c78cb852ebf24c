"""tpu_scripts/*.sh: usage text, --dry-run prints the expected commands, shellcheck passes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "tpu_scripts"
NAMES = ["create_tpu_vm.sh", "setup_tpu_vm.sh", "run_tpu.sh", "gpu_host.sh"]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", NAMES)
def test_usage(name):
    out = run_script(name, "-h")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage:") and "--dry-run" in out.stdout


@pytest.mark.parametrize("name", ["create_tpu_vm.sh", "setup_tpu_vm.sh", "run_tpu.sh"])
def test_name_required_and_unknown_flags(name):
    out = run_script(name, "--dry-run")
    assert out.returncode == 2 and "--name is required" in out.stderr
    out = run_script(name, "--name", "x", "--bogus", "--dry-run")
    assert out.returncode == 2 and "unknown argument: --bogus" in out.stderr


def test_create_dry_run():
    out = run_script(
        "create_tpu_vm.sh", "--name", "sj", "--zone", "us-west4-a",
        "--accelerator-type", "v5litepod-8", "--version", "v2-alpha-tpuv5-lite", "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "+ gcloud compute tpus tpu-vm create sj --zone=us-west4-a "
        "--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite"
    )


def test_setup_dry_run():
    out = run_script("setup_tpu_vm.sh", "--name", "sj", "--zone", "us-west4-a", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(l.startswith("+ tar -czf ") for l in lines)
    assert any(
        l.startswith("+ gcloud compute tpus tpu-vm scp ") and "--worker=all" in l for l in lines
    )
    install = [l for l in lines if "pip install -e '\\''.[tpu]'\\''" in l]
    assert install and install[0].startswith("+ gcloud compute tpus tpu-vm ssh sj --worker=all")
    out = run_script("setup_tpu_vm.sh", "--name", "sj", "--package", "spec-jax[tpu]", "--dry-run")
    assert "pip install '\\''spec-jax[tpu]'\\''" in out.stdout and "tar -czf" not in out.stdout


def test_run_tpu_dry_run():
    out = run_script(
        "run_tpu.sh", "--name", "sj", "--mesh", "data=2,model=4", "--prompt", "it's a test",
        "--results", "out/dir", "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    ssh, mkdir, scp = out.stdout.splitlines()
    assert ssh.startswith("+ gcloud compute tpus tpu-vm ssh sj --worker=all")
    assert "spec-jax generate --mesh data=2,model=4" in ssh
    assert "spec-jax bench --mesh data=2,model=4 --drafters ngram" in ssh
    assert mkdir == "+ mkdir -p out/dir"
    assert scp.startswith("+ gcloud compute tpus tpu-vm scp --recurse sj:~/spec_jax_results out/dir")
    assert "--worker=0" in scp


def test_gpu_host_dry_run():
    """The one GPU-host command measures random-weight targets (nothing else has to travel): the
    roofline, the layer layouts and the DFlash step; the default model only when asked."""
    out = run_script("gpu_host.sh", "--host", "me@gpu", "--dry-run")
    assert out.returncode == 0, out.stderr
    rsync, install, job, mkdir, scp = out.stdout.splitlines()[1:]
    assert rsync.startswith("+ rsync -az --delete --exclude=.git") and "me@gpu:spec_jax/" in rsync
    assert "pip install -e '\\''.[cuda]'\\''" in install
    assert job.startswith("+ ssh me@gpu 'cd ~/spec_jax && mkdir -p $HOME/spec_jax_results")
    assert "spec-jax bench --roofline --target random:llama-3.2-1b --dtype bfloat16" in job
    assert "benchmarks/layer_layout.py --presets llama-3.2-1b qwen3-8b --out" in job
    assert "benchmarks/dflash_step.py --target random:qwen3-8b --out" in job
    assert "spec-jax generate" not in job and "--mesh" not in job
    assert scp == "+ scp -r me@gpu:spec_jax_results/. ./gpu_results/me@gpu/"
    for script in ("layer_layout.py", "dflash_step.py"):
        assert (SCRIPTS.parent / "benchmarks" / script).is_file()

    local = run_script("gpu_host.sh", "--dry-run", "--results", "r", "--default-model",
                       "--mesh", "data=1,model=4", "--roofline", "none", "--layouts", "qwen3-8b").stdout
    install, job = local.splitlines()
    assert "[cuda]" in install and job.startswith(f"+ bash -c 'cd {SCRIPTS.parent} && mkdir -p ")
    assert "--roofline" not in job and "--presets qwen3-8b --out" in job
    assert "spec-jax generate --mesh data=1,model=4 --max-new-tokens 128 --json" in job
    assert "spec-jax bench --mesh data=1,model=4 --drafters ngram" in job


def test_dry_run_runs_nothing(tmp_path):
    out = run_script("run_tpu.sh", "--name", "sj", "--results", str(tmp_path / "new"), "--dry-run")
    assert out.returncode == 0 and not (tmp_path / "new").exists()


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (apt-get install -y shellcheck)",
)
def test_shellcheck():
    files = [str(SCRIPTS / n) for n in NAMES + ["common.sh"]]
    out = subprocess.run(
        ["shellcheck", "-x", *files], capture_output=True, text=True, cwd=SCRIPTS, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_gpu_host_quick_dry_run():
    """--quick runs benchmarks/gpu_quick.py from the checkout (no pip install: a lent GPU may have
    no internet), passes the options after -- on, and copies results back even when a step failed."""
    local = run_script("gpu_host.sh", "--quick", "--results", "r", "--dry-run", "--", "--preset", "qwen3-8b")
    assert local.returncode == 0, local.stderr
    (job,) = local.stdout.splitlines()
    assert job == f"+ bash -c 'cd {SCRIPTS.parent} && python3 benchmarks/gpu_quick.py --out {Path.cwd()}/r --preset qwen3-8b'"
    remote = run_script("gpu_host.sh", "--quick", "--host", "me@gpu", "--dry-run").stdout.splitlines()
    mkdir, rsync, job, local_mkdir, scp = remote
    assert "pip install" not in remote and rsync.startswith("+ rsync -az --delete --exclude=.git")
    assert job.startswith("+ ssh me@gpu 'cd ~/spec_jax && python3 benchmarks/gpu_quick.py --out $HOME/spec_jax_results/quick --commit ")
    assert scp == "+ scp -r me@gpu:spec_jax_results/quick/. ./gpu_results/me@gpu/"
    out = run_script("gpu_host.sh", "--dry-run", "--", "--preset", "tiny")
    assert out.returncode == 2 and "options after -- are for --quick" in out.stderr


QUICK_STEPS = ["ar_floor", "dflash_trees", "verify_cost", "capacity", "engine", "exactness"]


def run_quick(*args: str) -> subprocess.CompletedProcess:
    script = SCRIPTS.parent / "benchmarks" / "gpu_quick.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_gpu_quick_dry_run_lists_every_step_with_its_budget_in_priority_order(tmp_path):
    out = run_quick("--dry-run", "--out", str(tmp_path / "q"))
    assert out.returncode == 0, out.stderr
    plan = re.findall(r"^ *(\d+)\. (\S+) +(\d+) s ", out.stdout, re.M)
    assert [name for _, name, _ in plan] == QUICK_STEPS
    budgets = {name: int(seconds) for _, name, seconds in plan}
    # The whole suite inside 8 minutes on a lent GPU: the warm phase, with exactness run beside
    # its compiles (it times nothing), then the timed steps.
    assert re.search(r"^ 6\. exactness +240 s .*\(during the warm phase\)$", out.stdout, re.M)
    assert 290 + sum(b for name, b in budgets.items() if name != "exactness") <= 470
    commands = [line.strip() for line in out.stdout.splitlines() if "--run-step" in line and "--warm" not in line]
    assert [c.split("--run-step ")[1].split()[0] for c in commands] == QUICK_STEPS
    assert "--target random:qwen3-8b" in commands[0]
    assert all("--target random:llama-3.2-1b" in c for c in commands[1:5]) and "--target" not in commands[5]
    assert f"JAX_COMPILATION_CACHE_DIR={tmp_path / 'q' / 'jax_cache'}" in out.stdout
    assert not (tmp_path / "q").exists()  # ran nothing

    # The warm phase first: every step but exactness; dflash_trees one process per batch for its AR
    # rows and one per (batch, tree), capacity one per (attention, capacity), the engine one per
    # (concurrency, drafter): no process holds a long queue.
    warm = [line.strip() for line in out.stdout.splitlines() if line.strip().endswith("--warm")]
    assert len(warm) == 1 + 2 * 4 + 1 + 4 + 3 * 2 and re.search(r"^ 0\. warm phase +290 s ", out.stdout, re.M)
    # Longest first, as the last lease's warm phase took them (benchmarks/gpu_warm_seconds.json):
    # those it cut (batch 8's trees, the engine's DFlash pair at 32 slots) before all.
    names = [w.split("[")[1].split(":")[0] for w in warm]
    assert set(names[:4]) == {"dflash_trees-b8-t0", "dflash_trees-b8-t16", "dflash_trees-b8-t32",
                              "engine-c32-DFlash"} and names[4] == "verify_cost", names
    assert names[-1] == "capacity-dense-32768", names
    assert [c.split("--part ")[1].split()[0] for c in warm if "--run-step capacity" in c] == [
        "live-32768", "live-512", "dense-512", "dense-32768"]
    parts = [c.split("--batches ")[1].split(" --warm")[0] for c in warm if "--run-step dflash_trees" in c]
    assert sorted(parts) == [f"{b} --part {p}" for b in (1, 8) for p in ("ar", "t0", "t16", "t32")], parts
    assert sorted(c.split("--concurrency ")[1] for c in warm if "--run-step engine" in c) == sorted(
        f"{n} --part {d} --warm" for n in (1, 8, 32) for d in ("AR", "DFlash"))
    # Without a record: each step's first, then each one's second, and so on.
    plain = run_quick("--dry-run", "--warm-order-from", "none")
    first = [w.split("--run-step ")[1].split()[0] for w in plain.stdout.splitlines() if w.strip().endswith("--warm")]
    assert first[:6] == ["ar_floor", "dflash_trees", "verify_cost", "capacity", "engine", "dflash_trees"], first
    assert "(each step's first, then each one's second (no record to order by))" in plain.stdout
    assert "at most 470 s in all" in out.stdout  # warm phase + steps, inside the 8-minute lease
    assert "20 processes, 8 at a time in this order (longest first as recorded in" in out.stdout
    # Exactness compiles without autotuning (it times nothing).
    assert re.search(r"^ 6\. exactness .*\n    XLA_FLAGS \+= --xla_gpu_autotune_level=0$", out.stdout, re.M)
    # Every step keeps XLA's defaults; --fast-compile-flags reaches the small-target steps only.
    assert out.stdout.count("XLA_FLAGS +=") == 1  # exactness's own, above
    fast = run_quick("--dry-run", "--fast-compile-flags=--xla_gpu_enable_triton_gemm=false")
    tagged = re.findall(r"^ *(\d+)\. (\S+) .*\n    XLA_FLAGS \+= (?:\S+ )?--xla_gpu_enable_triton_gemm=false$",
                        fast.stdout, re.M)
    assert fast.returncode == 0 and [name for _, name in tagged] == QUICK_STEPS[1:]

    # Steps stay in priority order whatever order --steps names them; budgets scale and override.
    out = run_quick("--dry-run", "--steps", "engine,ar_floor", "--budget", "2", "--step-budget", "engine=7",
                    "--target", "random:tiny")
    plan = re.findall(r"^ *(\d+)\. (\S+) +(\d+) s ", out.stdout, re.M)
    assert plan == [("1", "ar_floor", str(2 * budgets["ar_floor"])), ("2", "engine", "7")]
    # The two steps, each also in the warm phase (the engine once per concurrency, 1, 8 and 32, and
    # drafter, AR and DFlash).
    assert out.stdout.count("--target random:tiny") == 2 + 1 + 3 * 2


def test_gpu_quick_opt_in_probes_and_xla_flags(tmp_path):
    """part 3's probes: `ar_profile` runs only when named, after the default steps' order, with
    --xla-flags and the autotune cache in every step's XLA_FLAGS; --batches/--trees reach the step."""
    out = run_quick("--dry-run", "--out", str(tmp_path / "q"), "--preset", "qwen3-8b", "--steps",
                    "ar_profile,dflash_trees", "--batches", "1", "--trees", "0,32",
                    "--xla-flags=--xla_gpu_graph_min_graph_size=1")
    assert out.returncode == 0, out.stderr
    assert [name for _, name, _ in re.findall(r"^ *(\d+)\. (\S+) +(\d+) s ", out.stdout, re.M)] == [
        "dflash_trees", "ar_profile"]
    # After the caller's own XLA_FLAGS: XLA takes the last. No autotune folder among them: JAX
    # sets its own inside the persistent cache, over any XLA_FLAGS one.
    assert "XLA_FLAGS=" in out.stdout and "--xla_gpu_graph_min_graph_size=1'" in out.stdout
    assert "autotune_cache_dir=" not in out.stdout
    assert "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=xla_gpu_per_fusion_autotune_cache_dir" in out.stdout
    assert "autotuning carried in: 0 fusions' results from" in out.stdout
    assert "--batches 1 --trees 0,32" in out.stdout and "--draft-vocabs" not in out.stdout
    vocab = run_quick("--dry-run", "--steps", "dflash_profile", "--draft-vocabs", "0,32768")
    assert "--run-step dflash_profile" in vocab.stdout and "--draft-vocabs 0,32768" in vocab.stdout
    default = run_quick("--dry-run")
    assert "ar_profile" not in default.stdout


def test_gpu_quick_device_busy_time_is_the_union_of_stream_intervals():
    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    from gpu_quick import covered_ns

    assert covered_ns([]) == 0
    assert covered_ns([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # overlaps counted once
    assert covered_ns([(30, 40), (0, 10)]) == 20  # any order


def test_gpu_quick_profiles_name_what_each_kernel_computes():
    """The probes' top kernels carry their instruction from the program's optimized HLO: a fusion's
    kernel is named after it with '.' and '-' as '_'. Checked on the CPU's own program text (the
    names and the text's shape are the same there), and on the loop `generate` just ran."""
    import re

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    from gpu_quick import hlo_of_kernels, newest_loop_hlo

    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.generate import generate

    hlo = jax.jit(lambda x, y: jnp.swapaxes(x, 0, 1) * 2.0 + y).lower(
        jnp.ones((3, 4)), jnp.ones((4, 3))).compile().as_text()
    fusions = re.findall(r"%([\w.\-]+) = \S+ fusion\(", hlo)
    assert fusions, hlo
    kernel = re.sub(r"[.\-]", "_", fusions[0])
    found = hlo_of_kernels(hlo, [kernel, "nvjet_tst_64x8_64x16_1x1_v_bz_TNN"])  # a cuBLAS kernel: not in HLO
    assert list(found) == [kernel]
    assert f"%{fusions[0]} = " in found[kernel]["hlo"] and "metadata" not in found[kernel]["hlo"]
    assert found[kernel]["computes"].startswith("ROOT ") and found[kernel]["operands"].startswith("f32[")

    generate(load_target("random:tiny", dtype="float32"), [[1, 2, 3]], max_new_tokens=2, ignore_eos=True)
    loop = newest_loop_hlo()
    assert loop is not None and "while" in loop

    # Per step by the loop's scopes: a verify-pass fusion's kernel lands in "verify", a cuBLAS
    # kernel (no HLO instruction of its name) among the library calls.
    from gpu_quick import LIBRARY_CALLS, by_scope_per_step
    from hlo_text import kernel_scope_shares

    verify_kernel = next(k for k, shares in kernel_scope_shares(loop).items()
                         if shares == {"verify": 1.0} and "fusion" in k)
    got = by_scope_per_step({verify_kernel: [2.0, 3e6], "nvjet_tst_64x8": [1.0, 5e5]}, loop)
    assert got["kernels_per_step_by_scope"] == {"verify": 2.0, LIBRARY_CALLS: 1.0}
    assert got["busy_ms_per_step_by_scope"] == {"verify": 3.0, LIBRARY_CALLS: 0.5}
    assert got["loop_body_launched_by_scope"]["verify"] > 0 and "draft" not in got["loop_body_launched_by_scope"]


TWIN_FUSIONS_HLO = """HloModule twins

%fused_a (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %add.1 = f32[4]{0} add(%p0, %p1)
}

%fused_b (q0: f32[4], q1: f32[4]) -> f32[4] {
  %q0 = f32[4]{0} parameter(0)
  %q1 = f32[4]{0} parameter(1)
  ROOT %add.7 = f32[4]{0} add(%q0, %q1)
}

%fused_c (r0: f32[4], r1: f32[4]) -> f32[4] {
  %r0 = f32[4]{0} parameter(0)
  %r1 = f32[4]{0} parameter(1)
  ROOT %multiply.3 = f32[4]{0} multiply(%r0, %r1)
}

%body (s: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %s = (f32[4]{0}, f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%s), index=0
  %y = f32[4]{0} get-tuple-element(%s), index=1
  %add_fusion.1 = f32[4]{0} fusion(%x, %y), kind=kLoop, calls=%fused_a, metadata={op_name="jit(generate)/while/body/draft/add"}
  %add_fusion.2 = f32[4]{0} fusion(%y, %add_fusion.1), kind=kLoop, calls=%fused_b, metadata={op_name="jit(generate)/while/body/verify/add"}
  %multiply_fusion = f32[4]{0} fusion(%add_fusion.2, %x), kind=kLoop, calls=%fused_c, metadata={op_name="jit(generate)/while/body/verify/mul"}
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%add_fusion.2, %multiply_fusion)
}
"""


def test_profile_shares_a_reused_kernel_over_its_twins_scopes():
    """XLA:GPU launches one kernel, named after the first, for fusions with the same body: the
    profile's attribution by scope shares its launches over every twin's scope (the H100 profile
    of session 34 put the DFlash chain's verify GEMMs in "draft" by the kernel's name alone)."""
    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    from gpu_quick import by_scope_per_step
    from hlo_text import kernel_scope_shares

    shares = kernel_scope_shares(TWIN_FUSIONS_HLO)
    assert shares["add_fusion_1"] == shares["add_fusion_2"] == {"draft": 0.5, "verify": 0.5}
    assert shares["multiply_fusion"] == {"verify": 1.0}  # same shapes, another body: no twin
    # Both add fusions ran as the first's kernel: 2 launches a step, one in each scope.
    got = by_scope_per_step({"add_fusion_1": [2.0, 4e6], "multiply_fusion": [1.0, 1e6]}, TWIN_FUSIONS_HLO)
    assert got["kernels_per_step_by_scope"] == {"draft": 1.0, "verify": 2.0}
    assert got["busy_ms_per_step_by_scope"] == {"draft": 2.0, "verify": 3.0}


def test_gpu_quick_exactness_cases_exist():
    """The GPU suite names test cases by id (one per drafter kind): a renamed case would leave
    the lease's exactness step collecting nothing."""
    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    from gpu_quick import FULL

    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *FULL.exactness_tests, *(f"--deselect={t}" for t in FULL.exactness_deselect)],
                         capture_output=True, text=True, timeout=120, cwd=SCRIPTS.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    live = [c for c in collected if c.startswith("tests/test_live_attention.py")]
    assert len(collected) - len(live) == len(FULL.exactness_tests) - 1 and live, collected
    # What it leaves out exists, and nothing else goes with it.
    assert not any(c.startswith(FULL.exactness_deselect) for c in collected)
    whole_file = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "tests/test_live_attention.py"], capture_output=True, text=True, timeout=120,
                                cwd=SCRIPTS.parent).stdout.splitlines()
    whole_file = {line for line in whole_file if "::" in line}
    left_out = {c for c in whole_file if c.startswith(FULL.exactness_deselect)}
    assert left_out and whole_file - left_out == set(live)


def test_gpu_quick_per_step_kernels_are_the_difference_of_two_traces():
    """The profile probes' arithmetic: a 1-token and an n-token trace, per step by difference."""
    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    from gpu_quick import step_activity

    short = {"events": 10, "busy_ns": 1_000_000, "by_name": {"gemm": [4, 800_000], "prefill_only": [6, 200_000]}}
    long = {"events": 50, "busy_ns": 9_000_000,
            "by_name": {"gemm": [24, 4_800_000], "prefill_only": [6, 200_000], "topk": [20, 6_000_000]}}
    got = step_activity(short, long, steps=4, step_ms=2.5)
    assert got["kernels_per_step"] == 10 and got["busy_ms_per_step"] == 2.0
    assert abs(got["gap_ms_per_step"] - 0.5) < 1e-12
    assert [(k["name"], k["count"], k["ms"]) for k in got["top_kernels_per_step"][:2]] == [
        ("topk", 5.0, 1.5), ("gemm", 5.0, 1.0)]  # costliest first
    assert got["top_kernels_per_step"][-1] == {"name": "prefill_only", "count": 0.0, "ms": 0.0}


@pytest.mark.parametrize("args,message", [
    (["--steps", "ar_floor,bogus"], "unknown step(s) ['bogus']; the steps are ar_floor, dflash_trees"),
    (["--step-budget", "engine=0"], "--step-budget wants STEP=SECONDS"),
    (["--budget", "-1"], "expected a number > 0"),
    (["--preset", "tiny", "--target", "random:tiny"], "not allowed with argument"),
])
def test_gpu_quick_bad_options(args, message):
    out = run_quick("--dry-run", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
