"""What calibrated runs stand on: calibration windows (``windows``), the hooks that see a
layer's inputs (``capture``), the resumable state (``state``), and the ranks of a torchrun run
(``ranks``)."""
