"""A fitted cost model: link parameters per class, read from and written to JSON, and choices.

The JSON a ``fit`` writes (seconds and seconds per byte)::

    {"format": "commlib-costmodel/1",
     "links": {"intra": {"alpha": ..., "beta": ...},
               "inter": {"alpha": ..., "beta": ..., "host_beta": ...}},
     "gamma": ..., "native_alpha": ..., "segment_bytes": 1048576,
     "call_overhead": {"ring": ..., ...},
     "fitted_on": {"hosts": 2, "ranks_per_host": [2, 2], "host_names": [...], "date": "..."},
     "samples": {...}}

``samples`` keeps the raw medians the parameters came from, so a fit can be checked later.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

from commlib.errors import InvalidUsageError
from commlib.selection.formulas import FORMULAS, Breakdown, Links, predict

__all__ = ["CostModel", "FORMAT"]

FORMAT = "commlib-costmodel/1"


@dataclasses.dataclass(frozen=True)
class CostModel:
    links: Links
    fitted_on: dict = dataclasses.field(default_factory=dict)
    samples: dict = dataclasses.field(default_factory=dict)

    # -- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        links = self.links
        return {
            "format": FORMAT,
            "links": {"intra": {"alpha": links.alpha_intra, "beta": links.beta_intra},
                      "inter": {"alpha": links.alpha_inter, "beta": links.beta_inter,
                                "host_beta": links.host_beta_inter}},
            "gamma": links.gamma, "native_alpha": links.native_alpha, "segment_bytes": links.segment_bytes,
            "call_overhead": dict(links.call_overhead),
            "fitted_on": self.fitted_on, "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "cost model") -> "CostModel":
        def number(value, where: str) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidUsageError(f"{source}: {where} must be a finite number >= 0, got {value!r}")
            return float(value)

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InvalidUsageError(f"{source}: not a commlib cost model (expected \"format\": \"{FORMAT}\")")
        try:
            intra, inter = data["links"]["intra"], data["links"]["inter"]
            links = Links(
                alpha_intra=number(intra["alpha"], "links.intra.alpha"),
                beta_intra=number(intra["beta"], "links.intra.beta"),
                alpha_inter=number(inter["alpha"], "links.inter.alpha"),
                beta_inter=number(inter["beta"], "links.inter.beta"),
                host_beta_inter=number(inter.get("host_beta", inter["beta"]), "links.inter.host_beta"),
                gamma=number(data["gamma"], "gamma"),
                native_alpha=number(data.get("native_alpha", 0.0), "native_alpha"),
                segment_bytes=int(number(data.get("segment_bytes", 1 << 20), "segment_bytes")) or 1,
                call_overhead=tuple((str(name), number(seconds, f"call_overhead.{name}"))
                                    for name, seconds in sorted(dict(data.get("call_overhead", {})).items())),
            )
        except (KeyError, TypeError) as missing:
            raise InvalidUsageError(f"{source}: missing field {missing}") from None
        return cls(links, dict(data.get("fitted_on", {})), dict(data.get("samples", {})))

    @classmethod
    def load(cls, path) -> "CostModel":
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise InvalidUsageError(f"cost model {path}: cannot read it: {error.strerror or error}") from None
        try:
            data = json.loads(text)
        except ValueError as error:
            raise InvalidUsageError(f"cost model {path}: not JSON: {error}") from None
        return cls.from_json(data, f"cost model {path}")

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    # -- using it ------------------------------------------------------------------------------
    def predict(self, nbytes: float, hosts: int, per_host: int) -> Dict[str, Breakdown]:
        if hosts < 1 or per_host < 1:
            raise InvalidUsageError(f"cost model: hosts and ranks per host must be >= 1, got {hosts}, {per_host}")
        return predict(self.links, nbytes, hosts, per_host)

    def choose(self, nbytes: float, hosts: int, per_host: int,
               available: Optional[Iterable[str]] = None) -> Tuple[str, str]:
        """The algorithm with the lowest predicted time, and a sentence saying why."""
        predicted = self.predict(nbytes, hosts, per_host)
        names = [name for name in FORMULAS if available is None or name in set(available)]
        if not names:
            raise InvalidUsageError("cost model: none of the modelled algorithms is available")
        ranked = sorted(names, key=lambda name: predicted[name].total)
        best = ranked[0]
        if hosts * per_host == 1:
            return "native", "a single rank: nothing to communicate"
        why = f"{best} has the lowest predicted time, {predicted[best].total * 1e6:.1f} us"
        if len(ranked) > 1:
            second = ranked[1]
            why += (f" against {second}'s {predicted[second].total * 1e6:.1f} us; {best}'s time is mostly "
                    f"{predicted[best].dominant()}, {second}'s {predicted[second].dominant()}")
        return best, why

    def native_threshold(self, hosts: int, per_host: int, available: Optional[Iterable[str]] = None) -> float:
        """The largest power-of-two size up to which every choice is ``native`` (-1: none)."""
        bound = -1
        size = 1
        while size <= 1 << 40:
            if self.choose(size, hosts, per_host, available)[0] != "native":
                return bound
            bound = size
            size *= 2
        return float("inf")
