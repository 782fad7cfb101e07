"""Ablation grids: a YAML file that names a base config and the runs to make from it.

A grid file (``configs/ablations/*.yaml``)::

    name: methods                       # optional; the table's title
    description: which bucket method    # optional; printed above the table
    base: detr_r50_irpe                 # a config name in configs/ or a path
    output_dir: outputs/ablations/methods
    overrides: [train.epochs=150]       # common to every run
    axes:                               # cartesian product of override values ...
      model.rpe: [none, rpe-2.0-product-ctx-1-k, rpe-2.0-cross-ctx-1-k]
      model.position_embedding: [sine, none]
    variants:                           # ... and/or an explicit list (times the axes)
      - name: product-ctx
        overrides: [model.rpe=rpe-2.0-product-ctx-1-k]
      - name: rtdetr                    # a variant on its own base config (another
        base: rtdetr_r50                # detector family's published recipe)
        overrides: []
    seeds: [1, 2, 3]                    # sets train.seed; one run per seed
    baseline: product-ctx               # the row the delta AP is taken against
    launcher: local                     # local (python tools/train.py) | torchrun |
                                        # slurm (each run one detr-irpe-submit job, waited for)
    nproc_per_node: 8                   # torchrun: processes; slurm: GPUs per node
    submit: [--partition, gpu]          # slurm only: more detr-irpe-submit options
    finetune: rtdetr_r18                # every run starts from these weights (--finetune:
                                        # a published name, a file or an http(s) address)
    synthetic_data:                     # generate data.root with the synthetic generator
      num_train: 2000                   # when its annotation files are missing
      num_val: 200
    eval_sizes: [480, 640, 800, 640x1280]  # evaluate each run's last checkpoint at these
                                        # test sizes (as --sizes takes them: S or HxW);
                                        # results.md gets an "AP (%) at test sizes" table
    eval_canvases: [mosaic1x1, mosaic2x2, pad2x2-c]  # and on these canvas layouts (as
                                        # --canvases takes them); results.md gets an
                                        # "AP (%) on canvases" table
    _base_: other_grid.yaml             # optional: start from another grid file, merged
                                        # like a config's _base_ (mappings such as axes
                                        # merge key by key; lists and scalars replace)

Every run is ``base`` (the variant's own, else the grid's) + ``overrides`` + the variant's overrides + ``train.seed``
+ ``train.output_dir=<output_dir>/<variant>/seed<k>``. :func:`load_grid` builds
and validates the config of every run before anything starts, so a typo in an
override fails at once, naming the grid file, the variant and the key.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detr_irpe.canvas_layouts import CanvasLayout, parse_canvases
from detr_irpe.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    find_yaml,
    load_config,
    parse_override,
    read_yaml_with_base,
    resolve_config_path,
)
from detr_irpe.data.synthetic import SyntheticSpec
from detr_irpe.sizes import EvalSize, parse_eval_sizes

GRID_KEYS = (
    "name", "description", "base", "output_dir", "overrides", "axes", "variants", "seeds",
    "baseline", "launcher", "nproc_per_node", "synthetic_data", "eval_sizes",
    "eval_canvases", "finetune", "submit",
)
LAUNCHERS = ("local", "torchrun", "slurm")
# The grids shipped with the package (demo_* on synthetic data, the rest on COCO).
GRID_DIR = CONFIG_DIR / "ablations"
VARIANT_KEYS = ("name", "overrides", "base")
SYNTHETIC_KEYS = ("num_train", "num_val", "seed")
# Keys the grid sets itself for every run.
_RESERVED = ("train.output_dir",)
_SLUG = re.compile(r"[^A-Za-z0-9._+-]+")


class GridError(ConfigError):
    """A grid file, or one of the runs it describes, that the user has to fix."""


@dataclass(frozen=True)
class Variant:
    """One row of the table: a name and the overrides that make it, on the grid's base
    config or on its own ``base`` (a family with its own published config: RT-DETR)."""

    name: str
    overrides: tuple[str, ...]
    base: Path | None = None

    @property
    def slug(self) -> str:
        """The variant's folder name."""
        return _SLUG.sub("_", self.name).strip("_") or "variant"


