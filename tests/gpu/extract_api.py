"""Signatures of the GPU-only APIs slurm-align calls, read with `ast` from the packages' files
(never imported), into the fixture tests/unit/generation/test_trtllm_engine.py checks our calls against.

    python tests/gpu/extract_api.py --package tensorrt_llm=SRC [--package transformer_engine=SRC]
        [--package megatron=SRC] [--note PKG=TEXT] [--out tests/fixtures/gpu_api.json] [--check]

SRC is a wheel (.whl), a folder holding the package (site-packages, a source checkout, an
unpacked container layer), or `installed`: this interpreter's copy, located with
importlib.util.find_spec on the top-level name (which locates without importing). `--out`
rewrites that package's entry of the fixture; `--check` compares instead and exits 1 on any
difference (tests/gpu/run_gpu_checks.sh runs it against the installed packages, so the fixture
made from published sources is confirmed against the real wheel wherever one is installed).

What is extracted per target (TARGETS): `callable` = the parameters of a function, a method
(looked up through base classes of the same module) or a class's __init__; `fields` = the
annotated class attributes of a dataclass / pydantic model and its same-module bases (public,
not ClassVar, not `field(init=False)`), with whether each has a default; `registers` = the
names a module class passes to register_parameter; `returns` = what a method returns.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import re
import sys
import zipfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_api.json"

# fixture key -> what to extract. Keys are the defining module + qualified name.
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "tensorrt_llm": {
        "tensorrt_llm.llmapi.llm.LLM": ("callable",),
        "tensorrt_llm.llmapi.llm.LLM.generate": ("callable",),
        "tensorrt_llm.llmapi.llm.LLM._collective_rpc": ("callable",),
        "tensorrt_llm.llmapi.llm.LLM.shutdown": ("callable",),
        "tensorrt_llm.llmapi.llm_args.TorchLlmArgs": ("fields",),
        "tensorrt_llm.llmapi.llm_args.KvCacheConfig": ("fields",),
        "tensorrt_llm.sampling_params.SamplingParams": ("fields",),
        "tensorrt_llm.executor.result.CompletionOutput": ("fields",),
        "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension.update_weights": ("callable",),
        "tensorrt_llm._torch.utils.get_device_uuid": ("callable",),
        "tensorrt_llm.executor.ray_gpu_worker.RayGPUWorker.sleep": ("callable",),
        "tensorrt_llm.executor.ray_gpu_worker.RayGPUWorker.wakeup": ("callable",),
    },
    "transformer_engine": {
        "transformer_engine.pytorch.module.layernorm_linear.LayerNormLinear": ("callable", "registers"),
    },
    "megatron": {
        "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec": ("callable",),
        "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec": ("callable",),
        "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed": ("callable",),
        "megatron.core.extensions.transformer_engine_spec_provider.TESpecProvider.column_parallel_layer_norm_linear":
            ("returns",),
        "megatron.core.extensions.transformer_engine.TELayerNormColumnParallelLinear": ("bases",),
    },
}
# Public names our code imports -> where they are defined (checked against the package's
# __init__ re-exports when extracting from a real package).
ALIASES = {
    "tensorrt_llm": {"tensorrt_llm.LLM": "tensorrt_llm.llmapi.llm.LLM",
                     "tensorrt_llm.SamplingParams": "tensorrt_llm.sampling_params.SamplingParams",
                     "tensorrt_llm.llmapi.KvCacheConfig": "tensorrt_llm.llmapi.llm_args.KvCacheConfig"},
    "transformer_engine": {},
    "megatron": {"megatron.core.tensor_parallel.model_parallel_cuda_manual_seed":
                 "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed"},
}


class Source:
    """Read-only access to a package's .py files: a wheel, a folder, or the installed copy."""

    def __init__(self, package: str, spec: str):
        self.package, self.spec = package, spec
        self._zip = None
        if spec == "installed":
            found = importlib.util.find_spec(package)  # locates; does not import
            if found is None or not found.submodule_search_locations:
                raise SystemExit(f"{package} is not installed in {sys.executable}")
            self.root = Path(next(iter(found.submodule_search_locations))).parent
        elif spec.endswith(".whl"):
            self._zip = zipfile.ZipFile(spec)
        else:
            self.root = Path(spec)
            if not (self.root / package).is_dir():
                raise SystemExit(f"{spec}: no {package}/ folder in it")

    def read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def version(self) -> str:
        names = self._zip.namelist() if self._zip is not None else [str(p.relative_to(self.root)) for p in
                                                                    self.root.glob("*.dist-info/METADATA")]
        dist = self.package.replace("_", "[-_]")
        for n in names:
            if re.match(rf"(?i){dist}[^/]*\.dist-info/METADATA$", n):
                m = re.search(r"^Version: (\S+)", self.read(n) or "", re.M)
                if m:
                    return m.group(1)
        text = self.read(f"{self.package}/version.py") or ""
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
        return m.group(1) if m else "unknown"


