"""A position encoding from a plugin (tests/plugins/alibi2d_encoding.py, the example of
docs/position_encodings.md "An encoding of your own") runs through every tool: the config
(``model.encodings``), the attention (checked against a naive softmax with the bias), train,
eval with ``--sizes``, the optimizer's no-decay group, the checkpoint (consent to import),
ONNX export with a dynamic size, the position-response figure and the ablation table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tool

from detr_irpe.attention import MultiheadAttention
from detr_irpe.config import ConfigError, load_config
from detr_irpe.encodings import get_encoding
from detr_irpe.encodings.irpe import IRPEEncoding

PLUGINS = ROOT / "tests" / "plugins"
IRPE = "rpe-2.0-product-ctx-1-k"
ALIBI = ("model.import=alibi2d_encoding", "model.encodings.encoder=[sine, alibi2d-0.5]")


@pytest.fixture()
def plugin_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    import alibi2d_encoding

    return alibi2d_encoding


def _naive(attn: MultiheadAttention, x: torch.Tensor, hw: tuple[int, int],
           pad: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention written out, with the distance bias built by loops over the grid
    (independent of the plugin's vectorised form)."""
    batch, length, width = x.shape
    heads, dim = attn.num_heads, attn.head_dim
    q, k, v = torch.nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
    q, k, v = (t.reshape(batch, length, heads, dim).transpose(1, 2) for t in (q, k, v))
    logits = q @ k.transpose(-1, -2) / dim ** 0.5
    slopes = attn.encodings["alibi2d"].alibi_slopes
    cells = [(r, c) for r in range(hw[0]) for c in range(hw[1])]
    rows = []
    for ri, ci in cells:
        rows.append(torch.stack([((ri - rj) ** 2 + (ci - cj) ** 2) ** 0.5
                                 * torch.ones((), dtype=x.dtype) for rj, cj in cells]))
    distance = torch.stack(rows)
    logits = logits - slopes[None, :, None, None] * distance
    if pad is not None:
        logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    out = logits.softmax(-1) @ v
    return attn.out_proj(out.transpose(1, 2).reshape(batch, length, width))


@pytest.mark.parametrize("impl", ["auto", "sdpa", "explicit"])
@pytest.mark.parametrize("with_irpe", [False, True])
def test_the_attention_adds_the_plugin_s_term_forward_and_backward(
        plugin_path, impl: str, with_irpe: bool) -> None:
    """Against the naive softmax (iRPE tables at zero add nothing, so the same reference
    holds with them); padding masked; gradients of the input and the slopes agree."""
    torch.manual_seed(0)
    irpe = [IRPEEncoding(IRPE, 8, 2)] if with_irpe else []
    attn = MultiheadAttention(16, 2, impl=impl,
                              encodings=[*irpe, plugin_path.ALiBi2D(8, 2)]).double()
    hw = (3, 4)
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, -4:] = True
    out, _ = attn(x, x, x, hw, key_padding_mask=pad)
    ref = _naive(attn, x, hw, pad)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (x, attn.encodings["alibi2d"].alibi_slopes))
    refs = torch.autograd.grad(ref.square().sum(), (x, attn.encodings["alibi2d"].alibi_slopes))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b)
    assert grads[1].abs().sum() > 0  # the slopes learn


def test_the_plugin_s_term_moves_the_attention_off_the_blocked_core(plugin_path) -> None:
    attn = MultiheadAttention(16, 2, dropout=0.1,
                              encodings=[IRPEEncoding(IRPE, 8, 2), plugin_path.ALiBi2D(8, 2)])
    x = torch.randn(1, 12, 16)
    assert attn._impl_for(x[:, None], x[:, None], False) == "explicit"
    with pytest.raises(ValueError, match="plugin encoding's logit term"):
        MultiheadAttention(16, 2, impl="blocked", encodings=[plugin_path.ALiBi2D(8, 2)])(
            x, x, x, (3, 4))


def test_a_plugin_encoding_is_named_in_model_encodings(plugin_path) -> None:
    cfg = load_config("detr_irpe_tiny", list(ALIBI))
    assert cfg.model.encodings["encoder"] == ["sine", "alibi2d-0.5"]
    assert (cfg.model.rpe, cfg.model.rope, cfg.model.position_embedding) == ("none", "none",
                                                                               "sine")
    # a shorthand named later still wins for its kind, the plugin stays
    cfg = load_config("detr_irpe_tiny", [*ALIBI, f"model.rpe={IRPE}"])
    assert cfg.model.encodings["encoder"] == ["sine", "alibi2d-0.5", IRPE]
    assert get_encoding("alibi2d").title == "ALiBi-2D"
    for bad, named in (("alibi2d-0", "alibi2d scale must be > 0"),
                       ("alibi3d", "unknown encoding 'alibi3d'")):
        with pytest.raises(ConfigError, match=named):
            load_config("detr_irpe_tiny", [ALIBI[0], f"model.encodings.encoder=[{bad}]"])


