"""PPO actor for the checkpoint-write test: rank 0 is SIGKILLed in the middle of its second
checkpoint write (the critic may have saved; the actor's shards are in iter_<step>.tmp; the manifest
that commits the step is not written). The previous checkpoint must stay valid and be used."""

import argparse
import os
import signal

_writes = []


def save_then_die(save):
    def save_and_maybe_die(state, path, *args, **kwargs):
        import torch.distributed as dist

        save(state, path, *args, **kwargs)
        _writes.append(path)
        if len(_writes) == 2 and dist.get_rank() == 0:
            print(f"test: killing rank 0 while {path} is being written", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return save_and_maybe_die


# Imports under the guard: spawned helpers (megatron's checkpoint writer) re-run this file as
# __mp_main__ and would import torch and megatron again for nothing.
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave

    with importing():   # as the product's launchers import
        from slurm_align.algorithms import ppo
        from slurm_align.models import checkpoint

    checkpoint.dist_checkpointing.save = save_then_die(checkpoint.dist_checkpointing.save)
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    leave(ppo.main(parser.parse_args().run_dir))   # as the product's launchers end
