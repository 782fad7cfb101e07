"""On a GPU (skipped without CUDA): fp16 with a GradScaler and bf16 train, checkpoint the
scaler and resume; a training step never waits for the GPU outside the matcher."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import load_tiny_config

from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_amp_training_on_gpu(tiny_dataset, tmp_path, amp):
    overrides = [f"data.root={tiny_dataset}", f"train.output_dir={tmp_path}", f"train.amp={amp}",
                 "train.device=cuda", "train.epochs=1"]
    result = run_training(load_tiny_config(*overrides), progress=False)
    assert result["iterations"] == 2 and len(result["summary"]["stats"]) == 12
    state = read_training_checkpoint(tmp_path / LAST)
    assert (state["scaler"] is not None) == (amp == "fp16")
    assert state["rng"][0]["cuda"], "the CUDA RNG state of the rank's device is saved"
    result = run_training(load_tiny_config(*overrides[:-1], "train.epochs=2"), progress=False)
    assert result["iterations"] == 4


# The DETR decoder, DAB-DETR's and DN-DETR's (whose denoising queries come from the targets).
DECODERS = {
    "detr": (),
    "dab": ("model.family=dab",),
    "dn": ("model.family=dab", "model.denoising.enabled=true"),
}


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_training_step_waits_for_the_gpu_only_in_the_matcher(decoder: str) -> None:
    """Forward, loss and backward raise on any host synchronisation; the matcher (scipy
    on the host) is the one accepted transfer, run between them. With denoising the
    queries are built from the targets inside the forward, so that path is checked too."""
    from detr_irpe.benchmark.model import synthetic_batch
    from detr_irpe.engine.trainer import loss_and_backward, model_outputs, targets_to
    from detr_irpe.models import build_model

    device = torch.device("cuda")
    cfg = load_tiny_config("model.num_classes=4", *DECODERS[decoder])
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model.to(device).train()
    criterion.to(device).train()
    images, targets = synthetic_batch(2, 64, 64, num_classes=4, objects=3)
    # images with different object counts: the denoising queries of image 1 are padded
    targets[1] = {k: v[:1] if k in ("boxes", "labels") else v for k, v in targets[1].items()}
    images, targets = images.to(device), targets_to(targets, device)

    def step(checked) -> dict:
        with checked():
            outputs = model_outputs(model, images, device, "none", targets)
            norms = criterion.normalizers([targets], outputs["pred_logits"].shape[1], device)
        indices = criterion.match(outputs, targets)
        with checked():
            loss_and_backward(criterion, outputs, targets, indices, norms)
        return outputs

    step(contextlib.nullcontext)  # warm-up: lazy CUDA / cuDNN initialisation may sync
    torch.cuda.synchronize()
    outputs = step(sync_error)
    torch.cuda.synchronize()
    assert ("dn_outputs" in outputs) == (decoder == "dn")
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@contextlib.contextmanager
def sync_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
