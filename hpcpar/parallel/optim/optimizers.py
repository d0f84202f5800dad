"""Optimizers and gradient clipping over any model's parameters (their settings and the
learning-rate schedule: ``settings``).

SGD and AdamW follow ``torch.optim.SGD`` (momentum, no dampening, no Nesterov) and
``torch.optim.AdamW`` (bias correction, eps outside the square root, decoupled weight decay)
operation for operation, so float32 results agree with torch's to rounding. Weight decay
applies to matrices (embeddings and linear weights), not to norm weights or biases.
Every update is elementwise, so it runs on each rank's shard as it is, and on many tensors
at once: a step is a fixed number of passes over flat buffers (master weights, gradients and
each state one contiguous array per dtype, each parameter's a view; ``flat_layout``), the
gradient scale (clipping) and the weight decay among them, whatever the number of tensors;
with ``fused`` (torch's ``fused=True``) one kernel on a GPU (the update's math, written once:
``ops.optimizer_update``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..device.backend import array_module
from ..data_parallel.reducer import check_partial_sums, owes_partial_sum
from ..errors import HpcparError
from ..data_parallel.flat_buffers import Flat, spans
from ..ops import UpdateStep, optimizer_update
from .flat_layout import Group, group_parameters
from .settings import OptimizerSettings
from ..params import Parameter

BLOCK = 1 << 15                 # elements per block of the update on the CPU (L2-sized)
STATE_NAMES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies the gradients by (1 when off)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class Optimizer:
    """The update of one step over flat buffers, and each parameter's state (same shape as
    the parameter: a view of one of the state's buffers).

    ``params``: a list of ``Parameter``s, or a dict name -> Parameter (``named_parameters``),
    whose names ``state_dict`` uses (a list's parameters are named by their own ``name``).
    The state of each parameter is its own, whatever the names; a parameter listed twice is
    an error (a tied weight is one Parameter, stepped once).

    Made, it takes the parameters' arrays into flat buffers (``flat_layout``): each
    ``p.master`` (with ``p.data`` when it is the master), each separate 16-bit ``p.data``,
    and each ``p.grad`` that no ``GradientReducer`` holds, becomes a view of a buffer of its
    kind; gradients a reducer holds stay where they are, in its buffer (make the reducer
    first). Use the parameters' arrays through the parameters afterwards: an array taken
    from one before is a copy the optimizer no longer updates, and it is made read-only
    where the backend can (NumPy), so a write into it fails. Arrays assigned to a
    parameter later (``p.grad = g``) are refused at the next step; write in place."""

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
        # On the CPU each run of parameters is updated block by block through one
        # cache-sized scratch buffer: it allocates nothing, and the dozen elementwise passes
        # read memory about once (the 100m preset's AdamW step, one thread: 0.29 s; the
        # same passes over whole runs: 0.62-0.71 s; ``benchmarks/optimizer.py``). A device
        # (a GPU, or the strict backend that stands in for one) takes each run whole: one
        # kernel per pass, through a scratch made for the step (the memory pool hands it
        # to the next forward) rather than one held for good; with ``fused``
        # (``--fused-optimizer``) one kernel a run and no scratch (``ops.optimizer_update``).
        self.block = BLOCK if xp is np else None
        self.update = optimizer_update(xp, settings.fused)
        self.groups = group_parameters(xp, params, self.block, settings.weight_decay)
        self._bound = [(p, a, getattr(p, a)) for g in self.groups for p in g.params
                       for a in g.attrs]
        self._scratch = {}
        self._partial = [p for p in params if owes_partial_sum(p)]
        self._make_state()            # zeros, as torch's first step makes them

    def _make_state(self) -> None:
        """Every state's buffers (zeros); each parameter's state is views of them."""
        for g in self.groups:
            dtype = g.params[0].master.dtype
            g.states = {k: Flat(self.xp, [p.master.shape for p in g.params], dtype)
                        for k in self.state_names}
            for i, p in enumerate(g.params):
                self.state[p] = {k: flat.views[i] for k, flat in g.states.items()}

    def state_of(self, p: Parameter) -> dict[str, object]:
        return self.state[p]

    def state_dict(self) -> dict[str, dict[str, object]]:
        """Each parameter's state (``exp_avg``, ``exp_avg_sq`` / ``momentum_buffer``, and
        ``step``, the optimizer steps taken, as torch keeps per parameter) by its name, as a
        checkpoint stores it; the names must be unique and non-empty. The arrays are views
        of the optimizer's buffers: copy them to keep them."""
        _check_names(self.names)
        return {name: {**self.state_of(p), "step": self.steps}
                for name, p in zip(self.names, self.params)}

    def load_state_dict(self, states: Mapping[str, Mapping[str, object]]) -> None:
        """The state of each named parameter (shapes checked), copied into the optimizer's
        buffers; and the step count, where the state has it (a checkpoint of the jobs keeps
        it apart)."""
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
            for key in self.state_names:
                value = states[name][key]
                if tuple(value.shape) != tuple(p.master.shape):
                    raise HpcparError(f"optimizer state {name}/{key}: shape "
                                      f"{tuple(value.shape)}, the parameter's is "
                                      f"{tuple(p.master.shape)}")
                view = self.state_of(p)[key]
                view[...] = self.xp.asarray(value, dtype=view.dtype)   # host data: uploaded

    def zero_grad(self) -> None:
        """Zero every parameter's gradient (which begins a data-parallel step): one
        operation per gradient buffer."""
        for span in spans(self.params, "grad"):
            span[...] = 0
        for reducer in _reducers(self.params):
            reducer.step_begins()

    def step(self, lr: float | None = None, grad_scale: float = 1.0) -> None:
        """Update every parameter's master weights from its ``grad`` (multiplied by
        ``grad_scale`` first, in place: the clip coefficient, over the loss scale), at ``lr``
        (default: the settings' lr); a 16-bit compute copy is refreshed from them. Parameters
        held by a ``GradientReducer`` must have been summed over dp (its ``finish``) since
        the last step."""
        lr = self.s.lr if lr is None else lr
        self._check_bound()
        for reducer in _reducers(self.params):
            reducer.use_for_step()
        check_partial_sums(self._partial, self.params, "optimizer step")
        for p in self._partial:
            p.partial_summed = False
        self.steps += 1
        update = getattr(self.update, self.s.optimizer)
        step = UpdateStep(lr, self.steps, grad_scale)
        for g in self.groups:
            tmp = self._scratch_for(g)
            for run in g.runs:
                arrays = {**run.arrays, **g.state_spans(run)}
                for blk in run.blocks:
                    a = {k: v[blk.start:blk.stop] for k, v in arrays.items()}
                    update(a, self.s, step, blk,
                           None if tmp is None else tmp[:blk.stop - blk.start])

    def _scratch_for(self, g: Group):
        """The reference passes' scratch: a block's on the host (kept), a group's largest
        run on a device for this step (the pool hands it to the next forward); none for the
        fused kernel (the strict backend's stand-in for it makes its own)."""
        dtype = g.params[0].master.dtype
        if self.block is None:
            return None if self.s.fused else self.xp.empty(g.largest, dtype=dtype)
        if dtype not in self._scratch:
            self._scratch[dtype] = self.xp.empty(self.block, dtype=dtype)
        return self._scratch[dtype]

    def _check_bound(self) -> None:
        """Every array the optimizer steps is still the parameter's own (one assigned since
        would be left out of the update, or would not see it)."""
        for p, attr, array in self._bound:
            if getattr(p, attr) is not array:
                raise HpcparError(
                    f"optimizer: the {_WHAT[attr]} of parameter {_name(p, self.params)} is "
                    f"not the array the optimizer steps: a new array was assigned to it"
                    f"{_MOVED if attr == 'grad' else ''}; write into it in place "
                    f"(p.{attr}[...] = ..., p.{attr} += ...)")


