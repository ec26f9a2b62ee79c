"""`slurm-align eval --out DIR` names the output folder; --run-dir, the other commands' flag,
stays an alias of it."""

from __future__ import annotations

from pathlib import Path

from slurm_align.cli import build_parser


def test_out_and_its_alias_run_dir_name_the_output_folder():
    parser = build_parser()
    common = ["eval", "ckpt", "--data", "p.parquet"]
    assert parser.parse_args([*common, "--out", "res"]).run_dir == Path("res")
    assert parser.parse_args([*common, "--run-dir", "res2"]).run_dir == Path("res2")
    assert parser.parse_args(common).run_dir is None
