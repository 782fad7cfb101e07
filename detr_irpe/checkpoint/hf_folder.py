"""Hugging Face ``save_pretrained`` folders: reading them into this project's layout and
writing a model as one, for every family with an ``HFSupport`` (DETR:
``DetrForObjectDetection``; DAB-DETR: ``DabDetrForObjectDetection``).

A folder holds ``config.json`` and ``model.safetensors`` (or a sharded safetensors
file, or ``pytorch_model.bin`` in older Hub repositories). The family whose key names the
weights have converts them (:func:`convert_hf_weights`); ``config.json`` gives the
``model.*`` settings (each family's ``HFSupport.model_settings``) and the category names
(``id2label``). The helpers for transformers' DETR-like ``config.json`` files live here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.layout import num_classes_of
from detr_irpe.checkpoint.safe import format_keys, load_safetensors, safe_load, safetensors_module
from detr_irpe.encodings import encodings
from detr_irpe.encodings.absolute import SINE
from detr_irpe.errors import CheckpointError
from detr_irpe.family import DetectorFamily, families, get_family
from detr_irpe.utils.files import fsync_dir, os_error_behind, write_error

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_SHARD_INDEX_NAME = "model.safetensors.index.json"
_TORCH_WEIGHTS_NAME = "pytorch_model.bin"
# (depths, layer type) of transformers' ResNetConfig -> the ResNet it is.
_HF_RESNET_NAMES = {
    ((2, 2, 2, 2), "basic"): "resnet18",
    ((3, 4, 6, 3), "basic"): "resnet34",
    ((3, 4, 6, 3), "bottleneck"): "resnet50",
    ((3, 4, 23, 3), "bottleneck"): "resnet101",
}


def _load_weights(folder: Path) -> dict[str, Tensor]:
    """The tensors of a ``save_pretrained`` folder: one safetensors file, a sharded one, or
    (older Hub repositories) ``pytorch_model.bin``."""
    if (folder / WEIGHTS_NAME).is_file():
        return load_safetensors(folder / WEIGHTS_NAME)[0]
    if (folder / _SHARD_INDEX_NAME).is_file():
        index = read_json(folder / _SHARD_INDEX_NAME)
        shards = sorted(set(index.get("weight_map", {}).values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_safetensors(folder / shard)[0])
        return state
    if (folder / _TORCH_WEIGHTS_NAME).is_file():
        obj = safe_load(folder / _TORCH_WEIGHTS_NAME)
        if isinstance(obj, Mapping) and all(isinstance(v, Tensor) for v in obj.values()):
            return dict(obj)
        raise CheckpointError(f"{folder / _TORCH_WEIGHTS_NAME} is not a state dict of tensors")
    raise CheckpointError(
        f"{folder} holds no weights: expected {WEIGHTS_NAME} (or {_SHARD_INDEX_NAME} or "
        f"{_TORCH_WEIGHTS_NAME}) next to {CONFIG_NAME}"
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable JSON file: {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def same_for_encoder_and_decoder(hf_config: Mapping[str, Any]) -> None:
    for a, b in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if hf_config.get(a, 0) != hf_config.get(b, 0):
            raise CheckpointError(
                f"{CONFIG_NAME}: {a}={hf_config.get(a)} differs from {b}={hf_config.get(b)}; "
                "this project's DETR uses one value for encoder and decoder"
            )


def check_activation(hf_config: Mapping[str, Any], expected: str, default: str) -> None:
    activation = hf_config.get("activation_function", default)
    if activation != expected:
        raise CheckpointError(
            f"{CONFIG_NAME}: activation_function={activation!r}; this project's model uses "
            f"{expected}"
        )


def model_settings(hf_config: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """``{our key: their value}`` of ``fields`` (ours -> theirs), the backbone and the
    class count (``id2label``)."""
    model = {ours: hf_config[theirs] for ours, theirs in fields.items() if theirs in hf_config}
    backbone = _backbone_name(hf_config)
    if backbone:
        model["backbone"] = backbone
    if isinstance(hf_config.get("id2label"), Mapping):
        model["num_classes"] = len(hf_config["id2label"])
    return model


# Settings both families name alike: ours -> theirs.
SHARED_FIELDS = {
    "nheads": "encoder_attention_heads",
    "enc_layers": "encoder_layers",
    "dec_layers": "decoder_layers",
    "dim_feedforward": "encoder_ffn_dim",
    "num_queries": "num_queries",
    "dilation": "dilation",
}


def _backbone_name(hf_config: Mapping[str, Any]) -> str | None:
    """The ResNet of a DETR ``config.json``: timm's name, or the one transformers' own
    ResNet config (depths, layer type) describes."""
    backbone_config = hf_config.get("backbone_config") or {}
    kind = backbone_config.get("model_type", "timm_backbone")
    if kind == "timm_backbone":
        return hf_config.get("backbone") or backbone_config.get("backbone")
    if kind != "resnet":
        raise CheckpointError(
            f"{CONFIG_NAME}: backbone_config.model_type={kind!r}; only ResNet backbones "
            "(timm's or transformers' own) convert"
        )
    if backbone_config.get("downsample_in_bottleneck"):
        raise CheckpointError(
            f"{CONFIG_NAME}: backbone_config.downsample_in_bottleneck=true strides the first "
            "1x1 convolution; torchvision's ResNet (used here) strides the 3x3 one"
        )
    depths = tuple(backbone_config.get("depths", (3, 4, 6, 3)))
    layer_type = backbone_config.get("layer_type", "bottleneck")
    name = _HF_RESNET_NAMES.get((depths, layer_type))
    if name is None:
        raise CheckpointError(
            f"{CONFIG_NAME}: a {layer_type} ResNet with depths {list(depths)} is none of "
            f"{', '.join(sorted(set(_HF_RESNET_NAMES.values())))}"
        )
    return name


def _hf_family(state: Mapping[str, Tensor]) -> DetectorFamily:
    """The family whose Hugging Face key names ``state`` has."""
    for family in families():
        if family.hf is not None and family.hf.recognizes_hf_keys(state):
            return family
    names = [f.hf.model_type for f in families() if f.hf is not None]
    raise CheckpointError(
        f"the weights have keys of no Hugging Face model this package reads (model types "
        f"{', '.join(names)}); e.g. {format_keys(sorted(state)[:3])}")


def convert_hf_weights(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], DetectorFamily]:
    """A transformers detector's state dict in this project's layout, and its family.

    Raises:
        CheckpointError: keys of no family's Hugging Face model, or keys its converter
            refuses.
    """
    family = _hf_family(state)
    converted, _ = family.hf.from_hf_keys(state)
    return converted, family


def read_hf_folder(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a ``save_pretrained`` folder of ``DetrForObjectDetection`` or
    ``DabDetrForObjectDetection`` (or its ``.safetensors`` file) into this project's layout.

    Returns:
        ``(state_dict, meta)``; ``meta`` has ``path``, ``format`` (``"hf"``),
        ``model_type`` (``detr`` or ``dab-detr``), ``layout`` (DETR: :data:`LAYOUTS`;
        DAB-DETR: :data:`DAB_LAYOUT`, one set of names), ``num_classes`` (transformers'
        ``num_labels``: DETR's class head rows minus the "no object" row, DAB-DETR's
        rows), ``category_names`` (``{id: name}`` from ``id2label`` without the
        ``"N/A"`` placeholders, or None), ``model`` (the ``model.*`` config values
        implied by ``config.json``, see :func:`hf_model_config` /
        :func:`hf_dab_model_config`) and ``hf_config`` (``config.json`` as a dict, or
        None for a lone file without one).

    Raises:
        CheckpointError: missing files, unreadable JSON / weights, unknown key layout,
            or a ``config.json`` that disagrees with the weights.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(
                f"{path} is not a Hugging Face save_pretrained folder: no {CONFIG_NAME}"
            )
        hf_config: dict[str, Any] | None = read_json(path / CONFIG_NAME)
        raw = _load_weights(path)
    elif path.is_file():
        raw, _ = load_safetensors(path)
        sibling = path.with_name(CONFIG_NAME)
        hf_config = read_json(sibling) if sibling.is_file() else None
    else:
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    family = _hf_family(raw)
    state, layout = family.hf.from_hf_keys(raw)
    if path.is_file() and hf_config is not None and \
            hf_config.get("model_type") != family.hf.model_type:
        hf_config = None  # a config.json of something else in the same folder
    num_classes = num_classes_of(state)
    model: dict[str, Any] = {} if hf_config is None else family.hf.model_settings(hf_config)
    model["family"] = family.name
    if num_classes is not None and model.get("num_classes", num_classes) != num_classes:
        raise CheckpointError(
            f"{path}: {CONFIG_NAME} names {model['num_classes']} labels (id2label) but the class "
            f"head is for {num_classes} classes"
        )
    names = None
    if hf_config is not None and isinstance(hf_config.get("id2label"), Mapping):
        names = {int(k): str(v) for k, v in hf_config["id2label"].items() if v != "N/A"}
    meta = {
        "path": str(path),
        "format": "hf",
        "model_type": family.hf.model_type,
        "layout": layout,
        "num_classes": num_classes,
        "category_names": names,
        "model": model,
        "hf_config": hf_config,
    }
    return state, meta


def _refusal(state: Mapping[str, Tensor], cfg: Any, family: DetectorFamily) -> str | None:
    """Why transformers cannot hold this model, or None when it can."""
    place = cfg.model.place("encoder")
    for entry, spec in place.entries:
        if not entry.holds_in_hf(spec):
            said = (f"model.{entry.legacy_key}={entry.describe(spec)}" if entry.legacy_key
                    else f"model.encodings.encoder: {entry.describe(spec)}")
            return (
                f"a model with {entry.title} ({said}) cannot be written for Hugging Face: "
                f"transformers' {family.title} has no {entry.about or entry.title}"
                f"{entry.hf_advice}")
    used = {e.name for e, _ in place.entries}
    for entry in encodings():
        keys = sorted(k for k in state if entry.param_key(k))
        if keys and entry.name not in used:
            return (
                f"the weights hold {entry.title} parameters ({keys[0]}, {len(keys)} in all) "
                f"although the config has no {entry.title}, and transformers' {family.title} "
                f"has no {entry.about or entry.title}{entry.hf_advice}")
    return family.hf.refusal(state, cfg)


def check_position_and_backbone(model: Any) -> str | None:
    """Refusals both DETR-like families share: the encoding, a ResNet cut short
    (``model.backbone_stages``) and a dilated small ResNet."""
    if model.place("encoder").absolute != SINE.name:
        return (
            f"model.position_embedding={model.position_embedding} cannot be written for Hugging "
            "Face: only the sine encoding converts"
        )
    if model.backbone_stages != 4:
        return (
            f"model.backbone_stages={model.backbone_stages} cannot be written for Hugging "
            f"Face: transformers builds every stage of the ResNet (its config names the whole "
            f"{model.backbone}, and its input projection reads the last stage's channels)"
        )
    if model.dilation and model.backbone in ("resnet18", "resnet34"):
        return (
            f"model.dilation=true with {model.backbone} cannot be written for Hugging Face: "
            "timm dilates layer4, this project only un-strides it for BasicBlock ResNets"
        )
    return None


def _labels(num_classes: int, category_names: Mapping[int, str] | None,
            category_ids: list[int] | None) -> dict[str, Any]:
    """``id2label`` / ``label2id`` of ``num_classes`` class indices (``"N/A"`` for unnamed
    ones). id2label is keyed by class index; a model on remapped categories names index k
    after its category ``category_ids[k]`` (the original ids stay behind)."""
    names = dict(category_names or {})
    ids = category_ids if len(category_ids or ()) == num_classes else None
    id2label = {str(i): names.get(ids[i] if ids else i, "N/A") for i in range(num_classes)}
    return {"id2label": id2label, "label2id": {name: int(i) for i, name in id2label.items()}}


def shared_config(cfg: Any) -> dict[str, Any]:
    """The ``config.json`` entries DetrConfig and DabDetrConfig name alike.

    The backbone is a timm ResNet built without downloading ImageNet weights
    (``use_pretrained_backbone: false``): the folder holds all weights.
    """
    model = cfg.model
    return {
        "use_timm_backbone": True,
        "backbone": model.backbone,
        "use_pretrained_backbone": False,
        "backbone_config": None,
        "dilation": model.dilation,
        "encoder_layers": model.enc_layers,
        "decoder_layers": model.dec_layers,
        "encoder_attention_heads": model.nheads,
        "decoder_attention_heads": model.nheads,
        "encoder_ffn_dim": model.dim_feedforward,
        "decoder_ffn_dim": model.dim_feedforward,
        "num_queries": model.num_queries,
        # This project drops out attention weights, residual branches and the FFN
        # activation with one rate; transformers has one setting for each.
        "dropout": model.dropout,
        "attention_dropout": model.dropout,
        "activation_dropout": model.dropout,
        "auxiliary_loss": False,
        "is_encoder_decoder": True,
    }


def hf_config_dict(
    cfg: Any, num_classes: int, category_names: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """A transformers 4-style ``config.json`` for ``cfg.model`` (both 4 and 5 read it), as
    its family writes it (``DetrConfig``, ``DabDetrConfig``)."""
    family = get_family(cfg.model.family)
    if family.hf is None:
        raise CheckpointError(f"model.family={family.name} has no Hugging Face model to write")
    return {**family.hf.config_json(cfg),
            **_labels(num_classes, category_names, cfg.model.category_ids)}


def write_hf_folder(
    state_dict: Mapping[str, Tensor],
    cfg: Any,
    out_dir: str | Path,
    *,
    category_names: Mapping[int, str] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``DetrForObjectDetection`` (plain
    DETR) or ``DabDetrForObjectDetection`` (plain DAB-DETR) ``.from_pretrained`` loads, in
    the names transformers' ``save_pretrained`` writes (DETR: the ``transformers4``
    layout of the Hub files).

    Args:
        state_dict: the model's weights in this project's layout.
        cfg: the model's :class:`~detr_irpe.config.Config` (only ``cfg.model`` is read).
        out_dir: a new folder, an empty one, or an earlier export (replaced).
        category_names: ``{id: name}`` for ``id2label`` (missing ids become ``"N/A"``).

    Raises:
        CheckpointError: an iRPE / DN-DETR / pre-norm / learned-position model (one line
            saying why), or ``out_dir`` holding other files.
    """
    family = get_family(cfg.model.family)
    if family.hf is None:
        raise CheckpointError(f"model.family={family.name} has no Hugging Face model to write")
    reason = _refusal(state_dict, cfg, family)
    if reason:
        raise CheckpointError(reason)
    num_classes = num_classes_of(state_dict)
    if num_classes is None:
        raise CheckpointError("the state dict has no class head: not a detector")
    tensors = family.hf.to_hf_keys(state_dict)
    config = hf_config_dict(cfg, num_classes, category_names)
    # transformers refuses safetensors files without this metadata entry.
    weights = safetensors_module().save(tensors, metadata={"format": "pt"})
    files = {CONFIG_NAME: (json.dumps(config, indent=2) + "\n").encode(), WEIGHTS_NAME: weights}
    out = _write_folder(Path(out_dir), files)
    logger.info("wrote %d tensors and %s to %s", len(tensors), CONFIG_NAME, out)
    return out