@dataclass(frozen=True)
class RunSpec:
    """One training run of a grid (a variant with one seed)."""

    variant: Variant
    seed: int
    overrides: tuple[str, ...]  # everything on top of the base config, output_dir included
    output_dir: Path
    # Validated; ``model.num_classes`` may still be None. Not part of equality/hash.
    config: Config = field(compare=False, hash=False)
    # the config the overrides go on (the variant's own base, else the grid's)
    base: Path | None = None

    @property
    def key(self) -> str:
        return f"{self.variant.name} / seed {self.seed}"


@dataclass
class Grid:
    """A loaded, validated grid; ``runs`` in execution order (variant-major)."""

    path: Path
    name: str
    description: str
    base: Path
    output_dir: Path
    overrides: tuple[str, ...]
    variants: list[Variant]
    seeds: list[int]
    baseline: str
    launcher: str = "local"
    nproc_per_node: int = 1
    synthetic_data: dict[str, Any] | None = None
    # the test sizes each run's last checkpoint is evaluated at (none: no size evaluation)
    eval_sizes: tuple[EvalSize, ...] = ()
    # the canvas layouts it is evaluated on (none: no canvas evaluation)
    eval_canvases: tuple[CanvasLayout, ...] = ()
    # the weights every run starts from (detr-irpe-train --finetune); None: the config's
    finetune: str | None = None
    # launcher: slurm: more options of detr-irpe-submit (--partition gpu, --timeout 240, ...)
    submit: tuple[str, ...] = ()
    runs: list[RunSpec] = field(default_factory=list)
    # What the command line changed in the grid file (its --config, its --set items):
    # the file's free-text description was written without them.
    command_line: tuple[str, ...] = ()

    @property
    def evaluates_after(self) -> bool:
        """Whether each finished run is evaluated again (``eval_sizes`` / ``eval_canvases``)
        into ``<run>/eval_sizes``."""
        return bool(self.eval_sizes or self.eval_canvases)

    @property
    def view_labels(self) -> list[str]:
        """The labels of ``eval_sizes`` then ``eval_canvases``: what a finished run's
        evaluation after the training must have."""
        return [s.label for s in self.eval_sizes] + [c.label for c in self.eval_canvases]

    def view_arguments(self) -> list[str]:
        """``--sizes ... --canvases ...`` of the training / evaluation tools (none without
        ``eval_sizes`` / ``eval_canvases``)."""
        sizes = ["--sizes", *(s.label for s in self.eval_sizes)] if self.eval_sizes else []
        canvases = ["--canvases", *(c.label for c in self.eval_canvases)] \
            if self.eval_canvases else []
        return sizes + canvases


# ----------------------------------------------------------------------------- reading
def resolve_grid_path(name_or_path: str | Path) -> Path:
    """A grid file as given, or a bare name looked up in the shipped
    ``configs/ablations/`` (``.yaml`` optional), so the tool works from any folder."""
    found = find_yaml(name_or_path, GRID_DIR)
    if found is not None:
        return found
    shipped = ", ".join(sorted(p.stem for p in GRID_DIR.glob("*.yaml")))
    raise GridError(f"grid file {str(name_or_path)!r} not found (looked in the working "
                    f"directory and {GRID_DIR}); shipped grids: {shipped}")


def _read_grid_yaml(path: Path) -> dict[str, Any]:
    """The grid file with its ``_base_`` chain merged exactly as config files merge
    (a missing file, bad YAML or a broken chain: a GridError naming the file)."""
    try:
        return read_yaml_with_base(path)
    except ConfigError as err:
        raise GridError(str(err)) from None


