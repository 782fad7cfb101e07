"""The registry of position encodings: one entry per encoding says what the package needs.

A *position encoding* tells an attention where its tokens are. Each one is one entry
(:class:`PositionEncoding`), registered by its own module: the absolute ones
(:mod:`.absolute`: ``sine``, ``learned``), iRPE (:mod:`.irpe`: every ``rpe-...`` string)
and the rotary ones (:mod:`.rope`: ``rope-axial``, ``rope-mixed``; :mod:`.rope_dinov3`:
``rope-dinov3``), and a user's own from a
module named in ``model.import`` (docs/position_encodings.md, "An encoding of your own").

An entry answers every question the rest of the package asks of an encoding: which
strings are its own and what they mean (``parse``), how it shows (``describe``), the
config key that held it before ``model.encodings`` (``legacy_key``), what it needs of the
attention (``check``), the module it adds to an attention (``build``), which state-dict
keys are its parameters and whether they decay, how a checkpoint without a saved config
reveals it (``state_facts``), whether Hugging Face folders and ONNX can hold it, its figure
(``response``) and its benchmark rows. Config, checkpoints, export, the figures, the
benchmark and the ablation tables ask this registry; no code outside an encoding's module
names it.

Where an encoding acts (:data:`KINDS`):

- ``absolute``: a vector per token added to the queries and keys before the attention
  (the family computes it: DETR's is normalised by the unpadded extent, RT-DETR's is not);
- ``attention``: inside the attention, given the token grid ``(H, W)``: terms on the
  logits or values (iRPE, a distance bias) or a rotation of q and k (RoPE).

The store is a :class:`~detr_irpe.registry.Registry`, as the backbones' and the families'.
This module imports nothing of the package but :mod:`detr_irpe.errors` and
:mod:`detr_irpe.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from detr_irpe.errors import ConfigError
from detr_irpe.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = [
    "BACKBONE_PREFIX",
    "BUILTIN_ENCODINGS",
    "always_weighted",
    "KINDS",
    "PLACES",
    "PositionEncoding",
    "encoding_names",
    "encodings",
    "get_encoding",
    "in_backbone",
    "parse_encoding",
    "register_encoding",
]

KINDS = ("absolute", "attention")
# Where a model can take encodings (model.encodings keys).
PLACES = ("encoder", "backbone")
# The state-dict / module prefix of a detector's backbone: an attention encoding's
# parameters and modules under it are model.encodings.backbone's (a ViT backbone's), never
# the encoder's (model.rpe / model.rope). An absolute encoding's are the encoder's wherever
# they sit (DETR keeps its learned one in backbone.1).
BACKBONE_PREFIX = "backbone."

# The built-in encodings: registry name -> the module whose import registers it.
BUILTIN_ENCODINGS: dict[str, str] = {
    "sine": "detr_irpe.encodings.absolute",
    "learned": "detr_irpe.encodings.absolute",
    "irpe": "detr_irpe.encodings.irpe",
    "rope": "detr_irpe.encodings.rope",
    "rope_dinov3": "detr_irpe.encodings.rope_dinov3",
}

ENCODINGS: Registry[PositionEncoding] = Registry(
    "position encoding",
    builtins=BUILTIN_ENCODINGS,
    replaces=True,  # a module reloaded in a notebook registers its encoding again
    error=ConfigError,
)


def _no_keys(key: str) -> bool:
    return False


def in_backbone(name: str) -> bool:
    """Whether a state-dict key or module name is in the detector's backbone
    (:data:`BACKBONE_PREFIX`): an attention encoding there is the backbone place's."""
    return name.startswith(BACKBONE_PREFIX)


def always_weighted(spec: Any) -> bool:
    """``weightless`` of an encoding whose every spec has weights."""
    return False


