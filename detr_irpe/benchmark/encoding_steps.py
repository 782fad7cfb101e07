"""Model level, position encodings: the full detector's training step with each encoding of
its encoder self-attention, all in one interleaved run (issue 31: RoPE's step time against
iRPE's and against none's, same run, same model).

The rows are ``none`` and the benchmark rows of every encoding of the registry
(:mod:`detr_irpe.encodings`: ``sine``, the published DETR / RT-DETR; ``irpe``,
``rpe-2.0-product-ctx-1-k`` without the absolute encoding; the two rotary ones), and any
of them joined by ``+`` (``irpe+sine``): the rows of the ablation
grids (``configs/ablations/encodings.yaml``, docs/position_encodings.md). Each is one
``model.encodings.encoder`` list, nothing else differs between the rows of a detector.

The detectors are benchmark targets of the family registry (default: DETR and RT-DETR). By default each is the tiny model of ``--quick``
(:data:`detr_irpe.benchmark.model.QUICK_MODEL`: a ResNet-18 / R18-vd, 32 channels, one
encoder layer) on 2 images of 128 x 160, so that the ten rows run in well under a minute
on a CPU; ``full=True`` builds the target's published config (R50) instead, and the image
size is a parameter. The step is the engine's :func:`~detr_irpe.engine.trainer.train_step`
(forward, matcher, loss, backward, clipping, AdamW) on the model level's synthetic batch;
all models are built first and stepped round-robin
(:func:`~detr_irpe.benchmark.model.interleave`), so a change of the machine's load touches
every row alike. Each row also names the attention path the encoder's self-attention took
in the timed steps (``sdpa`` = PyTorch's fused kernel; docs/irpe.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from detr_irpe.attention import MultiheadAttention
from detr_irpe.benchmark.common import markdown_table
from detr_irpe.benchmark.model import (
    build_benchmark_model,
    interleave,
    quick_overrides,
    select_targets,
    synthetic_batch,
    training_runner,
)
from detr_irpe.encodings import encodings as registered_encodings
from detr_irpe.errors import ConfigError

__all__ = [
    "DEFAULT_ENCODINGS", "DEFAULT_ENCODING_TARGETS", "ENCODINGS",
    "encoding_overrides", "encoding_row", "encoding_step_table", "encoding_targets",
    "run_encoding_step_benchmark",
]

logger = logging.getLogger(__name__)


def _rows() -> dict[str, list[str]]:
    """name -> encoder list: ``none`` and every encoding's benchmark rows."""
    return {"none": [], **{name: [text] for entry in registered_encodings()
                           for name, text in entry.benchmark.items()}}


# name -> model.encodings.encoder of the single rows; "a+b" joins rows (irpe+sine)
ENCODINGS: dict[str, list[str]] = _rows()
DEFAULT_ENCODINGS = tuple(ENCODINGS)
# the detectors of a default run: the two whose encoders the issue names
DEFAULT_ENCODING_TARGETS = ("DETR", "RT-DETR")


def encoding_row(name: str) -> list[str]:
    """The encoder list of row ``name`` (rows joined by ``+``: their lists together, in the
    order of :data:`ENCODINGS`).

    Raises:
        ConfigError: an unknown name, naming the known ones.
    """
    parts = name.split("+")
    for part in parts:
        if part not in ENCODINGS:
            raise ConfigError(f"--encodings: {name!r} not allowed; choose from "
                              f"{', '.join(ENCODINGS)}, or several joined by + (irpe+sine)")
    return [text for row, strings in ENCODINGS.items() if row in parts for text in strings]


def encoding_overrides(name: str) -> list[str]:
    """The override of row ``name``: ``model.encodings.encoder=[...]``.

    Raises:
        ConfigError: an unknown name, naming the known ones.
    """
    return [f"model.encodings.encoder=[{', '.join(encoding_row(name))}]"]


def encoding_targets(names: Sequence[str] | None = None) -> dict[str, str]:
    """``{row name: config}`` of the benchmark targets named (default
    :data:`DEFAULT_ENCODING_TARGETS`).

    Raises:
        ConfigError: an unknown target.
    """
    return select_targets(list(DEFAULT_ENCODING_TARGETS) if names is None else names,
                          "--encoding-targets")


class _PathRecorder:
    """Records the attention path (and the token count) of every call of one attention
    module's path choice: the module's own ``_impl_for``, wrapped on the instance."""

    def __init__(self, module: MultiheadAttention) -> None:
        self.paths: list[str] = []
        self.length: int | None = None
        choose = module._impl_for

        def recorded(q: torch.Tensor, k: torch.Tensor, need_weights: bool) -> str:
            path = choose(q, k, need_weights)
            if torch.is_grad_enabled():  # training steps only, not an eval forward
                self.paths.append(path)
                self.length = q.shape[-2]
            return path

        module._impl_for = recorded


