"""The install files agree with each other: requirements (ranges for users), constraints (the exact set CI
tests), .ci/run and the README's set-up commands."""
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
REQUIREMENT_FILES = ["requirements.txt", "requirements-peers.txt"]


def requirement_lines(name):
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            yield line


def pins():
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"constraints.txt: not an exact pin: {line!r}"
        pinned[canonical(name)] = Version(version)
    return pinned


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("filename", REQUIREMENT_FILES)
def test_every_requirement_is_pinned_within_its_range(filename):
    pinned = pins()
    for line in requirement_lines(filename):
        requirement = Requirement(line)
        name = canonical(requirement.name)
        assert name in pinned, f"{filename}: {requirement.name} has no pin in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pinned[name]}, outside {filename}'s {requirement.specifier}")


def test_every_user_range_has_an_upper_bound():
    """A new major release of a dependency must not reach users unnoticed (pytest 9 once broke a fresh install)."""
    for filename in REQUIREMENT_FILES:
        for line in requirement_lines(filename):
            requirement = Requirement(line)
            assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier), (
                f"{filename}: {requirement.name} has no upper bound")


def test_ci_installs_the_pinned_set_and_says_so():
    ci = (REPO / ".ci" / "run").read_text()
    assert "-c constraints.txt" in ci and "requirements-peers.txt" in ci
    assert "constraints.txt" in ci.split("install_torch_cpu.sh")[0], "the pins are printed before installing"


def test_the_readme_and_ci_install_the_same_torch():
    torch_pin = str(pins()["torch"])
    readme = (REPO / "README.md").read_text()
    assert f"pip install torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu" in readme
    installer = (REPO / ".ci" / "install_torch_cpu.sh").read_text()
    assert "https://download.pytorch.org/whl/cpu" in installer and "constraints.txt" in installer
    assert "pip install -r requirements.txt -c constraints.txt" in readme


def test_the_package_version_is_the_readmes():
    from tinytransformer import __version__
    assert f"Edition {__version__} " in (REPO / "README.md").read_text()
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
