"""Model level: training-step time and inference images/s of each decoder, plain vs iRPE
encoder.

The training step is the engine's own :func:`~detr_irpe.engine.trainer.train_step`
(forward, Hungarian matcher, set loss, backward, gradient clipping, AdamW step) run over
a fixed synthetic batch, in float32 and / or under bf16 autocast. Models are built by
:func:`~detr_irpe.models.build_model` from each decoder's published config
(:data:`DECODER_CONFIGS`: ``detr_r50``, ``dab_detr_r50``, ``dn_detr_r50``) with random
weights (``model.backbone_weights=none``), so nothing is downloaded; within a decoder the
only difference between the models is ``model.rpe``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from detr_irpe.benchmark.common import median, sync
from detr_irpe.config import load_config
from detr_irpe.data.categories import COCO_NUM_CLASSES
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.trainer import autocast_context, train_step, weighted_loss
from detr_irpe.errors import ConfigError
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch

__all__ = [
    "DECODER_CONFIGS", "DEFAULT_DECODERS", "DEFAULT_MODELS", "StepRunner",
    "build_benchmark_model", "decoder_name", "interleave", "model_table",
    "run_model_benchmark", "synthetic_batch", "training_state_bytes",
]

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("none", "rpe-2.0-product-ctx-1-k")
# Each decoder of the model rows and the published config its models are built from:
# DETR, DAB-DETR, and DAB-DETR trained with DN-DETR's denoising queries (their training
# step includes them: 5 groups of the batch's ground truth).
DECODER_CONFIGS = {"detr": "detr_r50", "dab": "dab_detr_r50", "dn": "dn_detr_r50"}
DEFAULT_DECODERS = tuple(DECODER_CONFIGS)
_DECODER_NAMES = {"detr": "DETR-R50", "dab": "DAB-DETR-R50", "dn": "DN-DETR-R50"}


def decoder_name(row: dict[str, Any]) -> str:
    """``DETR-R50`` / ``DAB-DETR-R50`` / ``DN-DETR-R50`` (+ ``-iRPE <rpe>``) of a model row
    (rows without ``decoder``, from before the decoders were measured, are DETR's)."""
    name = _DECODER_NAMES[row.get("decoder", "detr")]
    return name if row["rpe"] == "none" else f"{name}-iRPE {row['rpe']}"


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
                          decoder: str = "detr"):
    """``(cfg, model, criterion, postprocessor)`` of the ``decoder``'s config
    (:data:`DECODER_CONFIGS`, default ``configs/detr_r50.yaml``) with ``model.rpe=rpe``,
    random weights (seed 0) and the COCO class count."""
    if decoder not in DECODER_CONFIGS:
        raise ConfigError(f"unknown decoder {decoder!r}; choose from {', '.join(DECODER_CONFIGS)}")
    cfg = load_config(DECODER_CONFIGS[decoder], [
        f"model.rpe={rpe}", "model.backbone_weights=none", f"model.num_classes={COCO_NUM_CLASSES}",
        *overrides,
    ])
    torch.manual_seed(0)
    model, criterion, postprocessor = build_model(cfg)
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
            progress(f"training-step round {i + 1} of {steps} over {len(runners)} models")
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


