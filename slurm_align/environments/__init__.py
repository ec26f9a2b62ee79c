"""Environments for multi-turn rollouts: what the model talks to between its turns.

- base.py: the interface (reset a data row to the first messages; step from the conversation
  to the environment's reply, a reward, done and metrics) and the checks that stop a run naming
  the environment and the data row when an environment fails;
- config.py: the run's `environment` settings (pydantic);
- registry.py: environments by name ('rule', 'tools') or a user's 'module:Class';
- rule_env.py: the single-turn rule reward, the simplest environment;
- tool_calls.py, tools.py, tool_env.py: `<tool_call>` blocks parsed from a model turn, the
  tool interface and its argument checks, and the environment that runs a turn's calls in a
  worker pool (every failure of a call is an observation for the model, never a crash);
- calculator.py, sandbox.py: the built-in tools' engines (a safe arithmetic evaluator; model
  code in a resource-limited subprocess without network, `python -m
  slurm_align.environments.sandbox`);
- loss_mask.py: the per-token loss mask of a multi-turn trajectory.
"""

# The run config first: config/run.py imports environments/config.py, so importing this package
# before slurm_align.config would meet a half-made config module. The sandbox CLI (`python -m
# slurm_align.environments.sandbox`, stdlib only) also runs under a bare interpreter without
# pydantic, where there is no config to import.
try:
    import slurm_align.config  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "pydantic":
        raise
