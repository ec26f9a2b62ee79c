"""models/optimizer.py in one process: the LR schedule against its formula, bf16 training against
fp32, and resume continuing the schedule; gpt.py's activation recompute against no recompute.
(ZeRO-1 over real DP ranks: tests/integration/test_optimizer.py.)"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import load_run_config
from slurm_align.config.run import LoraConfig, ModelConfig, TrainingConfig
from slurm_align.models.checkpoint import find_latest, load_checkpoint, save_checkpoint
from slurm_align.models.forward import run_schedule
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import adapter_tensors, attach_configured, trainable_parameters
from slurm_align.models.optimizer import build_optimizer
from slurm_align.profiling.activations import SavedActivationPeak
from tests.support.single_rank import single_rank_world

ONE_RANK = SimpleNamespace(dp_size=1, tp_size=1, pp_size=1, tp_rank=0, dp_group=None)   # no collectives
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_seq_len=16)


def expected_lr(k: int, *, lr: float, init: float, warmup: int, decay: int, min_lr: float, style: str) -> float:
    """The schedule written out: linear warmup init -> lr over `warmup` steps, then linear or
    cosine decay to min_lr at step `decay`, min_lr after."""
    if k <= warmup and warmup > 0:
        return init + (lr - init) * k / warmup
    if k > decay:
        return min_lr
    ratio = (k - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_lr_of_each_step_follows_the_schedule_formula(style: str):
    training = TrainingConfig(lr_warmup_steps=3, lr_warmup_init=1e-5, lr_decay_style=style, min_lr=1e-4)
    w = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([w], ONE_RANK, training, lr=1e-3, total_steps=10)   # decay ends at the run's end
    seen = []
    for _ in range(13):
        seen.append(opt.lr)
        w.grad = torch.ones(4)
        opt.step()
    want = [expected_lr(k, lr=1e-3, init=1e-5, warmup=3, decay=10, min_lr=1e-4, style=style) for k in range(13)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert seen[3] == pytest.approx(1e-3) and seen[12] == pytest.approx(1e-4)


def test_constant_schedule_is_the_configured_lr_and_adam_settings_reach_adam():
    training = TrainingConfig(adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    w = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([w], ONE_RANK, training, lr=3e-4, weight_decay=0.1, total_steps=5)
    group = opt.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.1)
    for _ in range(5):
        assert opt.lr == 3e-4
        w.grad = torch.ones(4)
        opt.step()


def test_warmup_not_below_decay_end_is_refused(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: sft\ntraining:\n  lr_warmup_steps: 20\n  lr_decay_steps: 10\n")
    with pytest.raises(ConfigError, match=r"lr_warmup_steps=20 must be below lr_decay_steps=10"):
        load_run_config(path)


def batch() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))


def nll(logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
    lp = torch.log_softmax(logits[:, :-1, :MODEL.vocab_size].float(), -1)
    loss = -lp.gather(-1, mb["tokens"][:, 1:, None]).mean()
    return loss, {"loss": loss.detach()}


def train(pctx, training: TrainingConfig, steps: int, norms: list | None = None) -> tuple[list[float], list, object]:
    """`steps` optimizer steps on one batch: the losses, the chunks, the optimizer (`norms`:
    each step's gradient norm is appended there)."""
    chunks = build_gpt(MODEL, pctx, seed=11, training=training)
    opt = build_optimizer([p for c in chunks for p in c.parameters()], pctx, training, lr=3e-3, grad_clip=1.0,
                          total_steps=steps, models=chunks)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(run_schedule(chunks, [{"tokens": batch()}], nll, forward_only=False)[0]["loss"]))
        norm = opt.step()
        if norms is not None:
            norms.append(norm)
    return losses, chunks, opt


def test_bf16_trains_as_fp32_does_on_fp32_main_weights():
    with single_rank_world() as (_, pctx):
        fp32, _, _ = train(pctx, TrainingConfig(), 8)
        bf16, chunks, opt = train(pctx, TrainingConfig(precision="bf16"), 8)
    # Parameters (and so activations) bf16; main weights and gradient accumulation fp32.
    assert {p.dtype for c in chunks for p in c.parameters()} == {torch.bfloat16}
    assert [b.main.dtype for b in opt.buckets] == [torch.float32]
    assert {p.main_grad.dtype for p in opt.params} == {torch.float32}
    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2% per value); a loss of ~4
    # summed from such terms moves by a few 1e-3 (measured: at most 0.0018 over these 8 steps),
    # while training itself moves it by more than 0.5: 0.02 separates the two.
    assert fp32[-1] < fp32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5
    assert bf16 == pytest.approx(fp32, abs=0.02)


LONG = MODEL.model_copy(update={"max_seq_len": 64})   # attention's s x s terms outweigh q, k, v


