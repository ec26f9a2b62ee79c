"""The judge as a run's reward (RLAIF, `reward.judge_weight`): each fresh sample's pointwise
score in [0, 1] under the run's principles, from the judge component (ComponentJudge: its
published address, the run's secret) or the remote service (judge.remote).

Pointwise, not pairwise against a reference: a score needs no reference answer per prompt (the
task's data has none, and a policy's own earlier sample would make the reward drift with it),
costs one judging prompt per sample and principle instead of two (both orders), and adds to the
rule and reward-model terms as one more per-sample number (policy_gradient.combine_rewards).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from slurm_align.config.run import RunConfig
from slurm_align.judge.client import ComponentJudge, Judge, pointwise_scores
from slurm_align.judge.prompts import JudgeTemplate


class JudgeReward:
    def __init__(self, judge: Judge, template: JudgeTemplate, principles: Sequence[str]):
        self.judge, self.template, self.principles = judge, template, list(principles)

    @classmethod
    def for_run(cls, run: RunConfig) -> JudgeReward:
        """The run's judge: judge.remote's service, else the run's judge component."""
        if run.judge.remote is not None:
            from slurm_align.judge.remote import RemoteJudge
            judge: Judge = RemoteJudge(run.judge.remote)
        else:
            assert run.run_dir is not None, "a job's run config knows its run directory"
            cs = run.critic_server
            judge = ComponentJudge(run.run_dir, connect_timeout_s=cs.connect_timeout_s,
                                   request_timeout_s=cs.request_timeout_s)
        return cls(judge, JudgeTemplate.get(run.judge.template), run.judge.principles)

    def scores(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """[B] float64: the judge's pointwise score of each (prompt, response), averaged over the
        principles."""
        if not len(prompts):
            return np.zeros(0, np.float64)
        return pointwise_scores(self.judge, self.template, self.principles, list(zip(prompts, responses)))

    def shutdown(self) -> None:
        """End the run's judge component (its ranks exit 0); a remote service is not the run's."""
        if isinstance(self.judge, ComponentJudge):
            self.judge.shutdown()
