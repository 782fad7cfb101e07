"""An exponential moving average (EMA) of a model's weights (``train.ema``), as
RT-DETR trains: updated after every optimizer step, evaluated instead of the trained
weights, saved in the training checkpoint and resumed exactly.

After update ``n`` (counted from 1) every floating-point entry of the state dict
(parameters and buffers) becomes

    ema = d_n * ema + (1 - d_n) * weights,   d_n = decay * (1 - exp(-n / warmup)),

so the average follows the weights closely at first (``d_1`` is about
``decay / warmup``) and ever more slowly, ``d_n -> decay``. ``warmup = 0`` uses
``decay`` from the first update. Integer buffers (batch norm's counters) keep the
values of the copy the average started from. A tensor the state dict lists under two
names (D-FINE's ``decoder.up`` and ``decoder.decoder.up``, one parameter shared by two
modules) is averaged once. The entries a model names in ``EMA_FIXED`` (D-FINE's
``decoder.reg_scale``, an integer tensor in the published code, whose EMA averages
floating-point entries only) keep the values of the copy too, also when an average is
loaded. The average is of the bare module: a
model wrapped in ``DistributedDataParallel`` is averaged through its ``.module``, and
since every rank holds the same weights after each step, every rank's average is the
same.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.config import EmaConfig
from detr_irpe.errors import CheckpointError
from detr_irpe.utils.dist import unwrap_model

logger = logging.getLogger(__name__)


def ema_decay(updates: int, decay: float, warmup: int) -> float:
    """``d_n``: the share of the old average kept by update number ``updates`` (from 1)."""
    if warmup <= 0:
        return decay
    return decay * (1.0 - math.exp(-updates / warmup))


class ModelEma:
    """The moving average of ``model``'s weights (a copy of the bare module, in eval mode,
    without gradients).

    Attributes:
        module: the averaged model; evaluate and export this one.
        updates: the number of :meth:`update` calls so far (the checkpoint's ``updates``).
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: int = 2000) -> None:
        self.module = copy.deepcopy(unwrap_model(model)).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)
        self.decay = float(decay)
        self.warmup = int(warmup)
        self.updates = 0
        self._pairs: list[tuple[str, Tensor]] | None = None

    @classmethod
    def from_config(cls, model: nn.Module, cfg: EmaConfig) -> ModelEma:
        return cls(model, cfg.decay, cfg.warmup)

    def _fixed(self) -> dict[str, Tensor]:
        """The entries the module names in ``EMA_FIXED`` and every other name of the same
        tensors: ``{key: tensor shared with the module}``."""
        state = self.module.state_dict(keep_vars=True)
        fixed = {id(state[k]) for k in getattr(self.module, "EMA_FIXED", ()) if k in state}
        return {k: v for k, v in state.items() if id(v) in fixed}

    def _averaged(self) -> list[tuple[str, Tensor]]:
        """The floating-point entries of the average's state dict (tensors shared with it),
        each tensor once (under its first name), less the fixed ones."""
        if self._pairs is None:
            seen = {id(v) for v in self._fixed().values()}
            self._pairs = []
            for key, value in self.module.state_dict(keep_vars=True).items():
                if value.is_floating_point() and id(value) not in seen:
                    seen.add(id(value))
                    self._pairs.append((key, value))
        return self._pairs

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average towards ``model``'s current weights."""
        self.updates += 1
        d = ema_decay(self.updates, self.decay, self.warmup)
        weights = unwrap_model(model).state_dict()
        names = self._averaged()
        averaged = [v.detach() for _, v in names]
        current = [weights[k].detach() for k, _ in names]
        torch._foreach_mul_(averaged, d)
        torch._foreach_add_(averaged, current, alpha=1.0 - d)

    def state_dict(self) -> dict[str, Any]:
        """``{"module": state dict, "updates": n}``, the layout of RT-DETR's checkpoints."""
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any], where: str = "the checkpoint") -> None:
        """Take a :meth:`state_dict`'s weights and update count.

        Raises:
            CheckpointError: ``state`` is not ``{"module": state dict, "updates": n}`` of
                this model (naming ``where``).
        """
        module, updates = state.get("module"), state.get("updates")
        if not isinstance(module, Mapping) or not isinstance(updates, int):
            raise CheckpointError(
                f"{where}: its 'ema' entry is not {{'module': state dict, 'updates': int}}; "
                f"keys {sorted(map(str, state))}")
        kept = {k: v.detach().clone() for k, v in self._fixed().items()}
        try:
            self.module.load_state_dict(module)
        except RuntimeError as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(
                f"{where}: its EMA weights do not fit the model of this config ({first})"
            ) from None
        self._restore_fixed(kept, where)
        self.updates = updates

    @torch.no_grad()
    def _restore_fixed(self, kept: Mapping[str, Tensor], where: str) -> None:
        """Put back the fixed entries as they were before a load; an average saved while
        they were averaged (and shared ones twice) held other values: logged."""
        fixed = self._fixed()
        changed = [k for k, v in kept.items() if not torch.equal(fixed[k], v)]
        for key, value in kept.items():
            fixed[key].copy_(value)
        if changed:
            logger.warning("%s: its EMA holds %s at other values than the weights (saved "
                           "before the average left them alone); the weights' values are "
                           "used", where, ", ".join(changed))


__all__ = ["ModelEma", "ema_decay"]