def _format_value(value: Any) -> str:
    """An axis value as override text (parsed back as YAML by ``parse_override``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _string_list(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GridError(f"{where}: expected a list of 'section.key=value' strings, got {value!r}")
    for text in value:
        try:
            parse_override(text)
        except ConfigError as err:
            raise GridError(f"{where}: {err}") from None
    return tuple(value)


def _check_reserved(where: str, overrides: Iterable[str], seeds_given: bool) -> None:
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key in _RESERVED:
            raise GridError(f"{where}: {key} is set by the grid (output_dir/<variant>/seed<k>); "
                            "set the grid's output_dir instead")
        if key == "train.seed" and seeds_given:
            raise GridError(f"{where}: train.seed is set by the grid's seeds list; "
                            "remove it from the overrides")


def _axis_variants(where: str, axes: Any) -> list[Variant]:
    if not isinstance(axes, Mapping) or not axes:
        raise GridError(f"{where}: axes must be a non-empty mapping of "
                        "'section.key: [values]', e.g. model.rpe: [none, rpe-2.0-product-ctx-1-k]")
    keys, values = [], []
    for key, vals in axes.items():
        if not isinstance(key, str) or len(key.split(".")) < 2:
            raise GridError(f"{where}: axis {key!r} must be a config key 'section.key'")
        if not isinstance(vals, list) or not vals:
            raise GridError(f"{where}: axis {key}: expected a non-empty list of values, "
                            f"got {vals!r}")
        texts = [_format_value(v) for v in vals]
        if len(set(texts)) != len(texts):
            raise GridError(f"{where}: axis {key} lists a value twice: {texts}")
        keys.append(key)
        values.append(texts)
    variants = []
    for combo in itertools.product(*values):
        if len(keys) == 1:
            name = combo[0]
        else:  # 'rpe=none,position_embedding=sine': a value alone can be ambiguous
            name = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, combo))
        variants.append(Variant(name, tuple(f"{k}={v}" for k, v in zip(keys, combo))))
    return variants


def _listed_variants(where: str, items: Any) -> list[Variant]:
    if not isinstance(items, list) or not items:
        raise GridError(f"{where}: variants must be a non-empty list of "
                        "{name: ..., overrides: [...]}")
    variants = []
    for i, item in enumerate(items):
        at = f"{where}: variants[{i}]"
        if not isinstance(item, Mapping):
            raise GridError(f"{at}: expected a mapping with keys name and overrides, got {item!r}")
        unknown = sorted(set(item) - set(VARIANT_KEYS))
        if unknown:
            raise GridError(f"{at}: unknown key(s) {', '.join(map(str, unknown))}; "
                            f"allowed: {', '.join(VARIANT_KEYS)}")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise GridError(f"{at}: needs a non-empty string name")
        base = item.get("base")
        if base is not None:
            base = _resolve_base(Path(where), base)
        variants.append(Variant(name.strip(), _string_list(f"{at} ({name})",
                                                           item.get("overrides")), base))
    return variants


def _combine(listed: list[Variant], axis: list[Variant]) -> list[Variant]:
    if not listed:
        return axis
    if not axis:
        return listed
    def label(v: Variant) -> str:  # always key=value here: 'product,position_embedding=none'
        return ",".join(f"{o.split('=', 1)[0].split('.')[-1]}={o.split('=', 1)[1]}"
                        for o in v.overrides)

    return [Variant(f"{a.name},{label(b)}", a.overrides + b.overrides, a.base)
            for a in listed for b in axis]


def _seeds(where: str, value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in value)):
        raise GridError(f"{where}: seeds must be a non-empty list of integers, got {value!r}")
    if len(set(value)) != len(value):
        raise GridError(f"{where}: seeds lists a seed twice: {value}")
    return list(value)


def _synthetic(where: str, value: Any) -> dict[str, Any] | None:
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise GridError(f"{where}: synthetic_data must be true or a mapping "
                        f"(keys {', '.join(SYNTHETIC_KEYS)} and SyntheticSpec fields)")
    spec_keys = set(SyntheticSpec.__dataclass_fields__)
    unknown = sorted(set(value) - set(SYNTHETIC_KEYS) - spec_keys)
    if unknown:
        raise GridError(f"{where}: synthetic_data: unknown key(s) {', '.join(unknown)}; allowed: "
                        f"{', '.join(sorted(set(SYNTHETIC_KEYS) | spec_keys))}")
    try:
        SyntheticSpec(**{k: v for k, v in value.items() if k in spec_keys})
    except (TypeError, ValueError) as err:
        raise GridError(f"{where}: synthetic_data: {err}") from None
    return dict(value)


def _views(where: str, key: str, value: Any, example: str,
           parse: Callable[[Any, str], list[Any]]) -> tuple[Any, ...]:
    """A grid key listing test views (``eval_sizes``, ``eval_canvases``) as the tools'
    flags take them; null or ``[]`` (e.g. in a grid whose ``_base_`` has some): none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise GridError(f"{where}: {key} must be a list of {example}, got {value!r}")
    try:
        return tuple(parse(value, key))
    except ValueError as err:
        raise GridError(f"{where}: {err}") from None


