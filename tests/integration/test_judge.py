"""The judge (slurm_align/judge): its component serves its run over the critic's secured channel
and refuses strangers as the critic does (the critic probe's cases); the remote OpenAI-compatible
judge behind the same interface, its API key by variable name only; `slurm-align label`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from slurm_align.cli import main as cli_main
from slurm_align.config.run import ModelConfig, RemoteJudgeConfig
from slurm_align.judge import server as S
from slurm_align.judge.client import ComponentJudge, JudgeError, LocalJudge, pairwise_probs
from slurm_align.judge.prompts import PAIRWISE_ANSWERS, JudgeTemplate
from slurm_align.judge.remote import RemoteJudge
from slurm_align.rundir import RunDir, address_problem, create_run_secret, read_run_secret
from tests.integration.test_critic_security import raw, raw_infer, stranger_headers
from tests.support.critic_support import CHILD_ENV, REPO

JUDGE_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 64}
PROMPTS = ["7391=1379|3179?", "4411=1144|4141?", "90=09|90?"]


class JudgeProcess:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.log = open(run_dir / "judge.log", "wb")  # noqa: SIM115 closed by stop()
        self.proc = subprocess.Popen([sys.executable, str(REPO / "launchers" / "judge.py"), "--run-dir", str(run_dir)],
                                     cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **CHILD_ENV}, start_new_session=True)

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("judge-run")
    cfg = {"algorithm": "ppo", "seed": 7, "judge": {"model": JUDGE_MODEL, "template": "pairwise_compact"},
           "critic_server": {"bind_host": "127.0.0.1"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    create_run_secret(RunDir(run_dir))
    other = tmp_path_factory.mktemp("other-run")
    create_run_secret(RunDir(other))
    proc = JudgeProcess(run_dir)
    client = ComponentJudge(run_dir, connect_timeout_s=120, request_timeout_s=60)
    try:
        client.connect()
    except JudgeError:
        proc.stop()
        raise AssertionError(proc.log_text()) from None
    yield {"run_dir": run_dir, "proc": proc, "client": client, "secret": read_run_secret(RunDir(run_dir)),
           "other": read_run_secret(RunDir(other))}
    proc.stop()


def _body(prompts=PROMPTS, answers=PAIRWISE_ANSWERS) -> dict:
    return {"inputs": [{"name": "prompts", "shape": [len(prompts)], "datatype": "BYTES", "data": list(prompts)},
                       {"name": "answers", "shape": [len(answers)], "datatype": "BYTES", "data": list(answers)}]}


def test_judge_component_answers_its_run_with_its_models_log_probs_and_refuses_strangers(judge):
    from slurm_align.judge.model import JudgeModel
    from tests.support.single_rank import single_rank_world

    client = judge["client"]
    served = client.answer_logprobs(PROMPTS, PAIRWISE_ANSWERS)
    with single_rank_world() as (_env, pctx):   # the same model (seed, config) in this process
        local = LocalJudge(JudgeModel.load(ModelConfig(**JUDGE_MODEL), pctx, seed=7)).answer_logprobs(
            PROMPTS, PAIRWISE_ANSWERS)
    for s, ref in zip(served, local):
        assert s.keys() == ref.keys()
        np.testing.assert_allclose([s[a] for a in PAIRWISE_ANSWERS], [ref[a] for a in PAIRWISE_ANSWERS], atol=1e-5)
    # A bad request from the run is rejected naming what is wrong (answers of several tokens).
    with pytest.raises(JudgeError, match="one token each"):
        client.answer_logprobs(PROMPTS, ("yes", "no"))

    found, _ = address_problem(RunDir(judge["run_dir"]), "judge", judge["secret"])
    assert found is not None
    for endpoint, body in ((S.ANSWERS, _body()),
                           (S.CONTROL, {"inputs": [{"name": "command", "shape": [1], "datatype": "BYTES",
                                                    "data": [S.SHUTDOWN]}]})):
        for how, headers in stranger_headers(judge["secret"], judge["other"]).items():
            status, text = raw_infer(found, endpoint, headers, body)
            assert status in (400, 403, 500), (endpoint, how, status, text)
            assert "restricted" in text or "refused" in text, (endpoint, how, text)
    for method, path in [("GET", f"/v2/models/{S.ANSWERS}/config"),
                         ("POST", f"/v2/repository/models/{S.ANSWERS}/unload")]:
        status, text = raw(found, path, b"{}" if method == "POST" else None, method=method)
        assert status == 403 and "restricted" in text, (path, status, text)
    assert judge["proc"].proc.poll() is None, judge["proc"].log_text()   # the shutdown was refused
    assert client.answer_logprobs(PROMPTS, PAIRWISE_ANSWERS) == served
    assert "judge: refused a judge_" in judge["proc"].log_text()   # named as the judge, not the critic
    client.shutdown()   # the run's own shutdown is served
    assert judge["proc"].proc.wait(timeout=60) == 0, judge["proc"].log_text()


@pytest.fixture()
def openai_server(tmp_path, request):
    log = tmp_path / "received.jsonl"
    servers = []

    def start(*flags: str) -> str:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "programs" / "openai_judge_server.py"),
                                 "--log", str(log), *flags], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "JUDGE_TEST_KEY": "sk-test-4242"})
        servers.append(proc)
        line = proc.stdout.readline()   # "PORT n" once it listens
        assert line.startswith("PORT "), line
        return f"http://127.0.0.1:{int(line.split()[1])}/v1"

    yield start, log
    for p in servers:
        p.kill()
        p.wait(timeout=10)


ITEMS = [("7391=", "1379", "3179"), ("4411=", "4141", "1144"), ("852=", "258", "825")]


def test_remote_judge_reads_verdicts_from_log_probs_or_text_and_never_leaks_its_key(openai_server, monkeypatch,
                                                                                   tmp_path, capsys):
    start, log = openai_server
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-4242")
    tpl = JudgeTemplate.get("pairwise_compact")
    for flags in ((), ("--text-only",)):
        judge = RemoteJudge(RemoteJudgeConfig(url=start(*flags), model="judge", api_key_env="MY_JUDGE_KEY"))
        p = pairwise_probs(judge, tpl, ["sorted"], ITEMS)
        assert [bool(x > 0.5) for x in p] == [True, False, True], (flags, p)
        if not flags:   # from the log-probs: p(A) = 0.9 in both orders
            np.testing.assert_allclose(p, [0.9, 0.1, 0.9], atol=1e-6)
    # A wrong key: refused, the error names the variable, never the key.
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-wrong-0000")
    url = start()
    with pytest.raises(JudgeError, match=r"HTTP 401.*\$MY_JUDGE_KEY") as e:
        RemoteJudge(RemoteJudgeConfig(url=url, model="judge", api_key_env="MY_JUDGE_KEY")).answer_logprobs(["x"], "AB")
    assert "sk-wrong" not in str(e.value)
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(JudgeError, match=r"MY_JUDGE_KEY.*not set"):
        RemoteJudge(RemoteJudgeConfig(url=url, model="judge", api_key_env="MY_JUDGE_KEY")).answer_logprobs(["x"], "AB")

    # `slurm-align label` with the remote judge: the sorted answer is chosen; the key appears in
    # no file written and no output.
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-4242")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"prompt": pr, "response": r}) + "\n" for pr, a, b in ITEMS for r in (a, b)))
    config = tmp_path / "run.yaml"
    remote = {"url": url, "model": "judge", "api_key_env": "MY_JUDGE_KEY"}
    config.write_text(yaml.safe_dump({"judge": {"template": "pairwise_compact", "principles": ["sorted"],
                                                "remote": remote}}))
    out = tmp_path / "labels.jsonl"
    assert cli_main(["label", str(samples), "--config", str(config), "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["chosen"] for r in rows] == ["1379", "1144", "258"]
    random_out = tmp_path / "random.jsonl"
    assert cli_main(["label", str(samples), "--config", str(config), "--out", str(random_out), "--random-labels"]) == 0
    assert {r["judge_p"] for r in map(json.loads, random_out.read_text().splitlines())} == {0.5}
    captured = capsys.readouterr()
    for text in (captured.out, captured.err, out.read_text(), config.read_text(), log.read_text()):
        assert "sk-test-4242" not in text


@pytest.mark.skipif(os.environ.get("SLURM_ALIGN_JUDGE_TRAIN") != "1",
                    reason="trains the sort judge (1,500 SFT steps, minutes); set SLURM_ALIGN_JUDGE_TRAIN=1")
def test_trained_judge_agrees_with_the_task_rule_on_held_out_pairs(tmp_path):
    """A small judge trained here (SFT on the rule's "A"/"B" verdicts of training pairs) agrees with
    the rule on >= 90% of 1,000 held-out pairs, and beats its untrained twin (same weights before
    training) on the same pairs by an exact sign test."""
    from slurm_align.analysis.significance import paired_counts
    from tests.support.judge_support import agreement, train_sort_judge
    from tests.support.learning import ALPHA

    trained = agreement(train_sort_judge(tmp_path))
    twin = agreement(None)
    counts = paired_counts(twin, trained)
    print(f"judge agreement: trained {trained.mean():.3f}, untrained {twin.mean():.3f}; {counts}")
    assert trained.mean() >= 0.90, trained.mean()
    assert counts.p_better < ALPHA, counts


@pytest.mark.timeout(3600)   # the suite's 600 s cut the whole example short: a hang guard for a loaded 2-core host
@pytest.mark.skipif(os.environ.get("SLURM_ALIGN_CAI") != "1",
                    reason="runs examples/cai_tiny.sh end to end (~30-40 min here); set SLURM_ALIGN_CAI=1")
def test_constitutional_ai_example_raises_held_out_accuracy_and_its_control_does_not(tmp_path):
    """The CAI example as shipped: the judge arm's final policy beats the SFT start on held-out exact
    accuracy (exact sign test), the no-feedback control's does not. Measured (docs/cai.md, third
    version): 0.268 -> 0.3235 (SFT on revisions) -> 0.313 (148 / 58, p = 1.5e-10), control
    0.268 -> 0.203 (40 / 170)."""
    from slurm_align.judge.cai_report import report
    from tests.support.learning import ALPHA, TWIN_ALPHA

    subprocess.run(["bash", str(REPO / "examples" / "cai_tiny.sh"), str(tmp_path / "cai")], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    out = report(tmp_path / "cai")
    assert out["judge_dpo_vs_sft"]["p_better"] < ALPHA, out
    assert out["control_dpo_vs_sft"]["p_better"] > TWIN_ALPHA, out
