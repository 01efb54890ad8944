"""The dashboard's serving side, without a browser: it ships whole, offline, and safely."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.api.routes.dashboard import STATIC_DIR
from elastrain.service.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    tmp = tmp_path_factory.mktemp("static")
    settings = Settings(database_url=f"sqlite:///{tmp / 'db.sqlite'}", storage_path=tmp / "s")
    # No `with`: the lifespan (database, migrations) is not needed to serve files.
    return TestClient(create_app(settings))


def test_index_and_every_asset_it_loads(client: TestClient) -> None:
    res = client.get("/")
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="(/static/[^"]+)"', res.text)
    assert "/static/js/app.js" in refs and "/static/vendor/uplot/uPlot.iife.min.js" in refs
    for ref in refs:
        asset = client.get(ref)
        assert asset.status_code == 200, ref
    js = client.get("/static/js/app.js")
    assert "javascript" in js.headers["content-type"]  # module scripts need a JS MIME type


def test_module_imports_resolve() -> None:
    """Every `import ... from "./x.js"` in the app points at a shipped file."""
    for path in (STATIC_DIR / "js").glob("*.js"):
        for target in re.findall(r'from\s+"(\.{1,2}/[^"]+)"', path.read_text()):
            assert (path.parent / target).resolve().is_file(), f"{path.name} imports {target}"


def test_no_network_at_run_time() -> None:
    """Offline clusters: our own code loads nothing from outside the service."""
    ours = [p for p in STATIC_DIR.rglob("*") if p.suffix in {".html", ".js", ".css"}]
    ours = [p for p in ours if "vendor" not in p.parts]
    for path in ours:
        text = path.read_text()
        assert not re.search(
            r"""(?:src|href|url|import|from)\s*[=(]?\s*["']?(?:https?:)?//""", text
        ), path


def test_vendored_libraries_carry_their_licences() -> None:
    for lib in ("uplot", "js-yaml"):
        licence = STATIC_DIR / "vendor" / lib / "LICENSE"
        assert licence.is_file() and "MIT" in licence.read_text()


def test_static_paths_cannot_escape(client: TestClient) -> None:
    for path in ("/static/../main.py", "/static/%2e%2e/main.py", "/static/..%2fmain.py",
                 "/static/nope.js"):  # fmt: skip
        res = client.get(path)
        assert res.status_code == 404, path
        assert "create_app" not in res.text


def test_dashboard_module_stays_light() -> None:
    code = (
        "import sys, elastrain.api.routes.dashboard; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