def _eval_sizes(where: str, value: Any) -> tuple[EvalSize, ...]:
    """``eval_sizes``: test sizes as ``--sizes`` takes them (``640`` or ``"640x1280"``)."""
    return _views(where, "eval_sizes", value, "test sizes (a number of pixels S or "
                  "HEIGHTxWIDTH, e.g. [480, 640, 640x1280])", parse_eval_sizes)


def _eval_canvases(where: str, value: Any) -> tuple[CanvasLayout, ...]:
    """``eval_canvases``: canvas layouts as ``--canvases`` takes them (``mosaic2x2``)."""
    return _views(where, "eval_canvases", value, "canvas layouts (e.g. [mosaic1x1, "
                  "mosaic2x2, pad2x2-c])", parse_canvases)


def _resolve_base(grid_path: Path, base: Any) -> Path:
    if not isinstance(base, str) or not base:
        raise GridError(f"{grid_path}: base must name a config (e.g. detr_r50_irpe or a path)")
    beside = grid_path.parent / base
    if beside.is_file():
        return beside.resolve()
    try:
        return resolve_config_path(base).resolve()
    except ConfigError as err:
        raise GridError(f"{grid_path}: base: {err}") from None


def load_grid(
    path: str | Path,
    extra_overrides: Sequence[str] = (),
    output_dir: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    base: str | Path | None = None,
) -> Grid:
    """Read, expand and validate a grid file.

    Args:
        path: a grid file, or the name of a grid shipped in ``configs/ablations/``
            (``demo_methods``; see :func:`resolve_grid_path`).
        extra_overrides: appended to the grid's common overrides (command line).
        output_dir: replaces the grid's ``output_dir``.
        seeds: replace the grid's ``seeds``.
        base: replaces the grid's ``base`` config (a config name or a path).

    Raises:
        GridError: naming the file and the key, variant or override that is wrong;
            every run's config is built here, so bad overrides fail before any run.
    """
    path = resolve_grid_path(path)
    data = _read_grid_yaml(path)
    command_line = ((f"--config {base}",) if base is not None else ()) + tuple(extra_overrides)
    if base is not None:
        data["base"] = str(base)
    where = str(path)
    unknown = sorted(set(data) - set(GRID_KEYS))
    if unknown:
        raise GridError(f"{where}: unknown grid key(s) {', '.join(map(str, unknown))}; "
                        f"allowed: {', '.join(GRID_KEYS)}")
    if "base" not in data:
        raise GridError(f"{where}: missing 'base' (the config every run starts from)")
    base = _resolve_base(path, data["base"])
    seeds = _seeds(where, list(seeds) if seeds is not None else data.get("seeds"))
    common = _string_list(f"{where}: overrides", data.get("overrides")) + _string_list(
        "command-line overrides", list(extra_overrides))
    _check_reserved(f"{where}: overrides", common, seeds is not None)

    variants = _variants(where, data)
    names = [v.name for v in variants]
    baseline = data.get("baseline", names[0])
    if baseline not in names:
        raise GridError(f"{where}: baseline {baseline!r} is not a variant; variants: "
                        f"{', '.join(names)}")
    launcher, nproc, finetune, submit = _launch(where, data)
    out = output_dir if output_dir is not None else data.get("output_dir")
    if not out or not isinstance(out, (str, Path)):
        raise GridError(f"{where}: missing 'output_dir' (the folder of the grid's run folders)")
    name = data.get("name") or path.stem
    description = data.get("description") or ""

    grid = Grid(
        path=path, name=str(name), description=str(description).strip(), base=base,
        output_dir=Path(out), overrides=common, variants=variants, seeds=seeds or [],
        baseline=baseline, launcher=launcher, nproc_per_node=nproc,
        synthetic_data=_synthetic(where, data.get("synthetic_data")),
        eval_sizes=_eval_sizes(where, data.get("eval_sizes")),
        eval_canvases=_eval_canvases(where, data.get("eval_canvases")),
        finetune=finetune.strip() if finetune else None,
        submit=tuple(str(a) for a in submit),
        command_line=command_line,
    )
    grid.runs = _expand_runs(grid)
    return grid


