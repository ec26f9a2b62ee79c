"""setup.cfg's requirements: ranges that install beside TensorRT-LLM 1.2.1 and the GPU stacks
users have, and CI's exact versions (.ci/constraints.txt) inside them.

TensorRT-LLM 1.2.1's Requires-Dist is recorded from the release's own metadata in
tests/fixtures/trtllm_1.2.1_requires.json (its "source" says where from; tests/gpu/record_requires.py
makes it). For every package both name, the two specifier sets must have a version in common.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.gpu.reqs import by_name, satisfiable, setup_requirements

REPO = Path(__file__).resolve().parents[2]
TRTLLM = json.loads((REPO / "tests/fixtures/trtllm_1.2.1_requires.json").read_text())
# TensorRT-LLM's wheels are for these (cp310/cp312, Linux): its markers are evaluated there.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}


def ours(extras: tuple[str, ...] | None = None) -> dict[str, SpecifierSet]:
    groups = setup_requirements()
    reqs = [r for name, rs in groups.items() if extras is None or name in ("install_requires", *extras) for r in rs]
    return by_name(reqs, TARGET)


def theirs() -> dict[str, SpecifierSet]:
    return by_name([Requirement(r) for r in TRTLLM["requires_dist"]], TARGET)


def conflicts(a: dict[str, SpecifierSet], b: dict[str, SpecifierSet]) -> dict[str, str]:
    return {n: f"ours {a[n]} vs TensorRT-LLM {b[n]}" for n in a.keys() & b.keys() if satisfiable(a[n] & b[n]) is None}


def test_the_fixture_is_tensorrt_llm_1_2_1_metadata():
    assert TRTLLM["version"] == "1.2.1" and canonicalize_name(TRTLLM["package"]) == "tensorrt-llm"
    t = theirs()
    assert {"torch", "transformers", "numpy"} <= t.keys()
    assert "devel" not in str(t)  # extras' requirements (pytest, mypy, ...) are not the base set


def test_our_requirements_intersect_tensorrt_llm_1_2_1_for_every_shared_package():
    a, b = ours(), theirs()
    shared = a.keys() & b.keys()
    # the ones that matter are shared (a rename in either file would silently shrink the check)
    assert {"torch", "transformers", "numpy", "mpi4py", "pydantic", "setuptools"} <= shared, sorted(shared)
    assert conflicts(a, b) == {}
    assert canonicalize_name("tensorrt-llm") in ours(("trtllm",))
    assert Version(TRTLLM["version"]) in ours(("trtllm",))["tensorrt-llm"]


def test_the_check_fails_for_the_pins_the_package_had_before():
    """torch==2.13.0 and transformers>=5 (setup.cfg until this change) cannot live beside 1.2.1."""
    before = {"torch": SpecifierSet("==2.13.0"), "transformers": SpecifierSet(">=5,<6"), "numpy": SpecifierSet("<2")}
    assert set(conflicts(before, theirs())) == {"torch", "transformers"}


@pytest.mark.parametrize("spec, inside", [
    (">=2.9.1,<=2.10.0a0", "2.9.1"), ("==4.57.3", "4.57.3"), ("~=10.14.1", "10.14.1"), ("<2", "0"),
    (">2.0,<2.0.1", "2.0.0.post1"), ("==2.9.*", "2.9"), (">=1,!=1.0", "1.0.1")])
def test_satisfiable_finds_a_version_inside(spec, inside):
    v = satisfiable(SpecifierSet(spec))
    assert v is not None and SpecifierSet(spec).contains(v, prereleases=True)


@pytest.mark.parametrize("spec", [">=2.13,<=2.10.0a0", "==2.13.0,==2.9.1", "<1,>1", ">=5,==4.57.3"])
def test_satisfiable_sees_an_empty_set(spec):
    assert satisfiable(SpecifierSet(spec)) is None


@pytest.mark.parametrize("name, version", [
    ("torch", "2.9.1"), ("torch", "2.11.0"), ("torch", "2.13.0"),
    ("transformers", "4.57.3"), ("transformers", "5.17.0"), ("transformers", "5.24.0")])
def test_the_supported_stacks_are_admitted(name, version):
    """TensorRT-LLM 1.2.1's stack, this project's GPU machine (torch 2.11, transformers 5.17) and CI."""
    assert Version(version) in ours(("test",))[name]


def test_ci_constraints_lie_inside_our_ranges():
    a = ours(tuple(setup_requirements()))
    pins = {}
    for line in (REPO / ".ci/constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            (spec,) = r.specifier
            assert spec.operator == "==", f".ci/constraints.txt: {line} is not an exact pin"
            pins[canonicalize_name(r.name)] = Version(spec.version)
    assert "torch" in pins and "transformers" in pins
    outside = {n: f"{v} not in {a[n]}" for n, v in pins.items() if n in a and v not in a[n]}
    assert outside == {}
    assert set(pins) <= set(a), f"pins for packages setup.cfg does not require: {set(pins) - set(a)}"
