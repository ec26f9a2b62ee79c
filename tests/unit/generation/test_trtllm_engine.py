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
import contextlib
import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slurm_align.models import te_names
from tests.integration.test_generation_trtllm import QWEN, megatron_full  # imported before any fake tensorrt_llm

REPO = Path(__file__).resolve().parents[3]
# GPU_API_FIXTURE: signatures extracted from installed packages instead (run_gpu_checks.sh).
FIXTURE = json.loads(Path(os.environ.get("GPU_API_FIXTURE", REPO / "tests/fixtures/gpu_api.json")).read_text())
OBJECTS = {k: v for pkg in FIXTURE.values() for k, v in pkg["objects"].items()}
ALIASES = {k: v for pkg in FIXTURE.values() for k, v in pkg["aliases"].items()}
CHECKED_PACKAGES = ("tensorrt_llm", "transformer_engine")  # every call into these must be in the fixture
GPU_SOURCES = ("slurm_align/generation/trtllm_engine.py", "slurm_align/models/gpt.py",
               "slurm_align/models/cpu_compat.py")
INSTANCES = {"self._llm": "tensorrt_llm.llmapi.llm.LLM"}  # expressions holding a TensorRT-LLM object
KWARGS_FIELDS = {"tensorrt_llm.llmapi.llm.LLM": ("tensorrt_llm.llmapi.llm_args.TorchLlmArgs", {"backend"})}
# _collective_rpc's method runs on TensorRT-LLM's Ray worker: its extension class first, then the worker itself
RPC_TARGET = {"tensorrt_llm.llmapi.llm.LLM._collective_rpc": ("tensorrt_llm.llmapi.rlhf_utils.WorkerExtension",
                                                              "tensorrt_llm.executor.ray_gpu_worker.RayGPUWorker")}
ATTRIBUTE_READS = {"c": "tensorrt_llm.executor.result.CompletionOutput"}  # collect_outputs' completion


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
    owners = RPC_TARGET[key]
    remote = next((f"{o}.{method.value}" for o in owners if f"{o}.{method.value}" in OBJECTS),
                  f"{owners[0]}.{method.value}")
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
        elif isinstance(node, ast.FunctionDef) and node.name in ("_collect", "collect_outputs"):  # the reader
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in ATTRIBUTE_READS):
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
    ("orchestrator_type=ORCHESTRATOR", "orchestrator=ORCHESTRATOR", "'orchestrator' is not one"),
    ("free_gpu_memory_fraction=", "free_gpu_mem_fraction=", "no parameter 'free_gpu_mem_fraction'"),
    ('_collective_rpc("update_weights", args=(None,))', '_collective_rpc("update_weight", args=(None,))',
     "WorkerExtension.update_weight is not in"),
    ('_collective_rpc("wakeup", args=(wake,))', '_collective_rpc("wakeup", args=(wake, True))',
     "RayGPUWorker.wakeup takes 1 positional arguments, given 2"),
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
        "class Base(StrictBaseModel):\n    model: str = Field(description='x')\n"
        "    max_seq_len: int = Field(default=None)\n"
        "class TorchLlmArgs(Base):\n    enable_sleep: bool = False\n    _private: int = 0\n"
        "    kind: ClassVar[str] = 'x'\n")
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
    assert extract_api.main(["--package", "megatron=installed", "--check",
                             "--out", str(tmp_path / "fixture.json")]) == 1


# -- literal values and the order of the engine's calls ----------------------------------------
TRT = FIXTURE["tensorrt_llm"]
ENGINE_SRC = GPU_SOURCES[0]


