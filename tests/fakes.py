"""Training pieces that move the fake device clock (dtprofile.capture.clocks.FakeEventClock)."""

from __future__ import annotations

import torch
from torch import nn


class Advance(torch.autograd.Function):
    """Identity whose forward and backward move the fake device clock."""

    @staticmethod
    def forward(ctx, x, clock, fwd_ms, bwd_ms):
        ctx.clock, ctx.bwd_ms = clock, bwd_ms
        clock.advance(fwd_ms)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(ctx.bwd_ms)
        return grad, None, None, None


class TimedNet(nn.Module):
    def __init__(self, clock, fwd_ms=3.0, bwd_ms=7.0):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.clock, self.fwd_ms, self.bwd_ms = clock, fwd_ms, bwd_ms

    def forward(self, x):
        return Advance.apply(self.lin(x), self.clock, self.fwd_ms, self.bwd_ms)


class TimedSGD(torch.optim.SGD):
    def __init__(self, params, clock, ms=1.0):
        super().__init__(params, lr=0.01)
        self._clock, self._ms = clock, ms

    def step(self, closure=None):
        self._clock.advance(self._ms)
        return super().step(closure)
