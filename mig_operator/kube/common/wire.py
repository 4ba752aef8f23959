"""JSON as it travels to and from the API server, on the hot path of every pod.

orjson decodes a watch event or an answer three to four times faster than the standard library
(bench/results/benchmark-history.md), and in a burst of pods the controller spends a sixth of its CPU decoding. It is
strict where the standard library is lenient (a lone surrogate, NaN): kube-apiserver writes neither,
but a line it refuses is decoded by the standard library rather than failing, so nothing a client
could write into an object ever stops a watch.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: str | bytes) -> Any:
    """Decode one JSON document (an answer, a watch event)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(value: Any) -> bytes:
    """Encode a request body as UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # a type orjson does not know (a subclass of str, an int past 64 bits)
        return json.dumps(value).encode()
