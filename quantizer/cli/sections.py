"""A click command whose ``--help`` lists its options in titled sections, in the order given,
followed by an epilogue of examples kept as written."""

from __future__ import annotations

import click


class SectionedCommand(click.Command):
    """``sections``: (title, [parameter names]) in the order ``--help`` shows them; options not
    named in any section are listed last under "Other options"."""

    def __init__(self, *args, sections: list[tuple[str, list[str]]] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = list(sections)
        known = {p.name for p in self.params}
        for title, names in self.sections:
            unknown = set(names) - known
            if unknown:
                raise ValueError(f"section {title!r} names unknown options {sorted(unknown)}")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        listed: set[str] = set()
        by_name = {p.name: p for p in self.get_params(ctx)}
        for title, names in self.sections:
            self._write_section(ctx, formatter, title, [by_name[n] for n in names if n in by_name])
            listed.update(names)
        rest = [p for p in self.get_params(ctx) if p.name not in listed]
        self._write_section(ctx, formatter, "Other options", rest)

    @staticmethod
    def _write_section(ctx, formatter, title: str, params) -> None:
        rows = [row for row in (p.get_help_record(ctx) for p in params) if row is not None]
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.epilog:
            formatter.write_paragraph()
            for line in self.epilog.strip("\n").splitlines():
                formatter.write_text(line) if not line.startswith("  ") else formatter.write(line + "\n")
