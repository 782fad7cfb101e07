"""What makes two configs the same experiment: one list, one function.

A run folder holds one experiment. Its checkpoint is continued automatically only by a
config of the same experiment (the training engine), and a grid counts a folder as its
run only when the folder holds the run the grid describes (``detr-irpe-ablate``). Both
ask :func:`experiment_differences`.

Every key of every section counts, except the keys of :data:`NOT_IDENTITY` (so a key
added to the config later counts without an edit here) and, for a resumed training run,
the training recipe (``train.*`` but ``train.seed``), which a resumed run may change
and then applies from there on. Keys one of the two configs lacks (a config written by
an older or newer version of the package) are not compared.

Values the run decides when it starts are written resolved into its ``config.yaml`` and
checkpoints: ``auto`` (``train.amp``: bf16 or float32 for the machine),
``model.num_classes: null`` and ``model.category_ids: null`` (from the data). A config
that still says ``auto`` / ``null`` stands for whatever the run resolved, so it matches
the resolved value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keys that never make two configs different experiments: how the run is carried out
# (where, on what, how fast, how often and to which loggers it reports, how often it
# evaluates and saves, how bad images are treated), how weights start (a resumed run
# takes them from its checkpoint) and the schedule's length (a longer schedule continues
# the run).
NOT_IDENTITY = frozenset({
    "train.output_dir", "train.device", "train.num_threads", "train.print_freq",
    "train.loggers", "train.checkpoint_every", "train.eval_every", "data.num_workers",
    "data.cache_images", "data.strict", "data.max_image_pixels", "model.channels_last",
    "model.backbone_weights", "model.rpe_init",
    "train.epochs", "train.lr_drop",
})
# A value the run replaces by what it resolves to (``train.amp: auto``, ...), and the
# keys whose ``null`` means "from the data".
AUTO = "auto"
FROM_THE_DATA = frozenset({"model.num_classes", "model.category_ids"})


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"rpe": x}}`` -> ``{"model.rpe": x}``, nested sections included."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: saved -> current`` for every value that differs (keys in either config)."""
    a, b = flatten(saved), flatten(current)
    return [f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _counts(key: str, with_recipe: bool) -> bool:
    if key in NOT_IDENTITY:
        return False
    # train.* is the recipe, but a resumed run continues the random streams of its seed
    if key.startswith("train.") and key != "train.seed":
        return with_recipe
    return True


def _resolves_to(key: str, current: Any, saved: Any) -> bool:
    """Whether ``current`` is a value the run resolves, and ``saved`` what it became."""
    return current == AUTO or (key in FROM_THE_DATA and current is None and saved is not None)


def experiment_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, with_recipe: bool = False
) -> list[str]:
    """``key: saved -> current`` for every key that makes ``saved`` (a run folder's
    config) another experiment than ``current``; empty when they are the same one.

    Args:
        with_recipe: the training recipe counts too (a grid's run must be trained with
            the recipe the grid describes); without it, only what a resumed run cannot
            change counts (the model, loss and data settings and ``train.seed``).
    """
    a, b = flatten(saved), flatten(current)
    return [
        f"{key}: {a[key]!r} -> {b[key]!r}"
        for key in sorted(set(a) & set(b))
        if _counts(key, with_recipe) and a[key] != b[key] and not _resolves_to(key, b[key], a[key])
    ]


__all__ = [
    "NOT_IDENTITY",
    "config_differences",
    "experiment_differences",
    "flatten",
]
