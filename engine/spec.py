"""The engine's reading of a job spec: the same fields and defaults as docs/contracts.md.

The API validates the full spec with pydantic; this reads only what the math needs, with the
same defaults, so `TrainSpec.from_job_spec` means one thing on a phone, in the scheduler and in
the reference trainer. `n_train` (the dataset's training size) is needed for anything that
depends on epochs: steps per epoch, total steps and the learning-rate schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.kernels import DEFAULT_EXACTNESS, EXACTNESS
from engine.sampler import steps_per_epoch as _steps_per_epoch
from engine.slices import MAX_SLICES

SCHEDULES = ("constant", "cosine", "step")
OPTIMIZER_TYPES = ("sgd", "adamw", "lars")  # engine.optim implements each
UPLOAD_PRECISIONS = ("float32", "bfloat16", "float16")  # engine.precision rounds to each
AUDIT_RATE = 0.02  # verification.audit_rate's default: the share of upload nodes audited
PROBATION_STEPS = 20  # verification.probation_steps' default: steps a new phone is audited in full
MAX_PROBATION_STEPS = 100_000


class SpecError(ValueError):
    """A spec the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class TrainSpec:
    arch: str
    dataset: str
    width: float = 1.0
    hidden: int = 128
    dropout: float = 0.0
    blocks: int = 1
    global_batch_size: int = 256
    shards: int = 16
    epochs: int = 10
    seed: int = 0
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    beta1: float = 0.9  # adamw
    beta2: float = 0.999  # adamw
    eps: float = 1e-8  # adamw, lars
    trust_coefficient: float = 0.001  # lars (eta)
    label_smoothing: float = 0.0
    upload_precision: str = "float32"  # engine.precision: how shard gradients travel
    exactness: str = DEFAULT_EXACTNESS  # engine.kernels: portable (any CPU) or class
    slices: int = 1  # engine.slices: the vector's parts applied apart
    # the scheduler's audits (scheduler.policy.audit), no part of the math: the share of upload
    # nodes computed again by a second phone, and the steps each phone is audited in full.
    # A spec without `verification` (stored before audits existed) audits nothing; the API
    # fills the documented defaults (AUDIT_RATE, PROBATION_STEPS) into every job it takes
    audit_rate: float = 0.0
    probation_steps: int = 0
    crop_padding: int = 0  # augment: random crop after zero-padding by this much
    horizontal_flip: bool = False  # augment: mirror half the samples
    nesterov: bool = False
    weight_decay: float = 0.0
    warmup_epochs: float = 0.0
    schedule: str = "cosine"
    decay_epochs: tuple[float, ...] = ()
    decay_factor: float = 0.1
    lr_scaling: bool = True
    eval_every: int = 0  # engine.validation: the validation split every this many steps; 0: at the end only
    layers: tuple[Any, ...] = field(default=(), hash=False)  # a custom model's layer graph (engine.layerspec)
    n_train: int | None = None
    name: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def from_job_spec(cls, spec: dict[str, Any], n_train: int | None = None) -> TrainSpec:
        """Read a job spec dict (defaults as in docs/contracts.md); n_train enables schedules."""
        model = _section(spec, "model")
        opt = _section(spec, "optimizer")
        aug = _section(spec, "augment")
        verify = _section(spec, "verification")
        audited = "verification" in spec  # absent: a spec from before audits, which audits none
        layers = model.get("layers") or []
        if not isinstance(layers, list):
            raise SpecError("model.layers must be a list of layer objects")
        arch = model.get("arch", "custom" if layers else None)
        if arch is None:
            raise SpecError("model.arch or model.layers is required")
        if "dataset" not in spec:
            raise SpecError("dataset is required")
        decay = opt.get("decay_epochs", ()) or ()
        if not isinstance(decay, (list, tuple)):
            raise SpecError("optimizer.decay_epochs must be a list of numbers")
        out = cls(
            arch=str(arch),
            dataset=str(spec["dataset"]),
            width=_read(model, "width", 1.0, float, "model."),
            hidden=_read(model, "hidden", 128, int, "model."),
            dropout=_read(model, "dropout", 0.0, float, "model."),
            blocks=_read(model, "blocks", 1, int, "model."),
            global_batch_size=_read(spec, "global_batch_size", 256, int),
            shards=_read(spec, "shards", 16, int),
            epochs=_read(spec, "epochs", 10, int),
            seed=_read(spec, "seed", 0, int),
            optimizer=str(opt.get("type", "sgd")),
            lr=_read(opt, "lr", 0.1, float, "optimizer."),
            beta1=_read(opt, "beta1", 0.9, float, "optimizer."),
            beta2=_read(opt, "beta2", 0.999, float, "optimizer."),
            eps=_read(opt, "eps", 1e-8, float, "optimizer."),
            trust_coefficient=_read(opt, "trust_coefficient", 0.001, float, "optimizer."),
            label_smoothing=_read(spec, "label_smoothing", 0.0, float),
            upload_precision=str(spec.get("upload_precision", "float32")),
            exactness=str(spec.get("exactness", DEFAULT_EXACTNESS)),
            slices=_read(spec, "slices", 1, int),
            audit_rate=_read(verify, "audit_rate", AUDIT_RATE if audited else 0.0, float,
                             "verification."),
            probation_steps=_read(verify, "probation_steps", PROBATION_STEPS if audited else 0,
                                  int, "verification."),
            crop_padding=_read(aug, "crop_padding", 0, int, "augment."),
            horizontal_flip=_read(aug, "horizontal_flip", False, bool, "augment."),
            momentum=_read(opt, "momentum", 0.9, float, "optimizer."),
            nesterov=_read(opt, "nesterov", False, bool, "optimizer."),
            weight_decay=_read(opt, "weight_decay", 0.0, float, "optimizer."),
            warmup_epochs=_read(opt, "warmup_epochs", 0.0, float, "optimizer."),
            schedule=str(opt.get("schedule", "cosine")),
            decay_epochs=tuple(_read({"e": e}, "e", 0.0, float, "optimizer.decay_epochs ")
                               for e in decay),
            decay_factor=_read(opt, "decay_factor", 0.1, float, "optimizer."),
            lr_scaling=_read(opt, "lr_scaling", True, bool, "optimizer."),
            eval_every=_read(spec, "eval_every", 0, int),
            layers=tuple(layers),
            n_train=None if n_train is None else int(n_train),
            name=str(spec.get("name", "")),
            raw=dict(spec),
        )
        out.check()
        return out

    def check(self) -> None:
        """Refuse values the math cannot run, naming the field."""
        if self.shards < 1:
            raise SpecError("shards must be >= 1")
        if self.global_batch_size < 1 or self.global_batch_size % self.shards:
            raise SpecError(
                f"global_batch_size ({self.global_batch_size}) must be a positive multiple "
                f"of shards ({self.shards})"
            )
        if self.epochs < 1:
            raise SpecError("epochs must be >= 1")
        if self.optimizer not in OPTIMIZER_TYPES:
            raise SpecError(f"optimizer.type must be one of {', '.join(OPTIMIZER_TYPES)}")
        if not (self.eps > 0 and self.trust_coefficient > 0):
            raise SpecError("optimizer.eps and optimizer.trust_coefficient must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise SpecError("optimizer.beta1 and optimizer.beta2 must be in [0, 1)")
        if self.upload_precision not in UPLOAD_PRECISIONS:
            raise SpecError(f"upload_precision must be one of {', '.join(UPLOAD_PRECISIONS)}")
        if self.exactness not in EXACTNESS:
            raise SpecError(f"exactness must be one of {', '.join(EXACTNESS)}")
        if not 1 <= self.slices <= MAX_SLICES:
            raise SpecError(f"slices must be in [1, {MAX_SLICES}]")
        if not 0 <= self.audit_rate <= 1:
            raise SpecError("verification.audit_rate must be in [0, 1]")
        if not 0 <= self.probation_steps <= MAX_PROBATION_STEPS:
            raise SpecError(f"verification.probation_steps must be in [0, {MAX_PROBATION_STEPS}]")
        if not 0 <= self.crop_padding <= 64:
            raise SpecError("augment.crop_padding must be in [0, 64]")
        if not 0 <= self.label_smoothing < 1:
            raise SpecError("label_smoothing must be in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise SpecError(f"optimizer.schedule must be one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise SpecError("optimizer.lr must be > 0")
        if not 0 <= self.dropout < 1:
            raise SpecError("model.dropout must be in [0, 1)")
        if self.eval_every < 0:
            raise SpecError("eval_every must be >= 0 (steps; 0: validation at the end only)")
        if self.warmup_epochs < 0 or self.warmup_epochs >= self.epochs:
            raise SpecError("optimizer.warmup_epochs must be >= 0 and < epochs")
        if self.n_train is not None:
            if self.shards > self.n_train:
                raise SpecError(
                    f"shards ({self.shards}) exceeds the dataset's {self.n_train} training samples"
                )
            try:
                _steps_per_epoch(self.n_train, self.shards, self.global_batch_size)
            except ValueError as exc:
                raise SpecError(str(exc)) from None

    @property
    def audited(self) -> bool:
        """Whether the scheduler audits the job's results (a rate or a probation)."""
        return self.audit_rate > 0 or self.probation_steps > 0

    @property
    def per_shard_batch(self) -> int:
        """m = B / S: samples each shard contributes to every step."""
        return self.global_batch_size // self.shards

    @property
    def steps_per_epoch(self) -> int:
        return _steps_per_epoch(self._need_n_train(), self.shards, self.global_batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def model_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"width": self.width, "hidden": self.hidden,
                                   "dropout": self.dropout, "blocks": self.blocks}
        return {**options, "layers": list(self.layers)} if self.layers else options

    def _need_n_train(self) -> int:
        if self.n_train is None:
            raise SpecError(
                "this needs the dataset size: build the spec with "
                "TrainSpec.from_job_spec(spec, n_train=dataset_info(name).n_train)"
            )
        return self.n_train


def _read(section: dict[str, Any], key: str, default: Any, cast: type, where: str = "") -> Any:
    """section[key] as `cast`, refusing strings, bools-for-numbers and the like by name."""
    value = section.get(key, default)
    if cast is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{where}{key} must be true or false")
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if cast is int:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "an integer" if cast is int else "a number"
        raise SpecError(f"{where}{key} must be {kind}, got {value!r}")
    return cast(value)


def _section(spec: dict[str, Any], key: str) -> dict[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{key} must be an object")
    return value
