"""``train.ema``: the moving average of the weights against its formula, and a run with it
stopped in the middle of an epoch and resumed giving the straight run's average bit for bit.

The formula (docs/training.md, "EMA"): after update n, every floating-point state-dict
entry is ``d_n * ema + (1 - d_n) * weights`` with ``d_n = decay * (1 - exp(-n / warmup))``.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.checkpoint.files import read_checkpoint
from detr_irpe.config import ConfigError
from detr_irpe.engine.ema import ModelEma, ema_decay
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import CheckpointError, Interrupted
from detr_irpe.run_folder.checkpoints import BEST, LAST, read_training_checkpoint


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def test_decay_ramps_up_as_the_formula() -> None:
    for n in (1, 2, 10, 2000, 50_000):
        assert ema_decay(n, 0.9999, 2000) == pytest.approx(0.9999 * (1 - math.exp(-n / 2000)),
                                                           rel=1e-15)
    assert ema_decay(1, 0.99, 0) == 0.99  # no warm-up: the decay from the first update


def test_updates_follow_the_formula_in_float64() -> None:
    """Five updates towards ever new weights (parameters and BN statistics), against the
    formula applied entry by entry in Python floats."""
    model = _net()
    ema = ModelEma(model, decay=0.9, warmup=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    for n in range(1, 6):
        with torch.no_grad():
            for value in model.state_dict().values():
                if value.is_floating_point():
                    value.copy_(torch.randn(value.shape, generator=generator, dtype=value.dtype))
        d = 0.9 * (1 - math.exp(-n / 3))
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                expected[key] = d * expected[key] + (1 - d) * value
        ema.update(model)
    assert ema.updates == 5
    for key, value in ema.module.state_dict().items():
        if key.endswith("num_batches_tracked"):  # an integer buffer: kept as copied
            assert value == 0
            continue
        torch.testing.assert_close(value, expected[key], rtol=1e-14, atol=0, msg=key)


def test_the_average_has_no_gradients_and_is_in_eval_mode() -> None:
    model = _net().train()
    ema = ModelEma(model)
    assert not ema.module.training
    assert not any(p.requires_grad for p in ema.module.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the trained model is untouched


def test_a_wrapped_model_is_averaged_through_its_module() -> None:
    """DDP / DataParallel: the average is of the bare module (keys without ``module.``)."""
    model = _net()
    wrapped = nn.DataParallel(model)
    ema = ModelEma(wrapped, decay=0.5, warmup=0)
    assert ema.module.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(wrapped)
    torch.testing.assert_close(ema.module[0].weight, model[0].weight - 0.5, rtol=1e-14, atol=0)


def test_state_dict_round_trip_and_a_bad_one_is_named() -> None:
    model = _net()
    ema = ModelEma(model, decay=0.5, warmup=0)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    other = ModelEma(_net())
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1
    torch.testing.assert_close(other.module[0].weight, ema.module[0].weight, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="ckpt.pth: its 'ema' entry is not"):
        other.load_state_dict({"module": {}}, "ckpt.pth")
    bad = {"module": nn.Linear(2, 2).double().state_dict(), "updates": 3}
    with pytest.raises(CheckpointError, match="EMA weights do not fit"):
        other.load_state_dict(bad, "ckpt.pth")


@pytest.mark.parametrize("override", ["train.ema.decay=1.0", "train.ema.decay=-0.1",
                                      "train.ema.warmup=-1", "train.ema.rate=3"])
def test_bad_ema_settings_are_named(override: str) -> None:
    with pytest.raises(ConfigError, match="train.ema"):
        load_tiny_config(override)


# ----------------------------------------------------------------------------- a run
# 16 training images at batch 4: 4 steps per epoch; BN trains, dropout on: every state
# has to be restored for the average to come out the same.
_RUN = ["model.frozen_bn=false", "model.dropout=0.1", "train.epochs=2",
        "train.ema.enabled=true", "train.ema.decay=0.9", "train.ema.warmup=3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset

    root = tmp_path_factory.mktemp("synthetic_ema")
    generate_dataset(root, num_train=16, num_val=8, spec=SyntheticSpec(size=64), seed=0)
    return root


def _cfg(data: Path, out: Path, *extra: str):
    return load_tiny_config(f"data.root={data}", f"train.output_dir={out}", *_RUN, *extra)


def _sigterm_at_step(step: int):
    """An optimizer hook that sends this process SIGTERM before optimizer step ``step``
    (0-based): the run stops at the step boundary after it, with a checkpoint there."""
    seen = []

    def hook(optimizer, args, kwargs):
        if len(seen) == step:
            os.kill(os.getpid(), signal.SIGTERM)
        seen.append(step)

    return register_optimizer_step_pre_hook(hook)


@pytest.mark.slow  # three short training runs (~6 s)
def test_an_ema_run_stopped_mid_epoch_resumes_to_the_same_average(data, tmp_path) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_training(_cfg(data, straight), progress=False)

    handle = _sigterm_at_step(5)  # the second step of epoch 1
    try:
        with pytest.raises(Interrupted):
            run_training(_cfg(data, stopped), progress=False)
    finally:
        handle.remove()
    at_stop = read_training_checkpoint(stopped / LAST)
    assert (at_stop["epoch"], at_stop["batch_in_epoch"]) == (1, 2)
    assert at_stop["ema"]["updates"] == 6
    run_training(_cfg(data, stopped), progress=False)  # resumes from the mid-epoch save

    a, b = read_training_checkpoint(straight / LAST), read_training_checkpoint(stopped / LAST)
    assert a["ema"]["updates"] == b["ema"]["updates"] == a["iteration"] == 8
    assert a["ema"]["module"].keys() == b["ema"]["module"].keys() == a["model"].keys()
    for key, value in a["ema"]["module"].items():
        assert torch.equal(value, b["ema"]["module"][key]), key
    # the average is not the weights (decay 0.9 over 8 steps)
    differs = [k for k, v in a["model"].items()
               if v.is_floating_point() and not torch.equal(v, a["ema"]["module"][k])]
    assert differs


def test_eval_and_the_tools_read_the_ema_weights(data, tmp_path) -> None:
    """One epoch with EMA: the checkpoint holds both, the readers of every tool return the
    averaged weights, and the best checkpoint was chosen by evaluating them."""
    out = tmp_path / "run"
    result = run_training(_cfg(data, out, "train.epochs=1"), progress=False)
    raw = read_training_checkpoint(out / LAST)
    weights, meta = read_checkpoint(out / LAST)
    assert meta["weights"] == "ema" and meta["format"] == "detr_irpe"
    for key, value in raw["ema"]["module"].items():
        assert torch.equal(weights[key], value), key
    assert (out / BEST).exists() and raw["best_ap"] == result["best_ap"]
    log = (out / "train.log").read_text()
    assert "evaluation of the EMA weights" in log


@pytest.mark.slow  # two short training runs (~3 s)
def test_resuming_without_ema_drops_it_and_turning_it_on_starts_one(data, tmp_path, caplog):
    out = tmp_path / "run"
    run_training(_cfg(data, out, "train.epochs=1", "train.ema.enabled=false"), progress=False)
    assert "ema" not in read_training_checkpoint(out / LAST)
    with caplog.at_level("WARNING"):
        run_training(_cfg(data, out, "train.epochs=2"), progress=False, resume=out / LAST)
    assert "holds no EMA of the weights" in caplog.text
    assert read_training_checkpoint(out / LAST)["ema"]["updates"] == 4  # epoch 1's steps


# ----------------------------------------------------------------------------- tied tensors
def _tied(model: nn.Module) -> list[list[str]]:
    """The state-dict keys naming one tensor, in groups of two or more."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def _dfine_tiny() -> nn.Module:
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model

    torch.manual_seed(0)
    model, _, _ = build_model(load_config("dfine_tiny", ["model.num_classes=3"]),
                              load_backbone_weights=False)
    return model.double()