def _write_folder(out_dir: Path, files: Mapping[str, bytes]) -> Path:
    """Fill a temporary sibling folder, then rename it to ``out_dir``: a crash leaves
    the old folder or the new one, never a half-written one."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise CheckpointError(f"{out_dir} exists and is not a folder; give a folder path")
        others = sorted(p.name for p in out_dir.iterdir() if p.name not in files)
        if others:
            raise CheckpointError(
                f"{out_dir} exists and holds other files ({format_keys(others, 4)}); give a new or "
                "empty folder"
            )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp",
                                    dir=out_dir.parent))
    except OSError as err:
        raise write_error(out_dir, err) from err
    old = tmp.with_name(tmp.name + ".old")
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes a private folder
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)
        cause = os_error_behind(exc)  # a full disk: one line, the old folder intact
        if cause is None:
            raise
        raise write_error(out_dir, cause) from cause
    fsync_dir(out_dir.parent)  # the rename itself survives a power cut, as atomic_write's
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


__all__ = [
    "CONFIG_NAME",
    "SHARED_FIELDS",
    "WEIGHTS_NAME",
    "check_activation",
    "check_position_and_backbone",
    "convert_hf_weights",
    "hf_config_dict",
    "model_settings",
    "read_hf_folder",
    "read_json",
    "same_for_encoder_and_decoder",
    "shared_config",
    "write_hf_folder",
]
