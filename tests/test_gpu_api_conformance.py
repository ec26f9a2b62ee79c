"""Every call our GPU-only code makes into TensorRT-LLM, Transformer Engine and megatron-core's
GPU paths, checked on CPU against the signatures in tests/fixtures/gpu_api.json (extracted with
`ast` from the packages' sources by tests/gpu/extract_api.py; nothing GPU-only is imported here).

A call is found with `ast` in our source: a name imported from one of those packages, a method
on the object holding the LLM (`self._llm`), the worker method named in `_collective_rpc`, and
the CompletionOutput attributes the engine reads. Each must exist in the fixture with the
keywords we pass (LLM's **kwargs are TorchLlmArgs fields, as LLM validates them), enough
positional room, and every required argument given; a `**` splat cannot be checked and is an
error. A rename or a wrong keyword in the GPU path therefore fails here, on CPU.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from slurm_align.models import te_names

REPO = Path(__file__).resolve().parents[1]
# GPU_API_FIXTURE: signatures extracted from installed packages instead (run_gpu_checks.sh).
FIXTURE = json.loads(Path(os.environ.get("GPU_API_FIXTURE", REPO / "tests/fixtures/gpu_api.json")).read_text())
OBJECTS = {k: v for pkg in FIXTURE.values() for k, v in pkg["objects"].items()}
ALIASES = {k: v for pkg in FIXTURE.values() for k, v in pkg["aliases"].items()}
CHECKED_PACKAGES = ("tensorrt_llm", "transformer_engine")  # every call into these must be in the fixture
GPU_SOURCES = ("slurm_align/generation/trtllm_engine.py", "slurm_align/models/gpt.py",
               "slurm_align/models/cpu_compat.py")
INSTANCES = {"self._llm": "tensorrt_llm.llmapi.llm.LLM"}  # expressions holding a TensorRT-LLM object
KWARGS_FIELDS = {"tensorrt_llm.llmapi.llm.LLM": ("tensorrt_llm.llmapi.llm_args.TorchLlmArgs", {"backend"})}
RPC_TARGET = {"tensorrt_llm.llmapi.llm.LLM._collective_rpc": "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"}
ATTRIBUTE_READS = {"c": "tensorrt_llm.executor.result.CompletionOutput"}  # engine._collect's completion


def _imports(tree: ast.AST) -> dict[str, str]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name.split(".")[0] if a.asname is None else a.name
    return names


def _target(func: ast.expr, names: dict[str, str]) -> str | None:
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute):
        owner = ast.unparse(func.value)
        if owner in INSTANCES:
            return f"{INSTANCES[owner]}.{func.attr}"
        if isinstance(func.value, ast.Name) and func.value.id in names:
            return f"{names[func.value.id]}.{func.attr}"
    return None


def _signature(key: str) -> dict:
    obj = OBJECTS[key]
    if "params" in obj:
        return obj
    return {"params": [{"name": f["name"], "kind": "keyword_only", "required": f["required"]} for f in obj["fields"]],
            "var_positional": False, "var_keyword": False}


def check_call(key: str, call: ast.Call, where: str) -> list[str]:
    """Problems of one call against the fixture's signature of `key`."""
    key = ALIASES.get(key, key)
    if key not in OBJECTS:
        return [f"{where}: {key} is not in tests/fixtures/gpu_api.json (add it to tests/gpu/extract_api.py TARGETS)"]
    sig = _signature(key)
    params = {p["name"]: p for p in sig["params"]}
    positional = [p for p in sig["params"] if p["kind"] == "positional"]
    problems = []
    if any(isinstance(a, ast.Starred) for a in call.args):
        problems.append(f"{where}: *args into {key} cannot be checked")
    if len(call.args) > len(positional) and not sig["var_positional"]:
        problems.append(f"{where}: {key} takes {len(positional)} positional arguments, given {len(call.args)}")
    given = {p["name"] for p in positional[: len(call.args)]}
    for kw in call.keywords:
        if kw.arg is None:
            problems.append(f"{where}: **{ast.unparse(kw.value)} into {key} cannot be checked")
        elif kw.arg in params:
            given.add(kw.arg)
        elif sig["var_keyword"] and key in KWARGS_FIELDS:
            fields_key, extra = KWARGS_FIELDS[key]
            if kw.arg not in {f["name"] for f in OBJECTS[fields_key]["fields"]} | extra:
                problems.append(f"{where}: {key}(**kwargs) takes {fields_key} fields; {kw.arg!r} is not one")
        elif not sig["var_keyword"]:
            problems.append(f"{where}: {key} has no parameter {kw.arg!r}")
    missing = [n for n, p in params.items() if p["required"] and n not in given]
    if missing:
        problems.append(f"{where}: {key} requires {missing}")
    if key in RPC_TARGET:
        problems += _check_rpc(key, call, where)
    return problems


