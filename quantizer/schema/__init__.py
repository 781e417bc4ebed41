"""The checkpoint contract, with no torch: ``quantization_config`` (``config``), one module's
scheme (``scheme``), and the methods a checkpoint can name (``methods``)."""