@pytest.mark.parametrize("config", ["rtdetr_tiny", "dfine_tiny"])
def test_the_plugin_reaches_the_aifi_layer_of_rtdetr_and_dfine(plugin_path, config: str) -> None:
    """The families whose encoder is the hybrid encoder take the plugin from
    model.encodings as DETR does: its slopes sit in the AIFI self-attention, next to the
    config's iRPE (dfine_tiny's), and learn from the detection loss."""
    from detr_irpe.models import build_model
    from detr_irpe.structures import ImageBatch

    cfg = load_config(config, [*ALIBI, "model.num_classes=3", "model.backbone_weights=none"])
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    slopes = {k: v for k, v in model.named_parameters() if k.endswith(".alibi_slopes")}
    assert list(slopes) == ["encoder.encoder.0.layers.0.self_attn.encodings.alibi2d.alibi_slopes"]
    torch.manual_seed(0)
    batch = ImageBatch(torch.rand(2, 3, 64, 64), torch.zeros(2, 64, 64, dtype=torch.bool))
    targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.3]])}
               for _ in range(2)]
    model.train()
    losses = criterion(model(batch, targets), targets)
    total = sum(criterion.weight_dict[k] * v for k, v in losses.items()
                if k in criterion.weight_dict)
    (grad,) = torch.autograd.grad(total, list(slopes.values()))
    assert grad.abs().sum() > 0


def _data(tiny_dataset: Path) -> tuple[str, ...]:
    return (f"data.root={tiny_dataset}", "data.num_workers=0", "train.batch_size=4",
            "train.num_threads=1", "train.print_freq=1", "train.loggers=[]")


@pytest.fixture(scope="module")
def alibi_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch of detr_irpe_tiny with the plugin encoding, through tools/train.py."""
    sys.path.insert(0, str(PLUGINS))
    try:
        out = tmp_path_factory.mktemp("alibi")
        status = load_tool("train").main([
            "--config", "detr_irpe_tiny", "--no-progress", "--set", *ALIBI,
            *_data(tiny_dataset), "train.epochs=1", f"train.output_dir={out}"])
        assert status == 0
        return out
    finally:
        sys.path.remove(str(PLUGINS))


def test_train_eval_sizes_export_figure(alibi_run: Path, tiny_dataset: Path, plugin_path,
                                        tmp_path: Path) -> None:
    from detr_irpe.engine.optim import build_optimizer
    from detr_irpe.models import model_from_checkpoint

    ckpt = alibi_run / "checkpoint_last.pth"
    # the checkpoint's config names the plugin (imported again where it is rebuilt, with
    # consent: the mechanism of tests/integration/test_toy_family.py)
    loaded = model_from_checkpoint(ckpt, trust_imports=True)
    assert loaded.cfg.model.imports == ["alibi2d_encoding"]
    assert loaded.cfg.model.encodings["encoder"] == ["sine", "alibi2d-0.5"]
    slopes = [k for k in loaded.model.state_dict() if k.endswith(".alibi_slopes")]
    assert slopes == ["transformer.encoder.layers.0.self_attn.encodings.alibi2d.alibi_slopes"]
    # the slopes trained, in a group without weight decay
    start = plugin_path.ALiBi2D(8, 4, 0.5).alibi_slopes
    assert not torch.equal(loaded.model.state_dict()[slopes[0]], start)
    optimizer = build_optimizer(loaded.model, loaded.cfg.train)
    slope = dict(loaded.model.named_parameters())[slopes[0]]
    (group,) = [g for g in optimizer.param_groups if any(p is slope for p in g["params"])]
    assert group["weight_decay"] == 0.0
    # eval at two sizes
    out = tmp_path / "eval"
    assert load_tool("eval").main([str(ckpt), "--no-progress", "--output-dir", str(out),
                                   "--sizes", "64", "48x96", "--set",
                                   f"data.root={tiny_dataset}"]) == 0
    sizes = json.loads((out / "sizes.json").read_text())
    assert [row["size"] for row in sizes["sizes"]] == ["64", "48x96"]
    # the position-response figure has the plugin's panel
    figure = tmp_path / "response.png"
    assert load_tool("visualize").main(["position-response", "--checkpoint", str(ckpt),
                                        "--out", str(figure)]) == 0
    assert figure.is_file()
    from detr_irpe.visualization import encoder_position_responses

    responses = encoder_position_responses(loaded.model, extent=3)
    assert set(responses) == {"ALiBi-2D"}
    centre = responses["ALiBi-2D"][:, 3, 3]
    assert (centre == 0).all() and (responses["ALiBi-2D"][:, 0, 0] < 0).all()


@pytest.mark.slow  # a dynamic ONNX export and two onnxruntime runs (~10 s)
def test_export_with_a_dynamic_size(alibi_run: Path, plugin_path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    onnx_path = tmp_path / "alibi.onnx"
    assert load_tool("export").main([str(alibi_run / "checkpoint_last.pth"), "-o",
                                     str(onnx_path), "--size", "64x64", "--dynamic",
                                     "--check"]) == 0
    from detr_irpe.export.onnx import onnx_wrapper, run_onnx
    from detr_irpe.models import model_from_checkpoint

    model = model_from_checkpoint(alibi_run / "checkpoint_last.pth", trust_imports=True).model
    images = torch.rand(1, 3, 96, 128)  # not the traced size: the bias follows the grid
    logits, boxes = run_onnx(onnx_path, images)
    with torch.no_grad():
        ref_logits, ref_boxes = onnx_wrapper(model.eval())(images)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(boxes, ref_boxes, atol=2e-4, rtol=1e-4)


def test_the_docs_show_the_plugin_verbatim_and_their_figure_snippet_runs(
        plugin_path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "position_encodings.md").read_text()
    assert (PLUGINS / "alibi2d_encoding.py").read_text() in doc
    snippet = doc.split("drawn by:\n\n```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    exec(compile(snippet, "position_encodings.md", "exec"), {})
    assert (tmp_path / "docs" / "position_response.png").stat().st_size > 10_000