def _module_constants(tree: ast.Module) -> dict:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def literal_problems(source: str) -> list[str]:
    """Our literal arguments to LLM(...) against the choices the release accepts, and the memory
    tags against its ExecutorMemoryType values."""
    tree = ast.parse(source)
    consts = _module_constants(tree)
    names = _imports(tree)
    problems = []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _target(n.func, names) == "tensorrt_llm.LLM"]
    if len(calls) != 1:
        return [f"expected one LLM(...) call, found {len(calls)}"]
    kwargs = {k.arg: k.value for k in calls[0].keywords}
    for field, spec in TRT["literals"].items():
        arg = field.split(".", 1)[1]
        if arg not in kwargs:
            problems.append(f"LLM(...) does not pass {arg} (its default {spec['default']!r} is not what we need)")
            continue
        v = kwargs[arg]
        value = consts.get(v.id) if isinstance(v, ast.Name) else ast.literal_eval(v)
        if value not in spec["choices"]:
            problems.append(f"{arg}={value!r}: TensorRT-LLM accepts {spec['choices']}")
    for flag in ("enable_sleep",):
        if not (isinstance(kwargs.get(flag), ast.Constant) and kwargs[flag].value is True):
            problems.append(f"LLM(...) must pass {flag}=True")
    for arg in ("max_input_len", "max_num_tokens"):  # their defaults (1024, ...) refuse long prompts
        if arg not in kwargs:
            problems.append(f"LLM(...) must pass {arg} (default {TRT['defaults'].get('TorchLlmArgs.' + arg)})")
    tags = TRT["memory_tags"]
    for const in ("WEIGHT_TAGS", "EXTRA_TAGS", "CACHE_TAGS"):
        bad = [t for t in consts.get(const, ()) if t not in tags["values"] or t.startswith("_no_capture")]
        if bad:
            problems.append(f"{const}: {bad} are not releasable memory tags ({tags['values']})")
    if set(tags["weights"]) - set(consts.get("WEIGHT_TAGS", ())) or "kv_cache" not in consts.get("CACHE_TAGS", ()):
        problems.append("WEIGHT_TAGS must hold the weight tags and CACHE_TAGS the KV cache")
    return problems


def test_our_literal_values_are_ones_tensorrt_llm_accepts():
    assert literal_problems(_source(ENGINE_SRC)) == []


@pytest.mark.parametrize("old, new, message", [
    ('SAMPLER = "TRTLLMSampler"', 'SAMPLER = "TrtllmSampler"', "sampler_type='TrtllmSampler'"),
    ('LOAD_FORMAT = "dummy"', 'LOAD_FORMAT = "random"', "load_format='random'"),
    ('ALLREDUCE = "NCCL"', 'ALLREDUCE = "nccl"', "allreduce_strategy='nccl'"),
    ('CACHE_TAGS = ("kv_cache",', 'CACHE_TAGS = ("kv_caches",', "not releasable memory tags"),
    ("sampler_type=SAMPLER, ", "", "does not pass sampler_type"),
    ("enable_sleep=True, allreduce", "enable_sleep=False, allreduce", "enable_sleep=True"),
    ("max_input_len=self.max_input_len, ", "", "must pass max_input_len"),
])
def test_a_wrong_literal_fails_the_check(old, new, message):
    src = _source(ENGINE_SRC)
    assert old in src, f"the engine no longer contains {old!r}: update this test"
    problems = literal_problems(src.replace(old, new, 1))
    assert any(message in p for p in problems), problems


class FakeLLM:
    """Records what the engine asks of TensorRT-LLM's LLM, in order; answers generate()."""

    def __init__(self, log: list, **kwargs):
        self.log, self.kwargs, self.buckets = log, kwargs, []

    def _collective_rpc(self, method, args=None):
        (arg,) = args
        if method == "update_weights":
            if arg is None:
                self.log.append("update_weights:None")
            else:
                (_uuid, entries), = arg.items()
                self.buckets.append({n: t.clone() for n, (_, t) in entries})
                storages = {ptr for _, ((ptr, _offset), _t) in entries}
                self.log.append(f"update_weights:bucket:{len(storages)}-storage")
        else:
            self.log.append(f"{method}:{','.join(arg)}")

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.log.append("generate")
        self.sampling = sampling_params
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3, 4], finish_reason="length", logprobs=None)])
                for _ in prompts]

    def shutdown(self):
        self.log.append("shutdown")


@pytest.fixture
def fake_trtllm(monkeypatch):
    """tensorrt_llm and ray replaced by recorders (only the names the engine imports)."""
    import slurm_align.generation.trtllm_engine as eng

    log, made = [], {}

    def make_llm(**kwargs):
        made["llm"] = FakeLLM(log, **kwargs)
        made["env"] = dict(os.environ)   # what TensorRT-LLM's Ray workers would copy
        return made["llm"]

    trt = types.ModuleType("tensorrt_llm")
    trt.LLM = make_llm
    trt.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = lambda **kw: SimpleNamespace(**kw)
    torch_mod = types.ModuleType("tensorrt_llm._torch")
    utils = types.ModuleType("tensorrt_llm._torch.utils")
    utils.get_device_uuid = lambda index: f"GPU-fake-{index}"
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: "ray_init" in made
    ray.init = lambda **kw: made.update(ray_init=kw, ray_env=dict(os.environ))
    for name, mod in {"tensorrt_llm": trt, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm._torch": torch_mod,
                      "tensorrt_llm._torch.utils": utils, "ray": ray}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(eng, "import_tensorrt_llm", lambda: trt)
    # a view's "handle": its storage's address and its offset (CUDA IPC shares a storage once)
    monkeypatch.setattr(eng, "reduce_tensor", lambda t: ((t.untyped_storage().data_ptr(), t.storage_offset()), t))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")   # the fake GPU the engine is on
    return log, made


