"""CPU inference of an exported detector against transformers' model of the same family.

For each chosen benchmark target (default: RT-DETR) and ``model.rpe`` value, three
runtimes read the same input tensor on the CPU with the same number of threads, their
calls interleaved round-robin (:func:`~detr_irpe.benchmark.model.interleave`):

- ``PyTorch``: this project's model, eval mode, ``no_grad``, as its family's
  ``onnx_wrapper`` (``images -> (pred_logits, pred_boxes)``: the graph that is exported);
- ``PyTorch fused``: the same in its inference form (batch norms folded into the
  convolutions, RepVGG blocks merged, channels-last: ``--runtime fused``);
- ``PyTorch compiled`` (with ``compiled``; where a compiler is): the inference form
  through ``torch.compile`` with its weights frozen into the graph (``--runtime
  compiled``), compiled before the timed calls (the compile time is a note);
- ``PyTorch fused bf16`` (CPUs with native bf16 only: AVX512-BF16 / AMX): that under
  bfloat16 autocast, as ``train.amp=auto`` evaluates there;
- ``ONNX Runtime``: that model exported by :func:`detr_irpe.export.export_onnx` (a dynamic
  graph by default: any size, encodings and anchors computed inside it) and run by
  ``onnxruntime`` (``CPUExecutionProvider``, ``intra_op_num_threads`` = the threads);
- ``transformers``: the family's Hugging Face model (``RTDetrForObjectDetection``) with the
  same config and the same weights, written by
  :func:`detr_irpe.checkpoint.hf_folder.write_hf_folder` and read back by transformers'
  ``AutoModelForObjectDetection.from_pretrained`` (plain models only: transformers has no
  iRPE), eval mode, ``no_grad``.

Post-processing is left out of all three (it is outside the exported graph). The models
have random weights (no backbone weights are loaded); a model section with an
``input_normalization`` key gets ``none``, so that this project's model and transformers'
read the same ``[0, 1]`` pixels. Each row also gives the largest difference of its
outputs from the PyTorch row's (the same weights: a sanity check of the export and the
conversion). onnx / onnxscript / onnxruntime (the ``onnx`` extra) and transformers are
optional: without them their rows are left out with a note.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from detr_irpe.benchmark.common import median
from detr_irpe.benchmark.model import (
    DEFAULT_MODELS,
    StepRunner,
    build_benchmark_model,
    interleave,
    quick_overrides,
    row_name,
)
from detr_irpe.benchmark.profile import profile_inference
from detr_irpe.checkpoint.hf_folder import write_hf_folder
from detr_irpe.config import load_config
from detr_irpe.engine.precision import native_bf16_cpu
from detr_irpe.engine.speed import count_flops
from detr_irpe.errors import DetrIrpeError
from detr_irpe.export import IMAGE_INPUT, OUTPUTS, export_onnx, onnx_wrapper
from detr_irpe.family import get_family
from detr_irpe.inference.runtime import compile_frozen, compiler_problem
from detr_irpe.models.fusion import inference_form

__all__ = ["DEFAULT_TARGETS", "RUNTIMES", "DeploySettings", "deploy_table",
           "run_deploy_benchmark"]

logger = logging.getLogger(__name__)

# the rows of a default run: the real-time detector, the one deployed on CPUs
DEFAULT_TARGETS = ("RT-DETR",)
RUNTIMES = ("PyTorch", "ONNX Runtime", "transformers")


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _onnx_session(path: Path, threads: int) -> Callable[[torch.Tensor], tuple]:
    import onnxruntime  # optional (the onnx extra): checked by the caller

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])

    def run(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, boxes = session.run(list(OUTPUTS), {IMAGE_INPUT: images.numpy()})
        return torch.from_numpy(logits), torch.from_numpy(boxes)

    return run


def _transformers_model(model: torch.nn.Module, cfg: Any, folder: Path) -> torch.nn.Module:
    import transformers  # optional (the test extra): checked by the caller

    write_hf_folder(model.state_dict(), cfg, folder)
    return transformers.AutoModelForObjectDetection.from_pretrained(folder).eval()


def _overrides(config: str, quick: bool) -> list[str]:
    keys = {f.name for f in dataclasses.fields(load_config(config).model)}
    extra = quick_overrides(config) if quick else []
    return extra + (["model.input_normalization=none"] if "input_normalization" in keys else [])


def _diff(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[float, float]:
    return tuple(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs))


@dataclass(frozen=True)
class DeploySettings:
    """How :func:`run_deploy_benchmark` measures (its keywords).

    Attributes:
        batch, height, width: the input ``(batch, 3, height, width)``, a fixed random
            tensor (seed 0).
        threads: torch's and ONNX Runtime's intra-op threads.
        repeats, warmup: timed / untimed calls of each runtime.
        dynamic: export a dynamic graph (any batch and size) instead of a static one.
        quick: smoke-test sizes (:func:`~detr_irpe.benchmark.model.quick_overrides`).
        compiled: also the ``PyTorch compiled`` row (a compilation per model: about a
            minute for D-FINE-L on 2 cores); default (None): unless ``quick``.
        work_dir: where the ``.onnx`` files and the transformers folders go (default: a
            temporary folder, removed afterwards).
    """

    batch: int = 1
    height: int = 640
    width: int = 640
    threads: int = 2
    repeats: int = 5
    warmup: int = 1
    dynamic: bool = True
    quick: bool = False
    compiled: bool | None = None
    work_dir: str | Path | None = None


def run_deploy_benchmark(
    targets: Mapping[str, str],
    models: Sequence[str] = DEFAULT_MODELS,
    settings: DeploySettings | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Inference latency of each target in each runtime (see the module docstring).

    Args:
        targets: ``{row name: config name}`` (benchmark targets of the registry).
        models: ``model.rpe`` values; transformers' rows only for ``none``.
        settings: how to measure (:class:`DeploySettings`); ``options``: its fields as
            keywords (``height=64, repeats=1``), over ``settings``.
        progress: called with a line before each step.

    Returns:
        ``{"rows": [...], "notes": [...]}``: one row per (target, rpe, runtime) with
        ``target``, ``config``, ``rpe``, ``runtime``, ``batch``, ``image_hw``,
        ``latency_s`` (median wall seconds per call), ``latency_s_all``, ``cpu_s`` (median
        process CPU seconds), ``images_per_s``, ``gflops_per_image`` (the eager model's
        FLOPs of one image at the size, in billions), ``max_diff_logits`` / ``max_diff_boxes``
        (against the PyTorch row; 0 for it); ``notes``: the rows left out and why;
        ``profiles``: per model, the eager inference's time per module
        (:func:`~detr_irpe.benchmark.profile.profile_inference`).
    """
    s = replace(settings or DeploySettings(), **options)
    if s.compiled is None:
        s = replace(s, compiled=not s.quick)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    run = _DeployRun(s, progress)
    try:
        with tempfile.TemporaryDirectory(prefix="detr_irpe_deploy_") as tmp:
            run.folder = Path(s.work_dir) if s.work_dir is not None else Path(tmp)
            run.folder.mkdir(parents=True, exist_ok=True)
            for (name, config), rpe in [(t, r) for t in targets.items() for r in models]:
                run.add_model(name, config, rpe)
            interleave(run.runners, s.warmup + s.repeats, torch.device("cpu"), progress)
    finally:
        torch.set_num_threads(previous_threads)
    rows = []
    for runner in run.runners:
        walls, cpus = runner.walls[s.warmup:], runner.cpus[s.warmup:]
        rows.append({**runner.row, "latency_s": median(walls), "latency_s_all": walls,
                     "cpu_s": median(cpus), "images_per_s": s.batch / median(walls)})
    return {"rows": rows, "notes": run.notes, "threads": s.threads, "dynamic": s.dynamic,
            "profiles": run.profiles}


