"""The package's requirements admit every version each deployment target's image carries.

An offline check of pyproject.toml against images/pins/ (the resolution test in
tests/integration/test_install_targets.py runs pip's resolver on the same targets): each
requirement of tokenmill[extras] that names a package an image pins exactly must contain that
version, pre-release and local labels included (NVIDIA's torch is 2.9.0a0+<commit>.nv25.10).
"""

from __future__ import annotations

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.integration.test_install_targets import PINS, REPO, TARGETS, check_install, exact_pins


def requirements(extras: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in filter(None, extras.split(",")):
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_no_exact_pin_but_ray() -> None:
    # Ray must equal its cluster's version; everything else is a range that several images
    # can satisfy. Exact versions of one machine belong in images/pins/cpu.txt.
    pinned = [
        str(r)
        for r in requirements("")
        if any(s.operator == "==" for s in r.specifier) and r.name != "ray"
    ]
    assert pinned == []


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_requirements_admit_the_images_versions(name: str) -> None:
    target = TARGETS[name]
    pins = exact_pins(PINS / target.pins)
    refused = [
        f"{req} refuses {req.name}=={pins[check_install.canonical(req.name)]}"
        for req in requirements(target.extras)
        if check_install.canonical(req.name) in pins
        and (req.marker is None or req.marker.evaluate({"extra": ""}))
        and not req.specifier.contains(pins[check_install.canonical(req.name)], prereleases=True)
    ]
    assert refused == [], f"{name} (images/pins/{target.pins})"


def test_nvidias_torch_build_is_admitted() -> None:
    torch = next(r for r in requirements("") if r.name == "torch")
    assert torch.specifier.contains("2.9.0a0+145a3a7bda.nv25.10", prereleases=True)
    assert torch.specifier.contains("2.13.0+cpu")
