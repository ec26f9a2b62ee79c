"""The loss registry: name -> where the loss class lives and the pydantic model of its options.

Torch-free: config validation (on the login node) checks a run's `loss.options` against the
registered model without importing the loss itself. A new loss is one class in one file
(losses/base.py's interface) plus one `register_loss(LossSpec(...))`: here for the shipped
ones, or in a module the run lists under `plugins:`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import Field, model_validator

from slurm_align.config.base import StrictModel


class NoOptions(StrictModel):
    """A loss without hyper-parameters."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    """The registered name (RunConfig.loss.name; an algorithm's default loss)."""
    impl: str
    """'module:Class' of the loss (a losses.base.Loss subclass), imported where it runs."""
    options: type[StrictModel] = NoOptions
    """The typed options (RunConfig.loss.options is validated against it)."""
    kind: Literal["trainer", "policy", "rollout"] = "trainer"
    """trainer: a losses.base.Loss class the one-component trainers (sft, rm, dpo, kto) train
    with. policy: the per-token policy loss of the RL actor (algorithms/policy_gradient.py), a
    function like algorithms.policy_loss.clipped_policy_loss (same arguments, plus `options`).
    rollout: a losses.base.Loss class over rollouts that the RL actor and the critic build
    themselves from the run (algorithms/rollout_losses.py wraps the run's policy loss; losses/value.py);
    not a choice under `loss:`."""

    def parse_options(self, raw: dict[str, Any]) -> StrictModel:
        """The options model from the config's dict; a ValueError naming each bad field as
        'loss.options.FIELD', its value and what is allowed."""
        try:
            return self.options.model_validate(raw)
        except pydantic.ValidationError as e:
            problems = []
            for err in e.errors():
                loc = ".".join(str(p) for p in ("loss", "options", *err["loc"]))
                allowed = (err.get("ctx") or {}).get("expected")
                msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
                if err["type"] == "extra_forbidden":
                    msg += f" of loss {self.name!r}; allowed: {', '.join(self.options.model_fields) or 'none'}"
                elif allowed:
                    msg += f" (allowed: {allowed})"
                problems.append(f"field '{loc}': got {err.get('input')!r}; {msg}")
            raise ValueError("; ".join(problems)) from None

    def load(self) -> Any:
        """The loss class or function (imports it: torch)."""
        module, name = self.impl.split(":")
        return getattr(importlib.import_module(module), name)

    def build(self, options: StrictModel, model: Any) -> Any:
        """An instance of a trainer loss class."""
        return self.load()(options, model)


LOSSES: dict[str, LossSpec] = {}
"""Registered losses by name."""


def register_loss(spec: LossSpec) -> LossSpec:
    if spec.name in LOSSES and LOSSES[spec.name] != spec:
        raise ValueError(f"loss {spec.name!r} is already registered (differently)")
    if ":" not in spec.impl:
        raise ValueError(f"loss {spec.name!r}: impl must be 'module:Class', got {spec.impl!r}")
    LOSSES[spec.name] = spec
    return spec


def loss_spec(name: str) -> LossSpec:
    """The registered loss `name` (ValueError listing the registered ones otherwise)."""
    if name not in LOSSES:
        raise ValueError(f"loss {name!r} is not registered; allowed: {', '.join(LOSSES)}")
    return LOSSES[name]


# --- the shipped losses' options --------------------------------------------------------------

PreferenceLossKind = Literal["dpo", "scale", "ipo", "rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl"]


class PreferenceOptions(StrictModel):
    """The DPO family (NeMo-Aligner's preference_loss), with r = beta * (log pi(c) - log ref(c) -
    log pi(r) + log ref(r)) and g = (chosen reward - rejected reward) * gt_reward_scale."""

    preference_loss: PreferenceLossKind = "dpo"
    """dpo: -log sigma(r), with label_smoothing eps -(1-eps) log sigma(r) - eps log sigma(-r) (cDPO);
    scale: |chosen reward - rejected reward| * -log sigma(r); ipo: (r/beta - 1/(2 beta))^2;
    rpo_sq: (r - g)^2; rpo_bwd_kl: sigma(g)(log sigma(g) - log sigma(r)) + sigma(-g)(log sigma(-g) -
    log sigma(-r)); rpo_fwd_kl: sigma(r)(log sigma(r) - log sigma(g)) + sigma(-r)(log sigma(-r) -
    log sigma(-g)). Default dpo."""
    beta: float = Field(0.1, gt=0)
    """Temperature beta of the log-ratio margin. Default 0.1."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """eps of conservative DPO (dpo only): the share of pairs assumed mislabelled. Default 0."""
    average_log_probs: bool = False
    """Average the response tokens' log-probs per sequence instead of summing them (IPO's
    length normalisation). Default false (sum)."""
    gt_reward_scale: float = Field(1.0, gt=0)
    """Scale of the ground-truth reward margin g (the rpo variants). Default 1."""
    default_chosen_reward: float = 1.0
    """chosen_reward of a row that carries none (scale and rpo_*). Default 1."""
    default_rejected_reward: float = 0.0
    """rejected_reward of a row that carries none. Default 0."""
    preference_weight: float = Field(1.0, ge=0)
    """Weight of the preference loss. Default 1."""
    sft_weight: float = Field(0.0, ge=0)
    """Weight of an SFT term: the chosen response's negative log-likelihood, averaged over its
    tokens (RPO's NLL term). Default 0 (off)."""

    @model_validator(mode="after")
    def _something_trains(self):
        if self.preference_weight == 0 and self.sft_weight == 0:
            raise ValueError("preference_weight and sft_weight are both 0: nothing would train")
        if self.label_smoothing and self.preference_loss != "dpo":
            raise ValueError(f"label_smoothing={self.label_smoothing} applies to preference_loss 'dpo' only, "
                             f"not {self.preference_loss!r}")
        return self


class BradleyTerryOptions(StrictModel):
    """Bradley-Terry reward model: -log sigma(reward(chosen) - reward(rejected) - m), with the
    margin m = margin_scale * (chosen_reward - rejected_reward) of rows that carry both (Llama 2's
    margin loss), 0 on rows that do not."""

    margin_scale: float = Field(1.0, ge=0)
    """Scale of the rows' reward margin (0: no margin term). Default 1."""


HELPSTEER2_ATTRIBUTES = ["helpfulness", "correctness", "coherence", "complexity", "verbosity"]
"""HelpSteer2's attributes (each labelled 0-4), the regression reward model's default."""


class RegressionOptions(StrictModel):
    """A regression (multi-attribute) reward model: one output per attribute, MSE on labelled rows."""

    attributes: list[str] = Field(default_factory=lambda: list(HELPSTEER2_ATTRIBUTES), min_length=1)
    """Attribute names, in the order of the value head's outputs; each row labels them under
    these keys. model.num_labels must equal their count. Default HelpSteer2's five."""

    @model_validator(mode="after")
    def _distinct(self):
        if len(set(self.attributes)) != len(self.attributes):
            raise ValueError(f"attributes lists a name twice: {self.attributes}")
        return self

    def check_run(self, run: Any) -> list[str]:
        """Problems of this loss with the rest of the run (the head's width)."""
        if run.model.num_labels != len(self.attributes):
            return [f"field 'model.num_labels': got {run.model.num_labels}; the regression reward model has one "
                    f"output per attribute: {len(self.attributes)} ({', '.join(self.attributes)})"]
        return []


class KTOOptions(StrictModel):
    """KTO (Ethayarajh et al. 2024, as TRL defines it) on unpaired rows labelled desirable or
    undesirable: with L = log pi(y|x) - log ref(y|x) and z0 the reference point (the batch's
    mean L over mismatched prompt/response pairs, at least 0, without gradient), a desirable
    row's loss is desirable_weight * (1 - sigma(beta (L - z0))), an undesirable row's
    undesirable_weight * (1 - sigma(beta (z0 - L)))."""

    beta: float = Field(0.1, gt=0)
    """Temperature beta. Default 0.1."""
    desirable_weight: float = Field(1.0, gt=0)
    """lambda_D, the weight of desirable rows. Default 1."""
    undesirable_weight: float = Field(1.0, gt=0)
    """lambda_U, the weight of undesirable rows. Default 1."""


class KDOptions(StrictModel):
    """Offline knowledge distillation on a teacher's stored top-K log-probs (losses/distill.py):
    kd_weight * KL(teacher || student) over the top-K, both renormalised over those K tokens
    (or over the K tokens and the rest: rest_mass), plus sft_weight * the response tokens'
    negative log-likelihood; both averaged over response tokens."""

    kd_weight: float = Field(1.0, ge=0)
    """Weight of the top-K forward KL. Default 1."""
    sft_weight: float = Field(0.0, ge=0)
    """Weight of the SFT term (NLL of the stored response). Default 0 (off)."""
    rest_mass: bool = False
    """Add a (K+1)-th class, the mass outside the teacher's K ids (1 - the K stored
    probabilities; the student's over the rest of the vocabulary), instead of renormalising over
    the K: the student then also matches how much mass the teacher leaves outside them. Without
    it the loss is blind to the student's mass outside the K ids, which can grow freely (measured
    on the sort task: a student kept 17% of its mass on the teacher's top-8, the teacher 98%;
    docs/algorithms/distillation.md). Default false (the renormalised top-K KL)."""

    @model_validator(mode="after")
    def _something_trains(self):
        if self.kd_weight == 0 and self.sft_weight == 0:
            raise ValueError("kd_weight and sft_weight are both 0: nothing would train")
        return self


class ValueOptions(StrictModel):
    """The PPO critic's clipped value loss (losses/value.py); the critic fills it from ppo.value_clip."""

    value_clip: float = Field(0.2, gt=0)
    """Clip of the new values around the old ones. Default 0.2."""


for _spec in (
    LossSpec("nll", "slurm_align.losses.nll:NLL"),
    LossSpec("bradley_terry", "slurm_align.losses.bradley_terry:BradleyTerry", BradleyTerryOptions),
    LossSpec("preference", "slurm_align.losses.preference:Preference", PreferenceOptions),
    LossSpec("regression", "slurm_align.losses.regression:Regression", RegressionOptions),
    LossSpec("kto", "slurm_align.losses.kto:KTO", KTOOptions),
    LossSpec("kd", "slurm_align.losses.distill:KD", KDOptions),
    LossSpec("ppo_clip", "slurm_align.algorithms.policy_loss:clipped_policy_loss", kind="policy"),
    LossSpec("policy", "slurm_align.algorithms.rollout_losses:PolicyLoss", kind="rollout"),
    LossSpec("rollout_nll", "slurm_align.algorithms.rollout_losses:RolloutNLL", kind="rollout"),
    LossSpec("value", "slurm_align.losses.value:ValueLoss", ValueOptions, kind="rollout"),
):
    register_loss(_spec)