class _DeployRun:
    """One deployment benchmark's state: the input, the runners of every (model, runtime)
    row, the eager profiles and the notes of the rows left out."""

    def __init__(self, settings: DeploySettings, progress: Callable[[str], None] | None
                 ) -> None:
        self.s = settings
        self.progress = progress or (lambda line: None)
        self.notes: list[str] = []
        self.missing_onnx = _missing("onnx", "onnxscript", "onnxruntime")
        if self.missing_onnx:
            self.notes.append(f"ONNX Runtime rows left out: {', '.join(self.missing_onnx)} "
                              "not installed (pip install 'detr_irpe[onnx]')")
        self.missing_hf = _missing("transformers", "safetensors")
        if self.missing_hf:
            self.notes.append(f"transformers rows left out: {', '.join(self.missing_hf)} "
                              "not installed")
        self.images = torch.randn(settings.batch, 3, settings.height, settings.width,
                                  generator=torch.Generator().manual_seed(0))
        self.runners: list[StepRunner] = []
        self.profiles: list[dict[str, Any]] = []
        self.folder = Path()

    def add_model(self, name: str, config: str, rpe: str) -> None:
        """Build one model, profile its eager inference and add a runner per runtime."""
        s = self.s
        label = row_name({"target": name, "rpe": rpe})
        self.progress(f"building {label} ({config}) for CPU inference at "
                      f"{s.batch} x {s.height}x{s.width}")
        cfg, model, _, postprocessor = build_benchmark_model(
            rpe, torch.device("cpu"), _overrides(config, s.quick), config)
        wrapper = onnx_wrapper(model.eval())
        # the model's work per image at this size (every runtime computes the same)
        flops = count_flops(model, self.images[0]) / 1e9
        # where the eager model's time goes, post-processing included
        self.progress(f"profiling {label}'s eager inference by module")
        self.profiles.append({**profile_inference(model, postprocessor, self.images,
                                                  repeats=s.repeats, warmup=s.warmup),
                              "label": label})
        calls = {"PyTorch": wrapper, **self._pytorch_forms(model, label)}
        stem = f"{config}_{rpe}".replace("/", "_")
        calls.update(self._onnx(model, label, stem))
        calls.update(self._transformers(model, cfg, label, stem, rpe))
        with torch.no_grad():
            reference = tuple(t.clone() for t in wrapper(self.images))
            for runtime, call in calls.items():
                start = time.perf_counter()
                outputs = call(self.images)  # compiles the compiled row
                if runtime == "PyTorch compiled":
                    self.notes.append(f"{label}: compiled in "
                                      f"{time.perf_counter() - start:.0f} s (first call)")
                logits, boxes = _diff(reference, outputs)
                self.runners.append(StepRunner(
                    {"target": name, "config": config, "rpe": rpe, "runtime": runtime,
                     "batch": s.batch, "image_hw": [s.height, s.width],
                     "gflops_per_image": flops,
                     "max_diff_logits": logits, "max_diff_boxes": boxes},
                    _timed_call(call, self.images)))

    def _pytorch_forms(self, model: torch.nn.Module, label: str) -> dict[str, Callable]:
        """The inference form (batch norms folded, RepVGG merged, channels-last: --runtime
        fused), compiled (where a compiler is) and under bf16 autocast (native bf16 CPUs)."""
        calls: dict[str, Callable] = {"PyTorch fused": onnx_wrapper(inference_form(model))}
        if self.s.compiled:
            problem = compiler_problem()
            if problem is None:
                calls["PyTorch compiled"] = compile_frozen(onnx_wrapper(inference_form(model)))
            else:
                self.notes.append(f"{label}: no PyTorch compiled row ({problem})")
        if native_bf16_cpu():  # what train.amp=auto evaluates with on this CPU
            calls["PyTorch fused bf16"] = _bf16(calls["PyTorch fused"])
        return calls

    def _onnx(self, model: torch.nn.Module, label: str, stem: str) -> dict[str, Callable]:
        if self.missing_onnx:
            return {}
        s = self.s
        self.progress(f"exporting {label} to ONNX")
        try:
            path = export_onnx(model, self.folder / f"{stem}.onnx", (s.height, s.width),
                               batch=s.batch, dynamic=s.dynamic)
        except DetrIrpeError as err:
            self.notes.append(f"{label}: no ONNX Runtime row ({err})")
            return {}
        return {"ONNX Runtime": _onnx_session(path, s.threads)}

    def _transformers(self, model: torch.nn.Module, cfg: Any, label: str, stem: str,
                      rpe: str) -> dict[str, Callable]:
        if self.missing_hf or rpe != "none":
            return {}
        family = get_family(cfg.model.family)
        if family.hf is None:
            self.notes.append(f"{label}: model.family={family.name} has no Hugging Face model")
            return {}
        try:
            return {"transformers": _hf_call(
                _transformers_model(model, cfg, self.folder / f"{stem}_hf"))}
        except (DetrIrpeError, OSError, ValueError) as err:
            self.notes.append(f"{label}: no transformers row ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})")
            return {}


