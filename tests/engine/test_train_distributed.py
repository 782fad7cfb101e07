"""Two processes (torchrun, gloo) train exactly what one process trains with the same
global batch: the same gradients at every optimizer step, the same losses per epoch, the
same gathered evaluation.

Why it can hold: the distributed sampler splits one (seed, epoch) permutation
by stride, so the two ranks' k-th batches of 2 images together are the
single process's k-th batch of 4; augmentation is seeded per sample; the
criterion all-reduces the box count; DDP averages the gradients. BatchNorm is
frozen (per-process batch statistics would differ) and dropout is 0. Both runs
go through torchrun, so both use the distributed sampler's permutation. Every image
holds exactly 2 objects: the class loss is a weighted mean (the "no object" weight is
0.1) normalised per process by the sum of its weights, as in DETR, so the processes'
means average to the global one only when every process holds the same number of objects.

How it is compared: the sums run in another order on two processes, and AdamW turns
that float noise into whole steps (up to ``lr``) for weights whose gradient is ~0, so
comparing weights after training would compare noise. Each run records the gradients
every optimizer step is given (clipped, after DDP's averaging) and then sets them to zero
(``helpers.zeroing_gradient_recorder``): every step of both runs takes its gradients at
the same weights, and they must agree to float order (``helpers.FLOAT_ORDER_REL``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_close_to_scale

from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint

# tools/train.py's main, with the gradients of every optimizer step recorded (rank 0 saves
# them to argv[1]) and then set to zero on every rank (argv[2]: the tests folder).
_RECORDING_TRAIN = """
    import os
    import sys

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from detr_irpe.cli.train import main

    sys.path.insert(0, sys.argv[2])
    from helpers import zeroing_gradient_recorder

    rank0 = int(os.environ.get("RANK", "0")) == 0
    steps = []
    register_optimizer_step_pre_hook(zeroing_gradient_recorder(steps, keep=rank0))
    code = main(sys.argv[3:])
    if rank0:
        torch.save(steps, sys.argv[1])
    sys.exit(code)
"""


def _torchrun(nproc: int, data: Path, out: Path, batch_size: int) -> list[list[torch.Tensor]]:
    """Train in ``nproc`` processes; the gradients of every optimizer step (see above)."""
    script = out.parent / "train_recording.py"
    script.write_text(textwrap.dedent(_RECORDING_TRAIN))
    grads = out.parent / f"grads_{nproc}.pt"
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(script), str(grads), str(ROOT / "tests"),
        "--config", "synthetic_tiny",
        "--device", "cpu", "--output-dir", str(out), "--no-progress",
        "--set", f"data.root={data}", f"train.batch_size={batch_size}", "train.epochs=2",
        "model.frozen_bn=true", "model.dropout=0.0", "train.num_threads=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(grads, weights_only=True)


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


# two torchrun launches, four processes in all (~25 s on a busy machine)
@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    data = tmp_path / "data"
    # 16 / 8 images: divisible by the global batch, so no rank pads or drops anything.
    spec = SyntheticSpec(size=64, min_objects=2, max_objects=2, object_size=(0.2, 0.35))
    generate_dataset(data, num_train=16, num_val=8, spec=spec, seed=1)
    for split in ("train", "val"):
        annotations = json.loads((data / f"annotations/instances_{split}.json").read_text())
        per_image = [a["image_id"] for a in annotations["annotations"]]
        assert all(per_image.count(i["id"]) == 2 for i in annotations["images"])
    one, two = tmp_path / "one", tmp_path / "two"
    grads_one = _torchrun(1, data, one, batch_size=4)
    grads_two = _torchrun(2, data, two, batch_size=2)

    assert len(grads_one) == len(grads_two) == 8  # 4 steps per epoch in both
    for step, (a, b) in enumerate(zip(grads_one, grads_two)):
        assert len(a) == len(b)
        for k, (ga, gb) in enumerate(zip(a, b)):
            assert_close_to_scale(gb, ga, what=f"step {step}, parameter {k}")

    log_one, log_two = _log(one), _log(two)
    assert [r["epoch"] for r in log_one] == [r["epoch"] for r in log_two] == [0, 1]
    for a, b in zip(log_one, log_two):
        assert a["iteration"] == b["iteration"]
        for key in ("train_loss", "train_loss_ce", "train_loss_bbox", "train_loss_giou",
                    "test_loss", "test_loss_bbox"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
        # AP moves only where two scores, or an IoU and a threshold, lie within float
        # noise (~1e-6) of each other
        assert a["test_coco_eval_bbox"] == pytest.approx(b["test_coco_eval_bbox"], abs=1e-6)

    state_two = read_training_checkpoint(two / LAST)
    assert state_two["world_size"] == 2 and len(state_two["rng"]) == 2
    metrics_one = json.loads((one / "eval" / "metrics.json").read_text())
    metrics_two = json.loads((two / "eval" / "metrics.json").read_text())
    assert metrics_one["bbox"]["num_images"] == metrics_two["bbox"]["num_images"] == 8
    assert metrics_two["bbox"]["AP"] == pytest.approx(metrics_one["bbox"]["AP"], abs=1e-6)
