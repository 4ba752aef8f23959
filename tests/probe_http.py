"""One GET of a probe endpoint, as the kubelet asks it: the status and the body (0 and the error while
nothing listens)."""

from __future__ import annotations

import urllib.error
import urllib.request


def probe_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:  # not listening (yet)
        return 0, str(error)
