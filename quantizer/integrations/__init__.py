"""int4q inside other libraries: ``transformers`` registers cpu_int4 with ``from_pretrained`` when
imported."""
