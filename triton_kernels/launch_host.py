"""A launch plan's own tensors and host steps, as the launch cache (launch.LaunchCache) replays them: a Scratch (a
buffer the plan allocated, allocated afresh each replay) and a HostStep (torch work on the host between or after the
launches, rebound to each call's tensors)."""
from __future__ import annotations

import torch


class Scratch:
    """A plan step declaring a tensor the plan allocated for its launches (a partial-sum buffer): run() does
    nothing; a replay (LaunchCache) allocates a fresh uninitialised one of the same shape, strides and dtype."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def run(self):
        pass


class HostStep:
    """A plan step run on the host between or after launches (torch ops on the plan's tensors). TENSORS names its
    tensor attributes: a replay (LaunchCache) rebinds each to the call's input or Scratch it was planned on."""

    TENSORS: tuple = ()

    def run(self):
        raise NotImplementedError


class _HostEntry(list):
    """A cache entry with Scratch or HostStep replays: fired with a list of the call's tensors, to which each
    Scratch replay appends its fresh tensor (index len(inputs) + j for the j-th)."""


class _ScratchReplay:
    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device

    def fire(self, tensors: list) -> None:
        tensors.append(torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device))


class _HostReplay:
    __slots__ = ("step", "slots")

    def __init__(self, step: HostStep, slots: tuple):
        self.step, self.slots = step, slots  # (attribute, index in the call's tensors)

    def fire(self, tensors: list) -> None:
        step = object.__new__(type(self.step))
        step.__dict__.update(self.step.__dict__)
        for name, i in self.slots:
            setattr(step, name, tensors[i])
        step.run()


def _scratch_index(t, tensors: tuple, scratch: list) -> int | None:
    """The index Scratch tensor t takes in a replay's tensors (after the inputs), or None where t is no Scratch."""
    for j, s in enumerate(scratch):
        if t is s:
            return len(tensors) + j
    return None


def _where(t, tensors: tuple, scratch: list) -> int | None:
    """The index a HostStep's tensor takes in a replay's tensors: a Scratch's, or the one input it is."""
    i = _scratch_index(t, tensors, scratch)
    if i is not None:
        return i
    found = [i for i, u in enumerate(tensors) if u is t]
    return found[0] if len(found) == 1 else None