def _variants(where: str, data: Mapping[str, Any]) -> list[Variant]:
    """The grid's variants: its listed ones combined with its axes' (names and folders
    distinct; no variant sets the seed)."""
    if "axes" not in data and "variants" not in data:
        raise GridError(f"{where}: give 'axes' (override key -> list of values) and/or "
                        "'variants' (list of {name, overrides})")
    listed = _listed_variants(where, data["variants"]) if "variants" in data else []
    axis = _axis_variants(where, data["axes"]) if "axes" in data else []
    variants = _combine(listed, axis)
    for v in variants:
        # A variant's own seed would be overwritten by the grid's: always use seeds.
        _check_reserved(f"{where}: variant {v.name!r}", v.overrides, True)
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise GridError(f"{where}: variant name(s) used twice: {', '.join(dupes)}")
    slugs: dict[str, str] = {}
    for v in variants:
        if v.slug in slugs:
            raise GridError(f"{where}: variants {slugs[v.slug]!r} and {v.name!r} map to the same "
                            f"folder {v.slug!r}; rename one")
        slugs[v.slug] = v.name
    return variants


def _launch(where: str, data: Mapping[str, Any]) -> tuple[str, int, str | None, list]:
    """How the runs start: ``(launcher, nproc_per_node, finetune, submit options)``."""
    launcher = data.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise GridError(f"{where}: launcher {launcher!r} is not allowed; choose one of "
                        f"{', '.join(LAUNCHERS)}")
    nproc = data.get("nproc_per_node", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise GridError(f"{where}: nproc_per_node must be a positive integer, got {nproc!r}")
    if nproc > 1 and launcher == "local":
        raise GridError(f"{where}: nproc_per_node={nproc} needs launcher: torchrun or slurm")
    finetune = data.get("finetune")
    if finetune is not None and (not isinstance(finetune, str) or not finetune.strip()):
        raise GridError(f"{where}: finetune must be a checkpoint (a published name such as "
                        f"rtdetr_r18, a file or an http(s) address), got {finetune!r}")
    submit = data.get("submit") or []
    if not isinstance(submit, list) or not all(isinstance(a, (str, int)) for a in submit):
        raise GridError(f"{where}: submit must be a list of detr-irpe-submit options (e.g. "
                        f"[--partition, gpu, --timeout, 240]), got {submit!r}")
    if submit and launcher != "slurm":
        raise GridError(f"{where}: submit options need launcher: slurm (got {launcher})")
    return launcher, nproc, finetune, submit


def _expand_runs(grid: Grid) -> list[RunSpec]:
    try:
        base_cfg = load_config(grid.base, grid.overrides)
    except ConfigError as err:
        raise GridError(f"{grid.path}: base {grid.base} with the common overrides: {err}") from None
    seeds = grid.seeds or [base_cfg.train.seed]
    grid.seeds = seeds
    runs = []
    for variant in grid.variants:
        for seed in seeds:
            out = grid.output_dir / variant.slug / f"seed{seed}"
            overrides = (*grid.overrides, *variant.overrides, f"train.seed={seed}",
                         f"train.output_dir={out}")
            base = variant.base or grid.base
            try:
                cfg = load_config(base, overrides)
            except ConfigError as err:
                raise GridError(f"{grid.path}: variant {variant.name!r}: {err}") from None
            runs.append(RunSpec(variant, seed, overrides, out, cfg, base))
    return runs


__all__ = [
    "GRID_DIR",
    "GRID_KEYS",
    "LAUNCHERS",
    "Grid",
    "GridError",
    "RunSpec",
    "Variant",
    "load_grid",
    "resolve_grid_path",
]
