"""Error statistics of a quantized weight against its source, accumulated over row chunks."""

from __future__ import annotations

import math

import torch


class ErrorStats:
    """Accumulates SNR (dB, signal power over error power) and max abs error over chunks."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.max_abs_err = 0.0

    def add(self, reference: torch.Tensor, approx: torch.Tensor) -> None:
        ref = reference.to(torch.float32)
        err = approx.to(torch.float32) - ref
        self.signal += ref.pow(2).sum().item()
        self.noise += err.pow(2).sum().item()
        if err.numel():
            self.max_abs_err = max(self.max_abs_err, err.abs().max().item())

    def add_sums(self, signal: float, noise: float, max_abs_err: float) -> None:
        """Add a chunk given by its sums of squared values and errors and its largest absolute error."""
        self.signal += signal
        self.noise += noise
        self.max_abs_err = max(self.max_abs_err, max_abs_err)

    @property
    def snr_db(self) -> float:
        if self.noise == 0:
            return float("inf")
        if self.signal == 0:
            return float("-inf")
        return 10.0 * math.log10(self.signal / self.noise)

    def as_dict(self) -> dict[str, float | None]:
        """JSON-ready: an exact tensor's infinite SNR becomes null."""
        snr = self.snr_db
        return {"snr_db": round(snr, 4) if math.isfinite(snr) else None, "max_abs_err": self.max_abs_err}