_WHAT = {"grad": "gradient", "master": "master weights", "data": "compute copy"}
_MOVED = (" (or a GradientReducer made after the optimizer moved it into its buffer: make "
          "the reducer first)")


def _reducers(params: list) -> list:
    """The GradientReducers holding ``params``, each once."""
    return list({id(p.reducer): p.reducer for p in params if p.reducer is not None}.values())


def _name(p: Parameter, among: list) -> str:
    if p.name:
        return repr(p.name)
    index = next(i for i, q in enumerate(among) if q is p)
    return f"{index} of shape {tuple(p.master.shape)}"


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


def AdamW(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, xp=None, fused: bool = False) -> Optimizer:
    """torch.optim.AdamW over ``params`` (a list, or a dict by name), with its defaults;
    the decay applies to the params whose ``decay`` is set (matrices: the layers make
    biases and norm weights without). ``fused``: on a GPU the whole step is one kernel
    (not run on a GPU yet: off by default)."""
    settings = OptimizerSettings("adamw", lr=lr, betas=tuple(betas), eps=eps,
                                 weight_decay=weight_decay, fused=fused)
    params = params if isinstance(params, Mapping) else list(params)
    return Optimizer(settings, params, xp or _module_of(params))


def SGD(params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
        xp=None, fused: bool = False) -> Optimizer:
    """torch.optim.SGD over ``params`` (a list, or a dict by name; momentum without
    dampening); ``fused`` as ``AdamW``'s."""
    settings = OptimizerSettings("sgd", lr=lr, momentum=momentum, weight_decay=weight_decay,
                                 fused=fused)
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