def saved_activation_bytes(chunks, tokens: torch.Tensor) -> tuple[int, dict]:
    """Peak bytes autograd holds for the backward pass (profiling/activations.py), and the
    gradients it then computes."""
    with SavedActivationPeak(p for c in chunks for p in c.parameters()) as held:
        run_schedule(chunks, [{"tokens": tokens}], nll, forward_only=False)
    return held.peak, {n: p.grad.clone() for n, p in chunks[0].named_parameters()}


def test_recompute_gives_the_same_gradients_with_fewer_saved_activations():
    tokens = torch.randint(0, LONG.vocab_size, (4, 64), generator=torch.Generator().manual_seed(3))
    with single_rank_world() as (_, pctx):
        results = {mode: saved_activation_bytes(build_gpt(LONG, pctx, seed=11, training=TrainingConfig(
            recompute=mode)), tokens) for mode in ("none", "selective", "full")}
    base_bytes, base_grads = results["none"]
    for mode in ("selective", "full"):
        kept, grads = results[mode]
        assert grads.keys() == base_grads.keys()
        assert all(torch.equal(grads[k], base_grads[k]) for k in grads), mode   # fp32: exact
        assert kept < base_bytes, (mode, kept, base_bytes)
    assert results["full"][0] < results["selective"][0]


