"""``int4q setup-gguf``: fetch llama.cpp's converter, which ``--format gguf`` writes through."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("setup-gguf")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path),
              help="Where to put it (then set INT4Q_LLAMA_CPP to this folder). Default: inside this Python "
                   "environment, where int4q looks first.")
def setup_gguf(dest):
    """Fetch llama.cpp's converter (convert_hf_to_gguf's code and its gguf-py writer) once, with pip,
    from llama-cpp-python's source distribution; --format gguf and --imatrix-out need it."""
    from ..formats.gguf.converter import default_location
    from ..formats.gguf.fetch import LLAMA_CPP_PYTHON, fetch_converter

    dest = dest or default_location()
    fetched = fetch_converter(dest)
    state = "fetched" if fetched else "already there"
    click.echo(f"llama.cpp's converter (llama-cpp-python {LLAMA_CPP_PYTHON}) {state} -> {dest}")
