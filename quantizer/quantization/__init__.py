"""The core call (``run.quantize_checkpoint``: a ``request.QuantizeRequest`` in, a
``report.QuantizeReport`` out), the plan, recipes, and the two runs: streamed round-to-nearest
(``streamed``) and the layer-by-layer calibrated run (``calibrated``, ``layerwise``)."""