def test_resume_continues_the_lr_schedule_and_the_steps(tmp_path: Path):
    training = TrainingConfig(precision="bf16", lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-4)
    with single_rank_world() as (_, pctx):
        _, chunks, opt = train(pctx, training, 3)
        save_checkpoint(tmp_path, 3, chunks, opt, {})
        lrs = [opt.lr]
        opt.zero_grad()
        run_schedule(chunks, [{"tokens": batch()}], nll, forward_only=False)
        opt.step()
        lrs.append(opt.lr)
        want = {k: v.clone() for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}

        chunks2 = build_gpt(MODEL, pctx, seed=99, training=training)   # other weights: the checkpoint sets them
        opt2 = build_optimizer([p for c in chunks2 for p in c.parameters()], pctx, training, lr=3e-3,
                               grad_clip=1.0, total_steps=3)
        load_checkpoint(find_latest(tmp_path), chunks2, opt2)
        resumed = [opt2.lr]
        opt2.zero_grad()
        run_schedule(chunks2, [{"tokens": batch()}], nll, forward_only=False)
        opt2.step()
        resumed.append(opt2.lr)
        got = {k: v for k, v in chunks2[0].state_dict().items() if isinstance(v, torch.Tensor)}
    assert resumed == lrs and lrs[0] != 3e-3   # mid-decay, not the start of a fresh schedule
    assert opt2.steps == opt.steps == 4
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fp16_trains_as_fp32_does_with_loss_scaling():
    # hysteresis 1: an overflowing step would halve the scale at once (there should be none)
    t = TrainingConfig(precision="fp16", initial_loss_scale=2.0 ** 12, loss_scale_hysteresis=1)
    with single_rank_world() as (_, pctx):
        norms32: list[float] = []
        norms16: list[float] = []
        fp32, _, _ = train(pctx, TrainingConfig(), 8, norms32)
        fp16, chunks, opt = train(pctx, t, 8, norms16)
    assert {p.dtype for c in chunks for p in c.parameters()} == {torch.float16}
    assert [b.main.dtype for b in opt.buckets] == [torch.float32]
    # The loss was scaled before the backward pass and the gradients unscaled: without either,
    # the update would be 4096x off (Adam is scale-free, but the clip at 1.0 is not: the norm
    # returned is the unscaled one). fp16 keeps 11 significant bits (bf16: 8), so bf16's bound holds.
    assert opt.metrics() == {"loss_scale": 2.0 ** 12, "skipped_steps": 0.0} and opt.steps == 8
    assert fp16[-1] < fp16[0] - 0.5
    assert fp16 == pytest.approx(fp32, abs=0.02)
    assert norms16 == pytest.approx(norms32, rel=0.05) and min(norms32) > 1.0   # unscaled; the clip acts


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path: Path):
    """A loss scale of 2^40 overflows fp16's range (65504) in the backward pass: those steps are
    skipped (weights, Adam state and LR schedule untouched) and the scale halves each time until
    the gradients are finite; the scaler's state goes into the checkpoint and comes back."""
    t = TrainingConfig(precision="fp16", initial_loss_scale=2.0 ** 40, loss_scale_hysteresis=1,
                       lr_warmup_steps=2)
    with single_rank_world() as (_, pctx):
        chunks = build_gpt(MODEL, pctx, seed=11, training=t)
        opt = build_optimizer([p for c in chunks for p in c.parameters()], pctx, t, lr=3e-3, grad_clip=1.0,
                              total_steps=8, models=chunks)
        before = {k: v.clone() for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
        opt.zero_grad()
        run_schedule(chunks, [{"tokens": batch()}], nll, forward_only=False)
        norm = opt.step()
        assert not math.isfinite(norm)
        assert opt.metrics() == {"loss_scale": 2.0 ** 39, "skipped_steps": 1.0}
        assert opt.steps == 0 and opt.scheduler.num_steps == 0 and opt.lr == 0.0   # warmup's first LR
        assert all(torch.equal(v, before[k]) for k, v in chunks[0].state_dict().items() if k in before)
        scales = []
        while opt.steps == 0:
            opt.zero_grad()
            run_schedule(chunks, [{"tokens": batch()}], nll, forward_only=False)
            opt.step()
            scales.append(opt.loss_scale)
        skipped = int(opt.metrics()["skipped_steps"])
        assert skipped >= 2 and scales == [2.0 ** (40 - k) for k in range(2, skipped + 1)] + [scales[-1]]
        assert opt.scheduler.num_steps == 1 and opt.lr == pytest.approx(1.5e-3)   # warmup's second LR
        save_checkpoint(tmp_path, 1, chunks, opt, {})
        chunks2 = build_gpt(MODEL, pctx, seed=11, training=t)
        opt2 = build_optimizer([p for c in chunks2 for p in c.parameters()], pctx, t, lr=3e-3, grad_clip=1.0,
                               total_steps=8, models=chunks2)
        load_checkpoint(find_latest(tmp_path), chunks2, opt2)
    assert opt2.scaler_state() == opt.scaler_state()
    assert opt2.metrics() == {"loss_scale": scales[-1], "skipped_steps": float(skipped)}


def test_lora_on_a_bf16_base_trains_fp32_adapters_as_fp32_does():
    cfg = MODEL.model_copy(update={"lora": LoraConfig(rank=4, targets=["qkv", "proj", "fc1", "fc2"])})
    results = {}
    with single_rank_world() as (_, pctx):
        for precision in ("fp32", "bf16"):
            t = TrainingConfig(precision=precision)
            chunks = build_gpt(cfg, pctx, seed=11, training=t)
            attach_configured(chunks, cfg, pctx, 11)
            trained = trainable_parameters(chunks)
            opt = build_optimizer(trained, pctx, t, lr=1e-2, total_steps=3, models=chunks)
            losses, grads = [], {}
            for step in range(3):
                opt.zero_grad()
                losses.append(float(run_schedule(chunks, [{"tokens": batch()}], nll, forward_only=False)[0]["loss"]))
                if step == 0:   # bf16: the fp32 main_grad the hook accumulated
                    grads = {n: (p.main_grad if precision == "bf16" else p.grad).clone()
                             for n, p in adapter_tensors(chunks)}
                opt.step()
            results[precision] = (losses, grads, {p.dtype for c in chunks for p in c.parameters()},
                                  {p.dtype for _, p in adapter_tensors(chunks)})
            if precision == "bf16":   # only the adapters are in the optimizer
                assert [id(p) for b in opt.buckets for p in b.params] == [id(p) for p in trained]
    (l32, g32, base32, ad32), (l16, g16, base16, ad16) = results["fp32"], results["bf16"]
    assert base16 == {torch.bfloat16} and base32 == {torch.float32}
    assert ad16 == ad32 == {torch.float32}
    # One step's adapter gradients (B's: A's are zero while B is): bf16 activations round each
    # value by up to 2^-9, so the gradients agree to a few per cent, not exactly.
    b_grads = [k for k in g32 if "lora_B" in k]
    assert b_grads and all(float(g32[k].norm()) > 0 for k in b_grads)
    for k in b_grads:
        assert float((g16[k] - g32[k]).norm()) < 0.05 * float(g32[k].norm()), k
    assert l16[-1] < l16[0] and l16 == pytest.approx(l32, abs=0.02)


def test_fp16_loss_scale_and_skipped_steps_reach_a_trainers_metrics(tmp_path: Path):
    """The SFT trainer's step metrics (models/worker.py) carry the scaler's state: the first
    step at a scale of 2^40 overflows and is skipped."""
    from slurm_align import REPO_ROOT
    from slurm_align.algorithms.trainer import Trainer
    synth = REPO_ROOT / "examples" / "synthetic"
    run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={synth / 'sft_train.jsonl'}", "data.val_path=null", "actor.data_parallel=1",
        "training.precision=fp16", f"training.initial_loss_scale={2.0 ** 40}", "training.loss_scale_hysteresis=1"])
    with single_rank_world() as (_, pctx):
        trainer = Trainer(run, pctx, tmp_path)
        first, second = trainer.train_step(0), trainer.train_step(1)
    assert (first["loss_scale"], first["skipped_steps"]) == (2.0 ** 39, 1.0)
    assert (second["loss_scale"], second["skipped_steps"]) == (2.0 ** 38, 2.0)
