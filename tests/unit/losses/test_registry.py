"""The loss registry (losses/registry.py) and the run config's `loss:` section: options are
typed per loss, bad ones are errors naming the file, the field, the value and what is allowed,
and a plugin registers a loss with its own option in one file."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import ConfigError, load_run_config
from slurm_align.losses.registry import LOSSES, LossSpec, PreferenceOptions, register_loss

DPO = REPO_ROOT / "examples" / "dpo_tiny.yaml"


def test_the_dpo_example_validates_its_options():
    run = load_run_config(DPO, ["loss.options.preference_loss=rpo_bwd_kl", "loss.options.sft_weight=0.5"])
    spec, options = run.trainer_loss()
    assert spec.name == "preference" and isinstance(options, PreferenceOptions)
    assert (options.preference_loss, options.sft_weight, options.beta) == ("rpo_bwd_kl", 0.5, 0.1)
    assert load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml").trainer_loss()[0].name == "nll"


@pytest.mark.parametrize("override, needles", [
    (["loss.options.preference_loss=ipo2"], ["field 'loss.options.preference_loss'", "'ipo2'",
                                            "'dpo', 'scale', 'ipo', 'rpo_sq', 'rpo_fwd_kl' or 'rpo_bwd_kl'"]),
    (["loss.options.betta=0.2"], ["field 'loss.options.betta'", "0.2", "allowed: preference_loss, beta"]),
    (["loss.options.beta=-1"], ["field 'loss.options.beta'", "-1", "greater than 0"]),
    (["loss.options.label_smoothing=0.1", "loss.options.preference_loss=ipo"], ["label_smoothing", "'dpo' only"]),
    (["loss.name=no_such_loss"], ["field 'loss.name'", "'no_such_loss'", "allowed: nll, bradley_terry"]),
])
def test_bad_loss_options_name_file_field_value_and_what_is_allowed(override: list[str], needles: list[str]):
    with pytest.raises(ConfigError) as e:
        load_run_config(DPO, override)
    text = str(e.value)
    assert text.startswith(str(DPO)), text
    for needle in needles:
        assert needle in text, (needle, text)


def test_rejection_sampling_refuses_a_loss_section_and_trainers_refuse_policy_losses():
    with pytest.raises(ConfigError, match=r"field 'loss'.*SFT loss on its kept samples"):
        load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", ["algorithm=rejection_sampling",
                                                                    "loss.name=ppo_clip"])
    with pytest.raises(ConfigError, match=r"field 'loss\.name': got 'ppo_clip', a policy loss; dpo takes a trainer"):
        load_run_config(DPO, ["loss.name=ppo_clip", "loss.options={}"])


def test_a_plugin_registers_a_loss_with_its_own_option(tmp_path: Path):
    sft = REPO_ROOT / "examples" / "sft_tiny.yaml"
    run = load_run_config(sft, ["plugins=[tests.support.toy_loss]", "loss.name=toy_scaled_nll",
                                "loss.options.scale=2.5"])
    spec, options = run.trainer_loss()
    assert spec.impl == "tests.support.toy_loss:ScaledNLL" and options.scale == 2.5
    assert type(spec.build(options, run.model)).__name__ == "ScaledNLL"
    with pytest.raises(ConfigError, match=r"field 'loss.options.scale': got 0"):
        load_run_config(sft, ["plugins=[tests.support.toy_loss]", "loss.name=toy_scaled_nll", "loss.options.scale=0"])


def test_a_name_cannot_be_registered_twice_differently():
    with pytest.raises(ValueError, match="already registered"):
        register_loss(LossSpec("preference", "somewhere:Else"))
    with pytest.raises(ValueError, match="module:Class"):
        register_loss(LossSpec("toy_no_colon", "no_colon"))
    assert "toy_no_colon" not in LOSSES
