"""The whole benchmark of ``detr-irpe-benchmark`` (``tools/benchmark.py``): op, model
(every benchmark target of the family registry), encodings (a detector's step with each
position encoding), CPU inference of the exported model, profile, data and eval levels.

:func:`run_suite` measures the requested sections, checks the CPU targets of the project
(docs/benchmarks.md; full-size CPU runs only, never ``--quick``) and returns one JSON-able
dict; :func:`suite_markdown` renders it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from detr_irpe.benchmark import contention as contention_bench
from detr_irpe.benchmark import data as data_bench
from detr_irpe.benchmark import deploy as deploy_bench
from detr_irpe.benchmark import encoding_steps as encoding_bench
from detr_irpe.benchmark import evaluation as eval_bench
from detr_irpe.benchmark import model as model_bench
from detr_irpe.benchmark import op as op_bench
from detr_irpe.benchmark import profile as profile_bench
from detr_irpe.benchmark import reference as reference_bench
from detr_irpe.benchmark import roofline as roofline_bench
from detr_irpe.benchmark.common import environment
from detr_irpe.errors import ConfigError
from detr_irpe.utils.files import atomic_write_text

__all__ = [
    "SECTIONS", "SuiteOptions", "check_targets", "rerender", "run_suite", "suite_markdown",
    "target_ratios", "write_results",
]

logger = logging.getLogger(__name__)

SECTIONS = ("op", "contention", "model", "encodings", "onnx", "profile", "data", "eval")
PRECISIONS = ("none", "bf16", "fp16")
# CPU targets (docs/benchmarks.md): iRPE-DETR step / plain DETR step, ctx-product-k layer / plain MHA,
# qkv layer time and activation memory / plain MHA
TARGETS = {"model_train_step": 1.05, "op_k_time": 1.15, "op_qkv_time": 2.0, "op_qkv_memory": 1.5}
# with --reference-code: this project's iRPE step / the reference code's float32 step, in
# float32 and in the recommended CPU precision (bf16 autocast)
REFERENCE_TARGETS = {"none": 0.90, "bf16": 0.60}

# what every quick-mode table says instead of verdicts
QUICK_NOTE = ("QUICK MODE: smoke-test sizes, the numbers are meaningless; the CPU targets are "
              "judged only at full size (run without --quick)")
# tiny sizes for smoke tests (--quick): the models' in model_bench.QUICK_MODEL; the same
# tiny DETR in the reference code's argument names (the same values)
_QUICK_REFERENCE = {key: model_bench.QUICK_MODEL[key] for key in (
    "backbone", "hidden_dim", "nheads", "enc_layers", "dec_layers", "dim_feedforward",
    "num_queries")}
_QUICK_DATA = ["data.train_scales=[64]", "data.crop_resize_scales=[48]",
               "data.crop_size=[32,48]", "data.max_size=96"]


@dataclass
class SuiteOptions:
    """What to measure; defaults = the documented CPU run (a few minutes on 2 cores)."""

    device: str = "cpu"
    sections: Sequence[str] = SECTIONS
    threads: int = 2
    quick: bool = False
    # op level
    op_batch: int = 2
    op_hw: tuple[int, int] = (25, 38)
    op_dim: int = 256
    op_heads: int = 8
    op_repeats: int = 5
    op_dtype: str = "float32"
    sweep: bool = True
    sweep_grids: Sequence[tuple[int, int]] = op_bench.SWEEP_GRIDS
    sweep_repeats: int = 1
    naive_max_length: int = 1024
    # model level
    model_batch: int = 2
    model_hw: tuple[int, int] = (512, 640)
    model_repeats: int = 3
    model_warmup: int = 1
    # model-level precisions: float32 and bf16 autocast rows (with the loss difference)
    amp: Sequence[str] = ("none", "bf16")
    models: Sequence[str] = model_bench.DEFAULT_MODELS
    # the benchmark targets (row names of the family registry: DETR, DAB-DETR, DN-DETR,
    # RT-DETR, ...) of the model rows, each with every model.rpe value; None: all of them
    targets: Sequence[str] | None = None
    # encodings section: the step of each detector (encoding_targets: row names of the
    # registry, None = encoding_bench.DEFAULT_ENCODING_TARGETS) with each position encoding,
    # the tiny model unless encoding_full (the published config), in one interleaved run
    encodings: Sequence[str] = encoding_bench.DEFAULT_ENCODINGS
    encoding_targets: Sequence[str] | None = None
    encoding_batch: int = 2
    encoding_hw: tuple[int, int] = (128, 160)
    encoding_repeats: int = 3
    encoding_warmup: int = 1
    encoding_amp: Sequence[str] = ("none",)
    encoding_full: bool = False
    # CPU inference of the exported model (onnx section): the targets, the input, the
    # timed / untimed calls, a dynamic graph
    onnx_targets: Sequence[str] = deploy_bench.DEFAULT_TARGETS
    onnx_batch: int = 1
    onnx_hw: tuple[int, int] = (640, 640)
    onnx_repeats: int = 5
    onnx_warmup: int = 1
    onnx_dynamic: bool = True
    # the PyTorch compiled row (a torch.compile per model; off in quick mode)
    onnx_compiled: bool = True
    # the DETR-with-iRPE folder of a microsoft/Cream checkout: its step is measured in the
    # same run (precisions: reference_amp) and its outputs compared with this project's
    reference_code: str | None = None
    reference_amp: Sequence[str] = ("none",)
    # profile level: phases of one iteration of this config (its own data), per precision
    profile_config: str = "synthetic_demo"
    profile_steps: int = 20
    # data / eval level
    data_root: str = "datasets/synthetic"
    data_batches: int = 30
    data_workers: int = 0
    eval_repeats: int = 3
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick_options(cls, **kwargs) -> SuiteOptions:
        """Tiny sizes: every code path in seconds (smoke tests), numbers meaningless."""
        base = dict(
            quick=True, op_batch=1, op_hw=(4, 5), op_dim=32, op_heads=4, op_repeats=1,
            sweep_grids=((4, 4), (4, 8), (8, 8)), naive_max_length=32, model_batch=1,
            model_hw=(64, 64), model_repeats=1, model_warmup=0, data_batches=2, eval_repeats=1,
            onnx_hw=(64, 64), onnx_repeats=1, onnx_warmup=0, onnx_compiled=False,
            encoding_batch=1,
            encoding_hw=(64, 64), encoding_repeats=1, encoding_warmup=0,
        )
        base.update(kwargs)
        return cls(**base)


def _reference_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model rows the reference DETR-with-iRPE code is compared with: those of its
    family's benchmark targets (rows written before the registry named targets, without
    ``target``, see :func:`~detr_irpe.benchmark.model.target_of`)."""
    names = set(reference_bench.reference_targets())
    return [r for r in rows if model_bench.target_of(r) in names]


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The CPU targets judged on ``results``: none for a GPU run or a ``--quick`` run.

    Quick mode measures smoke-test sizes (a 4 x 5 grid, a 64 x 64 image), where fixed
    per-call overheads dominate and the ratios say nothing about the full-size targets.
    """
    if results["options"].get("quick") or not results["environment"]["device"].startswith("cpu"):
        return []
    return target_ratios(results)


def target_ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each CPU target with the measured ratios and whether it is met, whatever the sizes.

    ``ratio`` (the verdict) uses process CPU time (all threads): on a shared machine other
    jobs stretch wall time by whatever share of the cores they take, while CPU time only
    grows with cache / memory-bandwidth contention. ``ratio_wall`` is given as well.
    """
    out = []
    op = {r["key"]: r for r in results.get("op", {}).get("rows", [])}
    for base_key, base_label in ((op_bench.MHA_WEIGHTS, "DETR MHA (need_weights=True)"),
                                 (op_bench.MHA_SDPA, "SDPA MHA (need_weights=False)")):
        base = op.get(base_key)
        if base is None:
            continue
        for key, what, field_, limit in (
            ("irpe_product_k", "ctx-product-k layer time", "cpu_ms", TARGETS["op_k_time"]),
            ("irpe_product_qkv", "ctx-product-qkv layer time", "cpu_ms", TARGETS["op_qkv_time"]),
            ("irpe_product_qkv", "ctx-product-qkv activation memory", "saved_mib",
             TARGETS["op_qkv_memory"]),
        ):
            if key in op and base[field_]:
                ratio = op[key][field_] / base[field_]
                wall = (op[key]["median_ms"] / base["median_ms"]) if field_ == "cpu_ms" else None
                out.append({"target": f"{what} vs {base_label}", "limit": limit,
                            "ratio": ratio, "ratio_wall": wall, "met": ratio <= limit})
    plain = op.get(op_bench.PLAIN_TRAIN)
    for key in ("irpe_product_k_drop", "irpe_product_qkv_drop"):
        if plain is not None and key in op:
            limit = TARGETS["op_k_time"] if "_k_" in key else TARGETS["op_qkv_time"]
            ratio = op[key]["cpu_ms"] / plain["cpu_ms"]
            on = key.split("_")[2]
            out.append({"target": f"ctx-product-{on} layer time, training (dropout 0.1), vs "
                                  "the project's plain layer (rpe=none) in training",
                        "limit": limit, "ratio": ratio,
                        "ratio_wall": op[key]["median_ms"] / plain["median_ms"],
                        "met": ratio <= limit})
    model_rows = results.get("model", {}).get("rows", [])
    groups = dict.fromkeys((model_bench.target_of(r), r.get("amp", "none")) for r in model_rows)
    for target, amp in groups:
        rows = {r["rpe"]: r for r in model_rows
                if (model_bench.target_of(r), r.get("amp", "none")) == (target, amp)}
        if "none" not in rows:
            continue
        for rpe, r in rows.items():
            if rpe != "none":
                ratio = r["train_cpu_s"] / rows["none"]["train_cpu_s"]
                precision = "fp32" if amp == "none" else amp
                out.append({"target": f"{target} training step ({precision}), "
                                      f"{rpe} vs rpe=none",
                            "limit": TARGETS["model_train_step"], "ratio": ratio,
                            "ratio_wall": r["train_step_s"] / rows["none"]["train_step_s"],
                            "met": ratio <= TARGETS["model_train_step"]})
    reference = {r["rpe"]: r for r in results.get("model", {}).get("reference_rows", [])
                 if r.get("amp", "none") == "none"}
    for r in _reference_rows(model_rows):
        base, amp = reference.get(r["rpe"]), r.get("amp", "none")
        if base is None or r["rpe"] == "none" or amp not in REFERENCE_TARGETS:
            continue
        ratio = r["train_cpu_s"] / base["train_cpu_s"]
        precision = "fp32" if amp == "none" else amp
        out.append({"target": f"DETR training step, {r['rpe']}: this project in {precision} vs "
                              "the reference code in fp32",
                    "limit": REFERENCE_TARGETS[amp], "ratio": ratio,
                    "ratio_wall": r["train_step_s"] / base["train_step_s"],
                    "met": ratio <= REFERENCE_TARGETS[amp]})
    return out


