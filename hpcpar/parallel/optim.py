"""Optimizers and gradient clipping over any model's parameters (their settings and the
learning-rate schedule: ``optim_settings``).

SGD and AdamW follow ``torch.optim.SGD`` (momentum, no dampening, no Nesterov) and
``torch.optim.AdamW`` (bias correction, eps outside the square root, decoupled weight decay)
operation for operation, so float32 results agree with torch's to rounding. Weight decay
applies to matrices (embeddings and linear weights), not to norm weights or biases.
Every update is elementwise, so it runs on each rank's shard as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .errors import HpcparError
from .optim_settings import OptimizerSettings
from .params import Parameter

BLOCK = 1 << 15                 # elements per block of the AdamW update (L2-sized)
STATE_NAMES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies the gradients by (1 when off)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class Optimizer:
    """Per-parameter state (same shape as the shard) and the update of one step.

    ``params``: a list of ``Parameter``s, or a dict name -> Parameter (``named_parameters``),
    whose names ``state_dict`` uses (a list's parameters are named by their own ``name``).
    The state of each parameter is its own, whatever the names; a parameter listed twice is
    an error (a tied weight is one Parameter, stepped once)."""

    def __init__(self, settings: OptimizerSettings, params, xp):
        problems = settings.problems()
        if problems:
            raise HpcparError("invalid optimizer settings: " + "; ".join(problems))
        if isinstance(params, Mapping):
            self.names, params = list(params), list(params.values())
        else:
            params = list(params)
            self.names = [p.name for p in params]
        _check_params(params, self.names)
        self.s, self.params, self.xp = settings, params, xp
        self.state_names = STATE_NAMES[settings.optimizer]
        self.state: dict[Parameter, dict[str, object]] = {}     # by the object itself
        self.steps = 0                      # optimizer steps taken (AdamW's bias correction)
        # On the CPU the update runs block by block through one cache-sized scratch buffer:
        # it allocates nothing, and its ten elementwise passes read memory about once. A
        # device (a GPU, or the strict backend that stands in for one) takes each tensor
        # whole (one kernel per pass, not one per block).
        largest = max((p.master.size for p in params), default=1)
        self.block = BLOCK if xp is np else largest
        self._scratch = xp.empty(self.block, dtype=params[0].master.dtype) if params else None

    def state_of(self, p: Parameter) -> dict[str, object]:
        st = self.state.get(p)
        if st is None:
            st = self.state[p] = {k: self.xp.zeros_like(p.master) for k in self.state_names}
        return st

    def state_dict(self) -> dict[str, dict[str, object]]:
        """Each parameter's state (``exp_avg``, ``exp_avg_sq`` / ``momentum_buffer``, and
        ``step``, the optimizer steps taken, as torch keeps per parameter) by its name, as a
        checkpoint stores it; the names must be unique and non-empty."""
        _check_names(self.names)
        return {name: {**self.state_of(p), "step": self.steps}
                for name, p in zip(self.names, self.params)}

    def load_state_dict(self, states: Mapping[str, Mapping[str, object]]) -> None:
        """The state of each named parameter (shapes checked), taken as it is where it is
        already an array of this optimizer's module and dtype, else copied; and the step
        count, where the state has it (a checkpoint of the jobs keeps it apart)."""
        _check_names(self.names)
        missing = [n for n in self.names if n not in states]
        if missing:
            raise HpcparError(f"optimizer state: no state for {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        steps = {int(states[n]["step"]) for n in self.names if "step" in states[n]}
        if len(steps) > 1:
            raise HpcparError(f"optimizer state: the parameters' step counts differ "
                              f"({sorted(steps)}); load one optimizer's state_dict whole")
        if steps:                # AdamW's bias correction, SGD's first momentum step
            self.steps = steps.pop()
        for name, p in zip(self.names, self.params):
            st = {}
            for key in self.state_names:
                value = states[name][key]
                if tuple(value.shape) != tuple(p.master.shape):
                    raise HpcparError(f"optimizer state {name}/{key}: shape "
                                      f"{tuple(value.shape)}, the parameter's is "
                                      f"{tuple(p.master.shape)}")
                st[key] = self.xp.asarray(value, dtype=p.master.dtype)
            self.state[p] = st

    def zero_grad(self) -> None:
        """Zero every parameter's gradient (which begins a data-parallel step)."""
        for p in self.params:
            p.zero_grad()

    def step(self, lr: float | None = None, grad_scale: float = 1.0) -> None:
        """Update every parameter's master weights from its ``grad`` (multiplied by
        ``grad_scale`` first: the clip coefficient, over the loss scale), at ``lr``
        (default: the settings' lr); a 16-bit compute copy is refreshed from them
        (``Parameter.refresh``). Parameters held by a ``GradientReducer`` must have been
        summed over dp (its ``finish``) since the last step."""
        lr = self.s.lr if lr is None else lr
        for reducer in {id(p.reducer): p.reducer for p in self.params
                        if p.reducer is not None}.values():
            reducer.use_for_step()
        self.steps += 1
        for p in self.params:
            g = p.grad
            if grad_scale != 1.0:
                g *= grad_scale
            if self.s.optimizer == "sgd":
                self._sgd(p, g, lr)
            else:
                self._adamw(p, g, lr)
            p.refresh()                  # a 16-bit compute copy follows its master weights

    def _sgd(self, p: Parameter, g, lr: float) -> None:
        s = self.s
        if s.weight_decay and p.decay:
            g = g + s.weight_decay * p.master
        if s.momentum:
            st = self.state_of(p)
            buf = st["momentum_buffer"]
            if self.steps == 1:                       # torch: the buffer starts as the grad
                buf[...] = g
            else:
                buf *= s.momentum
                buf += g
            g = buf
        p.master -= lr * g

    def _adamw(self, p: Parameter, g, lr: float) -> None:
        """torch's single-tensor AdamW, elementwise, one block of elements at a time."""
        st = self.state_of(p)
        decay = 1.0 - lr * self.s.weight_decay if self.s.weight_decay and p.decay else 1.0
        arrays = [a.reshape(-1) for a in (p.master, g, st["exp_avg"], st["exp_avg_sq"])]
        for start in range(0, g.size, self.block):
            self._adamw_block(*(a[start:start + self.block] for a in arrays), lr, decay)

    def _adamw_block(self, w, g, m, v, lr: float, decay: float) -> None:
        s, xp = self.s, self.xp
        b1, b2 = s.betas
        if decay != 1.0:
            w *= decay
        tmp = self._scratch[:g.size]
        xp.subtract(g, m, out=tmp)                      # torch: exp_avg.lerp_(grad, 1 - b1)
        tmp *= 1.0 - b1
        m += tmp
        v *= b2                                         # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        bc1 = 1.0 - b1 ** self.steps
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.steps)
        xp.sqrt(v, out=tmp)                             # denom = sqrt(v) / sqrt(bc2) + eps
        tmp /= bc2_sqrt
        tmp += s.eps
        xp.divide(m, tmp, out=tmp)                      # param.addcdiv_(m, denom, -lr / bc1)
        tmp *= lr / bc1
        w -= tmp


