"""`slurm-align analyze heldout` (slurm_align/analysis/commands.py) on per-prompt evaluation files."""

from __future__ import annotations

from slurm_align.cli import main
from tests.unit.analysis.test_significance import write_eval


def test_heldout_pairs_each_evaluation_with_the_start_and_the_end_with_another_run(tmp_path, capsys):
    write_eval(tmp_path / "run", 0, [0, 0, 0, 0, 1, 1])
    write_eval(tmp_path / "run", 5, [1, 1, 1, 0, 1, 0])      # b=3, c=1
    write_eval(tmp_path / "run", 10, [1, 1, 0, 1, 1, 1])     # b=3, c=0
    write_eval(tmp_path / "run", 15, [0, 1, 1, 1, 1, 0])     # b=3, c=1
    write_eval(tmp_path / "twin", 0, [0, 0, 0, 0, 1, 1])
    write_eval(tmp_path / "twin", 2, [0, 0, 0, 0, 0, 0])
    assert main(["analyze", "heldout", str(tmp_path / "run"), "--against", str(tmp_path / "twin")]) == 0
    out = capsys.readouterr().out
    cells = [line.replace("│", " ").split() for line in out.splitlines() if line.startswith("│")]
    rows = {c[0]: c[1:5] for c in cells}
    assert rows["5"] == ["0.667", "3", "1", "3.12e-01"]       # P(Bin(4, 1/2) >= 3) = 5/16
    assert rows["10"] == ["0.833", "3", "0", "1.25e-01"]      # 1/8
    # the end: each prompt's majority over steps 5, 10, 15 = [1, 1, 1, 1, 1, 0]
    assert "end (steps [5, 10, 15], pooled) against step 0: 0.333 -> 0.833 on 6 prompts: b=4" in out
    assert "(steps [2]) against the end of" in out and "0.000 -> 0.833 on 6 prompts: b=5 " in out
    # an even --pool pools one fewer (a majority needs an odd count): here the last alone
    assert main(["analyze", "heldout", str(tmp_path / "run"), "--pool", "2"]) == 0
    assert "end (steps [15], pooled) against step 0: 0.333 -> 0.667 on 6 prompts: b=3" in capsys.readouterr().out


def test_heldout_names_a_run_without_evaluation_files(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["analyze", "heldout", str(tmp_path / "run")]) != 0
    assert "has no per-prompt evaluation (eval/step_<N>.jsonl)" in capsys.readouterr().err


def test_heldout_refuses_to_pair_other_prompts(tmp_path, capsys):
    write_eval(tmp_path / "run", 0, [0, 1])
    write_eval(tmp_path / "other", 0, [0, 1], prompts=["12=", "21="])
    assert main(["analyze", "heldout", str(tmp_path / "run"), "--against", str(tmp_path / "other")]) != 0
    assert "evaluated other prompts than" in capsys.readouterr().err
