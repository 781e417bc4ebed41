"""The precisions a run's options leave open, decided before any work: the grid a format implies,
the vocabulary table's and the head's bits, and whether a tied head is written untied. Each
choice the user did not ask for becomes a note."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from ..formats import CheckpointFormat
from ..io.structure import ModelStructure
from ..schema.config import matches_ignore
from ..schema.methods import get_method
from ..schema.scheme import GROUPS_OF, KEPT_BITS
from .recipes import recipe_bits

if TYPE_CHECKING:
    from .planning import QuantizeOptions


def separate_head_ok(fmt: CheckpointFormat, model_dir: Path, config: dict) -> bool:
    """Whether the output can hold a head apart from a tied table (a GGUF only where llama.cpp's
    converter writes one for the architecture; its other checks run here too, before any work)."""
    if not fmt.single_file:
        return True
    from ..formats.gguf.converter import preflight

    return preflight(model_dir, config)


def implied_options(options: QuantizeOptions, structure: ModelStructure,
                    separate_head_ok: bool = True) -> tuple[QuantizeOptions, list[str]]:
    """The options with every precision decided (the table's and the head's bits, kept modules
    added to ``ignore``) and what the format and the method require; a note for each change the
    user did not ask for. Without ``separate_head_ok`` a tied head stays tied."""
    notes = []
    emb, head = structure.embedding, structure.head
    kept = tuple(o.pattern for o in options.overrides if o.bits == KEPT_BITS)
    options = dataclasses.replace(options, ignore=options.ignore + kept)
    fmt = options.output_format
    if options.symmetric is None:
        options = dataclasses.replace(options, symmetric=fmt.default_symmetric)
        if fmt.default_symmetric:
            notes.append(f"the {fmt.name} export uses a symmetric grid, the one every GPTQ loader accepts "
                         "(GPTQModel refuses asymmetric v1 checkpoints it did not write); --asym for transformers "
                         "(vLLM 0.32 refuses sym=False: --format awq is the asymmetric grid vLLM runs)")
    if fmt.head_bits and options.recipe != "all4":
        raise InputError(f"--gguf-type {options.gguf_type} and --recipe {options.recipe} both choose which modules get "
                         "more bits; keep one (--override refines either)")
    table = _table_bits(options, emb)
    if table != KEPT_BITS and emb and not fmt.quantizes_embedding:
        if options.embedding_bits is not None:
            raise InputError(f"the {fmt.name} format has no quantized vocabulary table; drop --embedding-bits")
        table = KEPT_BITS
        notes.append(f"the {fmt.name} format has no quantized vocabulary table: {emb} stays in bf16")
    source_tied = structure.tied and emb is not None and head is not None
    type_head = fmt.head_bits if options.head_bits is None and options.embedding_bits is None else None
    if source_tied and (not separate_head_ok or (type_head and not options.untie_head)):
        return _kept_tied(options, head, table, type_head, notes)
    return _head_bits(options, structure, table, type_head, source_tied, notes)


def _kept_tied(options: QuantizeOptions, head: str, table: int, type_head: int | None,
               notes: list[str]) -> tuple[QuantizeOptions, list[str]]:
    """A tied head that stays tied: where the file reads the head from the table, or where the
    file type gives the two one precision (GGUF's K_M mixtures, as llama-quantize)."""
    fmt = options.output_format
    if options.untie_head or options.head_bits not in (None, table):
        raise InputError(f"{fmt.title} files of this architecture read the head from the table, so {head} "
                         "cannot be untied: drop --untie-head and --head-bits")
    unties = get_method(options.method).unties_head
    if type_head:
        table = type_head
        if unties:
            notes.append(f"--gguf-type {options.gguf_type} keeps {head} tied to the table at {table} bits, as "
                         f"llama-quantize does; {options.method} quantizes the table on the head's inputs")
    elif unties:
        notes.append(f"{fmt.title} files of this architecture read the head from the table: {head} stays tied "
                     f"to it, and {options.method} quantizes the table without calibration")
    options = dataclasses.replace(options, head_bits=table, embedding_bits=table, keep_embedding=table == KEPT_BITS)
    return options, notes


def _head_bits(options: QuantizeOptions, structure: ModelStructure, table: int, type_head: int | None,
               source_tied: bool, notes: list[str]) -> tuple[QuantizeOptions, list[str]]:
    """The head's bits, and for a tied head whether it is written untied."""
    fmt, head = options.output_format, structure.head
    own_head = not source_tied or options.untie_head or get_method(options.method).unties_head
    head_bits = options.head_bits or type_head or (recipe_bits(options.recipe, head or "", True, 0) if own_head
                                                   else table)
    if fmt.head_kept_by_default and options.head_bits is None and not options.untie_head and head \
            and head_bits != KEPT_BITS:
        head_bits = KEPT_BITS
        notes.append(f"the {fmt.name} export keeps {head} in bf16, which transformers' GPTQ loader needs; "
                     "--head-bits 4 quantizes it for vLLM and GPTQModel")
    if head and matches_ignore(head, options.ignore):
        head_bits = KEPT_BITS
    options = dataclasses.replace(options, embedding_bits=table, head_bits=head_bits,
                                  keep_embedding=table == KEPT_BITS)
    if not source_tied:
        if head and head_bits == KEPT_BITS and not matches_ignore(head, options.ignore):
            options = dataclasses.replace(options, ignore=options.ignore + (head,))
        return options, notes
    if head_bits == KEPT_BITS and table != KEPT_BITS:
        raise InputError(f"{head} shares the table in this model, so it can stay in bf16 only with the table: "
                         "add --embedding-bits 16, or give the head 4 or 8 bits")
    calibrated_head = head_bits in GROUPS_OF and get_method(options.method).unties_head  # an 8-bit one is not solved
    untie = options.untie_head or head_bits != table or calibrated_head
    if untie and not options.untie_head:
        why = (f"{options.method} quantizes the head on its own inputs" if calibrated_head
               else f"{head} has {head_bits} bits and the table {table}")
        notes.append(f"{why}: {head} is written untied (tie_word_embeddings false)")
    return dataclasses.replace(options, untie_head=untie), notes


def _table_bits(options: QuantizeOptions, emb: str | None) -> int:
    if options.keep_embedding or (emb and matches_ignore(emb, options.ignore)):
        if options.embedding_bits not in (None, KEPT_BITS):
            raise InputError(f"--keep-embedding (or --ignore of the table) contradicts --embedding-bits "
                             f"{options.embedding_bits}")
        return KEPT_BITS
    return options.embedding_bits or recipe_bits(options.recipe, emb or "", True, 0)
