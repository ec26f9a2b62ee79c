"""The teacher component of on-policy distillation (slurm_align/critic/teacher.py): a trained
policy (the session's SFT checkpoint) behind the critic's secured PyTriton server. Its answers are
the policy's own next-token log-probs, and it refuses every stranger's request as the critic
does (the critic probe's cases, tests/integration/test_critic_security.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from slurm_align import REPO_ROOT
from slurm_align.config import load_run_config
from slurm_align.critic import protocol as P
from slurm_align.critic.client import CriticClient, CriticError
from slurm_align.rundir import RunDir, create_run_secret, read_run_secret
from tests.integration.test_critic_security import OTHER, REQUESTS, raw_infer, stranger_headers, well_formed
from tests.support.critic_support import CHILD_ENV, CriticProcess


def teacher_run_dir(root, checkpoint):
    """A run directory as `submit` leaves it for a GRPO run distilled from `checkpoint`."""
    data = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
        "reward.model=false", "critic_server.bind_host=127.0.0.1"]).model_dump(mode="json")
    data["teacher_model"] = {**data["model"], "init_checkpoint": str(checkpoint)}   # the policy's shape
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(data))
    run = load_run_config(root / "config.yaml")
    assert run.components == ("actor", "teacher")
    create_run_secret(RunDir(root))
    return root, run


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, sft_checkpoint):
    run_dir, run = teacher_run_dir(tmp_path_factory.mktemp("teacher"), sft_checkpoint)
    proc = CriticProcess(run_dir, component="teacher")
    client = CriticClient.for_run_dir(run_dir, component="teacher", connect_timeout_s=120, request_timeout_s=60)
    try:
        addr = proc.wait_ready(timeout=180)
        client.connect()
    except AssertionError:
        proc.stop()
        raise
    yield {"run_dir": run_dir, "run": run, "proc": proc, "client": client, "addr": addr,
           "secret": read_run_secret(RunDir(run_dir))}
    client.close()
    proc.stop()


def test_the_teacher_answers_its_own_forward_log_probs(teacher, tmp_path):
    rng = np.random.default_rng(3)
    lengths = np.array([9, 5, 7])
    tokens = np.zeros((3, 9), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(48, 58, n)   # digits, as the sort task's
    values, rewards = teacher["client"].infer(tokens, lengths)
    np.savez(tmp_path / "in.npz", tokens=tokens, lengths=lengths)
    # the policy's own forward of the same checkpoint, in a process of its own (torch + megatron)
    code = ("import sys, numpy as np, torch\n"
            "from slurm_align.config import load_run_config\n"
            "from slurm_align.critic.teacher import TeacherWorker\n"
            "from slurm_align.critic.main import load_reward_weights\n"
            "from slurm_align.models.gpt import build_gpt\n"
            "from slurm_align.parallel.bootstrap import init_distributed\n"
            "from slurm_align.parallel.layout import initialize_model_parallel\n"
            "from slurm_align.models.forward import forward_logprobs\n"
            "from pathlib import Path\n"
            "run = load_run_config(Path(sys.argv[1]) / 'config.yaml'); env = init_distributed()\n"
            "pctx = initialize_model_parallel(env, 1, 1); m = run.teacher_model\n"
            "chunks = build_gpt(m, pctx, seed=run.seed); load_reward_weights(Path(m.init_checkpoint), chunks, pctx)\n"
            "d = np.load(sys.argv[2]); [c.eval() for c in chunks]\n"
            "lp = forward_logprobs(chunks, pctx, torch.from_numpy(d['tokens']), m.vocab_size,"
            " lengths=torch.from_numpy(d['lengths']))\n"
            "np.save(sys.argv[3], lp.numpy())\n")
    subprocess.run([sys.executable, "-c", code, str(teacher["run_dir"]), str(tmp_path / "in.npz"),
                    str(tmp_path / "out.npy")], check=True, cwd=REPO_ROOT, env={**os.environ, **CHILD_ENV},
                   timeout=300)
    reference = np.load(tmp_path / "out.npy")
    for i, n in enumerate(lengths):   # position p: log p(token p+1); meaningful for p < length - 1
        np.testing.assert_allclose(values[i, :n - 1], reference[i, :n - 1], rtol=0, atol=1e-5)
    assert (values[:, :8] <= 0).all() and not rewards.any()


def test_the_teacher_refuses_strangers_as_the_critic_does(teacher):
    client, addr = teacher["client"], teacher["addr"]
    tokens, lengths = np.full((2, 6), 50, np.int64), np.array([6, 4])
    before = client.infer(tokens, lengths)[0]
    for endpoint in REQUESTS:
        for how, headers in stranger_headers(teacher["secret"], OTHER).items():
            status, text = raw_infer(addr, endpoint, headers, well_formed(endpoint))
            assert status in (400, 403, 500), (endpoint, how, status, text)
            assert "restricted" in text or "refused" in text, (endpoint, how, text)
            np.testing.assert_array_equal(client.infer(tokens, lengths)[0], before)   # the run is served
    intruder = CriticClient(*addr, secret=OTHER, connect_timeout_s=10, request_timeout_s=30)
    with pytest.raises(CriticError, match="refused"):
        intruder.infer(tokens, lengths)
    intruder.close()
    teacher["proc"].check_alive()
    assert P.INFER in client._where(P.INFER) and "teacher at" in client._where(P.INFER)
