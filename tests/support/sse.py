"""Reading a server-sent event stream back in tests."""

from __future__ import annotations

import httpx


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a whole SSE response, in order (`[DONE]` included)."""
    return [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
