"""The registry of detector families: one object per family says what the package needs.

A *family* is a kind of detector (``detr``: DETR; ``dab``: DAB-DETR, DN-DETR with
denoising; ``rtdetr``: RT-DETR; ``dfine``: D-FINE and DEIM; a user's own).
``model.family`` in a config names it. Each family lives in one folder
(``detr_irpe/models/<family>/``) whose ``__init__`` registers a :class:`DetectorFamily`:
its config sections, how to build the model, loss and post-processor, the checkpoint
layouts it reads and writes, its ONNX wrapper, its figures and its benchmark targets.
Config, checkpoints, export, visualization, benchmark, ablation and the tools ask this
registry; no code outside a family's folder tests which family it holds.

The built-in families are imported the first time they are asked for (their folders hold
the model code, which imports torch); a user's family registers itself when a module named
in ``model.import`` is imported (docs/model.md, "A detector family of your own").

The store is a :class:`~detr_irpe.registry.Registry`, as the backbones' and the
encodings'. This module imports nothing else of the package but :mod:`detr_irpe.errors`
and :mod:`detr_irpe.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from detr_irpe.errors import ConfigError
from detr_irpe.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = [
    "AttentionSupport",
    "BUILTIN_FAMILIES",
    "FAMILIES",
    "DEFAULT_FAMILY",
    "CheckpointSupport",
    "DetectorFamily",
    "HFSupport",
    "families",
    "family_names",
    "family_of_model",
    "family_of_state",
    "get_family",
    "register_family",
]

# The families shipped with the package: name -> the module whose import registers it.
BUILTIN_FAMILIES: dict[str, str] = {
    "detr": "detr_irpe.models.detr",
    "dab": "detr_irpe.models.dab",
    "rtdetr": "detr_irpe.models.rtdetr",
    "dfine": "detr_irpe.models.dfine",
    "deimv2": "detr_irpe.models.deimv2",
}
# The family of a config that names none (every config written before model.family).
DEFAULT_FAMILY = "detr"

FAMILIES: Registry[DetectorFamily] = Registry(
    "detector family",
    builtins=BUILTIN_FAMILIES,
    replaces=True,  # a module reloaded in a notebook registers its family again
    aliases=lambda family: family.aliases,
    error=ConfigError,
    key="model.family: ",
    advice=", or register yours from a module named in model.import",
)


@dataclass(frozen=True)
class HFSupport:
    """A family's Hugging Face ``save_pretrained`` folders.

    Attributes:
        model_type: ``config.json``'s ``model_type`` (``"detr"``, ``"dab-detr"``).
        base_config: the config the folder's settings go on top of (``detr_r50``).
        model_settings: ``config.json`` -> ``{model key: value}`` (raises
            :class:`~detr_irpe.errors.CheckpointError` for settings this family lacks).
        from_hf_keys: Hugging Face state dict -> this family's state dict (``(state,
            layout name)``).
        refusal: ``(state, cfg) -> why this model cannot be written for transformers``
            or None.
        config_json: ``cfg -> config.json`` mapping of a model to write (the labels are added
            by the generic writer).
        to_hf_keys: this family's state dict -> Hugging Face's.
        recognizes_hf_keys: whether a Hugging Face state dict is this family's.
        recipe_config: ``model settings -> the shipped config of the published size
            they name`` (``rtdetr_r18``, ``dfine_m``), or None: the recipe (data sizes,
            augmentation, losses, schedule) a folder of that size goes on top of instead
            of ``base_config``.
    """

    model_type: str
    base_config: str
    model_settings: Callable[[Mapping[str, Any]], dict[str, Any]]
    from_hf_keys: Callable[[Mapping[str, Tensor]], tuple[dict[str, Tensor], str]]
    recognizes_hf_keys: Callable[[Mapping[str, Any]], bool]
    refusal: Callable[[Mapping[str, Tensor], Any], str | None]
    config_json: Callable[[Any], dict[str, Any]]
    to_hf_keys: Callable[[Mapping[str, Tensor]], dict[str, Tensor]]
    recipe_config: Callable[[Mapping[str, Any]], str | None] | None = None


@dataclass(frozen=True)
class CheckpointSupport:
    """What a family's state dicts look like.

    Attributes:
        recognizes: whether a state dict (keys; values may be shapes' holders) is this
            family's.
        layout_name: the public layout of one of its state dicts (``detr``, ``irpe_detr``,
            ``dab_detr``, ``dn_dab_detr``): shown in messages and stored with conversions.
        num_classes: the class count of a state dict's class head (None: no head).
        architecture_readers: functions ``state -> {config key: value}``, each reading the
            settings one part of the model implies (a mismatch is reported by key).
        implied_config: ``(path, state, meta) -> (base config name, {key: value})`` for a
            file without a saved config (a public release), or None when it implies none.
        resize_class_head: ``(state, num_classes) -> note`` resizing every class-count
            tensor in place (None: the head needs no resizing, or the sizes agree).
        sigmoid_head: the class head has one sigmoid per class (a new row starts at the
            focal prior), not softmax rows.
        class_keys: ``state ->`` the weights (``.weight`` / ``.bias`` of linear heads,
            embeddings) whose rows follow the classes: re-initialised together when fine-tuning to another
            class count; the first is the one compared.
        kept_last_row: those of ``class_keys`` whose last row is no class and is kept
            (DN-DETR's matching-query content).
        encoder_attention_prefix: the key prefix of the encoder layers whose
            self-attention takes iRPE tables (``transformer.encoder.layers.``).
        derived_keys: entries of the published files that this family's models compute
            instead of storing (D-FINE's anchors for one input size): dropped when a file
            is loaded into a model without them.
    """

    recognizes: Callable[[Mapping[str, Any]], bool]
    layout_name: Callable[[Mapping[str, Any]], str]
    num_classes: Callable[[Mapping[str, Any]], int | None] = lambda state: None
    architecture_readers: tuple[Callable[[Mapping[str, Any]], dict[str, Any]], ...] = ()
    implied_config: Callable[[Any, Mapping[str, Any], Mapping[str, Any]],
                             tuple[str, dict[str, Any]] | None] | None = None
    resize_class_head: Callable[[dict[str, Any], int], str | None] | None = None
    sigmoid_head: bool = False
    class_keys: Callable[[Mapping[str, Any]], tuple[str, ...]] = (
        lambda state: ("class_embed.weight", "class_embed.bias"))
    kept_last_row: tuple[str, ...] = ()
    encoder_attention_prefix: str = "transformer.encoder.layers."
    derived_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class AttentionSupport:
    """Where the attention figures (``visualize.py``) find a family's attention modules.

    Attributes:
        encoder: ``model ->`` the encoder self-attention modules, in layer order: each an
            :class:`~detr_irpe.attention.MultiheadAttention` called with ``(query, key,
            value, hw, ...)`` on one ``H x W`` token grid (row-major), whose maps the
            encoder and iRPE-contribution figures draw ([]: no encoder figures).
        decoder: ``model ->`` the decoder cross-attention modules with dense weights
            ``(B, heads, Q, L)`` over the encoder grid (``nn.MultiheadAttention``, or a
            module with ``attention_weights(q, k, key_padding_mask, attn_mask)``); []: none.
        no_decoder_figure: why there is no decoder-attention figure when ``decoder`` is
            empty (``visualize all`` shows it; an explicit request is refused with it).
        grid_stride: input pixels per grid cell when the model pads its input itself to a
            multiple of it (RT-DETR: 32), so that the grid covers ``H * stride x W *
            stride`` pixels; None: the grid covers the padded batch evenly (DETR).
    """

    encoder: Callable[[nn.Module], list[nn.Module]]
    decoder: Callable[[nn.Module], list[nn.Module]] = lambda model: []
    no_decoder_figure: str = "the model has no dense decoder cross-attention"
    grid_stride: int | None = None


@dataclass(frozen=True)
class DetectorFamily:
    """Everything the package needs of one detector family.

    Attributes:
        name: the value of ``model.family``.
        title: the name shown to people (``"DETR"``).
        model_config: the dataclass of the ``model`` section (a subclass of
            :class:`detr_irpe.config.ModelConfig`).
        loss_config: the dataclass of the ``loss`` section (a subclass of
            :class:`detr_irpe.config.LossConfig`).
        build: ``(model section, loss section, load_backbone_weights, categories) ->
            (model, criterion, postprocessor)``.
        build_detector: ``(model section, load_backbone_weights) -> model``.
        build_postprocessor: ``(model section, categories) -> post-processor`` (outputs ->
            per-image ``scores``, ``labels`` (category ids), ``boxes`` (absolute xyxy));
            ``categories``: the category ids there are (a sigmoid head scores only those),
            or None.
        model_types: the ``nn.Module`` classes of its detectors (to tell a built model's
            family).
        describe: ``model section -> name`` of one configuration (``"DN-DAB-DETR"``);
            default: ``title``.
        checkpoint: its state-dict layouts (None: it reads only its own saved files).
        hf: its Hugging Face folders (None: none).
        onnx_wrapper: ``model -> nn.Module`` mapping ``images (N, 3, H, W)`` to
            ``(pred_logits, pred_boxes)`` for export; None: the package's default (an
            all-False padding mask).
        sigmoid_classes: its class head is one sigmoid per class (focal loss, no "no
            object" output), not a softmax.
        figures: the extra figure kinds of ``visualize.py`` it offers (``"anchors"``).
        benchmark_targets: ``{row name: config name}`` of the benchmark's model rows
            (``{"DETR": "detr_r50"}``).
        aliases: older spellings of the name (``model.decoder`` values).
        attention: where the attention figures find its attention modules (None: it has
            no attention figures; ``visualize all`` skips them).
        selected_queries: ``model -> the module whose num_queries picks the queries from
            the encoder's proposals`` (top-k, no learned query embedding: RT-DETR, D-FINE),
            or None for that module when a model has learned queries; None: the family's
            queries are learned (DETR). A mosaic canvas of k images is evaluated with k
            times the queries and detections of such a model (docs/evaluation.md).
        resize_rule: ``data section -> resize rule`` (:mod:`detr_irpe.resize`): how its
            images become model inputs (train and evaluation sizes, test sizes, canvases,
            the memory estimate); None: the rule ``data.augmentation``'s recipe was
            written for.
    """

    name: str
    title: str
    model_config: type
    loss_config: type
    build: Callable[..., tuple[nn.Module, nn.Module, nn.Module]]
    build_detector: Callable[[Any, bool], nn.Module]
    build_postprocessor: Callable[..., nn.Module]
    model_types: tuple[type, ...] = ()
    describe: Callable[[Any], str] | None = None
    checkpoint: CheckpointSupport | None = None
    hf: HFSupport | None = None
    onnx_wrapper: Callable[[nn.Module], nn.Module] | None = None
    sigmoid_classes: bool = False
    figures: tuple[str, ...] = ()
    benchmark_targets: Mapping[str, str] = field(default_factory=dict)
    aliases: Sequence[str] = ()
    attention: AttentionSupport | None = None
    selected_queries: Callable[[nn.Module], nn.Module | None] | None = None
    resize_rule: Callable[[Any], Any] | None = None

    def name_of(self, model_cfg: Any) -> str:
        """The name of one configuration of this family (``DN-DAB-DETR``)."""
        return self.describe(model_cfg) if self.describe is not None else self.title


def register_family(family: DetectorFamily) -> DetectorFamily:
    """Make ``family`` available as ``model.family: <name>``.

    Registering the same name again replaces the entry (a module reloaded in a notebook);
    a name that is another family's alias is refused.
    """
    return FAMILIES.register(family.name, family)


def family_names() -> list[str]:
    """Every family's name: the built-in ones and those registered so far."""
    return sorted(FAMILIES.names())


def families() -> Iterator[DetectorFamily]:
    """Every family (the built-in ones loaded), in name order."""
    yield from sorted(FAMILIES.entries(), key=lambda family: family.name)


def get_family(name: str) -> DetectorFamily:
    """The family named ``name`` (or one of its aliases).

    Raises:
        ConfigError: no such family, naming the registered ones.
    """
    family = FAMILIES.find(name)
    if family is None:
        raise ConfigError(FAMILIES.unknown(name, family_names()))
    return family


def family_of_state(state: Mapping[str, Any]) -> DetectorFamily | None:
    """The family whose checkpoint layout ``state`` has, or None when none recognises it."""
    for family in families():
        if family.checkpoint is not None and family.checkpoint.recognizes(state):
            return family
    return None


def family_of_model(model: nn.Module) -> DetectorFamily | None:
    """The family of a built detector (its class, or a wrapper's ``module``)."""
    model = getattr(model, "module", model)
    for family in families():
        if family.model_types and isinstance(model, family.model_types):
            return family
    return None