def _bf16(call: Callable[[torch.Tensor], tuple]) -> Callable[[torch.Tensor], tuple]:
    """``call`` under CPU bfloat16 autocast, its outputs back in float32."""
    def run(images: torch.Tensor) -> tuple:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tuple(t.float() for t in call(images))

    return run


def _hf_call(model: torch.nn.Module) -> Callable[[torch.Tensor], tuple]:
    def run(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(pixel_values=images)
        return out.logits, out.pred_boxes

    return run


def _timed_call(call: Callable[[torch.Tensor], tuple], images: torch.Tensor
                ) -> Callable[[], float]:
    def step() -> float:
        with torch.no_grad():
            call(images)
        return 0.0

    return step


def deploy_table(section: Mapping[str, Any]) -> str:
    """Markdown: one row per (target, rpe, runtime); ``x PyTorch`` is the latency against
    this project's PyTorch row of the same model."""
    rows = section["rows"]
    roofline = "peaks" in section  # roofline.attach_roofline ran
    extra = " GFLOPs/img | GFLOP/s | % fp32 matmul peak | % fp32 conv peak |" if roofline else ""
    lines = ["| model | config | runtime | images | latency ms | CPU ms | img/s | x PyTorch "
             "| max abs diff logits | max abs diff boxes |" + extra,
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" * 4 if roofline
                                                                 else "")]
    for r in rows:
        base = next((b for b in rows if (b["target"], b["rpe"], b["runtime"])
                     == (r["target"], r["rpe"], "PyTorch")), None)
        x = "n/a" if base is None else f"{r['latency_s'] / base['latency_s']:.3f}"
        cells = ""
        if roofline:
            cells = (f" {r['gflops_per_image']:.2f} | {r['gflops_per_s']:.1f} | "
                     f"{100 * r['share_matmul']:.1f} | {100 * r['share_conv']:.1f} |")
        lines.append(
            f"| {row_name(r)} | {r['config']} | {r['runtime']} | {r['batch']} x "
            f"{r['image_hw'][0]}x{r['image_hw'][1]} | {1000 * r['latency_s']:.1f} | "
            f"{1000 * r['cpu_s']:.1f} | {r['images_per_s']:.2f} | {x} | "
            f"{r['max_diff_logits']:.1e} | {r['max_diff_boxes']:.1e} |" + cells)
    notes = [f"- {n}" for n in section.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else []))