def _encoder_attention(model: torch.nn.Module) -> MultiheadAttention | None:
    return next((m for m in model.modules() if isinstance(m, MultiheadAttention)), None)


def run_encoding_step_benchmark(
    encodings: Sequence[str] = DEFAULT_ENCODINGS,
    targets: Mapping[str, str] | None = None,
    batch: int = 2,
    height: int = 128,
    width: int = 160,
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
    amp: str | Sequence[str] = "none",
    full: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The training step of each (target, encoding, precision), interleaved.

    Args:
        encodings: names of :data:`ENCODINGS` (or several joined by ``+``).
        targets: ``{row name: config}`` (default: :func:`encoding_targets`).
        batch, height, width: the synthetic batch (:func:`~.model.synthetic_batch`).
        device: ``cpu`` or ``cuda[:N]``.
        repeats, warmup: timed / untimed steps of every row.
        amp: one ``train.amp`` value or several.
        full: the targets' published configs instead of the tiny model.

    Returns:
        one dict per row: ``target``, ``config``, ``family``, ``encoding``,
        ``encodings`` (the encoder's list as built, ``sine + rpe-2.0-product-ctx-1-k``), ``amp``, ``model`` (``tiny`` / ``full``),
        ``batch``, ``image_hw``, ``encoder_tokens`` (L of the encoder's self-attention),
        ``attention_path`` (the path(s) its first layer took in the steps, e.g. ``sdpa``), and the
        timing fields of :meth:`~.model.StepRunner.timing` (``train_step_s``,
        ``train_cpu_s``, ``loss_after``, ...).
    """
    dev = torch.device(device)
    amps = [amp] if isinstance(amp, str) else list(amp)
    overrides = {name: encoding_overrides(name) for name in encodings}
    targets = encoding_targets() if targets is None else dict(targets)
    images, image_targets = synthetic_batch(batch, height, width)
    data = (images.to(dev), [{k: v.to(dev) for k, v in t.items()} for t in image_targets])
    runners, recorders = [], []
    for (name, config), encoding, precision in [
            (t, e, a) for t in targets.items() for e in encodings for a in amps]:
        if progress is not None:
            progress(f"building {name} ({config}, {'full' if full else 'tiny'}) with encoding "
                     f"{encoding}, amp={precision}, at {batch} x {height}x{width}")
        extra = [*(() if full else quick_overrides(config)), *overrides[encoding]]
        # model.rpe comes again in the encoding's overrides, which win
        cfg, model, criterion, _ = build_benchmark_model("none", dev, extra, config)
        attention = _encoder_attention(model)
        recorders.append(None if attention is None else _PathRecorder(attention))
        row = {"target": name, "config": config, "family": cfg.model.family,
               "encoding": encoding, "encodings": cfg.model.place("encoder").describe(),
               "amp": precision, "model": "full" if full else "tiny"}
        runners.append(training_runner(row, cfg, model, criterion, data, dev))
    interleave(runners, warmup + repeats, dev, progress)
    rows = []
    for runner, recorder in zip(runners, recorders):
        paths = recorder.paths if recorder is not None else []
        rows.append({**runner.row, "batch": batch, "image_hw": [height, width],
                     "encoder_tokens": None if recorder is None else recorder.length,
                     "attention_path": "+".join(dict.fromkeys(paths)) or None,
                     **runner.timing(warmup)})
    return rows


def encoding_step_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per row; ``x none`` / ``x sine`` compare the step (wall and
    process-CPU time, medians) with the same detector's ``none`` / ``sine`` row of the
    same precision (n/a when the run has no such row)."""
    def find(row: Mapping[str, Any], encoding: str) -> Mapping[str, Any] | None:
        return next((r for r in rows if r["target"] == row["target"]
                     and r["amp"] == row["amp"] and r["encoding"] == encoding), None)

    def ratio(row: Mapping[str, Any], base: Mapping[str, Any] | None, key: str) -> float | None:
        return None if base is None or not base[key] else row[key] / base[key]

    table = []
    for r in rows:
        none, sine = find(r, "none"), find(r, "sine")
        table.append((
            r["target"], r["encoding"],
            r["encodings"],
            "fp32" if r["amp"] == "none" else r["amp"],
            f"{r['batch']} x {r['image_hw'][0]}x{r['image_hw'][1]} (L={r['encoder_tokens']})",
            r["attention_path"],
            f"{r['train_step_s']:.3f}", _x(ratio(r, none, "train_step_s")),
            _x(ratio(r, sine, "train_step_s")), f"{r['train_cpu_s']:.3f}",
            _x(ratio(r, none, "train_cpu_s")), _x(ratio(r, sine, "train_cpu_s")),
            f"{r['loss_after']:.4f} (N={r['loss_steps']})",
        ))
    return markdown_table(
        ["detector", "encoding", "encoder encodings", "amp", "images",
         "encoder attention", "train step s", "x none", "x sine", "train CPU s",
         "CPU x none", "CPU x sine", "loss after N"], table)


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