def _no_facts(state: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class PositionEncoding:
    """Everything the package needs of one position encoding.

    Attributes:
        name: the registry name (``"rope"``); also the name of its module inside an
            attention (``self_attn.encodings.<name>``).
        title: the name shown to people (``"RoPE"``).
        kind: ``"absolute"`` or ``"attention"`` (:data:`KINDS`).
        parse: ``text -> spec`` for the strings that are this encoding's (a spec is any
            hashable value; its ``describe`` shows it), None for any other string. A
            string of its own form with a bad value raises ``ValueError`` naming it.
        describe: ``spec -> text`` (the canonical string: ``rope-axial``).
        syntax: the strings it takes, for error messages (``"rope-axial[-THETA]"``).
        legacy_key: the ``model.*`` key that held it before ``model.encodings`` (``rpe``,
            ``rope``, ``position_embedding``), or None (a plugin's).
        legacy_default: what a saved config that predates ``legacy_key`` meant by its
            absence (``position_embedding``: ``sine``; ``rope``: ``none``).
        model_spec: ``built model ->`` the spec of this encoding its attention layers hold
            (None: none holds it; ``ValueError`` when layers differ), for encodings a
            state dict cannot show exactly; None: not known from a built model.
        build: ``(spec, width, heads) -> module``, the entry of the attention's encoding
            list (kind ``attention``: an :class:`~detr_irpe.attention.AttentionEncoding`,
            built-in or plugin). None for absolute encodings.
        legacy_children: ``{old child: path in the entry}``: the attention's own
            submodules that held this encoding's parameters before issue 48 (iRPE:
            ``rpe_k`` -> ``encodings.irpe.rpe_k``; RoPE: ``rope`` ->
            ``encodings.rope``), for the key migration of :mod:`detr_irpe.attention.keys`.
        shared: the name one module of it takes when it serves every attention of a
            stack, kept once by the stack's owner (RoPE-DINOv3: ``rope_embed``, the
            published DINOv3 key; :meth:`~.config.PlaceEncodings.shared_encodings`);
            None: every attention keeps its own entry.
        computed_key: whether a state-dict key is a buffer it computes from its setting
            (RoPE-DINOv3's ``periods``): no weight, so a file's such entry is dropped by
            a model without it (logged) and a model with it keeps its own.
        check: ``(spec, width, heads) -> why it cannot run on that attention`` or None.
        param_key: whether a state-dict key is one of its parameters.
        no_weight_decay: its parameters never decay (RoPE-Mixed's frequencies).
        parameter_count: ``(spec, width, heads) ->`` its parameters in one attention
            ``width`` wide with ``heads`` heads (0: none).
        attached: ``(spec, skip) ->`` the spec as an attention with ``skip`` leading tokens
            outside the grid (a ViT's class and register tokens) holds it (iRPE: with its
            skip bucket); the spec itself by default.
        fresh_start: a checkpoint without any of its parameters loads into a model with
            them, which keep the values the model was built with (iRPE tables added to a
            plain model; RoPE-Mixed added for fine-tuning); false: a missing-keys error;
            ``"backbone"``: so only for its :attr:`backbone_key` parameters (``learned``:
            a ViT's ``pos_embed``; a DEIMv2 ViT's starts at zero).
        backbone_key: whether a state-dict key in the backbone is one of its parameters
            where :attr:`param_key` does not say so (``learned``: a ViT's ``pos_embed``);
            read only for the backbone place.
        about: what it is, in a few words, for messages (``"rotary position encodings"``).
        weightless: ``spec ->`` whether it has no weights (only a saved config says a
            checkpoint was trained with it).
        state_facts: ``state -> {config key: shown value}``: what a state dict without a
            saved config reveals of it (``{"model.rope": "rope-mixed"}``).
        implied: the encoding string a state dict with its parameters but without a saved
            config is read as (``rope-mixed``: its frequencies load whatever base they
            started from), or None when the parameters do not say the setting (iRPE).
        hf: Hugging Face folders can hold it (None: yes for every spec).
        hf_advice: what to do when they cannot (``": convert with --rpe none ..."``).
        onnx: ONNX export supports it.
        response: ``(attention module, extent, query, key) -> {title: (h, 2R+1, 2R+1)
            array}``, the logit term each head adds for a key at each offset in
            ``[-R, R]^2`` from a query (``query`` / ``key``: ``(h, D)`` vectors or None for
            ones); ``{}`` when the module does not have this encoding (the figure of
            ``visualize position-response``); None: no figure.
        response_extent: ``attention module -> R`` that shows the encoding whole (iRPE:
            where its buckets saturate), or None.
        benchmark: ``{row name: encoding string}`` of its rows in the encodings benchmark.
    """

    name: str
    title: str
    kind: str
    parse: Callable[[str], Any | None]
    describe: Callable[[Any], str]
    syntax: str = ""
    legacy_key: str | None = None
    legacy_default: str = "none"
    model_spec: Callable[[nn.Module], Any] | None = None
    build: Callable[[Any, int, int], nn.Module] | None = None
    legacy_children: Mapping[str, str] = field(default_factory=dict)
    shared: str | None = None
    computed_key: Callable[[str], bool] = _no_keys
    check: Callable[[Any, int, int], str | None] = lambda spec, width, heads: None
    param_key: Callable[[str], bool] = _no_keys
    no_weight_decay: bool = False
    fresh_start: bool | str = False
    backbone_key: Callable[[str], bool] = _no_keys
    parameter_count: Callable[[Any, int, int], int] = lambda spec, width, heads: 0
    attached: Callable[[Any, int], Any] = lambda spec, skip: spec
    about: str = ""
    weightless: Callable[[Any], bool] = lambda spec: True
    state_facts: Callable[[Mapping[str, Tensor]], dict[str, Any]] = _no_facts
    implied: str | None = None
    hf: Callable[[Any], bool] | None = None
    hf_advice: str = ""
    onnx: bool = True
    response: Callable[..., dict[str, Any]] | None = None
    response_extent: Callable[[nn.Module], int | None] = lambda attn: None
    benchmark: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"encoding {self.name!r}: kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "attention" and self.build is None:
            raise ValueError(f"encoding {self.name!r}: an attention encoding needs "
                             "build=(spec, width, heads) -> module")

    @property
    def can_be_weightless(self) -> bool:
        """Whether some spec of it has no weights (known by trying its syntax's specs is
        not possible in general: an encoding with weights says so by ``weightless``
        returning False for every spec; the built-in ones are checked by tests)."""
        return self.weightless is not always_weighted

    def fresh_key(self, key: str, backbone: bool) -> bool:
        """Whether ``key`` is one of its parameters in the backbone place (``backbone``)
        or the encoder's that start fresh where a file has none of them
        (:attr:`fresh_start`)."""
        if self.fresh_start is True:
            return self.param_key(key) or (backbone and self.backbone_key(key))
        return backbone and self.fresh_start == "backbone" and self.backbone_key(key)

    def holds_in_hf(self, spec: Any) -> bool:
        return self.hf is None or self.hf(spec)


def register_encoding(encoding: PositionEncoding) -> PositionEncoding:
    """Make ``encoding`` available in ``model.encodings`` (and ``model.<legacy_key>``).

    Registering the same name again replaces the entry (a module reloaded in a notebook).

    Raises:
        ValueError: a name that is not an identifier.
    """
    return ENCODINGS.register(encoding.name, encoding)


def encodings() -> Iterator[PositionEncoding]:
    """Every encoding: the built-in ones first (in :data:`BUILTIN_ENCODINGS` order, whichever
    module was imported first), then the registered ones, in order."""
    entries = {entry.name: entry for entry in ENCODINGS.entries()}
    for name in dict.fromkeys([*BUILTIN_ENCODINGS, *entries]):
        if name in entries:
            yield entries[name]


def encoding_names() -> list[str]:
    return [e.name for e in encodings()]


def get_encoding(name: str) -> PositionEncoding:
    """The encoding registered as ``name``.

    Raises:
        ConfigError: no such encoding, naming the registered ones.
    """
    return ENCODINGS.get(name)


def _syntax() -> str:
    return "; ".join(f"{e.title}: {e.syntax or e.name}" for e in encodings())


def parse_encoding(text: Any, key: str = "model.encodings") -> tuple[PositionEncoding, Any]:
    """``"rope-mixed-10"`` -> ``(entry, spec)``.

    Raises:
        ConfigError: not a string, a string no encoding takes, or a bad value of one's own
            form; naming ``key``, the value and the forms there are.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{key}: {text!r} is not an encoding string; one of: {_syntax()}")
    for entry in encodings():
        try:
            spec = entry.parse(text.strip())
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None
        if spec is not None:
            return entry, spec
    raise ConfigError(f"{key}: unknown encoding {text!r}; one of: {_syntax()} (or register "
                      "one from a module named in model.import)")
