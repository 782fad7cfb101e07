"""The published-size tier's facts and files: every published config of every family, the
file each one starts from written in its official layout, and the checks' small helpers.

A published file is not downloaded (no network in tests): its content is made here with
deterministic random weights, every floating-point entry a function of its key and shape
(:func:`tier_value`: the CRC-32 of the key seeds the draw, as in
``tests/models/dfine/dfine_weights.py``, whose constants it keeps as built), and written
the way the published code wrote it, quirks included:

- DETR-R50 (facebookresearch/detr): ``{"model": sd}``; its name carries the first hex
  digits of the file's SHA-256, which the cache checks, so the zoo entry is pointed at an
  address whose name carries this file's digest;
- iRPE-DETR, DAB-DETR, DN-DETR (their ``main.py``): ``{"model", "epoch", "args"}`` with
  ``args`` an ``argparse.Namespace`` (what ``safe_load`` must allow); DAB-DETR / DN-DETR
  files carry no config, ``args`` says what the layout cannot show;
- RT-DETR (the zoo releases): ``{"ema": {"module", "updates"}, "model", "last_epoch"}``,
  the EMA weights being the model;
- D-FINE (the converted releases): ``{"model": sd}``; DEIM and DEIMv2 (their solver's
  files): ``{"ema": {"module"}, "model"}``; all with the anchors of the 640 x 640 eval
  size (``decoder.anchors``, +inf at the invalid ones, and ``decoder.valid_mask``) and
  ``reg_scale`` an integer tensor (the published YAML's ``4``). DEIMv2's files also hold
  what its ViT computes (the RoPE periods; DINOv3's ``qkv.bias_mask``, 1 / 0 / 1 by
  thirds: the published code creates it full of NaN and only Meta's backbone file sets
  it), written as the model holds them.

The files of DEIMv2 and of D-FINE / DEIM L and X (:data:`CALIBRATED`) are drawn
well-conditioned (:func:`calibrated_norms`, :data:`CALIBRATED_DECODER_GAIN`): drawn as the
others are, their BatchNorm statistics, which no layer before a norm keeps in range, and
their decoders at He's gain move PyTorch's own float32 outputs from float64 by up to 4.5
(DEIMv2-S) and 3.9 (DEIM-X) (docs/testing.md, "What it found").

The ``_irpe`` / ``_rope`` configs have no published file: they start from their plain
model's (``--finetune dfine_s``), so their case loads the plain file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from helpers import ROOT, load_script

from detr_irpe.checkpoint import zoo
from detr_irpe.config import Config, load_config

# the comparisons' generator: its constants (FDR's up / reg_scale, ...) are kept as built
WEIGHTS = load_script("tests/models/dfine/dfine_weights.py")
# Matrices are drawn at sqrt(2) / sqrt(fan in), He's gain. The comparisons' 0.5 shrinks
# the signal layer by layer until the biases carry the network: at 640 the 300 best of
# RT-DETR-R18's 8400 encoder scores then span 5.6e-4, 1296 tokens lie within 1e-4 of the
# 300th, and float32 against float64 alone swaps 19 of the 300 queries. At sqrt(2) the
# 300 span 1.2 (0.94 for D-FINE-S), 2 tokens lie within 1e-4 of the 300th and float32
# keeps float64's queries (every output within 3e-4): the runtimes can be compared.
GAIN = math.sqrt(2.0)
REFERENCE = ROOT / "tests" / "reference_data"
# kept as built: the comparisons' constants and what DEIMv2's ViT computes (not weights)
KEPT_LEAVES = (*WEIGHTS.KEPT_LEAVES, "periods", "bias_mask")
# The calibrated files' decoder matrices are drawn at the comparisons' 0.5, not GAIN: at
# GAIN DEIMv2's SwiGLU layers (a product of two projections) and 4 layers of
# self-attention over 192 channels grow the query content until float32 alone moves the
# logits by 0.57 (DEIMv2-S at 640, its norms calibrated); at 0.5 by 1.6e-5. The selection
# happens before the decoder (the encoder's scores), so GAIN's reason for the other
# layers still holds.
CALIBRATED_DECODER_GAIN = 0.5
# The published files drawn well-conditioned (:func:`tier_weights`): drawn as the others
# are, their float32 logits differ from float64 by 4.5 (DEIMv2-S), 0.15 (D-FINE-L) .. 3.9
# (DEIM-X). The ``_irpe`` / ``_rope`` configs of these load the calibrated plain file.
# D-FINE / DEIM's HGNetv2 norms keep their drawn statistics (D-FINE's are frozen norms,
# which the calibration never touched): calibrated, DEIM-L's 80 backbone norms (X: 130)
# normalising by their batch statistics amplify float32's rounding until the encoder's
# output is off by 1.4e-3 of its size and one of DEIM-L's 300 selected queries swaps
# (its logits 1.4 from float64's); with them drawn, 4.7e-5 of the logits' size.
CALIBRATED = ("dfine_l", "dfine_x", "deim_l", "deim_x", "deimv2_s", "deimv2_l")
# the calibration images' side: DEIMv2's evaluation size
CALIBRATION_SIDE = 640


@dataclass(frozen=True)
class Case:
    """One published config.

    Attributes:
        config: the shipped config (``detr_irpe/configs/NAME.yaml``).
        family: ``model.family``.
        num_classes: the published class count (91 COCO ids, 80 remapped classes).
        zoo: the zoo name of the file it loads (its own or, for ``_irpe`` / ``_rope``, its
            plain model's); None where no address is published (DAB-DETR / DN-DETR:
            Google Drive folders).
        base: the config of that file (itself for a published model).
    """

    config: str
    family: str
    num_classes: int
    zoo: str | None
    base: str

    @property
    def published(self) -> bool:
        """Whether a published file is this config's own (not a plain model's)."""
        return self.base == self.config


def _cases() -> dict[str, Case]:
    cases: list[Case] = [
        Case("detr_r50", "detr", 91, "detr_r50", "detr_r50"),
        Case("detr_r50_irpe", "detr", 91, "detr_r50_irpe/rpe-2.0-product-ctx-1-k",
             "detr_r50_irpe"),
        Case("detr_r50_irpe_300e", "detr", 91, "detr_r50_irpe/rpe-2.0-product-ctx-1-k/300e",
             "detr_r50_irpe_300e"),
        Case("detr_r50_irpe_1.9", "detr", 91, "detr_r50_irpe/rpe-1.9-product-ctx-1-k",
             "detr_r50_irpe_1.9"),
    ]
    for name in ("dab_detr_r50", "dn_detr_r50"):
        cases += [Case(name, "dab", 91, None, name), Case(f"{name}_irpe", "dab", 91, None, name)]
    for depth in (18, 34, 50, 101):
        name = f"rtdetr_r{depth}"
        cases.append(Case(name, "rtdetr", 80, name, name))
        if depth in (18, 50):
            cases.append(Case(f"{name}_irpe", "rtdetr", 80, name, name))
    for variant in ("dfine", "deim"):
        for size in "nsmlx":
            name = f"{variant}_{size}"
            cases.append(Case(name, "dfine", 80, name, name))
            if size in "sl":
                cases += [Case(f"{name}_{enc}", "dfine", 80, name, name) for enc in ("irpe", "rope")]
    # DEIMv2: S (ViT-Tiny) and L (DINOv3 ViT-S); M and X are the same architectures wider
    cases += [Case(f"deimv2_{size}", "deimv2", 80, f"deimv2_{size}", f"deimv2_{size}")
              for size in "sl"]
    return {case.config: case for case in cases}


# the families that resize to the ``data.eval_size`` square, and those whose published
# files store the anchors of that size
SQUARE_FAMILIES = ("rtdetr", "dfine", "deimv2")
ANCHOR_FAMILIES = ("dfine", "deimv2")


CASES: dict[str, Case] = _cases()

# The official key lists kept in tests/reference_data (key -> shape), by config.
_DFINE_KEY_LISTS = ("dfine_n", "dfine_s", "dfine_m", "dfine_l", "dfine_x", "deim_l", "deim_x")
_RTDETR_KEY_LISTS = {"rtdetr_r18": "r18", "rtdetr_r50": "r50"}


def official_keys(config: str) -> dict[str, tuple[int, ...]] | None:
    """``{key: shape}`` of the published model of ``config`` as the published code built
    it (``tests/reference_data/*_keys.json``), None where no list is kept."""
    import json

    if config in _DFINE_KEY_LISTS:
        entries = json.loads((REFERENCE / "dfine_official_keys.json").read_text())[config]["keys"]
    elif config.startswith("deimv2_"):
        entries = json.loads((REFERENCE / "deimv2" / "deimv2_official_keys.json").read_text())[
            config.split("_")[1]]["keys"].items()
    elif config in _RTDETR_KEY_LISTS:
        entries = json.loads((REFERENCE / "rtdetr_official_keys.json").read_text())[
            _RTDETR_KEY_LISTS[config]]
    else:
        return None
    return {key: tuple(shape) for key, shape in entries}


def load_case_config(case: Case, *overrides: str) -> Config:
    """The shipped config of ``case`` with the published class count."""
    return load_config(case.config, [f"model.num_classes={case.num_classes}", *overrides])


# ----------------------------------------------------------------------------- the files

def official_anchors(size: int, strides: tuple[int, ...], grid_size: float = 0.05,
                     eps: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchors a published D-FINE / DEIM decoder stores for a ``size`` x ``size`` eval
    input (written from the published rule): per level ``l`` of stride ``s``, a box at
    each cell's centre of side ``grid_size * 2**l``, in logit space; +inf where a
    coordinate is within ``eps`` of the image's border. ``(1, L, 4)`` and ``(1, L, 1)``."""
    boxes = []
    for level, stride in enumerate(strides):
        side = size // stride
        ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        centres = (torch.stack([xs, ys], -1).to(torch.float32) + 0.5) / side
        sides = torch.full_like(centres, grid_size * 2.0 ** level)
        boxes.append(torch.cat([centres, sides], -1).reshape(-1, 4))
    anchors = torch.cat(boxes)[None]
    valid = ((anchors > eps) & (anchors < 1 - eps)).all(-1, keepdim=True)
    anchors = torch.log(anchors / (1 - anchors))
    return torch.where(valid, anchors, torch.inf), valid


def tier_value(key: str, shape: tuple[int, ...], gain: float = GAIN) -> torch.Tensor:
    """The float64 value of state-dict entry ``key`` of ``shape``: seeded by the key's
    CRC-32; BatchNorm variances above 0.5, norm scales near 1, biases at 0.1 x N(0, 1),
    matrices at ``GAIN / sqrt(fan in)``. The decoder's ``enc_output.proj.bias`` is zero:
    RT-DETR / D-FINE zero the memory of the tokens at invalid anchors, which then score
    ``enc_output``'s bias alone; at zero they rank below the image's tokens, as trained
    models' do (with a random bias the 316 identical masked tokens of D-FINE-S tie at the
    300th place). ``gain``: the matrices' (:data:`GAIN` unless told)."""
    if key == "decoder.enc_output.proj.bias":
        return torch.zeros(shape, dtype=torch.float64)
    return WEIGHTS.synthetic_value(key, shape, gain=gain)


def synthetic_weights(model: torch.nn.Module, keep: Any = lambda key: True,
                      decoder_gain: float = GAIN) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` (the keys ``keep`` accepts) with :func:`tier_value`'s
    values in each entry's dtype (the matrices under ``decoder.`` at ``decoder_gain``);
    integer entries and the constants :data:`KEPT_LEAVES` (FDR's ``up`` / ``reg_scale``,
    DEIMv2's periods and mask, ...) as built. A tensor
    the model holds under two names (D-FINE's ``up``, DAB-DETR's shared box head) gets one
    value, its first name's, under both: a published file saves the same tensor twice."""
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for key, tensor in state.items():
        first.setdefault(id(tensor), key)
    # DEIMv2 has no enc_output: a masked token's score is enc_score_head's bias alone, the
    # same for the 316 of them; one value for every class keeps them below the image's
    # tokens (whose best class adds a positive projection), as D-FINE's zero bias does
    no_enc_output = "decoder.enc_output.proj.weight" not in state
    out = {}
    for key, value in state.items():
        if not keep(key):
            continue
        name = first[id(value)]
        if no_enc_output and name == "decoder.enc_score_head.bias":
            out[key] = torch.zeros_like(value)
        elif value.is_floating_point() and name.rsplit(".", 1)[-1] not in KEPT_LEAVES:
            gain = decoder_gain if name.startswith("decoder.") else GAIN
            out[key] = tier_value(name, tuple(value.shape), gain).to(value.dtype)
        else:
            out[key] = value.detach().clone()
    return out


def calibration_images(side: int = CALIBRATION_SIDE) -> torch.Tensor:
    """Two ``side`` x ``side`` images as the models see them (ImageNet-normalised,
    float64): what a photo looks like to a network, smooth colour fields (random colours
    on a 32-pixel grid, interpolated) with a little pixel noise, and standard normal noise
    (what the tier's checks feed the models besides photos). Seeded, so every process
    calibrates alike."""
    from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD  # noqa: PLC0415

    gen = torch.Generator().manual_seed(49)
    coarse = torch.rand(1, 3, side // 32, side // 32, generator=gen, dtype=torch.float64)
    smooth = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bilinear",
                                             align_corners=False)
    pixels = (smooth + 0.1 * torch.rand(1, 3, side, side, generator=gen,
                                        dtype=torch.float64)).clamp(0, 1)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    noise = torch.randn(1, 3, side, side, generator=gen, dtype=torch.float64)
    return torch.cat([(pixels - mean) / std, noise])


def calibrated_norms(model: torch.nn.Module, weights: dict[str, torch.Tensor],
                     images: torch.Tensor, skip: tuple[str, ...] = ()
                     ) -> dict[str, torch.Tensor]:
    """``weights`` with every BatchNorm's running mean and variance replaced by the
    per-channel mean and variance of what reaches it when ``model`` (a copy, in float64,
    holding ``weights``) runs on ``images`` with each norm's predecessors calibrated (one
    pass: each norm normalises by its batch's statistics and records them): every norm's
    output is then ``O(1)`` on such inputs, as a trained network's is. Random running
    statistics do not keep it so: DEIMv2-S's encoder then reaches 3e3 and its float32
    outputs differ from float64 by up to 4.5. The norms under the module prefixes ``skip``
    keep the statistics of ``weights``."""
    probe = copy.deepcopy(model)
    probe.load_state_dict(weights)
    probe.double().eval()
    norms = {name: module for name, module in probe.named_modules()
             if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
             and not name.startswith(skip)}
    for module in norms.values():
        module.reset_running_stats()
        module.momentum = None  # the cumulative average: one batch's statistics
        module.train()
    with torch.no_grad():
        probe(images.double())
    out = dict(weights)
    for name, module in norms.items():
        for stat in ("running_mean", "running_var"):
            key = f"{name}.{stat}"
            out[key] = getattr(module, stat).detach().to(weights[key].dtype).clone()
    return out


def tier_weights(case: Case, model: torch.nn.Module, keep: Any = lambda key: True
                 ) -> dict[str, torch.Tensor]:
    """The weights of ``case``'s published file (the keys ``keep`` accepts): those of
    :func:`synthetic_weights`; for :data:`CALIBRATED` files with the decoder drawn at
    :data:`CALIBRATED_DECODER_GAIN` and the norm statistics calibrated
    (:func:`calibrated_norms` on :func:`calibration_images`; D-FINE / DEIM's outside the
    backbone). An ``_irpe`` / ``_rope`` config's file is its plain model's, calibrated on
    the plain model (built here), not on ``model``: the same file as the plain config's."""
    if case.base not in CALIBRATED:
        return synthetic_weights(model, keep)
    if not case.published:
        from detr_irpe.models import build_model  # noqa: PLC0415

        base = CASES[case.base]
        plain, _, _ = build_model(load_case_config(base), load_backbone_weights=False)
        plain.eval()
        return {k: v for k, v in tier_weights(base, plain).items() if keep(k)}
    weights = synthetic_weights(model, keep, decoder_gain=CALIBRATED_DECODER_GAIN)
    skip = ("backbone.",) if case.family == "dfine" else ()
    return calibrated_norms(model, weights, calibration_images(), skip)


def _namespace_args(case: Case, cfg: Config) -> argparse.Namespace:
    """The ``args`` the official ``main.py`` saves, with the values this config has."""
    m = cfg.model
    if case.family == "detr":
        return argparse.Namespace(lr=1e-4, lr_backbone=1e-5, batch_size=2, epochs=150,
                                  backbone="resnet50", dilation=False, hidden_dim=m.hidden_dim,
                                  nheads=m.nheads, num_queries=m.num_queries,
                                  enc_rpe2d=m.rpe, position_embedding="sine")
    denoising = case.config.startswith("dn_")
    args = argparse.Namespace(
        modelname="dn_dab_detr" if denoising else "dab_detr", lr=1e-4, lr_backbone=1e-5,
        batch_size=1, epochs=50, backbone="resnet50", dilation=False,
        position_embedding="sine", pe_temperatureH=20, pe_temperatureW=20,
        enc_layers=6, dec_layers=6, dim_feedforward=2048, hidden_dim=256, dropout=0.0,
        nheads=8, num_queries=300, num_patterns=0, transformer_activation="prelu",
        pre_norm=False, two_stage=False, batch_norm_type="FrozenBatchNorm2d")
    if denoising:
        args.use_dn = True
    return args


def official_checkpoint(case: Case, cfg: Config, weights: dict[str, torch.Tensor]
                        ) -> dict[str, Any]:
    """The content of the published file of ``case`` (its base model's), in the official
    layout (module docstring), holding ``weights`` (this project's state dict)."""
    base = CASES[case.base]
    keys = official_keys(base.config)
    state = dict(weights)
    if base.family in ANCHOR_FAMILIES:
        anchors, valid = official_anchors(cfg.data.eval_size, cfg.model.detection_strides())
        state["decoder.anchors"], state["decoder.valid_mask"] = anchors, valid
        for key in ("decoder.reg_scale", "decoder.decoder.reg_scale"):
            state[key] = state[key].round().to(torch.int64)
    if keys is not None:  # the published order (the shapes are checked by the tests)
        state = {key: state[key] for key in keys}
    if base.family == "detr":
        if base.config == "detr_r50":
            return {"model": state}
        return {"model": state, "epoch": 149, "args": _namespace_args(base, cfg)}
    if base.family == "dab":
        return {"model": state, "epoch": 49, "args": _namespace_args(base, cfg)}
    if base.family == "rtdetr" or base.config.startswith("deim"):  # DEIM and DEIMv2
        # the training weights differ from the EMA in one tensor: the EMA must be read
        raw = dict(state)
        head = next(k for k in state if k.endswith("score_head.0.bias"))
        raw[head] = state[head] + 1.0
        out: dict[str, Any] = {"ema": {"module": state, "updates": 1000}, "model": raw}
        if base.family == "rtdetr":
            out["last_epoch"] = 71
        return out
    return {"model": state}


def ema_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a published file holds for the model (its EMA where it has one)."""
    return checkpoint["ema"]["module"] if "ema" in checkpoint else checkpoint["model"]


def write_published(case: Case, cfg: Config, weights: dict[str, torch.Tensor],
                    cache: Path, monkeypatch: Any) -> tuple[Path, dict[str, Any]]:
    """Write the published file of ``case`` where its zoo name is looked up (``cache``,
    torch.hub's ``checkpoints`` folder; DAB-DETR / DN-DETR files, which have no address,
    into ``cache``'s parent) and return its path and content. The DETR-R50 entry is
    pointed at an address whose name carries this file's SHA-256 prefix (``monkeypatch``:
    a ``pytest.MonkeyPatch``)."""
    checkpoint = official_checkpoint(case, cfg, weights)
    base = CASES[case.base]
    if base.zoo is None:
        path = cache.parent / f"{base.config}_official.pth"
    elif base.config == "detr_r50":
        tmp = cache / "detr-r50.tmp"
        torch.save(checkpoint, tmp)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]
        entry = zoo.ZOO[base.zoo]
        url = entry.url.rsplit("/", 1)[0] + f"/detr-r50-{digest}.pth"
        monkeypatch.setitem(zoo.ZOO, base.zoo, dataclasses.replace(entry, url=url))
        path = cache / zoo.ZOO[base.zoo].file_name
        tmp.rename(path)
        return path, checkpoint
    else:
        path = cache / zoo.ZOO[base.zoo].file_name
    torch.save(checkpoint, path)
    return path, checkpoint


# ----------------------------------------------------------------------------- the checks

def class_keys(state: dict[str, torch.Tensor], num_classes: int) -> list[str]:
    """The keys of ``state`` with a class dimension (a first dimension of the class count,
    DETR's ``+ 1`` or DN-DETR's ``label_enc``'s ``+ 1``): what fine-tuning replaces."""
    rows = {num_classes, num_classes + 1}
    return [k for k, v in state.items()
            if v.dim() >= 1 and v.shape[0] in rows and ("class" in k or "score_head" in k
                                                        or "label_enc" in k)]


def expected_input(case: Case, cfg: Config, height: int, width: int) -> tuple[int, int]:
    """The model input an image of ``height`` x ``width`` becomes at evaluation: the
    ``data.eval_size`` square (RT-DETR, D-FINE), or DETR's shorter side ``data.val_size``
    with the longer side scaled alike (within ``data.max_size``)."""
    if case.family in SQUARE_FAMILIES:
        return cfg.data.eval_size, cfg.data.eval_size
    short, long = sorted((height, width))
    size = cfg.data.val_size
    if long * size / short > cfg.data.max_size:
        size = int(round(cfg.data.max_size * short / long))
    other = int(size * long / short)  # the reference's rule truncates
    return (size, other) if height <= width else (other, size)


def unmatched_detections(a: list[dict], b: list[dict], score_tol: float, box_tol: float
                         ) -> list[dict]:
    """The detections of either list (COCO-style dicts) without a partner in the other:
    the same category, a score within ``score_tol`` and a box within ``box_tol`` pixels
    (each partner used once). Near the lowest kept score two lists may keep different
    members of a near tie: detections within ``score_tol`` of the higher of the two
    lists' lowest scores need no partner."""
    if not a or not b:
        return a + b
    floor = max(min(d["score"] for d in a), min(d["score"] for d in b)) + score_tol

    def unmatched(xs: list[dict], ys: list[dict]) -> list[dict]:
        pool = sorted(ys, key=lambda d: -d["score"])
        used = [False] * len(pool)
        missing = []
        for d in sorted(xs, key=lambda d: -d["score"]):
            if d["score"] <= floor:
                continue
            hit = next((i for i, e in enumerate(pool) if not used[i]
                        and e["category_id"] == d["category_id"]
                        and abs(e["score"] - d["score"]) <= score_tol
                        and max(abs(p - q) for p, q in zip(e["bbox"], d["bbox"])) <= box_tol),
                       None)
            if hit is None:
                missing.append(d)
            else:
                used[hit] = True
        return missing

    return unmatched(a, b) + unmatched(b, a)


def count_inf(tensor: torch.Tensor) -> int:
    return int(torch.isinf(tensor).sum())


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def float32_against_float64(model: torch.nn.Module, image: torch.Tensor
                            ) -> dict[str, tuple[float, float]]:
    """``model``'s float32 outputs on ``image`` (``(3, H, W)``) against those of a float64
    copy, queries paired as sets (the one-to-one pairing of least total difference over
    each query's logits and box, by scipy's assignment): for ``pred_logits`` and
    ``pred_boxes`` the largest difference of a pair and the float64 output's largest
    ``|value|``. Paired, because a near tie at a top-k may put two proposals in either
    order; a tie at the k-th place swaps a proposal, which the pairing then reports."""
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415

    exact = copy.deepcopy(model).double()
    single_input = image.float()
    with torch.no_grad():
        single = model([single_input])
        double = exact([single_input.double()])  # the same input, float32's rounding aside
    classes = double["pred_logits"].shape[-1]
    rows32 = torch.cat([single["pred_logits"][0], single["pred_boxes"][0]], -1).double()
    rows64 = torch.cat([double["pred_logits"][0], double["pred_boxes"][0]], -1)
    dist = torch.cdist(rows32, rows64, p=float("inf"))
    mine, theirs = linear_sum_assignment(dist.numpy())
    diff = (rows32[mine] - rows64[theirs]).abs()
    return {"pred_logits": (float(diff[:, :classes].max()),
                            float(double["pred_logits"].abs().max())),
            "pred_boxes": (float(diff[:, classes:].max()),
                           float(double["pred_boxes"].abs().max()))}
