"""Launch configurations of the 64-token pipeline's kernels, passed down as one object.

Each kernel file declares its shipped launch constants at its top (its named configs) and lists the ones a run
may change in ``LAUNCH_CONSTANTS``. A ``Launch`` holds overrides of some of them by name; the chunk plan carries
it (``ChunkPlan.launch``, from ``chunk64_kda(..., launch=...)``), the forward and backward hand it to every
launcher, and each launcher reads its constants through ``tiles.launch_values``. So a tuning run
(``benchmarks/tune_chunk64.py``) times a variant through the real pipeline without changing any module, and a call
without one runs the shipped configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from kdakit.ops.kda.chunk import finish, grads, grads_intra, intra, prep, walk

KERNEL_MODULES = (prep, intra, walk, grads, grads_intra, finish)
SHIPPED = MappingProxyType({name: getattr(m, name) for m in KERNEL_MODULES for name in m.LAUNCH_CONSTANTS})


@dataclass(frozen=True, eq=False)
class Launch:
    """Overrides of the kernels' launch constants by name (read-only); every other constant keeps its shipped
    value. Build it with ``launch_of``, which checks the names and the values' form."""

    overrides: Mapping[str, object]

    def get(self, name: str, default):
        return self.overrides.get(name, default)


def launch_of(overrides) -> Launch | None:
    """None (the shipped configs) for None or an empty mapping; a ``Launch`` as it is; else a mapping of
    ``LAUNCH_CONSTANTS`` names to values of the shipped value's form (an int for an int; a dict with the same keys,
    e.g. per operand kind, for a dict; a tuple of the same length for a tuple)."""
    if overrides is None or isinstance(overrides, Launch):
        return overrides
    if not isinstance(overrides, Mapping):
        raise TypeError(f"launch must be a mapping of launch-constant names to values, got {type(overrides).__name__}")
    if not overrides:
        return None
    unknown = sorted(set(overrides) - set(SHIPPED))
    if unknown:
        raise ValueError(f"launch names no launch constant: {unknown}; the constants are {sorted(SHIPPED)}")
    for name, value in overrides.items():
        _check_form(name, value, SHIPPED[name])
    frozen = {name: MappingProxyType(dict(v)) if isinstance(v, dict) else v for name, v in overrides.items()}
    return Launch(MappingProxyType(frozen))


def _check_form(name: str, value, shipped, any_length: bool = False) -> None:
    """``value`` has ``shipped``'s form; ``any_length``: a tuple of any length (the walks' candidate lists, whose
    shipped tuples differ in length between operand kinds)."""
    if isinstance(shipped, dict):
        if not isinstance(value, dict) or set(value) != set(shipped):
            raise ValueError(f"launch[{name!r}] must be a dict with keys {sorted(shipped)}, got {value!r}")
        lengths = {len(v) for v in shipped.values() if isinstance(v, tuple)}
        for key in shipped:
            _check_form(f"{name}[{key!r}]", value[key], shipped[key], len(lengths) > 1)
    elif isinstance(shipped, tuple):
        if not isinstance(value, tuple) or not value or (len(value) != len(shipped) and not any_length):
            raise ValueError(f"launch[{name!r}] must be a tuple like {shipped!r}, got {value!r}")
        for x in value:
            _check_form(name, x, shipped[0])
    elif isinstance(shipped, int) and not isinstance(shipped, bool):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"launch[{name!r}] must be a positive int, got {value!r}")
    else:
        raise TypeError(f"launch constant {name} has a form launch_of does not know: {shipped!r}")
