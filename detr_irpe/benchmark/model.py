"""Model level: training-step time and inference images/s of every benchmark target of the
family registry, plain vs iRPE encoder.

The rows come from the registry (:mod:`detr_irpe.family`): each family's
``benchmark_targets`` names its rows and the published config each is built from (DETR:
``{"DETR": "detr_r50"}``; DAB: ``DAB-DETR``, ``DN-DETR``; RT-DETR: ``{"RT-DETR":
"rtdetr_r50"}``; a user's family adds its own). The training step is the engine's own
:func:`~detr_irpe.engine.trainer.train_step` (forward, the family's matcher and loss with
its denoising queries, backward, gradient clipping, AdamW step) run over a fixed synthetic
batch, in float32 and / or under bf16 autocast. Models are built by
:func:`~detr_irpe.models.build_model` with random weights (no backbone weights loaded), so
nothing is downloaded; within a target the only difference between the models is
``model.rpe``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from detr_irpe.benchmark.common import median, sync
from detr_irpe.config import load_config
from detr_irpe.data.categories import COCO_NUM_CLASSES
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.trainer import autocast_context, train_step, weighted_loss
from detr_irpe.errors import ConfigError
from detr_irpe.family import DEFAULT_FAMILY, families
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch

__all__ = [
    "DEFAULT_MODELS", "QUICK_MODEL", "ModelSettings", "StepRunner", "benchmark_targets",
    "build_benchmark_model", "interleave", "model_table", "quick_overrides", "row_name",
    "run_model_benchmark", "select_targets", "synthetic_batch", "target_of",
    "training_runner", "training_state_bytes",
]

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("none", "rpe-2.0-product-ctx-1-k")
# Smoke-test sizes (--quick): each setting applies to the targets whose model section has
# the key (a ResNet-18 for DETR / DAB-DETR, an R18-vd for RT-DETR; narrow layers, few
# queries; two decoder layers, the fewest transformers' D-FINE is built with), so every
# family's row runs in a fraction of a second.
QUICK_MODEL: dict[str, Any] = {
    "backbone": "resnet18", "depth": 18, "hidden_dim": 32, "enc_hidden_dim": 32, "nheads": 4,
    "enc_layers": 1, "dec_layers": 2, "dim_feedforward": 64, "enc_dim_feedforward": 64,
    "num_queries": 5, "num_select": 5, "num_denoising": 10,
}


def benchmark_targets() -> dict[str, str]:
    """``{row name: config name}`` of every registered family's ``benchmark_targets``, the
    default family's first (its rows are the baseline of the ``x`` column), then the others
    in name order.

    Raises:
        ConfigError: two families name the same row.
    """
    out: dict[str, str] = {}
    for family in sorted(families(), key=lambda f: f.name != DEFAULT_FAMILY):
        for name, config in family.benchmark_targets.items():
            if name in out:
                raise ConfigError(f"benchmark target {name!r} of model.family={family.name} "
                                  "is another family's row name; rename one")
            out[name] = config
    return out


def select_targets(names: Sequence[str] | None = None, flag: str = "--targets"
                   ) -> dict[str, str]:
    """The registry's targets named by ``names`` (row names, in the given order), or all.

    Raises:
        ConfigError: an unknown name, or none given; naming the known ones.
    """
    known = benchmark_targets()
    if names is None:
        return known
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ConfigError(f"{flag}: {bad or 'none given'} not allowed; choose from "
                          f"{', '.join(known)}")
    return {n: known[n] for n in names}


def quick_overrides(config: str) -> list[str]:
    """The :data:`QUICK_MODEL` settings that ``config``'s model section has and accepts
    (D-FINE has a ``backbone`` key but no ``resnet18``), as overrides."""
    keys = {f.name for f in dataclasses.fields(load_config(config).model)}
    out: list[str] = []
    for key, value in QUICK_MODEL.items():
        if key not in keys:
            continue
        try:
            load_config(config, [*out, f"model.{key}={value}"])
        except ConfigError:
            continue
        out.append(f"model.{key}={value}")
    return out


def row_name(row: Mapping[str, Any]) -> str:
    """``DETR`` / ``RT-DETR`` / ... (+ ``-iRPE <rpe>``) of a model row (rows written before
    the registry named their targets carry ``decoder``; before that, only DETR's)."""
    name = target_of(row)
    return name if row["rpe"] == "none" else f"{name}-iRPE {row['rpe']}"


# results.json files written before the registry named the targets: their rows' decoder
# key and the row name it stands for (rows without it, older still, are DETR's)
_LEGACY_DECODERS = {"detr": "DETR", "dab": "DAB-DETR", "dn": "DN-DETR"}


def target_of(row: Mapping[str, Any]) -> str:
    """The target (row name) of a model row, also of one in an older ``results.json``."""
    if row.get("target"):
        return row["target"]
    decoder = row.get("decoder", "detr")
    return _LEGACY_DECODERS.get(decoder, decoder)


def synthetic_batch(
    batch: int, height: int, width: int, num_classes: int = COCO_NUM_CLASSES, objects: int = 7,
    pad: float = 0.1, seed: int = 0,
) -> tuple[ImageBatch, list[dict[str, Any]]]:
    """A padded image batch and DETR targets (``objects`` random boxes per image).

    The last image is ``pad`` narrower than the batch (padded on the right), as in a real
    batch of two aspect ratios. 7 objects per image is the COCO train average.
    """
    gen = torch.Generator().manual_seed(seed)
    images = []
    for i in range(batch):
        w = width - (int(pad * width) if i == batch - 1 and batch > 1 else 0)
        images.append(torch.randn(3, height, w, generator=gen))
    targets = []
    for i, img in enumerate(images):
        centers = 0.2 + 0.6 * torch.rand(objects, 2, generator=gen)
        sizes = 0.05 + 0.3 * torch.rand(objects, 2, generator=gen)
        h, w = img.shape[-2:]
        targets.append({
            "boxes": torch.cat([centers, sizes], dim=1),
            "labels": torch.randint(1, num_classes, (objects,), generator=gen),
            "image_id": torch.tensor(i),
            "orig_size": torch.tensor([h, w]),
            "size": torch.tensor([h, w]),
            "area": (sizes[:, 0] * sizes[:, 1] * h * w),
            "iscrowd": torch.zeros(objects, dtype=torch.int64),
        })
    return ImageBatch.from_images(images), targets


def build_benchmark_model(rpe: str, device: torch.device, overrides: Sequence[str] = (),
                          config: str | None = None):
    """``(cfg, model, criterion, postprocessor)`` of ``config`` (default: the first
    benchmark target's, ``detr_r50``) with ``model.rpe=rpe``, random weights (seed 0) and
    the COCO class count; nothing is read or downloaded."""
    if config is None:
        config = next(iter(benchmark_targets().values()))
    cfg = load_config(config, [f"model.rpe={rpe}", f"model.num_classes={COCO_NUM_CLASSES}",
                               *overrides])
    torch.manual_seed(0)
    # random weights: the backbone's model.backbone_weights (ImageNet, a file) are not read
    model, criterion, postprocessor = build_model(cfg, load_backbone_weights=False)
    return cfg, model.to(device), criterion.to(device), postprocessor


@dataclass
class StepRunner:
    """One (model, precision) of an interleaved timing: ``step()`` runs one optimizer step
    and returns its loss; :func:`interleave` fills ``walls`` / ``cpus`` / ``losses``."""

    row: dict[str, Any]
    step: Callable[[], float]
    # bytes the runner keeps between steps (weights, gradients, optimizer state)
    resident: Callable[[], int] | None = None
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # CUDA: bytes allocated during each step above what was allocated before it
    step_peaks: list[int] = field(default_factory=list)

    def timing(self, warmup: int) -> dict[str, Any]:
        """The row's timing fields: medians over the steps after ``warmup``."""
        walls, cpus = self.walls[warmup:], self.cpus[warmup:]
        peak = None
        if self.step_peaks and self.resident is not None:
            # what this model alone would peak at: its resident state plus its step's peak
            # never the first step: it allocates the gradients and the optimizer state,
            # which resident() counts already
            steps = self.step_peaks[max(warmup, 1):] or self.step_peaks
            peak = (self.resident() + max(steps)) / 2**20
        return {"train_step_s": median(walls), "train_step_s_all": walls,
                "train_cpu_s": median(cpus), "loss_after": self.losses[-1],
                "loss_steps": len(self.losses), "peak_train_mib": peak}


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, buffers, gradients and optimizer state: what a training
    run keeps allocated between steps."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def interleave(runners: Sequence[StepRunner], steps: int, device: torch.device,
               progress: Callable[[str], None] | None = None) -> None:
    """``steps`` rounds of one step of every runner in turn.

    Round-robin instead of one runner after the other: a machine that speeds up or slows
    down during the benchmark (other jobs, frequency, memory) then shifts every row
    alike, and the ratios between rows stay fair.
    """
    for i in range(steps):
        if progress is not None:
            progress(f"timed round {i + 1} of {steps} over {len(runners)} rows")
        for runner in runners:
            sync(device)
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start, cpu = time.perf_counter(), time.process_time()
            loss = runner.step()
            sync(device)
            runner.walls.append(time.perf_counter() - start)
            runner.cpus.append(time.process_time() - cpu)
            runner.losses.append(loss)
            if device.type == "cuda":
                runner.step_peaks.append(torch.cuda.max_memory_allocated(device) - before)


