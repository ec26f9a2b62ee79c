"""The wheels an offline GPU machine needs to run slurm-align's GPU checks, and nothing more.

    python tests/gpu/make_wheelhouse.py DIR [--have tests/gpu/gpu_machine_packages.txt]
        [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--test-deps LIST]
        [--extras EXTRAS] [--max-mib 40]

Run where the package registry is reachable (tests/gpu/make_wheelhouse.sh is the entry point).
1. What the GPU checks need: setup.cfg's install_requires (gpu_checks.py and the gpu tests import
   the package), the test extra's entries named in --test-deps (default GPU_CHECK_TEST_DEPS: the
   test runner, its plugins setup.cfg's addopts and markers use, transformers as the numerical
   reference) and any whole extras given with --extras (none by default: the rest of the test
   extra, wandb, mlflow, shellcheck, ..., serves no GPU check). Less what the target has (--have,
   one name or name==version a line: the target's full package list) and less what cannot travel
   (SKIP: TensorRT-LLM, Transformer Engine, PyTriton: too large, or CUDA builds; their checks skip
   on the target).
2. Their dependency closure, level by level with `pip download --no-deps` of binary wheels for
   the target's interpreter and platform, each wheel's own Requires-Dist giving the next level;
   not descending into a package the target has (its dependencies are there) or a skipped one,
   so torch and its CUDA wheels are never resolved. CI's pins (.ci/constraints.txt) choose the
   versions where they apply: exactly these wheels are downloaded.
3. Over --max-mib in all: refused, the folder left without them, the largest named.
DIR gets the wheels and MANIFEST.txt (name, version, size, who needs it; what was skipped, why).
"""

from __future__ import annotations

import argparse
import email
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.gpu.reqs import setup_requirements

REPO = Path(__file__).resolve().parents[2]
HAVE = Path(__file__).resolve().parent / "gpu_machine_packages.txt"
SKIP = {
    "tensorrt-llm": "GBs, from NVIDIA's index or container only; the TensorRT-LLM checks skip",
    "transformer-engine": "CUDA build (hundreds of MiB); the TE-spec checks skip",
    "nvidia-pytriton": "ships tritonserver (~100 MiB+) and needs numpy<2; the critic's checks skip",
}
# Of setup.cfg's test extra, what the GPU checks use: pytest and the plugins setup.cfg's addopts
# (-n, --dist: xdist) and the tests' hang guards (timeout marks) need; transformers, the
# numerical reference of gpu_checks.py and the gpu tests.
GPU_CHECK_TEST_DEPS = ("pytest", "pytest-xdist", "pytest-timeout", "transformers")
MANYLINUX = ("manylinux2014", "manylinux_2_17", "manylinux_2_24", "manylinux_2_26", "manylinux_2_27", "manylinux_2_28")


def read_have(path: Path) -> dict[str, Requirement]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            out[canonicalize_name(r.name)] = r
    return out


def target_env(python_version: str, platform: str) -> dict[str, str]:
    machine = platform.rsplit("_", 1)[-1] if not platform.endswith("x86_64") else "x86_64"
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": machine, "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix"}


def platforms(platform: str) -> list[str]:
    """The platform and the older manylinux tags a machine of it runs."""
    arch = "x86_64" if platform.endswith("x86_64") else platform.rsplit("_", 1)[-1]
    base = [f"{m}_{arch}" for m in MANYLINUX]
    if platform.startswith("manylinux_"):
        newest = platform.replace("manylinux2014", "manylinux_2_17")
        return [platform, *[p for p in base if p != platform and p <= newest]]
    return [platform, *[p for p in base if p != platform][:2]]


def pip_flags(python_version: str, platform: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
             "--abi", "cp" + python_version.replace(".", "")]
    for p in platforms(platform):
        flags += ["--platform", p]
    return flags


def wanted(extras: list[str], have: dict, env: dict,
           test_deps: tuple[str, ...] = GPU_CHECK_TEST_DEPS) -> tuple[list[Requirement], dict[str, str]]:
    """setup.cfg's requirements the GPU checks need (install_requires, the test extra's entries
    named in `test_deps`, whole `extras`) less what the target has: (to bring, {skipped: why})."""
    groups = setup_requirements()
    picked = {canonicalize_name(n) for n in test_deps}
    in_test = {canonicalize_name(r.name): r for r in groups.get("test", [])}
    unknown = sorted(picked - set(in_test))
    if unknown:
        raise SystemExit(f"--test-deps {unknown}: setup.cfg's test extra has {sorted(in_test)}")
    chosen = [*groups["install_requires"], *(in_test[n] for n in sorted(picked))]
    for group in extras:
        if group not in groups:
            raise SystemExit(f"--extras {group}: setup.cfg has {sorted(groups)}")
        chosen += groups[group]
    reqs, skipped = [], {}
    for r in chosen:
        name = canonicalize_name(r.name)
        if r.marker is not None and not r.marker.evaluate({"extra": "", **env}):
            continue
        if name in SKIP:
            skipped[name] = SKIP[name]
        elif name not in have:
            reqs.append(r)
    return reqs, skipped


