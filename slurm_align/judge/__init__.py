"""The judge: a generative model that answers judging prompts (pairwise: which of A and B better
satisfies a principle; pointwise: a score), its verdict read from the log-probs of the allowed
answers (prompts.py, verdict.py). It runs as its own component, served over the critic's secured
PyTriton channel (server.py, main.py), or at a remote OpenAI-compatible service (remote.py); both
answer through the same `Judge` interface (client.py), used as a run's reward (reward.py) and as
a batch labeller (`slurm-align label`, `slurm-align revise`: label.py)."""