def training_runner(row: dict[str, Any], cfg, model: torch.nn.Module,
                    criterion: torch.nn.Module, batch: tuple[ImageBatch, list[dict[str, Any]]],
                    device: torch.device) -> StepRunner:
    """A :class:`StepRunner` of ``model``: the engine's :func:`train_step` on ``batch``
    (forward, loss, backward, clipping at ``cfg.train.clip_max_norm``, the AdamW of
    ``cfg.train``) in the precision ``row["amp"]``; puts the model in training mode."""
    optimizer = build_optimizer(model, cfg.train)
    model.train()
    precision, clip = row["amp"], cfg.train.clip_max_norm

    def step() -> float:
        terms = train_step(model, criterion, [batch], optimizer, device, amp=precision,
                           clip_max_norm=clip)
        return float(weighted_loss(terms, criterion.weight_dict))

    return StepRunner(row, step, resident=partial(training_state_bytes, model, optimizer))


def _time_inference(model, postprocessor, images, targets, dev, amp, warmup, repeats) -> list[float]:
    model.eval()
    out = []
    with torch.no_grad(), autocast_context(dev, amp):
        sizes = torch.stack([t["orig_size"] for t in targets])
        for i in range(warmup + repeats):
            sync(dev)
            start = time.perf_counter()
            postprocessor(model(images), sizes)
            sync(dev)
            if i >= warmup:
                out.append(time.perf_counter() - start)
    return out


