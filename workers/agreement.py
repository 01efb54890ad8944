"""The step agreement: what every rank must hold the same before any of them updates its
weights. It is the global summed loss (the point the loss curve shows) and rank 0's
control (checkpoint, stop), so every rank acts on a control at the same step.

It is a sum over every rank of a two-value payload: [this rank's summed loss, the
control's code], the code 0 on every rank but 0. Where the step already makes a
collective that sums over every rank, the strategy carries the payload in it (DDP's first
gradient bucket, the squared-norm all-reduce of gradient clipping) and the agreement costs
no round trip of its own; elsewhere it is one small all-reduce of its own, in flight while
the gradients are clipped. Why it matters: as a collective of its own it made a DDP step
on CPU ranks measurably slower than the same loop without it (two synchronisation points a
step instead of one: each rank waits for the slowest twice), measured side by side under
torchrun (docs/benchmarks.md, part 1).

Either way the agreement completes before the update, with or after the gradient
collectives, so a peer lost during the step stops every survivor before its update; and
whichever carries it, every rank gets the same sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastrain.contracts.messages import Control

CONTROL_CODES = {Control.NONE: 0, Control.CHECKPOINT: 1, Control.STOP: 2, Control.LEAVE: 3}
_CONTROL_BY_CODE = {code: control for control, code in CONTROL_CODES.items()}


class StepAgreement:
    """One step's agreement. The strategy `offer`s this rank's loss as soon as it is known
    and may have a collective of its own carry the `payload` (then calls `carried` with
    the sum); `start` sends it on its own where none did; `wait` returns what every rank
    agreed on."""

    def __init__(self, control: Control = Control.NONE) -> None:
        self.control = control
        self._loss: torch.Tensor | None = None
        self._summed: torch.Tensor | None = None
        self._work: Any = None
        self.sent_alone = False
        """No collective of the step carried it: it took an all-reduce of its own."""

    def offer(self, loss: torch.Tensor) -> None:
        """This rank's summed loss of the step (a 0-dim tensor on the rank's device; zero
        where the rank reports no loss). Once carried or started, later offers change
        nothing."""
        if not self.settled:
            self._loss = loss.detach()

    @property
    def settled(self) -> bool:
        """A collective carries it or it was started on its own: nothing more to send."""
        return self._summed is not None

    def payload(self, dtype: torch.dtype) -> torch.Tensor:
        """What a carrying collective adds up over every rank: [loss, control code]."""
        if self._loss is None:
            raise RuntimeError("the step's loss must be offered before its agreement is sent")
        loss = self._loss.to(dtype)
        # Filled on the device, not copied from the host: a host-to-device copy of the
        # code would wait for the GPU's queued backward in the middle of DDP's comm hook.
        code = torch.full((), float(CONTROL_CODES[self.control]), dtype=dtype, device=loss.device)
        return torch.stack([loss, code])

    def carried(self, summed: torch.Tensor) -> None:
        """A collective over every rank summed `payload` (done by the time `wait` is called)."""
        self._summed = summed

    def start(self) -> None:
        """Its own all-reduce (asynchronous), unless a collective of the step carried it."""
        if self.settled:
            return
        packed = self.payload(torch.float64)
        self._work = dist.all_reduce(packed, async_op=True)
        self._summed, self.sent_alone = packed, True

    def wait(self) -> tuple[float, Control]:
        """The global summed loss and the control, the same on every rank."""
        self.start()
        if self._work is not None:
            self._work.wait()
            self._work = None
        assert self._summed is not None
        total, code = self._summed.tolist()  # the step's one host sync
        return float(total), _CONTROL_BY_CODE[round(code)]
