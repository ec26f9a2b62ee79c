"""Record a package release's Requires-Dist into a fixture, from its real metadata.

    python tests/gpu/record_requires.py SRC --source TEXT [--out tests/fixtures/trtllm_1.2.1_requires.json]

SRC: an sdist (.tar.gz, its PKG-INFO), a wheel (.whl, its dist-info/METADATA) or a metadata file.
For TensorRT-LLM, PyPI's sdist is a stub (wheel-stub fetches the real wheel from NVIDIA's index at
install time) whose PKG-INFO carries the release's Requires-Dist; NVIDIA's wheel holds the same.
tests/unit/test_requirements.py intersects our setup.cfg with what is recorded.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import json
import sys
import tarfile
import zipfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trtllm_1.2.1_requires.json"


def read_metadata(src: Path) -> str:
    if src.name.endswith(".whl"):
        with zipfile.ZipFile(src) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode()
    if src.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(src) as t:
            member = min((m for m in t.getmembers() if m.name.endswith("/PKG-INFO")), key=lambda m: m.name.count("/"))
            return t.extractfile(member).read().decode()
    return src.read_text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--source", required=True, help="where SRC came from (URL), recorded in the fixture")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args(argv)
    msg = email.message_from_string(read_metadata(args.src))
    out = {"package": msg["Name"], "version": msg["Version"], "requires_python": msg["Requires-Python"],
           "source": args.source, "requires_dist": msg.get_all("Requires-Dist") or []}
    if args.src.name.endswith((".tar.gz", ".tgz", ".whl")):
        out["file_sha256"] = hashlib.sha256(args.src.read_bytes()).hexdigest()
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['package']} {out['version']}: {len(out['requires_dist'])} Requires-Dist -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
