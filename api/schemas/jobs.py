"""The job spec (every field, default and range: docs/contracts.md) and job reads."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    computed_field,
    field_validator,
    model_validator,
)

from api.schemas.common import Labels, ReadModel, RequestModel
from engine import compute_class as server_class
from engine.kernels import DEFAULT_EXACTNESS
from engine.models import ARCHS as BUILTIN_ARCHS
from engine.models import CUSTOM
from engine.slices import MAX_SLICES
from engine.spec import AUDIT_RATE, MAX_PROBATION_STEPS, PROBATION_STEPS
from wire.states import JobState

ARCHS = (*BUILTIN_ARCHS, CUSTOM)  # the engine's list: one place says what exists


class ModelSpec(RequestModel):
    arch: Literal[ARCHS] = Field(  # type: ignore[valid-type]
        "custom", description="a built-in architecture, or `custom` (the default when `layers` "
        "is given) for the job's own layer graph")
    layers: list[dict[str, Any]] | None = Field(
        None, max_length=2000, description="the job's own model: a list of layer objects "
        "(`type` plus that layer's options; docs/models.md), checked against the dataset's "
        "input shape and class count at submit",
        examples=[[{"type": "conv2d", "out_channels": 16}, {"type": "relu"},
                   {"type": "global_avgpool"}, {"type": "dense", "units": 10}]])
    width: float = Field(1.0, ge=0.125, le=4)
    hidden: int = Field(128, ge=1, le=8192)
    dropout: float = Field(0.0, ge=0, le=0.9)
    blocks: int = Field(1, ge=1, le=8)

    @model_validator(mode="after")
    def _arch_or_layers(self) -> ModelSpec:
        if self.arch == "custom" and not self.layers:
            raise ValueError("give model.arch (a built-in architecture) or model.layers "
                             "(your own layer graph)")
        if self.arch != "custom" and self.layers:
            raise ValueError(f"give either model.arch ({self.arch!r}) or model.layers, not both")
        return self


class OptimizerSpec(RequestModel):
    type: Literal["sgd", "adamw", "lars"] = Field(
        "sgd", description="sgd (momentum, optional nesterov), adamw (decoupled weight decay) "
        "or lars (layer-wise trust ratio over SGD with momentum); docs/contracts.md")
    lr: float = Field(0.1, gt=0, le=100)
    momentum: float = Field(0.9, ge=0, le=0.999, description="sgd and lars")
    beta1: float = Field(0.9, ge=0, lt=1, description="adamw")
    beta2: float = Field(0.999, ge=0, lt=1, description="adamw")
    eps: float = Field(1e-8, gt=0, le=1, description="adamw and lars")
    trust_coefficient: float = Field(0.001, gt=0, le=1, description="lars: eta, the trust "
                                     "ratio's coefficient")
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0, le=1)
    warmup_epochs: float = Field(0.0, ge=0, le=1000)
    schedule: Literal["constant", "cosine", "step"] = "cosine"
    decay_epochs: list[float] = Field(default_factory=list, max_length=1000)
    decay_factor: float = Field(0.1, ge=0, le=1)
    lr_scaling: bool = True

    @field_validator("decay_epochs")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if any(e < 0 for e in value):
            raise ValueError("decay epochs must be >= 0")
        return sorted(value)


class AugmentSpec(RequestModel):
    crop_padding: int = Field(0, ge=0, le=64, description="random crop: zero-pad by this many "
                              "pixels, then take a window of the input's size (0: off)")
    horizontal_flip: bool = Field(False, description="mirror each sample with probability 1/2")


class PlacementSpec(RequestModel):
    min_devices: int = Field(1, ge=1, le=10000)
    max_devices: int = Field(8, ge=1, le=10000)
    selector: Labels = Field(default_factory=dict)
    min_battery: float = Field(20, ge=0, le=100)
    max_temp_c: float = Field(45, ge=20, le=120)
    backend: Literal["any", "numpy", "torch"] = "any"
    shared_mode: bool = False

    @field_validator("max_devices")
    @classmethod
    def _at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_devices")
        if low is not None and value < low:
            raise ValueError(f"max_devices ({value}) must be >= min_devices ({low})")
        return value


class VerificationSpec(RequestModel):
    audit_rate: float = Field(
        AUDIT_RATE, ge=0, le=1, description="the share of upload nodes (what a phone uploads: "
        "the shards it holds pre-added up the reduction tree) computed again by a second phone "
        "and compared byte for byte before the step commits; drawn per step and node by the "
        "server, unseen by the phone; 0: none, 1: every node (docs/scheduler.md, \"Audits\")")
    probation_steps: int = Field(
        PROBATION_STEPS, ge=0, le=MAX_PROBATION_STEPS, description="a phone's every upload "
        "node is audited until this many of its steps were audited and agreed")


class JobCreate(RequestModel):
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec
    dataset: str = Field(min_length=1, max_length=200)
    global_batch_size: int = Field(256, ge=1, le=65536)
    shards: int = Field(16, ge=1, le=4096)
    epochs: int = Field(10, ge=1, le=10000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    priority: int = Field(0, ge=-1000, le=1000)
    augment: AugmentSpec = Field(default_factory=AugmentSpec, description="drawn per sample "
                                 "from (seed, step, shard, its position in the shard): the "
                                 "same on every phone and in the reference trainer")
    upload_precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="how each shard's gradient travels: bfloat16 or float16 halve the "
        "upload bytes; the rounding (to nearest, ties to even) is part of the math, so the run "
        "still equals phalanx train --local of the same spec")
    slices: int = Field(1, ge=1, le=MAX_SLICES, description="the parameter vector cut into "
                        "this many parts (between tensors), each step's parts reduced and "
                        "updated by separate scheduler tasks in parallel: spreads a large "
                        "model's step over the workers; the same math bit for bit")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="the target is (1 - e) on the "
                                   "label plus e / classes on every class (torch's)")
    checkpoint_every: int = Field(50, ge=1, le=100000)
    eval_every: int = Field(0, ge=0, le=100000, description="the validation split's loss and "
                            "accuracy every this many steps (and at the last), a point of the "
                            "job's validation curve each; 0: only the final weights' "
                            "(engine.validation, as phalanx train --local computes them)")
    verification: VerificationSpec = Field(
        default_factory=VerificationSpec, description="audits: a phone's result is checked, "
        "not trusted (DESIGN.md invariant 7)")
    exactness: Literal["portable", "class"] = Field(
        DEFAULT_EXACTNESS, description="portable: every shard gives the same bits on any CPU "
        "(x86 or ARM, whatever BLAS kernel), so any phone whose agent computes the portable path "
        "may take it and the run equals phalanx train --local anywhere; class: float32 BLAS, "
        "faster, but its bits are those of one compute class, so the job's shards are kept on "
        "devices of the class its first placement chose (docs/api.md)")

    @field_validator("shards")
    @classmethod
    def _divides_batch(cls, value: int, info: ValidationInfo) -> int:
        batch = info.data.get("global_batch_size")
        if batch is not None and batch % value:
            raise ValueError(f"global_batch_size ({batch}) must be divisible by shards ({value})")
        return value

    @model_validator(mode="after")
    def _warmup_before_end(self) -> JobCreate:
        if self.optimizer.warmup_epochs >= self.epochs:
            raise ValueError(f"optimizer.warmup_epochs ({self.optimizer.warmup_epochs:g}) must "
                             f"be < epochs ({self.epochs})")
        return self

    @model_validator(mode="after")
    def _portable_on_numpy(self) -> JobCreate:
        # torch's kernels, like BLAS's, give other bits per CPU: a portable shard is numpy's
        if self.exactness == "portable" and self.placement.backend == "torch":
            raise ValueError("exactness portable computes every shard with numpy's portable "
                             "kernels: placement.backend torch cannot apply (use any or numpy, "
                             "or exactness class)")
        return self

    def spec(self) -> dict[str, Any]:
        """The spec a job keeps: every field with its default, a model's unset `layers` left out."""
        out = self.model_dump()
        if out["model"]["layers"] is None:
            del out["model"]["layers"]
        return out


