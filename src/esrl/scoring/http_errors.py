"""What esrl's HTTP clients (the scorer client, the Elo judge) share: which answers to retry, and how a
failure reads in one line of an error message."""

from __future__ import annotations

import json
from typing import Any

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
"""Answers worth another attempt (timeouts, rate limits, server errors); other 4xx answers are final."""


def exception_line(e: BaseException) -> str:
    """`TypeName: first line of the message`, for a transport error inside a one-line cause."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def response_detail(response: Any) -> str:
    """The first line (200 characters at most) of an error answer: FastAPI's `detail`, else the body, else the
    status reason."""
    try:
        detail = response.json().get("detail", "")
    except Exception:  # noqa: BLE001 - any non-JSON error page
        detail = response.text
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return text.strip().splitlines()[0][:200] if text.strip() else response.reason_phrase
