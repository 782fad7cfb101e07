"""A training step reads nothing back from the device outside the matcher, but for one
deliberate read: whether the summed loss is finite, right after the matcher (so that an
infinite loss stops the run before the optimizer step). Forward, loss and backward
queue work without waiting. On the CPU this is checked by making every read-back
(``.item()``, ``bool()``, ``int()``, ``float()``, ``.tolist()``, ``.numpy()``) raise
inside those regions, or counting them; ``tests/engine/test_train_gpu.py`` checks the same
regions on a GPU with ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pytest
import torch
from helpers import READ_BACKS, load_tiny_config, no_read_back

from detr_irpe.benchmark.model import synthetic_batch
from detr_irpe.engine.trainer import loss_and_backward, model_outputs, targets_to
from detr_irpe.models import build_model
from detr_irpe.models.dab.denoising import Denoising, build_denoising_queries

# The DETR decoder, DAB-DETR's and DN-DETR's (whose denoising queries come from the targets).
DECODERS = {
    "detr": (),
    "dab": ("model.family=dab",),
    "dn": ("model.family=dab", "model.denoising.enabled=true"),
}


def tiny_model_and_batch(num_classes: int = 4, *overrides: str):
    cfg = load_tiny_config(f"model.num_classes={num_classes}", *overrides)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    images, targets = synthetic_batch(2, 64, 64, num_classes=num_classes, objects=3)
    targets[1] = {k: v[:1] if k in ("boxes", "labels") else v for k, v in targets[1].items()}
    return model.train(), criterion.train(), images, targets


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_forward_loss_backward_read_nothing_back(monkeypatch, decoder: str) -> None:
    model, criterion, images, targets = tiny_model_and_batch(4, *DECODERS[decoder])
    device = torch.device("cpu")
    targets = targets_to(targets, device)
    with no_read_back(monkeypatch):
        outputs = model_outputs(model, images, device, "none", targets)
        norms = criterion.normalizers([targets], outputs["pred_logits"].shape[1], device)
    assert ("dn_outputs" in outputs) == (decoder == "dn")
    indices = criterion.match(outputs, targets)  # the one place that reads back (scipy)
    with no_read_back(monkeypatch):
        losses = loss_and_backward(criterion, outputs, targets, indices, norms)
    assert set(criterion.weight_dict) <= set(losses)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_check_catches_a_read_back(monkeypatch) -> None:
    """The fixture is not vacuous: an int() of a tensor (what a per-step label-range
    check does) is caught."""
    labels = torch.tensor([1, 2])
    with no_read_back(monkeypatch), pytest.raises(AssertionError, match="read-back"):
        int(labels.max())


def test_building_denoising_queries_reads_nothing_back(monkeypatch) -> None:
    """The pad S comes from the targets' lengths (host shapes), validity and the mask
    from device-side comparisons: no .item(), no nonzero, no boolean indexing."""
    _, _, _, targets = tiny_model_and_batch()
    label_enc = torch.nn.Embedding(5, 31)
    with no_read_back(monkeypatch):
        dn = build_denoising_queries(targets, Denoising(), label_enc, 4, num_queries=4)
    assert (dn.groups, dn.pad) == (5, 3) and dn.content.shape == (2, 15, 32)


def test_the_finite_loss_check_is_one_read(monkeypatch) -> None:
    """What a training step runs after the matcher (the loss check on) reads back exactly
    one value: the check of the summed loss, before the backward pass."""
    model, criterion, images, targets = tiny_model_and_batch()
    device = torch.device("cpu")
    targets = targets_to(targets, device)
    outputs = model_outputs(model, images, device, "none")
    norms = criterion.normalizers([targets], outputs["pred_logits"].shape[1], device)
    indices = criterion.match(outputs, targets)
    reads = []

    def count(name):
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            reads.append(name)
            return real(self, *args, **kwargs)
        return method

    with monkeypatch.context() as patch:
        for name in READ_BACKS:
            patch.setattr(torch.Tensor, name, count(name))
        loss_and_backward(criterion, outputs, targets, indices, norms, check_finite=True)
    assert reads == ["__bool__"]
