"""The web dashboard: `index.html` at `/` and the static assets under `/static/`.

Everything the browser needs ships in `api/static/` (vendored libraries included), so the
dashboard works on an offline cluster. The page is a client of the public REST API and has
no routes of its own beyond these two; it must stay free of torch and ray imports.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)

# Served through a plain route (not `router.mount`) so that `app.include_router(router)`
# carries it on every FastAPI version; StaticFiles still does the path checks, ETags and 304s.
_files = StaticFiles(directory=STATIC_DIR)

# The app shell is tiny and must never be stale after an upgrade; assets revalidate by ETag.
_NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/")
def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_NO_CACHE)


@router.get("/static/{path:path}")
async def static(path: str, request: Request) -> Response:
    response = await _files.get_response(path, request.scope)
    response.headers.update(_NO_CACHE)
    return response
