"""The printed tables of the benchmark CLIs: columns, one line per row, right-aligned.

A row is a dict keyed by the column names as the header prints them; the same dicts go to
``--json`` (:mod:`commlib.bench.record`), so a table and its JSON never disagree on a name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, Union

__all__ = ["Column", "header_line", "format_line", "names"]


@dataclasses.dataclass(frozen=True)
class Column:
    """``name`` (the header and the row's key), its ``width``, and how a value prints: a format
    spec (``".1f"``; ``"s"``: ``str(value)``) or a function; None prints ``missing``."""

    name: str
    width: int
    format: Union[str, Callable[[Any], str]] = ""
    missing: str = "-"

    def cell(self, value: object) -> str:
        if value is None:
            text = self.missing
        elif callable(self.format):
            text = self.format(value)
        elif self.format == "s":
            text = str(value)
        else:
            text = format(value, self.format)
        return f"{text:>{self.width}}"


def names(columns: Sequence[Column]) -> list:
    return [column.name for column in columns]


def header_line(columns: Sequence[Column]) -> str:
    return " ".join(f"{column.name:>{column.width}}" for column in columns)


def format_line(columns: Sequence[Column], row: Mapping[str, object]) -> str:
    return " ".join(column.cell(row[column.name]) for column in columns)
