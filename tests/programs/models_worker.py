"""Rank program for the model tests (run under mpirun by tests/integration/test_models_*.py and others;
not a test).

    python tests/programs/models_worker.py ACTION[+ACTION...] TP PP OUT_DIR [OUT_DIR...]

Each rank joins a gloo world and sets up megatron's parallel state through slurm_align.parallel
(the runtime's own bootstrap: rank 0 binds a free port and shares it over MPI), and runs each
ACTION in each OUT_DIR, in order (one launch for several checks: start-up is most of its cost).
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from slurm_align.config.run import ModelConfig

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=260, max_seq_len=32)


def init_parallel(tp: int, pp: int):
    """The runtime's ParallelContext. No fallback: these tests are about slurm_align.parallel's
    layout, so an import error there must fail them, not silently test raw megatron instead."""
    # Deferred: megatron's checkpoint writer re-imports this file in a spawned process, where
    # importing the bootstrap (mpi4py) at module level would initialise MPI and hang it.
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel
    return initialize_model_parallel(init_distributed(), tp, pp)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, MODEL.vocab_size, (6, 20), generator=g)


def _kind(value_head: bool) -> str:
    return "value" if value_head else "lm"


def reference(pctx, out: Path, value_head: bool):
    """TP=1 PP=1: write full weights and the outputs they give."""
    from slurm_align.models.forward import forward_logits, forward_values
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    chunks = build_gpt(MODEL, pctx, value_head=value_head, seed=11)
    full = full_state_dict(chunks, pctx)
    y = (forward_values(chunks, pctx, tokens()) if value_head
         else forward_logits(chunks, pctx, tokens(), MODEL.vocab_size))
    torch.save({"full": full, "out": y, "keys": list(chunks[0].state_dict().keys())},
               out / f"ref_{_kind(value_head)}.pt")


def check(pctx, out: Path, value_head: bool):
    """Load the reference weights into this TP/PP layout and compare outputs and round trip."""
    from slurm_align.models.forward import forward_logits, forward_values
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict, load_full_state_dict
    ref = torch.load(out / f"ref_{_kind(value_head)}.pt")
    chunks = build_gpt(MODEL, pctx, value_head=value_head, seed=99)  # different init on purpose
    load_full_state_dict(chunks, pctx, ref["full"])
    y = (forward_values(chunks, pctx, tokens(), micro_batch_size=2, broadcast=True) if value_head
         else forward_logits(chunks, pctx, tokens(), MODEL.vocab_size, micro_batch_size=4, broadcast=True))
    full = full_state_dict(chunks, pctx)
    assert list(full) == [k for k in ref["full"]], (list(full), list(ref["full"]))
    weight_err = max((full[k] - ref["full"][k]).abs().max().item() for k in full)
    to_first = full_state_dict(chunks, pctx, to_all=False)  # only the first PP stage receives it
    if pctx.pp_rank == 0:
        weight_err = max(weight_err, max((to_first[k] - ref["full"][k]).abs().max().item() for k in ref["full"]))
    else:
        assert to_first is None
    out_err = (y - ref["out"]).abs().max().item()
    # The same seed gives the same full weights in this layout as in the TP=1 PP=1 reference.
    same_seed = full_state_dict(build_gpt(MODEL, pctx, value_head=value_head, seed=11), pctx)
    init_err = max((same_seed[k] - ref["full"][k]).abs().max().item() for k in full)
    rank = dist.get_rank()
    (out / f"check_{_kind(value_head)}{rank}.txt").write_text(
        f"out_err={out_err} weight_err={weight_err} init_err={init_err} shape={tuple(y.shape)}\n")


def ckpt_save(pctx, out: Path, value_head: bool):
    """Save weights + AdamW state (exp_avg = 0.5 * param, a layout-free relation) under TP/PP."""
    from slurm_align.models.checkpoint import init_optimizer_state, save_checkpoint
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    chunks = build_gpt(MODEL, pctx, value_head=value_head, seed=5)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    init_optimizer_state(opt)
    for p, st in opt.state.items():
        st["exp_avg"].copy_(0.5 * p.detach())
        st["step"] = torch.tensor(4.0)   # AdamW's own update count, kept apart from the run's step
    save_checkpoint(out / "ckpt", 3, chunks, opt, {"consumed_samples": 48})
    full = full_state_dict(chunks, pctx)
    if dist.get_rank() == 0:
        torch.save(full, out / "saved_full.pt")


def ckpt_load(pctx, out: Path, value_head: bool):
    from slurm_align.models.checkpoint import CheckpointError, find_latest, load_checkpoint
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    chunks = build_gpt(MODEL, pctx, value_head=value_head, seed=77)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    try:
        common = load_checkpoint(find_latest(out / "ckpt"), chunks, opt)
    except CheckpointError as exc:   # a damaged checkpoint: the test reads why the load refused it
        (out / f"load{dist.get_rank()}.txt").write_text(f"refused: CheckpointError: {exc}\n")
        return
    full = full_state_dict(chunks, pctx)
    saved = torch.load(out / "saved_full.pt")
    weight_err = max((full[k] - saved[k]).abs().max().item() for k in saved)
    optim_err = max((st["exp_avg"] - 0.5 * p.detach()).abs().max().item() for p, st in opt.state.items())
    steps = {float(st["step"]) for st in opt.state.values()}
    (out / f"load{dist.get_rank()}.txt").write_text(
        f"weight_err={weight_err} optim_err={optim_err} step={common['step']} "
        f"consumed={common['consumed_samples']} opt_steps={sorted(steps)}\n")


def greedy_score(pctx, out: Path, value_head: bool):
    """Greedy responses of the SFT_tiny-shaped model in OUT/ckpt_path.txt (or its seed init when
    the file says 'init') to synthetic prompts, scored by the task's own scorer."""
    from slurm_align.config.run import ModelConfig
    from slurm_align.data.jsonl import read_jsonl
    from slurm_align.data.synthetic import score
    from slurm_align.models.checkpoint import load_weights
    from slurm_align.models.forward import forward_logits
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.tokenizer import ByteTokenizer
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=260, max_seq_len=32)
    chunks = build_gpt(cfg, pctx, seed=1234)
    src = (out / "ckpt_path.txt").read_text().strip()
    if src != "init":
        load_weights(src, chunks)
    tok = ByteTokenizer()
    prompts = [r["prompt"] for r in read_jsonl(Path(__file__).parents[2] / "examples/synthetic/prompts.jsonl",
                                               ("prompt",), "prompt")[:32]]
    seqs = [[tok.bos_id, *tok.encode(p)] for p in prompts]
    done = [False] * len(seqs)
    for _ in range(9):
        length = max(map(len, seqs))
        batch = torch.full((len(seqs), length), tok.pad_id)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = torch.tensor(s)
        logits = forward_logits(chunks, pctx, batch, cfg.vocab_size)
        for i, s in enumerate(seqs):
            if not done[i]:
                nxt = int(logits[i, len(s) - 1].argmax())
                done[i] = nxt == tok.eos_id
                if not done[i]:
                    s.append(nxt)
    responses = [tok.decode(s[1 + len(tok.encode(p)):]) for s, p in zip(seqs, prompts)]
    mean = sum(map(score, responses)) / len(responses)
    (out / "score.txt").write_text(f"score={mean} examples={responses[:4]}\n")