def pins(have: dict[str, Requirement]) -> dict[str, Requirement]:
    """CI's exact versions (.ci/constraints.txt) for what the target lacks: the combination CI proves."""
    out = {}
    for line in (REPO / ".ci/constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            if canonicalize_name(r.name) not in have:
                out[canonicalize_name(r.name)] = r
    return out


def _quiet_env() -> dict[str, str]:
    # the registry only: no local find-links folders or file:// indexes of this machine
    return {**os.environ, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}


def wheel_requires(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist) from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = email.message_from_string(z.read(meta).decode())
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def collect(reqs: list[Requirement], have: dict, env: dict, flags: list[str], dl: Path) -> dict[str, dict]:
    """Breadth-first over Requires-Dist, one `pip download --no-deps` per level (binary wheels
    for the target): name -> {version, wheel, needed_by}. Stops at what the target has (its own
    dependencies are there) and at what is skipped. Greedy: the first version chosen for a name
    must satisfy everything that later asks for it (else a clear error); CI's pins keep the
    choices to the versions CI runs. Torch and the target's other packages are never resolved."""
    fixed = pins(have)
    need: dict[str, dict] = {}
    level = [(r, "slurm-align") for r in reqs]
    while level:
        ask: dict[str, Requirement] = {}
        asked_by: dict[str, set[str]] = {}
        for r, parent in level:
            name = canonicalize_name(r.name)
            if name in have or name in SKIP:
                continue
            if name in need:
                if need[name]["version"] not in r.specifier:
                    raise SystemExit(f"{parent} needs {r}, but {name} {need[name]['version']} was already chosen "
                                     f"(for {sorted(need[name]['needed_by'])}): add a pin to the --have list")
                need[name]["needed_by"].add(parent)
                need[name]["extras"] |= set(r.extras)  # extras first seen later: not followed (rare)
                continue
            prev = ask.get(name)
            spec = r.specifier & (prev.specifier if prev else r.specifier)
            if name in fixed:
                spec &= fixed[name].specifier
            merged = Requirement(f"{name}{spec}")
            merged.extras = set(r.extras) | (prev.extras if prev else set())
            ask[name] = merged
            asked_by.setdefault(name, set()).add(parent)
        if not ask:
            break
        before = set(dl.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
               "-d", str(dl), *flags, *(f"{n}{r.specifier}" for n, r in ask.items())]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_quiet_env())
        if proc.returncode:
            err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location"))
            raise SystemExit(f"pip download {sorted(ask)} for the target failed:\n{err[-3000:]}")
        level = []
        for w in sorted(set(dl.glob("*.whl")) - before):
            name, version, requires = wheel_requires(w)
            key = canonicalize_name(name)
            r = ask[key]
            need[key] = {"version": Version(version), "wheel": w, "needed_by": asked_by[key], "extras": set(r.extras)}
            for line in requires:
                dep = Requirement(line)
                if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in {"", *r.extras}):
                    level.append((dep, key))
        missing = set(ask) - {n for n in need}
        if missing:
            raise SystemExit(f"pip download gave no wheel for {sorted(missing)}")
    return need


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--have", type=Path, default=HAVE, help="what the target has (name or name==version a line)")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64")
    ap.add_argument("--test-deps", default=",".join(GPU_CHECK_TEST_DEPS),
                    help="comma-separated entries of setup.cfg's test extra the checks need")
    ap.add_argument("--extras", default="", help="comma-separated whole extras of setup.cfg to bring too")
    ap.add_argument("--max-mib", type=float, default=40.0,
                    help="refuse above this (the checkout and the wheels travel within 64 MiB)")
    args = ap.parse_args(argv)
    env = target_env(args.python_version, args.platform)
    have = read_have(args.have)
    extras = [e for e in args.extras.split(",") if e]
    reqs, skipped = wanted(extras, have, env, tuple(n for n in args.test_deps.split(",") if n))
    flags = pip_flags(args.python_version, args.platform)
    with tempfile.TemporaryDirectory() as tmp:
        dl = Path(tmp)
        need = collect(reqs, have, env, flags, dl)
        wheels = sorted(e["wheel"] for e in need.values())
        total = sum(w.stat().st_size for w in wheels)
        if total > args.max_mib * 2**20:
            biggest = ", ".join(f"{w.name} {w.stat().st_size / 2**20:.1f} MiB"
                                for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:5])
            print(f"make_wheelhouse: REFUSED: the wheels come to {total / 2**20:.1f} MiB, over the limit of "
                  f"{args.max_mib:g} MiB (--max-mib); nothing written to {args.dir}. Largest: {biggest}",
                  file=sys.stderr)
            return 2
        args.dir.mkdir(parents=True, exist_ok=True)
        lines = [f"# wheels for cp{args.python_version.replace('.', '')} {args.platform}; target has: "
                 f"{', '.join(sorted(have))}", f"# total {total / 2**20:.1f} MiB"]
        for w in wheels:
            name = canonicalize_name(parse_wheel_filename(w.name)[0])
            os.replace(w, args.dir / w.name)
            lines.append(f"{w.name}\t{(args.dir / w.name).stat().st_size}\t"
                         f"needed by {', '.join(sorted(need[name]['needed_by']))}")
        lines += [f"# skipped {n}: {why}" for n, why in sorted(skipped.items())]
        (args.dir / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print(f"make_wheelhouse: {len(wheels)} wheels, {total / 2**20:.1f} MiB -> {args.dir}")
    for n, why in sorted(skipped.items()):
        print(f"  skipped {n}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
