"""JSONL data formats (SFT, preferences, prompts), tokenised datasets, the synthetic task."""