def test_tied_tensors_are_averaged_once_and_reg_scale_not_at_all() -> None:
    """D-FINE's ``up`` and ``reg_scale`` are each one parameter under two names. After n
    updates towards ever new weights, every entry (the tied ones under both names) is the
    closed-form average of its source, in float64; reg_scale keeps the value it started
    with (the published EMA does not average it: an integer tensor there)."""
    model = _dfine_tiny()
    assert sorted(map(sorted, _tied(model))) == [
        ["decoder.decoder.reg_scale", "decoder.reg_scale"], ["decoder.decoder.up", "decoder.up"]]
    ema = ModelEma(model, decay=0.9, warmup=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    scale = max(float(v.abs().max()) for v in expected.values() if v.is_floating_point())
    generator = torch.Generator().manual_seed(1)
    for n in range(1, 6):
        with torch.no_grad():  # every floating-point tensor (a tied one once) moves
            for value in {id(v): v for v in model.state_dict(keep_vars=True).values()}.values():
                if value.is_floating_point():
                    value.copy_(torch.randn(value.shape, generator=generator,
                                            dtype=value.dtype))
                    scale = max(scale, float(value.abs().max()))
        d = 0.9 * (1 - math.exp(-n / 3))
        for key, value in model.state_dict().items():
            if value.is_floating_point() and not key.endswith("reg_scale"):
                expected[key] = d * expected[key] + (1 - d) * value
        ema.update(model)
    got = ema.module.state_dict()
    # every value is a convex combination of values of magnitude <= scale; each update
    # rounds a multiply and an add (the formula here two of each): at most 4 float64
    # roundings of size <= eps * scale per update, 5 updates
    bound = 5 * 4 * torch.finfo(torch.float64).eps * scale
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=bound, msg=key)
    assert got["decoder.reg_scale"].item() == got["decoder.decoder.reg_scale"].item() == 4.0
    assert got["decoder.up"].item() != model.decoder.up.item()  # averaged, not copied


def test_an_average_saved_with_reg_scale_averaged_loads_with_the_weights_value(caplog) -> None:
    """An EMA saved before the fix (reg_scale averaged twice: near 8 at the start) keeps
    loading; its reg_scale is the weights' 4 again, logged."""
    model = _dfine_tiny()
    old = ModelEma(model, decay=0.9, warmup=0).state_dict()
    old["module"] = dict(old["module"])
    for key in ("decoder.reg_scale", "decoder.decoder.reg_scale"):
        old["module"][key] = torch.tensor([7.6], dtype=torch.float64)
    old["updates"] = 3
    ema = ModelEma(model, decay=0.9, warmup=0)
    with caplog.at_level("WARNING"):
        ema.load_state_dict(old, "old.pth")
    assert ema.updates == 3 and ema.module.decoder.reg_scale.item() == 4.0
    assert "old.pth: its EMA holds decoder.reg_scale" in caplog.text
    # an average saved now loads as it is, without a warning
    caplog.clear()
    again = ModelEma(model, decay=0.9, warmup=0)
    again.load_state_dict(ema.state_dict(), "new.pth")
    assert "new.pth" not in caplog.text
