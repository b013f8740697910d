"""What every engine option's check raises, and the checks the config objects share."""
from __future__ import annotations


class EngineConfigError(ValueError):
    """An invalid engine option; the message names the option."""


def _bad(owner: str, field: str, value, why: str):
    raise EngineConfigError(f"{owner}.{field}={value!r}: {why}")


def _positive(owner: str, **fields) -> None:
    for name, value in fields.items():
        if value is not None and (not _is_int(value) or value < 1):
            _bad(owner, name, value, "must be an integer >= 1")



def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
