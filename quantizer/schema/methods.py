"""The quantization methods a checkpoint's ``quantization_config.method`` can name, and what each
promises (calibration, the head, the codes verify may check). A method is one module in
``quantizer.methods`` plus one entry in :data:`METHODS`, like a format in ``formats/``. Importing
this module does not import torch, so the CLI lists the methods cheaply.

A method's module exposes a class taking ``(settings)`` whose objects have:

- ``calibration_record()``: what the run's ``quantization_config.calibration`` record adds for it;
- ``quantize(weight, stats, scheme, storage) -> (quantized, report entry)``: one weight [N, K] on
  the module's scheme, its grids as the format stores them (a ``methods.grid.Storage``), given its
  input statistic (None for an uncalibrated method);
- for a calibrated method, ``accumulator(in_features, device)``: a fresh statistic of a linear's
  input, fed by the layer-wise driver (``quantizer.quantization.layerwise``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import UnsupportedError


@dataclass(frozen=True)
class MethodInfo:
    name: str  # the --method value and quantization_config.method
    title: str  # its name on the model card
    module: str  # the module in quantizer.methods with its behaviour
    cls: str  # the class there
    calibrated: bool = False  # needs calibration text and the layer-wise driver
    default_nsamples: int | None = None  # calibration windows when the user gives none
    unties_head: bool = False  # quantizes the head on its own inputs, so a tied head is untied
    nearest_codes: bool = False  # every code is its group grid's nearest point (verify checks it)
    searches_grids: bool = False  # its grids come from the weighted search, which may clip a group
    grid_search_setting: str | None = None  # ...or do when this calibration setting is true

    def make(self, settings=None):
        """The method object, with its own ``settings`` (None: its defaults)."""
        module = importlib.import_module(f"quantizer.methods.{self.module}")
        return getattr(module, self.cls)(settings)

    def searched_grids(self, calibration: dict) -> bool:
        """Whether a run with this ``quantization_config.calibration`` chose grids by the search."""
        return self.searches_grids or bool(self.grid_search_setting and calibration.get(self.grid_search_setting))


METHODS = {m.name: m for m in (
    MethodInfo("minmax", "round-to-nearest on the min/max grid", "rtn", "RoundToNearest", nearest_codes=True),
    MethodInfo("gptq", "GPTQ", "gptq_method", "GptqMethod", calibrated=True, default_nsamples=128, unties_head=True,
               grid_search_setting="weighted_grids"),
    MethodInfo("weighted", "activation-weighted rounding (grids searched on the inputs' mean squares, codes "
               "refined on their correlations)", "weighted", "WeightedRounding", calibrated=True, default_nsamples=16,
               searches_grids=True),
)}
NAMES = tuple(METHODS)
UNCALIBRATED = "minmax"  # the default method, and the one a calibrated run uses for what sees no activations


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise UnsupportedError(f"method {name!r} is not one of {', '.join(NAMES)}")
    return METHODS[name]
