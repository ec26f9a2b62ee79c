"""Rewards for the PPO family: rule (verifiable) rewards run on the actor ranks, and their
combination with a reward model's score.

- `rule.RuleReward`: a user function given as "module:function", called as
  `fn(response, prompt, **fields)` (the response text, the prompt text and the data row's other
  fields, e.g. `answer`) and returning a finite float; anything else stops the run with an error
  naming the function and the sample's prompt.
- shipped verifiable rewards: `slurm_align.rewards.sort:exact` / `:partial` (the synthetic
  sort task), `slurm_align.rewards.arithmetic:exact_answer` (answers ride in the data),
  `slurm_align.rewards.math:verified_answer` (math answers by equivalence, math-verify) and
  `slurm_align.rewards.code:passes_tests` (model-written code against the row's tests, sandboxed).
"""
