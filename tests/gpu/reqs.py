"""setup.cfg's requirements read as `packaging` objects, and whether specifier sets intersect.

Shared by tests/unit/test_requirements.py (our ranges against TensorRT-LLM 1.2.1's Requires-Dist)
and tests/gpu/make_wheelhouse.py (what a GPU machine must be brought). Reads setup.cfg with
configparser: no build backend, no import of the package.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"


def _lines(text: str) -> list[Requirement]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(Requirement(line))
    return out


def setup_requirements(setup_cfg: Path = SETUP_CFG) -> dict[str, list[Requirement]]:
    """{"install_requires": [...], "<extra>": [...]} as setup.cfg states them."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    out = {"install_requires": _lines(cfg["options"]["install_requires"])}
    if cfg.has_section("options.extras_require"):
        for extra, text in cfg["options.extras_require"].items():
            out[extra] = _lines(text)
    return out


def by_name(reqs: list[Requirement], env: dict[str, str] | None = None) -> dict[str, SpecifierSet]:
    """Specifiers per canonical name (several lines for a name are ANDed); requirements whose
    marker is false in `env` (default: this interpreter, no extra) are left out."""
    out: dict[str, SpecifierSet] = {}
    for r in reqs:
        if r.marker is not None and not r.marker.evaluate({"extra": "", **(env or {})}):
            continue
        name = canonicalize_name(r.name)
        out[name] = out.get(name, SpecifierSet()) & r.specifier
    return out


def _candidates(spec: SpecifierSet) -> list[Version]:
    """Versions at and next to every bound of `spec`: if any version satisfies it, one of these
    does (bounds are the only places where membership changes)."""
    out = [Version("0")]
    for s in spec:
        text = s.version.removesuffix(".*")
        try:
            v = Version(text)
        except InvalidVersion:
            continue
        rel = list(v.release) + [0] * (3 - len(v.release))
        out.append(v)
        for i in range(len(rel)):
            up = rel[: i + 1]
            up[-1] += 1
            out.append(Version(".".join(map(str, up))))
            if rel[i] > 0:
                down = rel[: i + 1]
                down[-1] -= 1
                out.append(Version(".".join(map(str, [*down, 999]))))
        out.append(Version(f"{v.base_version}.post1"))
    return out


def satisfiable(spec: SpecifierSet) -> Version | None:
    """A version inside `spec` (pre-releases allowed), or None when the set is empty."""
    return next((v for v in sorted(set(_candidates(spec))) if spec.contains(v, prereleases=True)), None)