def rm_accuracy(pctx, out: Path, value_head: bool):
    """Load the RM checkpoint in OUT/ckpt_path.txt into a fresh value model (as the critic will)
    and measure pairwise accuracy of last-token rewards on the held-out preference pairs."""
    from slurm_align.config.run import ModelConfig
    from slurm_align.data.datasets import PreferenceDataset
    from slurm_align.models.checkpoint import load_weights
    from slurm_align.models.forward import forward_values, last_token_values
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.tokenizer import ByteTokenizer
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=260, max_seq_len=32)
    chunks = build_gpt(cfg, pctx, value_head=True, seed=4321)
    load_weights((out / "ckpt_path.txt").read_text().strip(), chunks)
    ds = PreferenceDataset(Path(__file__).parents[2] / "examples/synthetic/pref_val.jsonl", ByteTokenizer(), 32)
    b = ds.batch(list(range(64)))
    rewards = last_token_values(forward_values(chunks, pctx, b["tokens"]), b["lengths"])
    acc = (rewards[:64] > rewards[64:]).float().mean().item()
    (out / "rm_accuracy.txt").write_text(f"accuracy={acc}\n")


def main(argv: list[str]) -> int:
    actions, tp, pp, outs = argv[0].split("+"), int(argv[1]), int(argv[2]), [Path(p) for p in argv[3:]]
    pctx = init_parallel(tp, pp)
    for out in outs:
        for action in actions:
            if action in ("reference", "check"):  # both model kinds in one launch (start-up is the cost)
                for value_head in (False, True):
                    {"reference": reference, "check": check}[action](pctx, out, value_head)
            else:
                {"ckpt_save": ckpt_save, "ckpt_load": ckpt_load, "greedy_score": greedy_score,
                 "rm_accuracy": rm_accuracy}[action](pctx, out, False)
    dist.barrier()
    pctx.destroy()
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main(sys.argv[1:]))   # as the product's launchers end
