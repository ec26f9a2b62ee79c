"""JSONL readers with errors that name the file, the line and what is wrong.

Formats (as NeMo-Aligner users know them):
    SFT          {"input": str, "output": str}
    preferences  {"prompt": str, "chosen": str, "rejected": str}
    prompts      {"prompt": str}
Extra keys are allowed and ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from slurm_align.config.errors import ConfigError

SFT_KEYS = ("input", "output")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")
PROMPT_KEYS = ("prompt",)


def read_jsonl(path: str | Path, keys: tuple[str, ...], kind: str) -> list[dict[str, str]]:
    """Every non-blank line must be a JSON object with string values for `keys`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{kind} data file not found"], path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"cannot read {kind} data file ({e})"], path) from None
    rows, problems = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict):
            problems.append(f"line {n}: expected a JSON object with keys {list(keys)}, got {type(obj).__name__}")
            continue
        missing = [k for k in keys if k not in obj]
        if missing:
            problems.append(f"line {n}: missing key(s) {missing} ({kind} lines need {list(keys)}; "
                            f"found {sorted(obj)})")
            continue
        wrong = [f"{k!r} is {type(obj[k]).__name__}" for k in keys if not isinstance(obj[k], str)]
        if wrong:
            problems.append(f"line {n}: values must be strings: {', '.join(wrong)}")
            continue
        rows.append({k: obj[k] for k in keys})
        if len(problems) >= 20:
            break
    if problems:
        raise ConfigError(problems[:20], path)
    if not rows:
        raise ConfigError([f"{kind} data file is empty (expected JSON lines with keys {list(keys)})"], path)
    return rows
