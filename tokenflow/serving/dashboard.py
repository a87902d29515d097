"""`GET /dashboard`: one static page (static/dashboard.html, inline script and style, nothing
fetched from elsewhere) that polls /v1/tokenflow/streams once a second and draws it.

The page itself is no secret and holds no data, so it is not behind the API key (a browser
cannot send a bearer header when it loads a page): `auth.RequireApiKey` leaves /dashboard open.
Where the server has keys, the page takes one from the URL fragment, `/dashboard#key=KEY`,
which the browser never sends to the server (a query string would land in access logs), keeps
it for the tab and clears it from the address bar, or asks for it; then it sends it to
/v1/tokenflow/streams as a bearer token, which shows a tenant's key its own streams only.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

DASHBOARD_FILE = "static/dashboard.html"


def dashboard_html() -> str:
    """The page, as shipped in the package."""
    return files("tokenflow.serving").joinpath(DASHBOARD_FILE).read_text(encoding="utf-8")


def dashboard_router() -> APIRouter:
    """The route serving the page (read once, when the app is built)."""
    router = APIRouter()
    page = dashboard_html()

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The live page of the scheduler's streams."""
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    return router
