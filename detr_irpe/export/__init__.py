"""Export a trained detector (any family) for deployment: :mod:`.onnx` (images in, class logits and boxes out)."""

from detr_irpe.export.onnx import (
    IMAGE_INPUT,
    MIN_OPSET,
    OUTPUTS,
    ImagesToPredictions,
    check_input_size,
    export_onnx,
    onnx_wrapper,
    parse_size,
    run_onnx,
)

__all__ = [
    "IMAGE_INPUT",
    "MIN_OPSET",
    "OUTPUTS",
    "ImagesToPredictions",
    "check_input_size",
    "export_onnx",
    "onnx_wrapper",
    "parse_size",
    "run_onnx",
]