def _module_file(src: Source, dotted: str) -> tuple[ast.Module, list[str]]:
    """The module AST holding `dotted` and the qualified name inside it."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        base = "/".join(parts[:cut])
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            text = src.read(rel)
            if text is not None:
                return ast.parse(text), parts[cut:]
    raise KeyError(f"{dotted}: no module file for it in {src.spec}")


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _mro(tree: ast.Module, cls: ast.ClassDef) -> list[ast.ClassDef]:
    """The class and its bases defined in the same module, nearest first."""
    classes, out, todo = _classes(tree), [], [cls]
    while todo:
        c = todo.pop(0)
        if c in out:
            continue
        out.append(c)
        todo += [classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes]
    return out


def _method(tree: ast.Module, cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for c in _mro(tree, cls):
        for n in c.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return n
    return None


def _params(fn: ast.FunctionDef, method: bool) -> dict:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [{"name": p.arg, "kind": "positional", "required": d is None} for p, d in zip(positional, defaults)]
    params += [{"name": p.arg, "kind": "keyword_only", "required": d is None}
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if method and params and params[0]["name"] in ("self", "cls"):
        params = params[1:]
    return {"params": params, "var_positional": a.vararg is not None, "var_keyword": a.kwarg is not None}


def _fields(tree: ast.Module, cls: ast.ClassDef) -> dict:
    fields: dict[str, bool] = {}
    for c in reversed(_mro(tree, cls)):  # bases first, subclasses override
        for n in c.body:
            if not (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
                continue
            name, ann, value = n.target.id, ast.unparse(n.annotation), n.value
            if name.startswith("_") or ann.startswith("ClassVar"):
                continue
            call = value if isinstance(value, ast.Call) else None
            kw = {k.arg: k.value for k in call.keywords} if call is not None else {}
            if call is not None and ast.unparse(call.func) in ("field", "dataclasses.field") and \
                    isinstance(kw.get("init"), ast.Constant) and kw["init"].value is False:
                continue
            has_default = value is not None and not (
                call is not None and ast.unparse(call.func) == "Field" and not call.args
                and "default" not in kw and "default_factory" not in kw)
            fields[name] = not has_default
    return {"fields": [{"name": k, "required": v} for k, v in fields.items()]}


def extract(src: Source, key: str, kinds: tuple[str, ...]) -> dict:
    tree, qual = _module_file(src, key)
    node = next((n for n in tree.body if getattr(n, "name", None) == qual[0]), None)
    if node is None:
        raise KeyError(f"{key}: {qual[0]} not found in its module")
    member = None
    if len(qual) == 2:
        member = _method(tree, node, qual[1])
        if member is None:
            raise KeyError(f"{key}: no method {qual[1]} in {qual[0]} or its bases")
    out: dict = {}
    for kind in kinds:
        if kind == "callable":
            if member is not None:
                out.update(_params(member, method=True))
            elif isinstance(node, ast.ClassDef):
                init = _method(tree, node, "__init__")
                out.update(_params(init, method=True) if init is not None else _fields(tree, node))
            else:
                out.update(_params(node, method=False))
        elif kind == "fields":
            out.update(_fields(tree, node))
        elif kind == "registers":
            out["registers"] = sorted({c.args[0].value for c in ast.walk(node) if isinstance(c, ast.Call)
                                       and isinstance(c.func, ast.Attribute) and c.func.attr == "register_parameter"
                                       and c.args and isinstance(c.args[0], ast.Constant)})
        elif kind == "returns":
            out["returns"] = sorted({ast.unparse(r.value) for r in ast.walk(member or node)
                                     if isinstance(r, ast.Return) and r.value is not None})
        elif kind == "bases":
            out["bases"] = [ast.unparse(b) for b in node.bases]
    return out


def literal_choices(src: Source) -> dict[str, list]:
    """The Literal[...] choices and enum values our literal arguments are checked against, as the
    package states them (compared with the fixture's "literals" by --check)."""
    out: dict[str, list] = {}
    text = src.read("tensorrt_llm/llmapi/llm_args.py") or ""
    tree = ast.parse(text) if text else ast.Module(body=[], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in ("SamplerType", "LoadFormat"):
            out[node.name] = [t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                              if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                node.target.id in ("orchestrator_type", "allreduce_strategy"):
            out[node.target.id] = sorted({c.value for c in ast.walk(node.annotation)
                                          if isinstance(c, ast.Constant) and isinstance(c.value, str)})
    vm = src.read("tensorrt_llm/_torch/virtual_memory.py") or ""
    for node in ast.walk(ast.parse(vm)) if vm else []:
        if isinstance(node, ast.ClassDef) and node.name == "ExecutorMemoryType":
            out["ExecutorMemoryType"] = [n.value.value for n in node.body if isinstance(n, ast.Assign)
                                         and isinstance(n.value, ast.Constant)]
    return out


def reexported(src: Source, public: str) -> bool:
    """Whether `a.b.Name` is importable as written: Name bound in a/b/__init__.py (or a/b.py)."""
    module, name = public.rsplit(".", 1)
    base = module.replace(".", "/")
    text = src.read(f"{base}/__init__.py") or src.read(f"{base}.py")
    if text is None:
        return False
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name for a in n.names):
            return True
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name:
            return True
    return False


def package_entry(package: str, src: Source, note: str | None) -> dict:
    objects = {key: extract(src, key, kinds) for key, kinds in TARGETS[package].items()}
    aliases = ALIASES[package]
    missing = [a for a in aliases if not reexported(src, a)]
    entry = {"version": src.version(), "source": note or f"extracted with ast from {src.spec}",
             "aliases": aliases, "objects": objects}
    if package == "tensorrt_llm":
        entry["literals_read"] = literal_choices(src)
    if missing:
        entry["aliases_not_reexported"] = missing
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", action="append", default=[], metavar="PKG=SRC", required=True)
    ap.add_argument("--note", action="append", default=[], metavar="PKG=TEXT",
                    help="where the sources came from, recorded in the fixture")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    notes = dict(n.split("=", 1) for n in args.note)
    fixture = json.loads(args.out.read_text()) if args.out.is_file() else {}
    status = 0
    for item in args.package:
        package, spec = item.split("=", 1)
        if package not in TARGETS:
            raise SystemExit(f"--package {package}: allowed {sorted(TARGETS)}")
        entry = package_entry(package, Source(package, spec), notes.get(package))
        if not args.check:
            keep = {k: v for k, v in fixture.get(package, {}).items()
                    if k in ("literals", "defaults", "memory_tags", "literals_source")}
            fixture[package] = {**entry, **keep}
            continue
        want = fixture.get(package, {}).get("objects", {})
        diff = [k for k in entry["objects"] if entry["objects"][k] != want.get(k)]
        report = io.StringIO()
        for k in diff:
            print(f"{package} {entry['version']}: {k}\n  fixture: {json.dumps(want.get(k))}\n"
                  f"  package: {json.dumps(entry['objects'][k])}", file=report)
        lits = entry.get("literals_read", {})
        want_lits = fixture.get(package, {}).get("literals", {})
        for key, short in (("TorchLlmArgs.sampler_type", "SamplerType"), ("TorchLlmArgs.orchestrator_type",
                                                                          "orchestrator_type"),
                           ("TorchLlmArgs.allreduce_strategy", "allreduce_strategy")):
            if short in lits and key in want_lits:
                wanted = sorted(c for c in want_lits[key]["choices"] if c is not None)
                if sorted(lits[short]) != wanted:
                    diff.append(key)
                    print(f"{package}: {key} choices {lits[short]} in the package, {wanted} in the fixture",
                          file=report)
        tags = lits.get("ExecutorMemoryType")
        fixture_tags = fixture.get(package, {}).get("memory_tags", {}).get("values", [])
        if tags is not None and sorted(tags) != sorted(fixture_tags):
            diff.append("memory_tags")
            print(f"{package}: memory tags {tags} in the package differ from the fixture's", file=report)
        for a in entry.get("aliases_not_reexported", []):
            print(f"{package}: {a} is not re-exported where our code imports it", file=report)
        print(report.getvalue() or f"{package} {entry['version']}: matches the fixture", end="" if diff else "\n")
        status |= bool(diff or entry.get("aliases_not_reexported"))
    if not args.check:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