def run_model_benchmark(
    models: Sequence[str] = DEFAULT_MODELS,
    batch: int = 2,
    height: int = 512,
    width: int = 640,
    device: str = "cpu",
    train_repeats: int = 3,
    train_warmup: int = 1,
    infer_repeats: int = 3,
    infer_warmup: int = 1,
    amp: str | Sequence[str] = "none",
    overrides: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    extra_runners: Sequence[StepRunner] = (),
    decoders: Sequence[str] = ("detr",),
) -> list[dict[str, Any]]:
    """Training-step seconds, inference images/s and the loss after the timed steps, for
    each decoder, each ``model.rpe`` value and each precision.

    All models are built first and their steps interleaved (:func:`interleave`), together
    with ``extra_runners`` (e.g. the reference code's, see
    :mod:`detr_irpe.benchmark.reference`), whose timings the caller reads from them.

    Every (model, precision) pair starts from the same weights (seed 0) and trains on the
    same batch, so ``loss_after`` of a bf16 row minus the fp32 row's is the precision's
    effect on the optimisation after ``train_warmup + train_repeats`` steps.

    Args:
        models: ``model.rpe`` values (``"none"`` = plain DETR).
        batch, height, width: images per step and their padded size.
        device: ``cpu`` or ``cuda[:N]``.
        train_repeats, train_warmup: timed / untimed optimizer steps.
        infer_repeats, infer_warmup: timed / untimed inference batches.
        amp: one ``train.amp`` value or several (``none``, ``bf16``, ``fp16``).
        overrides: extra config overrides (e.g. smaller models for tests).
        decoders: keys of :data:`DECODER_CONFIGS` (``detr``, ``dab``, ``dn``); every
            (decoder, rpe, amp) model is stepped in the one interleaved run.

    Returns:
        one dict per (decoder, model, amp): ``decoder``, ``rpe``, ``amp``, ``train_step_s`` (median),
        ``train_step_s_all``, ``train_cpu_s`` (median process CPU time),
        ``train_images_per_s``, ``infer_batch_s``, ``infer_images_per_s``,
        ``loss_after``, ``peak_train_mib`` (CUDA only: the model's training state plus
        the largest allocation above it during one of its steps after the first, i.e.
        its peak had it run alone, without the input batch, which all rows share),
        ``encoder_tokens``.
    """
    dev = torch.device(device)
    amps = [amp] if isinstance(amp, str) else list(amp)
    images, targets = synthetic_batch(batch, height, width)
    images = images.to(dev)
    targets = [{k: v.to(dev) for k, v in t.items()} for t in targets]
    built, runners = [], []
    for decoder, rpe in [(d, r) for d in decoders for r in models]:
        for precision in amps:
            if progress is not None:
                progress(f"building {decoder_name({'decoder': decoder, 'rpe': rpe})} "
                         f"amp={precision} at {batch} x {height}x{width}")
            cfg, model, criterion, postprocessor = build_benchmark_model(rpe, dev, overrides,
                                                                         decoder)
            optimizer = build_optimizer(model, cfg.train)
            model.train()

            def step(model=model, criterion=criterion, optimizer=optimizer, precision=precision,
                     clip=cfg.train.clip_max_norm) -> float:
                terms = train_step(model, criterion, [(images, targets)], optimizer, dev,
                                   amp=precision, clip_max_norm=clip)
                return float(weighted_loss(terms, criterion.weight_dict))

            built.append((model, postprocessor))
            runners.append(StepRunner({"decoder": decoder, "rpe": rpe, "amp": precision}, step,
                                      resident=partial(training_state_bytes, model, optimizer)))
    interleave([*runners, *extra_runners], train_warmup + train_repeats, dev, progress)
    results = []
    for runner, (model, postprocessor) in zip(runners, built):
        precision = runner.row["amp"]
        infer = _time_inference(model, postprocessor, images, targets, dev, precision,
                                infer_warmup, infer_repeats)
        timing = runner.timing(train_warmup)
        results.append({
            **runner.row,
            "batch": batch,
            "image_hw": [height, width],
            "encoder_tokens": -(-height // 32) * -(-width // 32),
            **timing,
            "train_images_per_s": batch / timing["train_step_s"],
            "infer_batch_s": median(infer),
            "infer_images_per_s": batch / median(infer),
        })
    return results


def model_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown. ``x plain`` compares with the ``rpe=none`` row of the same decoder and
    precision (the iRPE overhead on that decoder), ``x DETR`` with the DETR row of the same
    ``rpe`` and precision (the decoder's cost), ``x fp32`` with the same model in float32;
    ``loss diff`` is ``loss_after`` minus the float32 row's (same start, same batch, same
    number of steps)."""
    def find(decoder: str, rpe: str, amp: str) -> dict[str, Any] | None:
        return next((r for r in rows if r.get("decoder", "detr") == decoder and r["rpe"] == rpe
                     and r.get("amp", "none") == amp), None)

    def ratio(r: dict[str, Any], base: dict[str, Any] | None) -> str:
        return "n/a" if base is None else f"{r['train_step_s'] / base['train_step_s']:.3f}"

    lines = [
        "| model | amp | images | train step s | x plain | x DETR | x fp32 | train CPU s "
        "| train img/s | infer img/s | loss after N | loss diff vs fp32 | peak train MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        amp, decoder = r.get("amp", "none"), r.get("decoder", "detr")
        fp32 = find(decoder, r["rpe"], "none")
        x_plain, x_detr = ratio(r, find(decoder, "none", amp)), ratio(r, find("detr", r["rpe"], amp))
        x_fp32 = ratio(r, fp32)
        loss = r.get("loss_after")
        loss_cell = "n/a" if loss is None else f"{loss:.4f} (N={r.get('loss_steps')})"
        diff = ("n/a" if fp32 is None or loss is None or fp32.get("loss_after") is None
                else f"{loss - fp32['loss_after']:+.4f}")
        peak = "n/a (CPU)" if r["peak_train_mib"] is None else f"{r['peak_train_mib']:.0f}"
        lines.append(
            f"| {decoder_name(r)} | {'fp32' if amp == 'none' else amp} | {r['batch']} x "
            f"{r['image_hw'][0]}x{r['image_hw'][1]} (L={r['encoder_tokens']}) | "
            f"{r['train_step_s']:.3f} | {x_plain} | {x_detr} | {x_fp32} | {r['train_cpu_s']:.3f} | "
            f"{r['train_images_per_s']:.2f} | {r['infer_images_per_s']:.2f} | {loss_cell} | "
            f"{diff} | {peak} |"
        )
    return "\n".join(lines)
