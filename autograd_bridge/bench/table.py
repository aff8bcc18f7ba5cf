"""A printed table whose rows are also the JSON rows: columns named as the header prints them."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

__all__ = ["Table"]


class Table:
    """``add(row)`` prints the row (rank 0's ``say``) and keeps it; ``record()`` is its JSON part."""

    def __init__(self, title: str, columns: Sequence[str], say: Callable[[str], None], digits: int = 1):
        self.columns, self.say, self.digits = list(columns), say, digits
        self.rows: List[Dict[str, Any]] = []
        self.widths = [max(len(column), 8) for column in self.columns]
        say(f"# {title}")
        say(" ".join(f"{column:>{width}}" for column, width in zip(self.columns, self.widths)))

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        cells = (f"{self._cell(row.get(column)):>{width}}" for column, width in zip(self.columns, self.widths))
        self.say(" ".join(cells))

    def _cell(self, value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.{self.digits}f}" if abs(value) < 1e6 else f"{value:.3g}"
        return str(value)

    def record(self) -> Dict[str, List]:
        return {"columns": self.columns, "rows": self.rows}
