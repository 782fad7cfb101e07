"""Deterministic weights for DEIMv2's HGNetv2 sizes (Atto, Femto, Pico, N), for comparisons
with the published code.

Every entry is ``deimv2_weights.deimv2_state_dict``'s (a function of its key and shape),
but two kinds:

- the matrices (convolutions) of the backbone and the encoder are
  ``dfine_weights.synthetic_value`` at gain 1.5 and 1.0 instead of 0.5: at 0.5 the
  twenty-odd ReLU convolutions of an HGNetv2 shrink the image's part of the maps below
  1e-6 of the biases', so that the detections would hardly depend on the backbone (at
  these gains the maps vary between the two seeded images by a fifth of their size);
- the entries of one shared tensor (the box head the Atto / Femto / Pico decoders share
between their layers: ``decoder.dec_bbox_head.{0,1,2}``) all take the value of the first
key that names it, so that loading the dict gives the same tensor whichever key is read
last. The script that ran the published code
(tests/reference_data/deimv2/make_deimv2_hgnet_official.py) used this function on the
published model, so no weight file is stored.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("deimv2_weights_hgnet_", _HERE / "deimv2_weights.py")
_weights = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_weights)
_synthetic = _weights._backbone.dfine_weights.synthetic_value

# the gains of the matrices under these top-level modules (module docstring)
GAINS = {"backbone": 1.5, "encoder": 1.0}


def hgnet_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The deterministic state dict of ``model`` (module docstring)."""
    state = model.state_dict(keep_vars=True)
    values = _weights.deimv2_state_dict({k: v.detach() for k, v in state.items()})
    for key, tensor in state.items():
        gain = GAINS.get(key.split(".", 1)[0])
        if gain is not None and tensor.is_floating_point() and tensor.dim() > 1:
            values[key] = _synthetic(key, tuple(tensor.shape), gain).to(tensor.dtype)
    first: dict[object, str] = {}
    for key, tensor in state.items():
        owner = first.setdefault(id(tensor), key)
        if owner != key:
            values[key] = values[owner].clone()
    return values
