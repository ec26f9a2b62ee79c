"""Critic component entry inside a job: `python -m slurm_align.launchers.critic --run-dir RUN_DIR`."""

# Under the guard: spawned helper processes re-run this module as __mp_main__ (see actor.py).
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave
    from slurm_align.slurm.preemption import block_term

    block_term()   # before MPI, tritonserver and their threads start: see slurm_align.slurm.preemption
    with importing():
        from slurm_align.critic.main import cli
    leave(cli())
