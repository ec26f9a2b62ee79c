"""Registered losses: every loss a model trains with is one class behind one interface
(losses/base.py: the columns it needs, its per-micro-batch loss and normaliser, its metrics),
registered by name with its typed options (losses/registry.py, torch-free, so the login node
validates a run's `loss:` section without torch). The model worker (models/worker.py) trains
with any of them."""
