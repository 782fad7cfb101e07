"""What a float64 comparison with data made by the published code on another CPU can
promise, for the ``*_official`` tests of RT-DETR and D-FINE / DEIM.

Two parts of those models are not float64. The anchors (:func:`~detr_irpe.models.hybrid.
decoder.generate_anchors`) are float32, as published, and their ``log`` is a float32
transcendental whose last bit depends on the CPU's vector code (torch's float32 ``log``
on an AVX2 AMD EPYC and on an AVX-512 Intel Xeon differ by one unit in the last place on
some anchors). One such ulp moves D-FINE-N's logits by 2e-10 and its boxes by 1.6e-8, more
than any float64 rounding. The denoising queries of a training forward go through a
float32 ``log`` too (the inverse sigmoid of the noised boxes; 2e-7 on the logits of the
denoising outputs). So the tests give the model the float32 values the data was made
with (:func:`reference_float32`), and what is left differs only in float64 roundings.

The D-FINE / DEIM data (an Intel Xeon) used the correctly rounded float32 ``log``
(float64 ``log`` rounded once): with it D-FINE-N's outputs equal the data to 1.3e-15.
The RT-DETR data used another one (that of an AVX2 CPU): its eval anchors are stored in
``rtdetr_official_anchors.pt`` (``make_rtdetr_official_anchors.py``).

The float64 rest (:func:`float64_tolerance`): a sum of ``n`` terms computed in another
order (other BLAS / convolution kernels, SIMD widths, thread splits) differs by at most
``2 * gamma_n * sum |terms|`` with ``gamma_n ~ n * u``, ``u = 2^-53`` (Higham, Accuracy
and Stability of Numerical Algorithms, 3.1). The networks are built of normalised layers
(batch / layer norm after each block), which keep activations, and the rounding they
carry, at the scale of the outputs; so an output differs by at most about ``depth`` such
terms, ``depth`` the number of weighted layers (each one reduction on the longest path,
an upper bound), ``n`` their largest fan-in and ``scale`` the largest output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor, nn

DATA = Path(__file__).resolve().parent / "reference_data"
U64 = 2.0**-53  # float64 unit roundoff


def float64_tolerance(model: nn.Module, reference: Tensor) -> float:
    """``2 * depth * n * u * scale``: the most two float64 evaluations of ``model`` that
    sum in other orders can differ by at an output of ``reference`` (module docstring)."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    fan_in = max(m.weight[0].numel() for m in layers)
    scale = max(float(reference.abs().max()), 1.0)
    return 2 * len(layers) * fan_in * U64 * scale


@contextmanager
def reference_float32(kind: str) -> Iterator[None]:
    """Inside: the RT-DETR / D-FINE models compute the float32 values the ``kind`` data
    (``"dfine"`` or ``"rtdetr"``) was made with, on any CPU: for ``"dfine"`` every float32
    ``torch.log`` (the anchors', and the denoising boxes' inverse sigmoid in training) is
    the correctly rounded one; for ``"rtdetr"`` the anchors are the stored ones (its eval
    data)."""
    from detr_irpe.models.hybrid import decoder as hybrid_decoder

    if kind == "dfine":
        log = torch.log

        def correctly_rounded_log(x: Tensor) -> Tensor:  # float64 log, rounded once
            return log(x.double()).float() if x.dtype == torch.float32 else log(x)

        with mock.patch.object(torch, "log", correctly_rounded_log):
            yield
        return
    original = hybrid_decoder.generate_anchors
    stored = torch.load(DATA / "rtdetr_official_anchors.pt", weights_only=True)

    def anchors(shapes, *args, **kwargs):
        values, valid = original(shapes, *args, **kwargs)
        key = "x".join(f"{h}_{w}" for h, w in shapes)
        saved = stored[key].to(values.device)
        assert torch.equal(saved.isinf(), values.isinf()), key
        return saved, valid

    with mock.patch.object(hybrid_decoder, "generate_anchors", anchors):
        yield


def training_targets() -> list[dict]:
    """The two images' targets the published code's training forwards were run with
    (the ``make_*_official.py`` scripts of D-FINE / DEIM and DEIMv2)."""
    f64 = torch.float64
    return [{"labels": torch.tensor([1, 4, 0]),
             "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.3], [0.25, 0.3, 0.2, 0.25],
                                    [0.7, 0.6, 0.1, 0.3]], dtype=f64)},
            {"labels": torch.tensor([2]),
             "boxes": torch.tensor([[0.4, 0.55, 0.5, 0.6]], dtype=f64)}]


def flat_outputs(out: Mapping, prefix: str = "",
                 skip: Callable[[str], bool] = lambda key: False) -> Iterator[tuple[str, Tensor]]:
    """``(dotted name, tensor)`` of a detector's output dict: nested dicts and lists of
    dicts (the auxiliary and denoising outputs) flattened, ``dn_meta`` and the tensors
    whose key ``skip`` names left out."""
    for key, value in out.items():
        if torch.is_tensor(value):
            if not skip(key):
                yield prefix + key, value
        elif isinstance(value, Mapping) and key != "dn_meta":
            yield from flat_outputs(value, f"{prefix}{key}.", skip)
        elif isinstance(value, list) and value and isinstance(value[0], Mapping):
            for i, item in enumerate(value):
                yield from flat_outputs(item, f"{prefix}{key}.{i}.", skip)


def assert_training_forward_equal(out: Mapping, ref: Mapping,
                                  tolerance: Callable[[Tensor], float],
                                  skip: Callable[[str], bool] = lambda key: False) -> None:
    """A training forward's outputs ``out`` (denoising on) against the published code's
    ``ref`` (``{"outputs": {name: tensor}, "dn_num_group", "dn_num_split",
    "dn_positive_idx"}``): the same names, each tensor within ``tolerance(reference)``,
    the same denoising groups and positive indices."""
    ours, theirs = dict(flat_outputs(out, skip=skip)), ref["outputs"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        # the published reg_scale is an int64 parameter (the YAML's 4), ours a float one
        torch.testing.assert_close(ours[key].detach(), value, rtol=0,
                                   atol=tolerance(value.double()),
                                   check_dtype=key != "reg_scale", msg=key)
    meta = out["dn_meta"]
    assert meta["dn_num_group"] == ref["dn_num_group"]
    assert list(meta["dn_num_split"]) == ref["dn_num_split"]
    for a, b in zip(meta["dn_positive_idx"], ref["dn_positive_idx"]):
        assert torch.equal(a, b)


__all__ = ["assert_training_forward_equal", "flat_outputs", "float64_tolerance",
           "reference_float32", "training_targets"]