@dataclass(frozen=True)
class ModelSettings:
    """How :func:`run_model_benchmark` measures (its keywords).

    Attributes:
        batch, height, width: images per step and their padded size.
        device: ``cpu`` or ``cuda[:N]``.
        train_repeats, train_warmup: timed / untimed optimizer steps.
        infer_repeats, infer_warmup: timed / untimed inference batches.
        amp: one ``train.amp`` value or several (``none``, ``bf16``, ``fp16``).
        overrides: extra config overrides of every target (keys all their families have).
        quick: smoke-test sizes (:func:`quick_overrides` of each target's config).
    """

    batch: int = 2
    height: int = 512
    width: int = 640
    device: str = "cpu"
    train_repeats: int = 3
    train_warmup: int = 1
    infer_repeats: int = 3
    infer_warmup: int = 1
    amp: str | Sequence[str] = "none"
    overrides: Sequence[str] = ()
    quick: bool = False


def run_model_benchmark(
    models: Sequence[str] = DEFAULT_MODELS,
    settings: ModelSettings | None = None,
    *,
    targets: Mapping[str, str] | None = None,
    extra_runners: Sequence[StepRunner] = (),
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Training-step seconds, inference images/s and the loss after the timed steps, for
    each benchmark target, each ``model.rpe`` value and each precision.

    All models are built first and their steps interleaved (:func:`interleave`), together
    with ``extra_runners`` (e.g. the reference code's, see
    :mod:`detr_irpe.benchmark.reference`), whose timings the caller reads from them.

    Every (model, precision) pair starts from the same weights (seed 0) and trains on the
    same batch, so ``loss_after`` of a bf16 row minus the fp32 row's is the precision's
    effect on the optimisation after ``train_warmup + train_repeats`` steps. Every target
    reads the same batch (RT-DETR, which reads no padding mask, takes the padded pixels
    of the narrower image as image, as the published model would).

    Args:
        models: ``model.rpe`` values (``"none"`` = the published model).
        settings: how to measure (:class:`ModelSettings`); ``options``: its fields as
            keywords (``batch=1, height=64``), over ``settings``.
        targets: ``{row name: config name}`` (default: :func:`benchmark_targets`, every
            family's); every (target, rpe, amp) model is stepped in the one interleaved run.
        extra_runners: stepped in the same rounds (their rows are the caller's).
        progress: called with a line before each step.

    Returns:
        one dict per (target, model, amp): ``target``, ``config``, ``family``, ``rpe``,
        ``amp``, ``train_step_s`` (median), ``train_step_s_all``, ``train_cpu_s`` (median
        process CPU time), ``train_images_per_s``, ``infer_batch_s``,
        ``infer_images_per_s``, ``loss_after``, ``peak_train_mib`` (CUDA only: the
        model's training state plus the largest allocation above it during one of its
        steps after the first, i.e. its peak had it run alone, without the input batch,
        which all rows share), ``encoder_tokens``.
    """
    s = replace(settings or ModelSettings(), **options)
    dev = torch.device(s.device)
    targets = benchmark_targets() if targets is None else dict(targets)
    images, batch_targets = synthetic_batch(s.batch, s.height, s.width)
    images = images.to(dev)
    batch_targets = [{k: v.to(dev) for k, v in t.items()} for t in batch_targets]
    built = _build_runners(models, targets, s, (images, batch_targets), progress)
    runners = [runner for runner, _, _ in built]
    interleave([*runners, *extra_runners], s.train_warmup + s.train_repeats, dev, progress)
    results = []
    for runner, model, postprocessor in built:
        infer = _time_inference(model, postprocessor, images, batch_targets, dev,
                                runner.row["amp"], s.infer_warmup, s.infer_repeats)
        timing = runner.timing(s.train_warmup)
        results.append({
            **runner.row,
            "batch": s.batch,
            "image_hw": [s.height, s.width],
            "encoder_tokens": -(-s.height // 32) * -(-s.width // 32),
            **timing,
            "train_images_per_s": s.batch / timing["train_step_s"],
            "infer_batch_s": median(infer),
            "infer_images_per_s": s.batch / median(infer),
        })
    return results


def _build_runners(models: Sequence[str], targets: Mapping[str, str], s: ModelSettings,
                   batch: tuple[Any, list[dict[str, Any]]],
                   progress: Callable[[str], None] | None
                   ) -> list[tuple[StepRunner, torch.nn.Module, torch.nn.Module]]:
    """``(training runner, model, post-processor)`` of every (target, rpe, amp)."""
    dev = torch.device(s.device)
    amps = [s.amp] if isinstance(s.amp, str) else list(s.amp)
    built = []
    for (name, config), rpe in [(t, r) for t in targets.items() for r in models]:
        extra = [*(quick_overrides(config) if s.quick else ()), *s.overrides]
        for precision in amps:
            if progress is not None:
                progress(f"building {row_name({'target': name, 'rpe': rpe})} ({config}) "
                         f"amp={precision} at {s.batch} x {s.height}x{s.width}")
            cfg, model, criterion, postprocessor = build_benchmark_model(rpe, dev, extra, config)
            runner = training_runner(
                {"target": name, "config": config, "family": cfg.model.family, "rpe": rpe,
                 "amp": precision},
                cfg, model, criterion, batch, dev)
            built.append((runner, model, postprocessor))
    return built


def model_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown. ``x plain`` compares with the ``rpe=none`` row of the same target and
    precision (the iRPE overhead on that detector), ``x <first>`` with the first target's
    row of the same ``rpe`` and precision (the detector's cost against the baseline, DETR
    in a default run), ``x fp32`` with the same model in float32; ``loss diff`` is
    ``loss_after`` minus the float32 row's (same start, same batch, same number of
    steps)."""
    def find(target: str, rpe: str, amp: str) -> dict[str, Any] | None:
        return next((r for r in rows if target_of(r) == target and r["rpe"] == rpe
                     and r.get("amp", "none") == amp), None)

    def ratio(r: dict[str, Any], base: dict[str, Any] | None) -> str:
        return "n/a" if base is None else f"{r['train_step_s'] / base['train_step_s']:.3f}"

    first = target_of(rows[0]) if rows else "DETR"
    lines = [
        f"| model | config | amp | images | train step s | x plain | x {first} | x fp32 "
        "| train CPU s | train img/s | infer img/s | loss after N | loss diff vs fp32 "
        "| peak train MiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        amp, target = r.get("amp", "none"), target_of(r)
        fp32 = find(target, r["rpe"], "none")
        x_plain, x_first = ratio(r, find(target, "none", amp)), ratio(r, find(first, r["rpe"], amp))
        x_fp32 = ratio(r, fp32)
        loss = r.get("loss_after")
        loss_cell = "n/a" if loss is None else f"{loss:.4f} (N={r.get('loss_steps')})"
        diff = ("n/a" if fp32 is None or loss is None or fp32.get("loss_after") is None
                else f"{loss - fp32['loss_after']:+.4f}")
        peak = "n/a (CPU)" if r["peak_train_mib"] is None else f"{r['peak_train_mib']:.0f}"
        lines.append(
            f"| {row_name(r)} | {r.get('config', 'n/a')} | {'fp32' if amp == 'none' else amp} | "
            f"{r['batch']} x {r['image_hw'][0]}x{r['image_hw'][1]} (L={r['encoder_tokens']}) | "
            f"{r['train_step_s']:.3f} | {x_plain} | {x_first} | {x_fp32} | "
            f"{r['train_cpu_s']:.3f} | {r['train_images_per_s']:.2f} | "
            f"{r['infer_images_per_s']:.2f} | {loss_cell} | {diff} | {peak} |"
        )
    return "\n".join(lines)
