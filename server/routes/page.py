"""The chat page at `/` and the API docs at /docs, every file served from the package.

FastAPI's own docs page loads Swagger UI from a CDN; this one loads the copy that the
`fastapi-offline` package ships, so a server with no way out still shows its docs. There is no
/redoc: ReDoc's bundle fetches its logo from its CDN whatever it is told.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

PAGE_DIR = Path(__file__).resolve().parent.parent / "static"
DOCS_ASSETS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
PAGE_URL = "/static"
DOCS_ASSETS_URL = "/docs/assets"

router = APIRouter(include_in_schema=False)


def _root(request: Request) -> str:
    """The prefix a proxy serves the app under (`--root-path`), for absolute asset URLs."""
    return str(request.scope.get("root_path", ""))


# The chat page loads only its own files and talks only to this server; no other site may frame
# it (a page that did could lead a user's clicks on it).
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


@router.get("/")
async def chat_page() -> FileResponse:
    return FileResponse(PAGE_DIR / "index.html", headers=PAGE_HEADERS)


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    assets = _root(request) + DOCS_ASSETS_URL
    return get_swagger_ui_html(
        openapi_url=_root(request) + str(request.app.openapi_url),
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{assets}/swagger-ui-bundle.js",
        swagger_css_url=f"{assets}/swagger-ui.css",
        swagger_favicon_url=f"{assets}/favicon.png",
        # Otherwise a page opened on a non-loopback host asks validator.swagger.io for a badge.
        swagger_ui_parameters={"validatorUrl": None},
    )


def install_page(app: FastAPI) -> None:
    """Serve the page, the docs and their files; `app` is built with `docs_url=None` and
    `redoc_url=None`, so FastAPI's CDN-loading pages are not there."""
    app.include_router(router)
    app.mount(PAGE_URL, StaticFiles(directory=PAGE_DIR), name="page")
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=DOCS_ASSETS_DIR), name="docs-assets")