def run_suite(
    options: SuiteOptions, output_dir: str | Path, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure the requested sections; writes the sweep plot into ``output_dir``."""
    encoding_targets, onnx_targets = _checked_targets(options)
    dev = torch.device(options.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but CUDA is not available; use --device cpu")
    if dev.type == "cpu":
        torch.set_num_threads(options.threads)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    opts = asdict(options)
    results: dict[str, Any] = {"environment": environment(options.device, options.threads),
                               "options": opts}
    torch.manual_seed(0)
    if "op" in options.sections:
        results["op"] = _op_section(options, output_dir, progress)
    if "contention" in options.sections and dev.type == "cpu":
        results["contention"] = contention_bench.run_contention_benchmark(
            sorted({1, options.threads}), settings=contention_bench.ContentionSettings(
                options.op_batch, *options.op_hw, dim=options.op_dim, heads=options.op_heads,
                repeats=options.op_repeats), progress=progress)
    if "model" in options.sections:
        results["model"] = _model_level(options, progress)
    if "encodings" in options.sections:
        results["encodings"] = {"rows": encoding_bench.run_encoding_step_benchmark(
            options.encodings, encoding_targets, options.encoding_batch, *options.encoding_hw,
            device=options.device, repeats=options.encoding_repeats,
            warmup=options.encoding_warmup, amp=options.encoding_amp,
            full=options.encoding_full, progress=progress)}
    if "onnx" in options.sections:
        results["onnx"] = _onnx_section(options, onnx_targets, progress)
    if {"data", "eval", "profile"} & set(options.sections):
        root = Path(options.data_root)
        if options.quick and options.data_root == SuiteOptions.data_root:
            root = output_dir / "synthetic_quick"
        data_bench.ensure_synthetic(root, *((8, 4) if options.quick else (1600, 200)))
        if "profile" in options.sections:
            results["profile"] = _profile(options, root, progress)
        if "data" in options.sections:
            if progress is not None:
                progress("data loader")
            results["data"] = {"rows": data_bench.run_data_benchmark(
                root, num_batches=options.data_batches, num_workers=options.data_workers,
                overrides=_QUICK_DATA if options.quick else (), progress=progress)}
        if "eval" in options.sections:
            if progress is not None:
                progress("COCO evaluation")
            results["eval"] = eval_bench.run_eval_benchmark(root, repeats=options.eval_repeats)
    results["targets"] = check_targets(results)
    return results


def _checked_targets(options: SuiteOptions) -> tuple[Any, dict[str, str]]:
    """Every option checked before anything is measured; ``(encoding targets, onnx
    targets)``."""
    unknown = [s for s in options.sections if s not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown benchmark section(s) {unknown}; choose from {list(SECTIONS)}")
    # each row names one precision; "auto" would hide which one was measured
    for flag, values in (("--amp", options.amp), ("--encoding-amp", options.encoding_amp)):
        bad_amp = [a for a in values if a not in PRECISIONS]
        if bad_amp:
            raise ConfigError(f"{flag}: {bad_amp} not allowed; choose from {list(PRECISIONS)}")
    # the reference code has no GradScaler, so float16 autocast is not offered for it
    bad_amp = [a for a in options.reference_amp if a not in ("none", "bf16")]
    if bad_amp:
        raise ConfigError(f"--reference-amp: {bad_amp} not allowed; choose from none, bf16")
    model_bench.select_targets(options.targets)
    encoding_targets: dict[str, str] = {}
    if "encodings" in options.sections:
        encoding_targets = encoding_bench.encoding_targets(options.encoding_targets)
        for name in options.encodings:
            encoding_bench.encoding_overrides(name)
    onnx_targets = model_bench.select_targets(options.onnx_targets, "--onnx-targets")
    if options.reference_code:
        reference_bench.check_reference_dir(options.reference_code)
    return encoding_targets, onnx_targets


def _op_section(options: SuiteOptions, output_dir: Path,
                progress: Callable[[str], None] | None) -> dict[str, Any]:
    """One attention layer's rows, and its sweep over the grid sizes (plotted)."""
    common = dict(batch=options.op_batch, dim=options.op_dim, heads=options.op_heads,
                  device=options.device, dtype=_dtype(options.op_dtype), progress=progress)
    rows = op_bench.run_benchmark(height=options.op_hw[0], width=options.op_hw[1],
                                  repeats=options.op_repeats, **common)
    section: dict[str, Any] = {"rows": [r.as_dict() for r in rows]}
    if options.sweep:
        sweep = op_bench.run_sweep(options.sweep_grids, naive_max_length=options.naive_max_length,
                                   repeats=options.sweep_repeats, **common)
        plot = op_bench.plot_sweep(
            sweep, output_dir / "op_sweep.png",
            title=f"one attention layer fwd+bwd, B={options.op_batch}, C={options.op_dim}, "
                  f"{options.op_heads} heads, {options.device}, {options.threads} threads",
        )
        section["sweep"] = sweep
        section["plot"] = str(plot)
    return section


def _onnx_section(options: SuiteOptions, onnx_targets: dict[str, str],
                  progress: Callable[[str], None] | None) -> dict[str, Any]:
    """The deployment rows, with the machine's roofline."""
    section = deploy_bench.run_deploy_benchmark(
        onnx_targets, options.models, deploy_bench.DeploySettings(
            options.onnx_batch, *options.onnx_hw, threads=options.threads,
            repeats=options.onnx_repeats, warmup=options.onnx_warmup,
            dynamic=options.onnx_dynamic, quick=options.quick,
            compiled=options.onnx_compiled), progress)
    if progress is not None:
        progress("measuring the machine's peak GFLOP/s (roofline)")
    return roofline_bench.attach_roofline(section, options.threads, quick=options.quick)


def _model_level(options: SuiteOptions, progress: Callable[[str], None] | None) -> dict:
    """This project's model rows; with ``reference_code`` the reference code's steps on
    the same batch, interleaved with ours, and its outputs with our weights."""
    def ours(extra_runners: Sequence[model_bench.StepRunner] = ()) -> list[dict[str, Any]]:
        return model_bench.run_model_benchmark(
            options.models, model_bench.ModelSettings(
                options.model_batch, *options.model_hw, device=options.device,
                train_repeats=options.model_repeats, train_warmup=options.model_warmup,
                infer_repeats=max(options.model_repeats, 1),
                infer_warmup=1 if options.model_warmup else 0, amp=options.amp,
                quick=options.quick),
            targets=model_bench.select_targets(options.targets), extra_runners=extra_runners,
            progress=progress)

    if not options.reference_code:
        return {"rows": ours()}
    changes = _QUICK_REFERENCE if options.quick else {}
    # the same batch as run_model_benchmark builds (synthetic_batch is seeded)
    images, targets = model_bench.synthetic_batch(options.model_batch, *options.model_hw)
    images = images.to(options.device)
    targets = [{k: v.to(options.device) for k, v in t.items()} for t in targets]
    with reference_bench.reference_code(options.reference_code) as ref_models:
        runners = reference_bench.step_runners(
            ref_models, (images, targets), options.models, options.device,
            options.reference_amp, changes, progress)
        rows = ours(runners)
    checks = []
    config = next(iter(reference_bench.reference_targets().values()))
    for rpe in options.models:
        if progress is not None:
            progress(f"outputs of this project vs the reference code, rpe={rpe}")
        _, model, _, _ = model_bench.build_benchmark_model(
            rpe, torch.device(options.device),
            model_bench.quick_overrides(config) if options.quick else (), config)
        checks.append({"rpe": rpe, **reference_bench.compare_outputs(
            options.reference_code, model, rpe, images, options.device, changes)})
    return {"rows": rows,
            "reference_rows": reference_bench.rows_of(runners, options.model_warmup),
            "reference_outputs": checks}


def _profile(options: SuiteOptions, root: Path, progress: Callable[[str], None] | None) -> dict:
    overrides = data_bench.dataset_overrides(root)
    if options.quick:
        overrides += [*model_bench.quick_overrides(options.profile_config), *_QUICK_DATA,
                      "train.batch_size=2"]
    rows = []
    for amp in options.amp:
        if progress is not None:
            progress(f"phases of a {options.profile_config} training iteration, amp={amp}")
        rows.append(profile_bench.profile_training_step(
            options.profile_config, overrides, steps=1 if options.quick else options.profile_steps,
            warmup=0 if options.quick else 3, amp=amp, device=options.device,
        ))
    return {"rows": rows}


def suite_markdown(results: dict[str, Any]) -> str:
    """All measured tables as markdown, headed by the machine and versions."""
    env, opts = results["environment"], results["options"]
    parts = [
        f"Machine: {env['cpu']} ({env['cpu_count']} CPUs"
        + (f", GPU {env['gpu']}, CUDA {env['cuda']}" if "gpu" in env else "")
        + f"), device {env['device']}, {env['threads']} threads, load average "
        f"{env['load_average']}; torch {env['torch']}, torchvision {env['torchvision']}, "
        f"python {env['python']}, commit {env['git_commit']}, {env['date']}"
        + (f" -- {QUICK_NOTE}" if opts["quick"] else ""),
    ]
    for name, markdown in _SECTION_MARKDOWN:
        if name in results:
            parts += markdown(results, opts)
    return "\n".join(parts + _targets_markdown(results, opts)) + "\n"


def _targets_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    if opts["quick"]:
        parts += ["\n### CPU targets\n", f"Not judged: {QUICK_NOTE}."]
    elif results.get("targets"):
        parts += ["\n### CPU targets (verdict on process CPU time; memory: saved MiB)\n",
                  "| target | limit | measured | wall-time ratio | met |",
                  "|---|---:|---:|---:|---|"]
        parts += [f"| {t['target']} | {t['limit']:.2f}x | {t['ratio']:.2f}x | "
                  + ("" if t.get("ratio_wall") is None else f"{t['ratio_wall']:.2f}x")
                  + f" | {'yes' if t['met'] else 'NO'} |" for t in results["targets"]]
    return parts


def _op_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    h, w = opts["op_hw"]
    parts = [
        f"\n### Op level: one attention layer, forward + backward\n\nB={opts['op_batch']}, "
        f"{h}x{w} (L={h * w}), C={opts['op_dim']}, {opts['op_heads']} heads, "
        f"{opts['op_dtype']}, 10% of the last image's keys padded, median of "
        f"{opts['op_repeats']} (naive: 1).\n",
        op_bench.op_table(results["op"]["rows"]),
    ]
    if "sweep" in results["op"]:
        sweep = results["op"]["sweep"]
        parts += [f"\n### Op level vs L (median of {opts['sweep_repeats']}; plot "
                  f"{Path(results['op']['plot']).name})\n", op_bench.sweep_table(sweep)]
        if sweep["skipped"]:
            parts.append("\n" + "\n".join(f"- {note}" for note in sweep["skipped"]))
    return parts


def _model_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    section = results["model"]
    parts = ["\n### Model level: training step and inference of each benchmark target "
             "of the family registry (one interleaved run)\n",
             model_bench.model_table(section["rows"])]
    if section.get("reference_rows"):
        parts += ["\n### Model level: the reference DETR-with-iRPE code, same batch, same "
                  "run\n", reference_bench.reference_table(_reference_rows(section["rows"]),
                                                           section["reference_rows"]),
                  "\n" + reference_bench.outputs_table(section["reference_outputs"])]
    return parts


def _encodings_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    rows = results["encodings"]["rows"]
    model = ("the published configs (R50)" if opts.get("encoding_full")
             else "the tiny model (ResNet-18 / R18-vd, 32 channels)")
    return [f"\n### Model level, position encodings: the training step of each detector "
            f"with each encoding of its encoder, {model}, median of "
            f"{opts.get('encoding_repeats')} steps after {opts.get('encoding_warmup')} "
            "(one interleaved run)\n", encoding_bench.encoding_step_table(rows)]


def _contention_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    size = results["contention"]["size"]
    return [f"\n### Attention on a shared CPU: one encoder attention layer (B {size[0]}, "
            f"{size[1]} x {size[2]}, {size[3]} wide, {size[4]} heads, forward + backward, "
            "dropout 0.1), quiet and next to a competing one-thread process\n",
            contention_bench.contention_table(results["contention"])]


def _onnx_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    section = results["onnx"]
    parts = [f"\n### CPU inference: the exported model in ONNX Runtime vs PyTorch and "
             f"transformers ({section['threads']} threads, "
             f"{'dynamic' if section['dynamic'] else 'static'} ONNX graph, "
             "no post-processing, one interleaved run)\n",
             deploy_bench.deploy_table(section)]
    if section.get("profiles"):
        parts += ["\nWhere the eager PyTorch inference's time goes, by module (median of "
                  "the same repeats; deformable: the decoder's multi-scale deformable "
                  "sampling, decoder: the rest of it; heads: the rest of the forward "
                  "pass):\n", profile_bench.inference_profile_table(section["profiles"])]
    if "peaks" in section:
        parts += [f"\nThe machine's measured peaks ({section['threads']} threads; the "
                  "roofline columns above are each row's model FLOPs x images per "
                  "second over them):\n", roofline_bench.peak_table(section["peaks"])]
    return parts


def _profile_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    rows = results["profile"]["rows"]
    return [f"\n### Where a training iteration's time goes: {rows[0]['config']}, batch "
            f"{rows[0]['batch_size']}, median of {rows[0]['steps']} steps (ms)\n",
            profile_bench.profile_table(rows)]


def _data_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    return ["\n### Data loader (training split, decode + augmentation + collate)\n",
            data_bench.data_table(results["data"]["rows"])]


def _eval_markdown(results: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    return ["\n### COCO evaluation (CocoEvaluator, synthetic val split)\n",
            eval_bench.eval_table(results["eval"])]


# the sections' tables, in the order of the report
_SECTION_MARKDOWN: tuple[tuple[str, Callable[[dict[str, Any], dict[str, Any]], list[str]]], ...] = (
    ("op", _op_markdown), ("model", _model_markdown), ("encodings", _encodings_markdown),
    ("contention", _contention_markdown), ("onnx", _onnx_markdown),
    ("profile", _profile_markdown), ("data", _data_markdown), ("eval", _eval_markdown))


def write_results(results: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path]:
    """``results.json`` and ``results.md`` in ``output_dir``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output_dir / "results.json", output_dir / "results.md"
    atomic_write_text(json_path, json.dumps(results, indent=2, default=str) + "\n")
    atomic_write_text(md_path, suite_markdown(results))
    return json_path, md_path


def rerender(output_dir: str | Path) -> dict[str, Any]:
    """Rebuild targets, ``results.md`` and the sweep plot from ``results.json`` (no measuring)."""
    output_dir = Path(output_dir)
    path = output_dir / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --render rebuilds the tables of an earlier run "
                          "in --output-dir")
    results = json.loads(path.read_text())
    results["targets"] = check_targets(results)
    if "sweep" in results.get("op", {}):
        opts = results["options"]
        results["op"]["plot"] = str(op_bench.plot_sweep(
            results["op"]["sweep"], output_dir / "op_sweep.png",
            title=f"one attention layer fwd+bwd, B={opts['op_batch']}, C={opts['op_dim']}, "
                  f"{opts['op_heads']} heads, {opts['device']}, {opts['threads']} threads",
        ))
    write_results(results, output_dir)
    return results
