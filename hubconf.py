"""torch.hub entry points: DETR-R50, DAB-DETR-R50, DN-DETR-R50, RT-DETR-R18 / R50,
D-FINE / DEIM N-X, each with and without iRPE in the encoder (D-FINE / DEIM: S and L), and
DEIMv2 Atto, Femto, Pico, N and S-X.

    import torch
    model = torch.hub.load("PATH/TO/detr_irpe", "detr_resnet50_irpe", source="local",
                           pretrained=True)            # the iRPE model zoo's 150-epoch file
    model, postprocessor = torch.hub.load("PATH/TO/detr_irpe", "detr_resnet50",
                                          source="local", pretrained=True,
                                          return_postprocessor=True)

``pretrained=True`` downloads the published checkpoint (addresses in
``detr_irpe/checkpoint/zoo.py``) into torch.hub's cache (``torch.hub.get_dir()/checkpoints``;
the hash is checked where the file name carries one), reads it weights-only and returns
the model in eval mode. Offline, a ``CheckpointError`` names the address and the path to
put the file at. Other keyword arguments are ``model.*`` config values,
e.g. ``backbone_weights="none"`` (no ImageNet download for an untrained model) or
``rpe_init="zero"``. With ``num_classes`` other than 91 the published class head is
replaced by a fresh one (fine-tuning), with a warning. ``checkpoint="PATH"`` loads a file
instead of the published one: an official DETR / iRPE-DETR file into the entry's
recipe, or a run of this project built from its saved config (below).

DAB-DETR and DN-DETR (``dab_detr_resnet50[_irpe]``, ``dn_detr_resnet50[_irpe]``): the
official weights are shared through Google Drive folders, which have no stable download
address, so ``pretrained=True`` cannot fetch them; it raises a one-line
``CheckpointError`` that says where the file is and how to load it: download it once and
pass ``checkpoint="PATH/TO/file.pth"`` (any checkpoint the tools read), e.g.

    model = torch.hub.load("PATH/TO/detr_irpe", "dn_detr_resnet50", source="local",
                           checkpoint="checkpoint.pth")     # the DN-DETR-R50 file, 44.4 AP

RT-DETR (``rtdetr_r18[_irpe]``, ``rtdetr_r50[_irpe]``; 80 COCO classes, remapped):
``pretrained=True`` downloads the official 72-epoch file of the zoo names ``rtdetr_r18`` /
``rtdetr_r50``; the ``_irpe`` entries load it into the model with iRPE in the AIFI layer,
whose tables start at zero (``rpe_init``), so the model starts as the published one.
``checkpoint="PATH"`` loads any file the tools read instead (an official release, or a run
of this project with its saved config).

    model = torch.hub.load("PATH/TO/detr_irpe", "rtdetr_r50_irpe", source="local",
                           pretrained=True)            # fine-tune from the public weights

D-FINE and DEIM (``dfine_n`` .. ``dfine_x``, ``deim_n`` .. ``deim_x``, ``dfine_s_irpe``,
``dfine_l_irpe``, ``deim_s_irpe``, ``deim_l_irpe``; 80 COCO classes): as RT-DETR's, with
the published files of the zoo names of the same sizes (docs/dfine.md).

DEIMv2 (``deimv2_atto``, ``deimv2_femto``, ``deimv2_pico``, ``deimv2_n``: HGNetv2;
``deimv2_s``, ``deimv2_m``, ``deimv2_l``, ``deimv2_x``: ViT; 80 COCO classes): the same,
with the published files of the zoo names of the same sizes (docs/deimv2.md). The ViT's
encoding is a ``model.*`` keyword: ``encodings={"backbone": []}`` loads the published
weights into the ViT without its RoPE.

    model = torch.hub.load("PATH/TO/detr_irpe", "deimv2_s", source="local",
                           pretrained=True)            # 50.9 AP published

A ``checkpoint`` that carries its config (a run of this project) builds the model of
that config, as ``Predictor.from_checkpoint`` does; keyword arguments given explicitly
(``num_classes``, ``rpe``, ``model.*`` values) go on top of it. Where the saved config
differs from the entry's recipe, every differing key is logged with both values, and so
is every key the keyword arguments change; when the weights do not fit what they change,
one ``CheckpointError`` lists all those keys with both values. Modules the saved config
names (``model.import``) are imported only with ``trust_imports=True``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("detr_irpe.hub")

dependencies = ["torch", "torchvision"]

# The iRPE setting of configs/detr_r50_irpe.yaml: its 150-epoch file is the zoo's default.
_PUBLISHED_RPE = "rpe-2.0-product-ctx-1-k"


def _config(name: str, num_classes: int, model_options: dict[str, Any]):
    from detr_irpe.config import config_from_dict, load_config

    values = load_config(name).to_dict()
    values["model"].update(model_options, num_classes=num_classes)
    return config_from_dict(values)


def _download(entry) -> tuple[dict, dict]:
    """The published checkpoint of a :class:`~detr_irpe.checkpoint.zoo.ZooEntry` as
    ``(state_dict, meta)``, downloaded into torch.hub's cache the first time (offline:
    a one-line CheckpointError naming the address and where to put the file)."""
    from detr_irpe.checkpoint import read_checkpoint
    from detr_irpe.checkpoint.download import download_zoo_entry

    return read_checkpoint(download_zoo_entry(entry))


def _make(
    config: str,
    zoo_name: str,
    pretrained: bool,
    checkpoint: str | None,
    num_classes: int | None,
    return_postprocessor: bool,
    model_options: dict[str, Any],
    trust_imports: bool,
):
    """A DETR entry: ``checkpoint``'s model when given (:func:`_build_file`), else the
    config's model with, when ``pretrained``, the published file of zoo name ``zoo_name``
    (91 classes unless ``num_classes`` says otherwise)."""
    from detr_irpe.checkpoint.zoo import zoo_entry

    if checkpoint is not None:
        _refuse_both(config, zoo_name, pretrained)
        return _build_file(config, checkpoint, num_classes, 91, return_postprocessor,
                           model_options, trust_imports)
    # an unpublished name, or no way to download the file, fails before the model is built
    weights = _download(zoo_entry(zoo_name)) if pretrained else None
    return _build(config, weights, num_classes or 91, return_postprocessor, model_options)


def _refuse_both(config: str, zoo_name: str, pretrained: bool) -> None:
    """An entry with a published file takes ``pretrained=True`` or ``checkpoint``, not both
    (a one-line CheckpointError)."""
    from detr_irpe.errors import CheckpointError

    if pretrained:
        raise CheckpointError(f"{config}: pass pretrained=True (the {zoo_name} file) or "
                              "checkpoint='PATH', not both")


def _build(
    config: str,
    weights: tuple[dict, dict] | None,
    num_classes: int,
    return_postprocessor: bool,
    model_options: dict[str, Any],
):
    """The model of ``config`` with ``model_options`` and, when given, the read checkpoint
    ``weights`` loaded (a class head of another class count is replaced), in eval mode."""
    from detr_irpe.checkpoint import load_state
    from detr_irpe.models import build_model

    cfg = _config(config, num_classes, model_options)
    # no ImageNet download when a checkpoint brings the backbone
    model, _, postprocessor = build_model(cfg, load_backbone_weights=weights is None)
    if weights is not None:
        load_state(model, *weights, strict_head=False)
        model.eval()
    return (model, postprocessor) if return_postprocessor else model


def detr_resnet50_irpe(
    pretrained: bool = False,
    num_classes: int | None = None,
    rpe: str | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """DETR-R50 with iRPE ``rpe`` in every encoder self-attention (config ``detr_r50_irpe``;
    ``rpe=None``: the recipe's ``rpe-2.0-product-ctx-1-k``, or a run's own).

    Published weights exist for ``rpe-2.0-product-ctx-1-k`` (150 epochs) and
    ``rpe-1.9-product-ctx-1-k``; another ``rpe`` with ``pretrained=True`` is an error.
    ``checkpoint``: a file to load instead (an official iRPE-DETR file, or a run of this
    project, built from its saved config).
    """
    zoo_name = f"detr_r50_irpe/{rpe or _PUBLISHED_RPE}"
    return _make("detr_r50_irpe", zoo_name, pretrained, checkpoint, num_classes,
                 return_postprocessor,
                 model_options if rpe is None else {**model_options, "rpe": rpe},
                 trust_imports)


def detr_resnet50(
    pretrained: bool = False,
    num_classes: int | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """Plain DETR-R50 (config ``detr_r50``); ``pretrained=True``: the DETR model zoo's file.
    ``checkpoint``: a file to load instead (an official DETR file, or a run of this
    project, built from its saved config)."""
    return _make("detr_r50", "detr_r50", pretrained, checkpoint, num_classes,
                 return_postprocessor, model_options, trust_imports)


# The official DAB-DETR / DN-DETR model zoos (their repositories' READMEs link each file
# from a Google Drive folder; no stable address to download from).
_DAB_FILES = {
    "dab_detr_r50": ("DAB-DETR-R50 (42.2 AP)", "github.com/IDEA-Research/DAB-DETR",
                     "dab_detr_resnet50"),
    "dn_detr_r50": ("DN-DETR-R50 (44.4 AP)", "github.com/IDEA-Research/DN-DETR",
                    "dn_detr_resnet50"),
}


def _make_dab(
    config: str,
    pretrained: bool,
    checkpoint: str | None,
    num_classes: int | None,
    return_postprocessor: bool,
    model_options: dict[str, Any],
    trust_imports: bool = False,
):
    """A ``dab`` decoder entry: the config's model, with ``checkpoint``'s weights when given
    (a checkpoint with a saved config: that config's model, :func:`_build_saved`).

    ``pretrained=True`` without ``checkpoint`` raises a one-line CheckpointError naming the
    official file and the call that loads it (before anything is built)."""
    from detr_irpe.errors import CheckpointError

    if pretrained and checkpoint is None:
        base = config.removesuffix("_irpe")
        name, repository, entry = _DAB_FILES[base]
        if config != base:
            raise CheckpointError(
                f"no published weights for {config} (iRPE on {name.split()[0]} is the "
                f"experiment): train it, or start from the official {name} file (model zoo "
                f"of {repository}, a Google Drive link) with checkpoint='PATH', which leaves "
                "the iRPE tables as model.rpe_init says")
        raise CheckpointError(
            f"the official {name} weights have no stable download address (a Google Drive "
            f"link in the model zoo of {repository}): download the file once and load it "
            f"with torch.hub.load(REPO, {entry!r}, source='local', checkpoint='PATH')")
    if checkpoint is None:
        return _build(config, None, num_classes or 91, return_postprocessor, model_options)
    return _build_file(config, checkpoint, num_classes, 91, return_postprocessor,
                       model_options, trust_imports)


def _build_file(
    config: str,
    checkpoint: str,
    num_classes: int | None,
    default_classes: int,
    return_postprocessor: bool,
    model_options: dict[str, Any],
    trust_imports: bool,
):
    """``checkpoint``'s model: the config saved in it (a run of this project,
    :func:`_build_saved`), or the entry's ``config`` with its weights loaded."""
    from detr_irpe.checkpoint import read_checkpoint

    weights = read_checkpoint(checkpoint)
    if isinstance(weights[1].get("config"), Mapping):  # a run of this project
        return _build_saved(config, checkpoint, weights, num_classes, return_postprocessor,
                            model_options, trust_imports)
    return _build(config, weights, num_classes or default_classes, return_postprocessor,
                  model_options)