def _check_rpc(key: str, call: ast.Call, where: str) -> list[str]:
    method = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "method"), None)
    if not isinstance(method, ast.Constant):
        return [f"{where}: the worker method of {key} must be a literal to be checked"]
    remote = f"{RPC_TARGET[key]}.{method.value}"
    args = next((k.value for k in call.keywords if k.arg == "args"), call.args[1] if len(call.args) > 1 else None)
    fake = ast.Call(func=ast.Name("remote"), args=list(args.elts) if isinstance(args, ast.Tuple) else [], keywords=[])
    if args is not None and not isinstance(args, ast.Tuple):
        return [f"{where}: args of {key} must be a literal tuple to be checked"]
    return check_call(remote, fake, where)


def problems_in(source: str, filename: str) -> list[str]:
    """Every problem of the GPU-only calls in one source file."""
    tree = ast.parse(source)
    names = {k: v for k, v in _imports(tree).items() if v.split(".")[0] in (*CHECKED_PACKAGES, "megatron")}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            key = _target(node.func, names)
            if key is None:
                continue
            canonical = ALIASES.get(key, key)
            checked = key.split(".")[0] in CHECKED_PACKAGES or canonical in OBJECTS
            if checked:
                problems += check_call(key, node, f"{filename}:{node.lineno}")
        elif isinstance(node, ast.FunctionDef) and node.name == "_collect":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ATTRIBUTE_READS:
                    obj = OBJECTS[ATTRIBUTE_READS[sub.value.id]]
                    if sub.attr not in {f["name"] for f in obj["fields"]}:
                        problems.append(f"{filename}:{sub.lineno}: CompletionOutput has no field {sub.attr!r}")
    return problems


def _source(rel: str) -> str:
    return (REPO / rel).read_text()


@pytest.mark.parametrize("rel", GPU_SOURCES)
def test_gpu_calls_match_the_real_signatures(rel):
    assert problems_in(_source(rel), rel) == []


def test_the_gpu_calls_are_found():
    """The check sees the GPU-only calls at all (an empty scan would pass anything)."""
    found = set()
    for rel in GPU_SOURCES:
        tree = ast.parse(_source(rel))
        names = _imports(tree)
        found |= {ALIASES.get(k, k) for k in (_target(n.func, names) for n in ast.walk(tree)
                                              if isinstance(n, ast.Call)) if k}
    for key in ("megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec",
                "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed",
                "tensorrt_llm.llmapi.llm.LLM", "tensorrt_llm.llmapi.llm.LLM.generate",
                "tensorrt_llm.llmapi.llm.LLM._collective_rpc", "tensorrt_llm.llmapi.llm.LLM.shutdown",
                "tensorrt_llm.sampling_params.SamplingParams", "tensorrt_llm.llmapi.llm_args.KvCacheConfig",
                "tensorrt_llm._torch.utils.get_device_uuid"):
        assert key in found, key


@pytest.mark.parametrize("old, new, message", [
    ("max_tokens=params.max_new_tokens", "max_new_tokens=params.max_new_tokens", "no parameter 'max_new_tokens'"),
    ("orchestrator_type=\"ray\"", "orchestrator=\"ray\"", "'orchestrator' is not one"),
    ("free_gpu_memory_fraction=", "free_gpu_mem_fraction=", "no parameter 'free_gpu_mem_fraction'"),
    ('_collective_rpc("update_weights", args=(None,))', '_collective_rpc("update_weight", args=(None,))',
     "WorkerExtension.update_weight is not in"),
    ("use_tqdm=False)", "use_tqdm=False, **{})", "cannot be checked"),
    ("return LLM(model=str(self.workdir), ", "return LLM(", "requires ['model']"),
])
def test_a_wrong_call_fails_the_check(old, new, message):
    src = _source(GPU_SOURCES[0])
    assert old in src, f"the engine no longer contains {old!r}: update this test"
    assert any(message in p for p in problems_in(src.replace(old, new, 1), "engine")), message


