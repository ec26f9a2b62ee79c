"""SFT, reward-model and DPO trainers on the synthetic task, on real mpirun ranks.

Each learning test asserts a margin that a broken trainer would miss (loss on the wrong tokens,
no optimizer step, wrong sign, no reference), and the layout test checks that TP=2, PP=2 and DP=2
take the same optimizer steps as TP=1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.test_models_parallel import mpirun
from tests.support.trainer_runs import make_run, metrics, train

pytestmark = pytest.mark.mpi
ONE_RANK = ["actor.data_parallel=1"]


def test_sft_learns_and_resume_continues_identically(tmp_path: Path):
    run_a = make_run(tmp_path / "a", "sft_tiny.yaml",
                     [*ONE_RANK, "trainer.num_steps=40", "trainer.save_interval=20"])
    a = train(run_a)
    assert len(a) == 40
    # ln(259) = 5.56 at init; a trainer that learns nothing (or from the prompt only) stays > 2.
    assert a[0]["loss"] > 5.0 and a[-1]["loss"] < 1.5 and a[-1]["val_loss"] < 1.5, (a[0], a[-1])

    # The policy now sorts digits, by the task's own scorer (random init scores 0).
    final = run_a / "checkpoints" / "sft" / "iter_0000040"
    (tmp_path / "ckpt_path.txt").write_text(str(final))
    mpirun(1, "greedy_score", "1", "1", str(tmp_path))
    score = float((tmp_path / "score.txt").read_text().split()[0].split("=")[1])
    assert score > 0.8, (tmp_path / "score.txt").read_text()

    # "Killed" after step 20's checkpoint: a copy of the run whose newest complete checkpoint is
    # iter_20 (plus a half-written save of step 30) resumes at 20 and repeats a's curve; the
    # metrics it had logged past step 20 are dropped and logged again.
    run_b = tmp_path / "b"
    shutil.copytree(run_a, run_b)
    shutil.rmtree(run_b / "checkpoints" / "sft" / "iter_0000040")
    (run_b / "checkpoints" / "sft" / "iter_0000030.tmp").mkdir()
    b = train(run_b)
    assert len((run_b / "metrics.jsonl").read_text().splitlines()) == 40
    assert [r["step"] for r in b] == list(range(1, 41))
    for ra, rb in zip(a[20:], b[20:]):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * max(1.0, abs(ra["loss"])), (ra, rb)
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-4 * ra["grad_norm"], (ra, rb)

    # Stopped for preemption (the job script's USR2 warning is RUN_DIR/stop_requested; Slurm's
    # TERM takes the same stop point): the trainer ends after its step 1, saved, and says so
    # (stopped_step, which the job script requeues on); the restart continues as a did.
    run_c = make_run(tmp_path / "c", "sft_tiny.yaml",
                     [*ONE_RANK, "trainer.num_steps=40", "trainer.save_interval=20"])
    (run_c / "stop_requested").write_text("0\n")
    assert [r["step"] for r in train(run_c)] == [1]
    assert (run_c / "stopped_step").read_text().strip() == "1"
    assert (run_c / "stopped_by").read_text().strip() == "warning"
    assert (run_c / "checkpoints" / "sft" / "iter_0000001" / "manifest.json").is_file()
    for name in ("stop_requested", "stopped_step", "stopped_by"):   # as the requeued job script does
        (run_c / name).unlink()
    c = train(run_c)
    assert [r["step"] for r in c] == list(range(1, 41))
    for ra, rc in zip(a[1:], c[1:]):
        assert abs(ra["loss"] - rc["loss"]) <= 1e-5 * max(1.0, abs(ra["loss"])), (ra, rc)


def test_reward_model_accuracy_well_above_chance(tmp_path: Path):
    # 80 steps: half the rejected answers are not shuffles but near misses (a digit dropped or
    # added, a truncation), which take the tiny model longer to rank.
    m = train(make_run(tmp_path / "rm", "rm_tiny.yaml", [*ONE_RANK, "trainer.num_steps=80", "trainer.save_interval=0"]))
    assert m[-1]["val_accuracy"] >= 0.9, m[-1]   # chance is 0.5; a sign error gives ~0
    assert m[-1]["val_reward_margin"] > 1.0, m[-1]
    assert m[-1]["loss"] < 0.5 * m[0]["loss"], (m[0], m[-1])
    # The final checkpoint, loaded into a fresh value model the way the PPO critic loads its
    # reward model, ranks held-out pairs with last-token rewards just as well.
    (tmp_path / "ckpt_path.txt").write_text(str(tmp_path / "rm" / "checkpoints" / "rm" / "iter_0000080"))
    mpirun(1, "rm_accuracy", "1", "1", str(tmp_path))
    acc = float((tmp_path / "rm_accuracy.txt").read_text().split("=")[1])
    assert acc >= 0.9, acc


def test_dpo_implicit_reward_margin_rises(tmp_path: Path):
    m = train(make_run(tmp_path / "dpo", "dpo_tiny.yaml",
                       [*ONE_RANK, "trainer.num_steps=20", "trainer.save_interval=0"]))
    assert abs(m[0]["reward_margin"]) < 1e-6, m[0]   # policy == reference at step 1
    assert m[-1]["val_reward_margin"] > 0.5, m[-1]   # beta=0.1: log-ratio gap > 5 nats
    assert m[-1]["val_accuracy"] >= 0.9, m[-1]
    assert m[-1]["reward_margin"] > m[len(m) // 2]["reward_margin"] > m[0]["reward_margin"], m


def test_tp2_pp2_dp2_take_the_same_steps_as_tp1(tmp_path: Path):
    common = ["trainer.num_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
              "data.val_path=null", "trainer.save_interval=0"]
    base = train(make_run(tmp_path / "tp1", "sft_tiny.yaml", common + ONE_RANK))
    # tp2: the replicated fp32 optimizer; pp2 and dp2: the flat layout (models/optimizer.py), at
    # DP 2 sharded (ZeRO-1): both equal the TP1 run's replicated steps
    for name, layout in [("tp2", ["actor.tensor_parallel=2", "actor.data_parallel=1"]),
                         ("pp2", ["actor.pipeline_parallel=2", "actor.data_parallel=1",
                                  "training.distributed_optimizer=true"]),
                         ("dp2", ["actor.data_parallel=2", "training.distributed_optimizer=true"])]:
        other = train(make_run(tmp_path / name, "sft_tiny.yaml", common + layout), ranks=2)
        for r1, r2 in zip(base, other):
            assert abs(r1["loss"] - r2["loss"]) <= 1e-5 * r1["loss"], (name, r1, r2)
            assert abs(r1["grad_norm"] - r2["grad_norm"]) <= 1e-5 * r1["grad_norm"], (name, r1, r2)
    assert len(metrics(tmp_path / "pp2")) == 3