class JobDryRun(BaseModel):
    """A job as it would be created, its plan and where it could run (`dry_run=true`)."""

    name: str
    state: JobState = JobState.PENDING
    spec: dict[str, Any]
    total_steps: int
    owner: str | None = None
    plan: dict[str, Any] = Field(description="parameters, FLOPs per sample (forward + backward), "
                                 "memory per phone for one micro-batch, bytes moved per step, "
                                 "and each layer's shape, parameters and FLOPs (docs/models.md)")
    placement: dict[str, Any] = Field(description="how many devices could take the job now, "
                                      "and why each other cannot")


class JobRead(ReadModel):
    id: str
    name: str
    state: JobState
    reason: str | None
    priority: int
    step: int
    total_steps: int
    metrics: dict[str, Any]
    spec: dict[str, Any]
    owner: str | None = Field(None, description="the user who submitted it (their token's id); "
                              "null: an admin")
    plan: dict[str, Any] | None = Field(None, description="the estimate made at submit: "
                                        "parameters, FLOPs, memory per phone, bytes per step")
    compute_class: str | None = Field(None, description="a `class` job's compute class (its "
                                      "fingerprint), chosen at its first placement; null for "
                                      "a portable job or before")
    devices: list[str] = []  # every device holding a shard (primary or a straggler's backup)
    shards: dict[str, list[int]] = {}  # device id -> the shards it owns (primary)
    created: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @computed_field(description="portable (the same bits on any CPU) or class (kept on one "
                    "compute class)")  # type: ignore[prop-decorator]
    @property
    def exactness(self) -> str:
        return str(self.spec.get("exactness", DEFAULT_EXACTNESS))

    @computed_field(description="whether phalanx train --local on this server computes this "
                    "job's bits: always for a portable job; for a class job, whether the "
                    "server's compute class is the job's (null until it is placed)")  # type: ignore[prop-decorator]
    @property
    def server_is_reference(self) -> bool | None:
        if self.exactness != "class":
            return True
        if self.compute_class is None:
            return None
        return server_class.fingerprint() == self.compute_class


class StepMetricRead(ReadModel):
    step: int
    ts: dt.datetime
    epoch: float
    train_loss: float | None
    train_accuracy: float | None
    val_loss: float | None
    val_accuracy: float | None
    lr: float | None
    samples: int
    step_seconds: float | None
    devices: int
    energy_j: float | None