def _check_params(params: list, names: list) -> None:
    seen: dict[int, int] = {}
    label = [repr(n) if n else f"item {i}" for i, n in enumerate(names)]
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise HpcparError(f"optimizer: {label[i]} is a {type(p).__name__}, not a Parameter "
                              f"(layer.parameters() or hp.named_parameters(model) lists them)")
        if id(p) in seen:
            raise HpcparError(f"optimizer: one parameter is listed twice, as {label[seen[id(p)]]}"
                              f" and {label[i]}; a tied weight is one Parameter: list it once")
        seen[id(p)] = i


def _check_names(names: list[str]) -> None:
    if any(not n for n in names) or len(set(names)) != len(names):
        raise HpcparError("optimizer state by name needs unique, non-empty parameter names: "
                          "build the optimizer from hp.named_parameters(model) (or "
                          "layer.named_parameters())")


def array_module(a):
    """The array module of ``a``: NumPy, CuPy, or the strict test backend's."""
    if hasattr(a, "__cuda_array_interface__"):
        import cupy
        return cupy
    if type(a).__module__ == "hpcpar.parallel.strict":
        from .strict import xp
        return xp
    import numpy
    return numpy


def AdamW(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, xp=None) -> Optimizer:
    """torch.optim.AdamW over ``params`` (a list, or a dict by name), with its defaults;
    the decay applies to the params whose ``decay`` is set (matrices: the layers make
    biases and norm weights without)."""
    settings = OptimizerSettings("adamw", lr=lr, betas=tuple(betas), eps=eps,
                                 weight_decay=weight_decay)
    params = params if isinstance(params, Mapping) else list(params)
    return Optimizer(settings, params, xp or _module_of(params))


def SGD(params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
        xp=None) -> Optimizer:
    """torch.optim.SGD over ``params`` (a list, or a dict by name; momentum without
    dampening)."""
    settings = OptimizerSettings("sgd", lr=lr, momentum=momentum, weight_decay=weight_decay)
    params = params if isinstance(params, Mapping) else list(params)
    return Optimizer(settings, params, xp or _module_of(params))


def _module_of(params):
    items = list(params.values()) if isinstance(params, Mapping) else list(params)
    if not items:
        raise HpcparError("optimizer: no parameters to optimize")
    first = items[0]
    return array_module(first.master if isinstance(first, Parameter) else first)


@dataclass
class LossScaler:
    """Dynamic loss scaling for float16 compute (torch.amp.GradScaler's rule): the loss is
    multiplied by ``scale`` so small gradients survive float16; a step whose gradients
    overflow is skipped and the scale halved; after ``growth_interval`` good steps in a row
    it doubles. Powers of two, so scaling and unscaling are exact."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale /= 2.0
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