def test_refit_generate_sleep_call_order_with_a_fake_llm(fake_trtllm, tmp_path):
    """wake all but the KV cache -> update buckets (one storage each) -> final None -> wake KV
    cache -> generate -> sleep; the buckets hold every HF tensor, equal to the mapping's."""
    from slurm_align.generation.params import SamplingParams
    from slurm_align.generation.trtllm_engine import ALL_TAGS, CACHE_TAGS, EXTRA_TAGS, WEIGHT_TAGS, TrtllmEngine
    from slurm_align.generation.trtllm_mapping import hf_weights

    log, made = fake_trtllm
    engine = TrtllmEngine(QWEN, "cpu", bucket_mib=0, workdir=str(tmp_path))  # one layer per bucket
    full = megatron_full(QWEN, 0)
    prompts = [torch.tensor([1, 2, 3])]
    engine.refit(full)
    llm = made["llm"]
    first = list(log)
    assert first[-1] == "update_weights:None" and not any(e.startswith(("wakeup", "sleep")) for e in first)
    engine.generate(prompts, SamplingParams(max_new_tokens=2), seeds=[7])
    engine.sleep()
    log.clear()
    llm.buckets.clear()
    engine.refit(full)
    engine.generate(prompts, SamplingParams(max_new_tokens=2), seeds=[7])
    engine.sleep()
    n_buckets = QWEN.num_layers + 1   # a bucket per layer (budget 0), and the rest
    assert log == [f"wakeup:{','.join(WEIGHT_TAGS + EXTRA_TAGS)}", *["update_weights:bucket:1-storage"] * n_buckets,
                   "update_weights:None", f"wakeup:{','.join(CACHE_TAGS)}", "generate", f"sleep:{','.join(ALL_TAGS)}"]
    # spelled out, against TensorRT-LLM's own list: sleep releases every releasable tag; before the
    # first update_weights every one of them but the KV cache is awake (the finalizing call runs
    # the model's post-load processing and resets executor caches), the KV cache after it
    releasable = {t for t in TRT["memory_tags"]["values"] if not t.startswith("_no_capture")}
    assert set(ALL_TAGS) == releasable
    woken_first, woken_last = log[0].split(":")[1].split(","), log[n_buckets + 2].split(":")[1].split(",")
    assert set(woken_first) == releasable - {"kv_cache"} and woken_last == ["kv_cache"]
    want = hf_weights(full, QWEN, torch.bfloat16)
    got = {n: t for b in llm.buckets for n, t in b.items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    for b in llm.buckets:   # whole layers per bucket
        assert len({n.split(".")[2] for n in b if n.startswith("model.layers.")}) <= 1
    kw = llm.kwargs
    assert (kw["sampler_type"], kw["enable_sleep"], kw["load_format"]) == ("TRTLLMSampler", True, "dummy")
    assert kw["max_input_len"] == QWEN.max_seq_len and kw["max_num_tokens"] >= kw["max_input_len"]
    assert [p.seed for p in llm.sampling] == [7]
    with pytest.raises(Exception, match="asleep"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_generation_phase_puts_the_engine_to_sleep_before_training_state_returns(fake_trtllm, tmp_path):
    from slurm_align.generation.memory import generation_phase
    from slurm_align.generation.trtllm_engine import TrtllmEngine

    log, _ = fake_trtllm
    engine = TrtllmEngine(QWEN, "cpu", workdir=str(tmp_path))

    class Offload:
        def offload(self):
            log.append("offload")

        def reload(self):
            log.append("reload")

    with generation_phase(engine, Offload(), free_engine_after=False):
        engine.refit(megatron_full(QWEN, 0))
    assert log[0] == "offload" and log[-2:] == ["sleep:" + ",".join(__import__(
        "slurm_align.generation.trtllm_engine", fromlist=["ALL_TAGS"]).ALL_TAGS), "reload"]
