"""`/docs` (Swagger UI) and `/redoc` (ReDoc): the API's reference pages, from local files.

FastAPI's own pages load their scripts from a CDN, unpinned and without integrity, which no
CSP of ours could allow. These load the copies vendored in `api/static/vendor/` (see its
README) and no inline script, under `elastrain.api.security.DOCS_CSP`.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

_SWAGGER = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>elastrain API - Swagger UI</title>
<link rel="stylesheet" href="/static/vendor/swagger-ui/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/static/vendor/swagger-ui/swagger-ui-bundle.js"></script>
<script src="/static/docs/swagger-init.js"></script></body></html>
"""

_REDOC = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>elastrain API - ReDoc</title></head>
<body><redoc spec-url="/openapi.json"></redoc>
<script src="/static/vendor/redoc/redoc.standalone.js"></script></body></html>
"""


@router.get("/docs")
def swagger_ui() -> HTMLResponse:
    return HTMLResponse(_SWAGGER)


@router.get("/redoc")
def redoc() -> HTMLResponse:
    return HTMLResponse(_REDOC)
