"""Prompt distribution for generation and the rollout rebalance for training.

- prompts.PromptServer: rank-0 work-stealing server thread (dynamic sharding)
- static.StaticPrompts / static_shard: fixed slices (the baseline)
- replica.open_prompt_source / replica_batches: one requester per generation replica
- rebalance.rebalance: equal sample counts per DP rank, optionally token-balanced
"""