def test_a_wrong_attribute_read_fails_the_check():
    src = _source(GPU_SOURCES[0]).replace("c.finish_reason", "c.stop_status", 1)
    assert any("no field 'stop_status'" in p for p in problems_in(src, "engine"))


def test_te_names_match_transformer_engine_and_megatron():
    """te_names' table is what megatron-core's TE spec + Transformer Engine really create."""
    te = OBJECTS["transformer_engine.pytorch.module.layernorm_linear.LayerNormLinear"]
    fused = {name.rsplit(".", 1)[1] for name in te_names._TE_TO_LOCAL}
    assert fused <= set(te["registers"]), (fused, te["registers"])
    provider = OBJECTS["megatron.core.extensions.transformer_engine_spec_provider.TESpecProvider."
                       "column_parallel_layer_norm_linear"]
    assert provider["returns"] == ["TELayerNormColumnParallelLinear"]
    assert OBJECTS["megatron.core.extensions.transformer_engine.TELayerNormColumnParallelLinear"]["bases"] == \
        ["te.pytorch.LayerNormLinear"]


def test_megatron_part_of_the_fixture_is_what_extract_api_reads_now():
    """The committed megatron-core signatures are the installed 0.16.1's, read with ast."""
    from tests.gpu import extract_api

    assert extract_api.main(["--package", "megatron=installed", "--check"]) == 0


def test_extract_api_reads_signatures_fields_and_flags_a_change(tmp_path):
    from tests.gpu import extract_api

    pkg = tmp_path / "tree" / "tensorrt_llm"
    (pkg / "llmapi").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .llmapi.llm import LLM\n")
    (pkg / "llmapi" / "__init__.py").write_text("")
    (pkg / "llmapi" / "llm.py").write_text(
        "class Base:\n    def generate(self, inputs, sampling_params=None, *, use_tqdm: bool = True): ...\n"
        "class LLM(Base):\n    def __init__(self, model, dtype='auto', **kwargs): ...\n")
    (pkg / "llmapi" / "llm_args.py").write_text(
        "class Base(StrictBaseModel):\n    model: str = Field(description='x')\n    max_seq_len: int = Field(default=None)\n"
        "class TorchLlmArgs(Base):\n    enable_sleep: bool = False\n    _private: int = 0\n    kind: ClassVar[str] = 'x'\n")
    src = extract_api.Source("tensorrt_llm", str(tmp_path / "tree"))
    assert extract_api.extract(src, "tensorrt_llm.llmapi.llm.LLM.generate", ("callable",)) == {
        "params": [{"name": "inputs", "kind": "positional", "required": True},
                   {"name": "sampling_params", "kind": "positional", "required": False},
                   {"name": "use_tqdm", "kind": "keyword_only", "required": False}],
        "var_positional": False, "var_keyword": False}
    fields = extract_api.extract(src, "tensorrt_llm.llmapi.llm_args.TorchLlmArgs", ("fields",))["fields"]
    assert fields == [{"name": "model", "required": True}, {"name": "max_seq_len", "required": False},
                      {"name": "enable_sleep", "required": False}]
    assert extract_api.reexported(src, "tensorrt_llm.LLM") and not extract_api.reexported(src, "tensorrt_llm.Other")
    # --check fails when the package no longer matches the fixture
    changed = json.loads(json.dumps(FIXTURE))
    key = "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed"
    changed["megatron"]["objects"][key]["params"][0]["name"] = "random_seed"
    (tmp_path / "fixture.json").write_text(json.dumps(changed))
    assert extract_api.main(["--package", "megatron=installed", "--check", "--out", str(tmp_path / "fixture.json")]) == 1
