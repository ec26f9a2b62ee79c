"""submitit, subclassed for heterogeneous jobs (submitit has none: upstream issue 1741).

We keep submitit's submission path (submission file in its folder, sbatch through its
CommandFunction, job-id parsing, scancel) and replace the two parts that do not fit:
the script is our rendered hetjob script (the components run launchers, not a pickled
function), and the state comes from scontrol/sacct through state.py, never from a
sacct-only watcher that hangs when accounting is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from submitit.slurm import slurm as submitit_slurm

from slurm_align.slurm import state as job_state


class HetJob(submitit_slurm.SlurmJob):
    """A submitted (het)job. `state` is combined over components; no pickled result."""

    @property
    def state(self) -> str:  # type: ignore[override]
        return self.component_states()[0]

    def component_states(self) -> tuple[str, list[str]]:
        return job_state.slurm_state(self.job_id)

    def done(self, force_check: bool = False) -> bool:  # type: ignore[override]
        return self.state in job_state.FINAL_STATES


class HetjobExecutor(submitit_slurm.SlurmExecutor):
    """Submits an already rendered (het)job script with sbatch."""

    job_class = HetJob

    def __init__(self, folder: str | Path, script: str, after: Sequence[str] = ()):
        super().__init__(folder=folder)
        self._script = script
        self._after = list(after)

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        # On the command line, where sbatch applies it to the whole (het)job. Dependents of a
        # job that fails are cancelled by Slurm (reason DependencyNeverSatisfied), not left
        # pending forever.
        deps = [f"--dependency=afterok:{':'.join(self._after)}", "--kill-on-invalid-dep=yes"] if self._after else []
        return ["sbatch", *deps, str(submission_file_path)]

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return 1

    def submit_script(self) -> HetJob:
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        job = self._submit_command("")
        assert isinstance(job, HetJob)  # job_class above; an internal invariant, not user input
        return job