def _overrides(options: Mapping[str, Any], prefix: str = "model") -> list[str]:
    """``model.*`` keyword values as ``"model.key=value"`` overrides (values as JSON,
    which YAML reads back as they were; sections such as ``denoising`` key by key)."""
    out = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            out += _overrides(value, f"{prefix}.{key}")
        else:
            out.append(f"{prefix}.{key}={json.dumps(value)}")
    return out


def _flat(values: Mapping[str, Any], prefix: str = "model") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def _recipe_differences(recipe: str, cfg) -> list[str]:
    """``"key: recipe A, checkpoint B"`` for every model key where ``cfg`` differs from
    the entry's ``recipe`` config."""
    from detr_irpe.config import load_config

    ours = _flat(load_config(recipe).to_dict()["model"])
    theirs = _flat(cfg.to_dict()["model"])
    return [f"{key}: recipe {ours.get(key)!r}, checkpoint {theirs.get(key)!r}"
            for key in theirs if ours.get(key) != theirs.get(key)]


def _saved_differences(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """``"key: checkpoint A, given B"`` for every ``model.*`` keyword value in ``given``
    that differs from the saved config ``saved`` (values compared as JSON has them)."""
    section = saved.get("model")
    theirs = _flat(section) if isinstance(section, Mapping) else {}
    out = []
    for key, value in _flat(given).items():
        value = json.loads(json.dumps(value))
        if theirs.get(key) != value:
            out.append(f"{key}: checkpoint {theirs.get(key)!r}, given {value!r}")
    return out


def _build_saved(
    recipe: str,
    checkpoint: str,
    weights: tuple[dict, dict],
    num_classes: int | None,
    return_postprocessor: bool,
    model_options: dict[str, Any],
    trust_imports: bool,
):
    """The model of the config saved with ``weights`` (explicit ``num_classes`` and
    ``model_options`` on top), its weights loaded, in eval mode.

    Every key where the saved config differs from ``recipe`` is logged with both values,
    and every key an explicit argument changes, apart. When the weights do not fit the
    changed config, one CheckpointError lists the keys the weights show and every key the
    arguments changed, each with both values."""
    from detr_irpe.checkpoint import config_for_checkpoint, load_state
    from detr_irpe.errors import CheckpointError
    from detr_irpe.models import build_model

    state, meta = weights
    given = dict(model_options) if num_classes is None else \
        {**model_options, "num_classes": num_classes}
    changed = _saved_differences(meta["config"], given)
    cfg = config_for_checkpoint(checkpoint, state, meta, None, _overrides(given),
                                trust_imports=trust_imports)
    explicit = set(_flat(given))
    differences = [d for d in _recipe_differences(recipe, cfg)
                   if d.split(":")[0] not in explicit]
    if differences:
        family = {"model.family", "model.denoising.enabled", "model.rpe"}
        level = logging.WARNING if any(d.split(":")[0] in family for d in differences) \
            else logging.INFO
        logger.log(level, "%s: built from the config saved in %s, which differs from the "
                   "entry's recipe %s in %d key(s): %s", recipe, checkpoint, recipe,
                   len(differences), "; ".join(differences))
    names = meta.get("category_names")  # the post-processing scores only these
    model, _, postprocessor = build_model(cfg, load_backbone_weights=False,
                                          categories=names if names else None)
    try:
        load_state(model, state, meta, strict_head=False)
    except CheckpointError as err:
        if not changed:
            raise
        raise CheckpointError(
            f"{err} The keyword arguments contradict the config saved in {checkpoint} in "
            f"{len(changed)} key(s): {'; '.join(changed)}; leave them out to build the run "
            "as it was saved") from None
    if changed:
        logger.warning("%s: keyword arguments change the config saved in %s in %d key(s): %s",
                       recipe, checkpoint, len(changed), "; ".join(changed))
    model.eval()
    return (model, postprocessor) if return_postprocessor else model


def dab_detr_resnet50(
    pretrained: bool = False,
    num_classes: int | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """DAB-DETR-R50 (config ``dab_detr_r50``, 50-epoch recipe): anchor-box queries, sigmoid
    classes (``num_classes`` outputs, no "no object"); the postprocessor keeps the top
    (query, class) scores.

    ``checkpoint``: a file to load (e.g. the official DAB-DETR-R50 one, downloaded by hand:
    ``pretrained=True`` alone says where it is).
    """
    return _make_dab("dab_detr_r50", pretrained, checkpoint, num_classes,
                     return_postprocessor, model_options, trust_imports)


def dab_detr_resnet50_irpe(
    pretrained: bool = False,
    num_classes: int | None = None,
    rpe: str | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """DAB-DETR-R50 with iRPE ``rpe`` in every encoder self-attention (config
    ``dab_detr_r50_irpe``). No published weights: ``checkpoint`` loads a file, e.g. your
    own run, or the official DAB-DETR-R50 one (iRPE tables then start as ``rpe_init``)."""
    return _make_dab("dab_detr_r50_irpe", pretrained, checkpoint, num_classes, return_postprocessor,
                     model_options if rpe is None else {**model_options, "rpe": rpe},
                     trust_imports)


def dn_detr_resnet50(
    pretrained: bool = False,
    num_classes: int | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """DN-DETR-R50 (config ``dn_detr_r50``): DAB-DETR-R50 trained with denoising queries
    (training only; in eval mode it is a DAB-DETR whose queries start from ``label_enc``).

    ``checkpoint``: a file to load (e.g. the official DN-DETR-R50 one, downloaded by hand:
    ``pretrained=True`` alone says where it is).
    """
    return _make_dab("dn_detr_r50", pretrained, checkpoint, num_classes,
                     return_postprocessor, model_options, trust_imports)


def dn_detr_resnet50_irpe(
    pretrained: bool = False,
    num_classes: int | None = None,
    rpe: str | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """DN-DETR-R50 with iRPE ``rpe`` in every encoder self-attention (config
    ``dn_detr_r50_irpe``). No published weights: ``checkpoint`` loads a file, e.g. your
    own run, or the official DN-DETR-R50 one (iRPE tables then start as ``rpe_init``)."""
    return _make_dab("dn_detr_r50_irpe", pretrained, checkpoint, num_classes, return_postprocessor,
                     model_options if rpe is None else {**model_options, "rpe": rpe},
                     trust_imports)


# RT-DETR: 80 classes (COCO's categories remapped to 0..79), as the official files
_RTDETR_CLASSES = 80


def _make_rtdetr(
    config: str,
    zoo_name: str,
    pretrained: bool,
    checkpoint: str | None,
    num_classes: int | None,
    return_postprocessor: bool,
    model_options: dict[str, Any],
    trust_imports: bool,
):
    """An RT-DETR entry: ``checkpoint``'s model when given, else the config's model with,
    when ``pretrained``, the official weights of zoo name ``zoo_name`` (an ``_irpe``
    config's tables start as ``rpe_init``)."""
    from detr_irpe.checkpoint.zoo import zoo_entry
    from detr_irpe.errors import CheckpointError

    if checkpoint is not None:
        _refuse_both(config, zoo_name, pretrained)
        return _build_file(config, checkpoint, num_classes, _RTDETR_CLASSES,
                           return_postprocessor, model_options, trust_imports)
    weights = None
    if pretrained:
        try:
            entry = zoo_entry(zoo_name)
        except KeyError:
            raise CheckpointError(
                f"no published checkpoint {zoo_name!r} in this package's zoo "
                "(detr_irpe/checkpoint/zoo.py); download the official file and pass "
                "checkpoint='PATH'") from None
        weights = _download(entry)
    return _build(config, weights, num_classes or _RTDETR_CLASSES, return_postprocessor,
                  model_options)


def rtdetr_r18(
    pretrained: bool = False,
    num_classes: int | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """RT-DETR-R18 (config ``rtdetr_r18``, 72-epoch recipe, 46.4 AP published): sigmoid
    classes; the postprocessor keeps the top 300 (query, class) scores.
    ``pretrained=True``: the official file (zoo name ``rtdetr_r18``)."""
    return _make_rtdetr("rtdetr_r18", "rtdetr_r18", pretrained, checkpoint, num_classes,
                        return_postprocessor, model_options, trust_imports)


def rtdetr_r18_irpe(
    pretrained: bool = False,
    num_classes: int | None = None,
    rpe: str | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """RT-DETR-R18 with iRPE ``rpe`` in the AIFI layer (config ``rtdetr_r18_irpe``).
    ``pretrained=True``: the official RT-DETR-R18 file, iRPE tables starting at zero."""
    return _make_rtdetr("rtdetr_r18_irpe", "rtdetr_r18", pretrained, checkpoint, num_classes,
                        return_postprocessor,
                        model_options if rpe is None else {**model_options, "rpe": rpe},
                        trust_imports)


def rtdetr_r50(
    pretrained: bool = False,
    num_classes: int | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """RT-DETR-R50 (config ``rtdetr_r50``, 72-epoch recipe, 53.1 AP published).
    ``pretrained=True``: the official file (zoo name ``rtdetr_r50``)."""
    return _make_rtdetr("rtdetr_r50", "rtdetr_r50", pretrained, checkpoint, num_classes,
                        return_postprocessor, model_options, trust_imports)


def rtdetr_r50_irpe(
    pretrained: bool = False,
    num_classes: int | None = None,
    rpe: str | None = None,
    checkpoint: str | None = None,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    **model_options: Any,
):
    """RT-DETR-R50 with iRPE ``rpe`` in the AIFI layer (config ``rtdetr_r50_irpe``).
    ``pretrained=True``: the official RT-DETR-R50 file, iRPE tables starting at zero."""
    return _make_rtdetr("rtdetr_r50_irpe", "rtdetr_r50", pretrained, checkpoint, num_classes,
                        return_postprocessor,
                        model_options if rpe is None else {**model_options, "rpe": rpe},
                        trust_imports)


# the families of the entries _published_entry serves: (name, the page of their configs)
_PUBLISHED_FAMILIES = {"dfine": ("D-FINE", "docs/dfine.md"), "deim": ("DEIM", "docs/dfine.md"),
                       "deimv2": ("DEIMv2", "docs/deimv2.md")}


def _published_entry(config: str, zoo_name: str):
    """A D-FINE / DEIM / DEIMv2 entry: the model of ``config`` (80 classes);
    ``pretrained=True`` loads the published file of ``zoo_name`` (an ``_irpe`` config's
    tables start at zero, so it computes the published model until trained);
    ``checkpoint="PATH"`` any file the tools read (a published file needs no config here:
    the entry names the variant)."""
    def entry(pretrained: bool = False, num_classes: int | None = None,
              checkpoint: str | None = None, return_postprocessor: bool = False,
              trust_imports: bool = False, **model_options: Any):
        return _make_rtdetr(config, zoo_name, pretrained, checkpoint, num_classes,
                            return_postprocessor, model_options, trust_imports)

    entry.__name__ = entry.__qualname__ = config
    kind, size = config.split("_")[:2]
    family, page = _PUBLISHED_FAMILIES[kind]
    extra = " with iRPE in the AIFI layer" if config.endswith("_irpe") else ""
    # the letters S .. X in capitals, the named sizes as published (DEIMv2-Atto)
    size = size.upper() if len(size) == 1 else size.capitalize()
    entry.__doc__ = (f"{family}-{size}{extra} (config ``{config}``; {page}). "
                     f"``pretrained=True``: the published file (zoo name ``{zoo_name}``).")
    return entry


# D-FINE / DEIM (docs/dfine.md): every published size, and iRPE in S and L
dfine_n = _published_entry("dfine_n", "dfine_n")
dfine_s = _published_entry("dfine_s", "dfine_s")
dfine_m = _published_entry("dfine_m", "dfine_m")
dfine_l = _published_entry("dfine_l", "dfine_l")
dfine_x = _published_entry("dfine_x", "dfine_x")
dfine_s_irpe = _published_entry("dfine_s_irpe", "dfine_s")
dfine_l_irpe = _published_entry("dfine_l_irpe", "dfine_l")
deim_n = _published_entry("deim_n", "deim_n")
deim_s = _published_entry("deim_s", "deim_s")
deim_m = _published_entry("deim_m", "deim_m")
deim_l = _published_entry("deim_l", "deim_l")
deim_x = _published_entry("deim_x", "deim_x")
deim_s_irpe = _published_entry("deim_s_irpe", "deim_s")
deim_l_irpe = _published_entry("deim_l_irpe", "deim_l")
# DEIMv2 (docs/deimv2.md): the four DINOv3 sizes; the backbone's encoding is a keyword,
# e.g. encodings={"backbone": []} (the published weights fine-tuned without RoPE)
deimv2_s = _published_entry("deimv2_s", "deimv2_s")
deimv2_m = _published_entry("deimv2_m", "deimv2_m")
deimv2_l = _published_entry("deimv2_l", "deimv2_l")
deimv2_x = _published_entry("deimv2_x", "deimv2_x")
# and the four HGNetv2 sizes (Atto, Femto, Pico: the lite encoder; N: B0, the hybrid one)
deimv2_atto = _published_entry("deimv2_atto", "deimv2_atto")
deimv2_femto = _published_entry("deimv2_femto", "deimv2_femto")
deimv2_pico = _published_entry("deimv2_pico", "deimv2_pico")
deimv2_n = _published_entry("deimv2_n", "deimv2_n")


def from_checkpoint(
    checkpoint: str,
    return_postprocessor: bool = False,
    trust_imports: bool = False,
    device: str = "cpu",
    **model_options: Any,
):
    """The model of any checkpoint the tools read, of any registered family (a run of this
    project, a public file, a zoo name or a Hugging Face folder), built from the config it
    carries (or implies), weights loaded, in eval mode, as ``Predictor.from_checkpoint``
    builds it. A family registered by a plugin works too: the module the checkpoint names
    (``model.import``) is imported only with ``trust_imports=True`` (or when it is imported
    already). Keyword arguments are ``model.*`` values on top of the saved config.

        model = torch.hub.load("PATH/TO/detr_irpe", "from_checkpoint", source="local",
                               checkpoint="outputs/run/checkpoint_best.pth")
    """
    from detr_irpe.models import model_from_checkpoint

    loaded = model_from_checkpoint(checkpoint, None, _overrides(model_options), device,
                                   trust_imports=trust_imports)
    return (loaded.model, loaded.postprocessor) if return_postprocessor else loaded.model
