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
    out = run_script("gpu_host.sh", "--host", "me@gpu", "--mesh", "data=1,model=4", "--dry-run")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "pip install -e '\\''.[cuda]'\\''" in text
    assert "spec-jax generate --mesh data=1,model=4" in text
    assert "spec-jax bench --mesh data=1,model=4" in text
    assert "+ scp -r me@gpu:spec_jax_results/. ./gpu_results/me@gpu/" in text
    # The issue-5 GPU measurement: a random 1B-class Llama in bfloat16 against the HBM floor.
    assert "spec-jax bench --roofline --target random:llama-3.2-1b --dtype bfloat16" in text
    local = run_script("gpu_host.sh", "--dry-run", "--results", "r").stdout
    assert "[cuda]" in local
    assert "spec-jax generate --mesh data=1,model=8 --max-new-tokens 128 --json" in local
    assert local.splitlines()[2].endswith(" > r/generate.json")
    assert local.splitlines()[-1].endswith(" > r/roofline.txt")
    skipped = run_script("gpu_host.sh", "--dry-run", "--roofline", "none").stdout
    assert "--roofline" not in skipped


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
