"""PPO actor for the checkpoint-write test: rank 0 is SIGKILLed in the middle of its second
checkpoint write (the critic has saved; the actor's shards are in iter_<step>.tmp; the manifest
that commits the step is not written). The previous checkpoint must stay valid and be used."""

import argparse
import os
import signal
import sys

import torch.distributed as dist

from slurm_align.algorithms import ppo
from slurm_align.models import checkpoint

_save = checkpoint.dist_checkpointing.save
_writes = []


def save_then_die(state, path, *args, **kwargs):
    _save(state, path, *args, **kwargs)
    _writes.append(path)
    if len(_writes) == 2 and dist.get_rank() == 0:
        print(f"test: killing rank 0 while {path} is being written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    checkpoint.dist_checkpointing.save = save_then_die
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(parser.parse_args().run_dir))
