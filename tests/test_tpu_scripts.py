"""tpu_scripts/*.sh: usage text, --dry-run prints the expected commands, shellcheck passes."""

from __future__ import annotations

import shutil
import subprocess
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
