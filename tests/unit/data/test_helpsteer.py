"""HelpSteer2-format rows of a policy's own samples (data/helpsteer.py): each distinct response and
the right answer per prompt, labelled by the task's rule; rows over the context left out; the
samples of the held-out prompts only in the validation rows, beside the task's pairs."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.data.helpsteer import attributes, main, policy_sample_rows


def test_policy_rows_are_the_rules_attributes_of_each_distinct_sample_and_the_right_answer():
    rows = policy_sample_rows({"41672=": ["12466", "21467", "12466"], "90=": ["09", "09"]})
    assert [(r["input"], r["output"]) for r in rows] == [
        ("41672=", "12467"), ("41672=", "12466"), ("41672=", "21467"), ("90=", "09")]
    assert [r["correctness"] for r in rows] == [4.0, 0.0, 0.0, 4.0]
    assert all(r == {"input": r["input"], "output": r["output"], **attributes(r["input"], r["output"])} for r in rows)
    wide = "\ufffd" * 9          # 27 bytes: over a 32-token context with the prompt, BOS and EOS
    assert [r["output"] for r in policy_sample_rows({"41672=": [wide]})] == ["12467"]


def test_the_policy_rows_hold_out_their_own_prompts_beside_the_tasks_pairs(tmp_path: Path):
    gen = tmp_path / "generate"
    gen.mkdir()
    prompts = [f"{i}=" for i in range(10**7, 10**7 + 300)]   # 8 digits: none of the task's prompts
    (gen / "shard_00000.jsonl").write_text("".join(
        json.dumps({"prompt": p, "response": r}) + "\n" for p in prompts for r in (p[:4], p[:3])))
    main([str(tmp_path / "out"), "--samples", str(gen)])
    train, val = ([json.loads(line) for line in (tmp_path / "out" / f"helpsteer_policy_{s}.jsonl").open()]
                  for s in ("train", "val"))
    pairs = {s: len((REPO_ROOT / "examples" / "synthetic" / f"pref_{s}.jsonl").read_text().splitlines())
             for s in ("train", "val")}
    policy_train = {r["input"] for r in train if r["input"] in prompts}
    policy_val = {r["input"] for r in val if r["input"] in prompts}
    assert len(policy_val) == 200 and len(policy_train) == 100 and not policy_train & policy_val
    assert len(train) == 2 * pairs["train"] + 3 * 100 and len(val) == 2 * pairs["val"] + 3 * 200
    assert all(r["correctness"] == attributes(r["input"], r["output"])["correctness"] for r in train + val)
