"""Which browser pages may call the API: Starlette's CORS middleware, from `allowed_origins`."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from hotlora.server.http.request_ids import HEADER as REQUEST_ID_HEADER

ANY_PORT = ":*"


def cors_options(origins: list[str]) -> dict[str, Any]:
    """CORSMiddleware's arguments for these origins; one ending in `:*` matches any port."""
    exact = [origin for origin in origins if not origin.endswith(ANY_PORT)]
    any_port = [re.escape(o.removesuffix(ANY_PORT)) for o in origins if o.endswith(ANY_PORT)]
    return {
        "allow_origins": exact,
        "allow_origin_regex": f"(?:{'|'.join(any_port)})(?::[0-9]+)?" if any_port else None,
        "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"],
        # Mirrors whatever the page asks for, Authorization included.
        "allow_headers": ["*"],
        "expose_headers": [REQUEST_ID_HEADER],
        # The origin list is the gate: an allowed public page may reach a server on this machine.
        "allow_private_network": True,
    }


def install_cors(app: FastAPI, origins: list[str]) -> None:
    """Answer preflights and tag responses for `origins` (none: every preflight gets 400)."""
    app.add_middleware(CORSMiddleware, **cors_options(origins))
