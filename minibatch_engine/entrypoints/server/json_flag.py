"""A command-line flag that takes a JSON object, as vLLM's ``--kv-events-config``
and ``--kv-transfer-config`` do: parsed, checked to be an object, and any key
the config does not know refused by name."""
from __future__ import annotations

import json


def json_object_flag(value, flag: str, known) -> dict:
    """``value`` (JSON text or a dict) as a dict whose keys are all in ``known``;
    otherwise a ValueError that names ``flag`` and the offending key(s)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    known = list(known)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return value
