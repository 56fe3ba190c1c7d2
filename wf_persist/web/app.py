"""The web view: HTML pages and a JSON API over one database, read-only by default.

Pages: the runs (filters, keyset paging, live refresh), a run (input, outcome, pending
signals, timeline), the catalog. The JSON API mirrors them (``/api/workflows``,
``/api/runs``, ``/api/runs/{id}``, ``/api/runs/{id}/events``; 404 for an unknown run).
Actions (signal, cancel, retry) exist only when the app is made with ``allow_actions`` and
need ``Authorization: Bearer <token>``: a browser never sends that header on its own, so
another site cannot make a visitor's browser act. The server never runs workflow code.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import lifecycle
from ..client import Client
from ..errors import (
    ClosedError,
    DatabaseUnavailableError,
    InvalidArgumentError,
    StatementCancelledError,
    UnknownExecutionError,
    UnsupportedDatabaseError,
    WfPersistError,
)
from ..timeouts import WEB_LOCK_TIMEOUT, positive
from . import data

_HERE = Path(__file__).parent
Handler = Callable[[Request], Awaitable[Response]]

#: Sent with every answer. The pages load only their own script and style, and no other site
#: may frame them: a page that framed the view could lead a visitor, token pasted, into
#: clicking an action (cancel, retry) they never meant.
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        b"frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every HTTP answer, errors too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                known = {name.lower() for name, _ in message.get("headers", [])}
                extra = [pair for pair in SECURITY_HEADERS if pair[0] not in known]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


def host_name(header: str) -> str:
    """The name a ``Host`` header asks for, without its port, brackets and letter case
    (``[::1]:4787`` is ``::1``): Starlette's own check, before its 1.x releases, cut an IPv6
    literal at its first colon."""
    found = _HOST.fullmatch(header.strip().lower())
    return "" if found is None else found["v6"] or found["name"] or found["bare"]


#: A ``Host`` header: ``[IPv6 literal]``, a name or IPv4 address, each with an optional
#: port, or an IPv6 literal without brackets (no port); anything else names no host.
_HOST = re.compile(
    r"\[(?P<v6>[0-9a-f:.]+)\](?::\d+)?|(?P<name>[^:\[\]\s]+)(?::\d+)?|(?P<bare>[0-9a-f:.]+)"
)


class AllowedHosts:
    """ASGI middleware answering only requests whose ``Host`` names one of ``hosts`` (400
    otherwise): a page of another site whose name rebinds to this address reads nothing."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        #: As Starlette's TrustedHostMiddleware took them: ``*`` any, ``*.example.com``
        #: any name under it, else the name itself.
        self.any = "*" in hosts
        self.under = tuple(h[1:].lower() for h in hosts if h.startswith("*."))
        self.hosts = frozenset(host_name(h) for h in hosts if not h.startswith("*"))

    def allowed(self, name: str) -> bool:
        return self.any or name in self.hosts or bool(name and name.endswith(self.under))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            raw = dict(scope.get("headers", [])).get(b"host", b"")
            if not self.allowed(host_name(raw.decode("latin-1"))):
                await PlainTextResponse("Invalid host header", status_code=400)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def host_patterns(hosts: object) -> list[str]:
    """``allowed_hosts`` checked when the app is made (Starlette makes middleware at the
    first request): names, ``*`` or ``*.name``; a ``str`` (its every letter a name, and
    ``"*"`` in it anywhere allowing any host) is refused."""
    if isinstance(hosts, str | bytes) or not isinstance(hosts, Sequence):
        raise InvalidArgumentError(f"allowed_hosts must be a list of names, got {hosts!r:.80}")
    names = list(hosts)
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"allowed_hosts: not a name: {name!r:.80}")
        if name.startswith("*") and name != "*" and not name.startswith("*."):
            raise InvalidArgumentError(f"allowed_hosts: a pattern is * or *.name, got {name!r}")
    return names


class WebView:
    """The app's state: the client it reads through, and whether actions are allowed."""

    def __init__(self, client: Client, *, allow_actions: bool, token: str | None) -> None:
        self.client = client
        #: Whether the app's own client was closed at its last shutdown.
        self.closed = False
        self.allow_actions = allow_actions
        self.token = token if token else (secrets.token_urlsafe(24) if allow_actions else None)
        self.templates = Environment(
            loader=FileSystemLoader(_HERE / "templates"),
            autoescape=select_autoescape(["html"]),
        )
        self.templates.filters["pretty"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False)

    def page(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = self.templates.get_template(name).render(actions=self.allow_actions, **context)
        return HTMLResponse(html, status_code=status)

    def authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        expected = f"Bearer {self.token}"
        return self.allow_actions and hmac.compare_digest(given.encode(), expected.encode())


def _errors(view: WebView, api: bool) -> Callable[[Handler], Handler]:
    """Typed errors as 404 (an unknown run), 503 (the database out of reach or not usable
    here, or a statement of the request cancelled by its timeout) or 400, in
    JSON or as a page; nothing else of the library's raw errors leaves the server."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except UnknownExecutionError:
                if api:
                    return JSONResponse({"error": "Run not found"}, status_code=404)
                return view.page("error.html", 404, message="Run not found")
            except WfPersistError as exc:
                # The database out of reach, busy or not usable by this server (tables
                # dropped, a schema taken down, a grant revoked) is the server's trouble
                # (503), not the request's (400: do not send it again).
                busy = isinstance(
                    exc,
                    DatabaseUnavailableError
                    | StatementCancelledError
                    | UnsupportedDatabaseError
                    | ClosedError,
                )
                status = 503 if busy else 400
                if api:
                    return JSONResponse({"error": str(exc)}, status_code=status)
                return view.page("error.html", status, message=str(exc))

        return run

    return wrap


def create_app(
    database: Any = None,
    *,
    allow_actions: bool = False,
    token: str | None = None,
    client: Client | None = None,
    allowed_hosts: Sequence[str] | None = None,
    schema: str | None = None,
    lock_timeout: float | None = WEB_LOCK_TIMEOUT,
) -> Starlette:
    """The web view's ASGI app over ``database`` (a URL or an engine; default
    ``$WF_PERSIST_DATABASE_URL``; ``schema``: the PostgreSQL schema of the wf_ tables), or
    over ``client``. With ``allow_actions`` the pages and
    the API can signal, cancel and retry runs given the ``token`` (made up if not given:
    ``app.state.view.token``). ``allowed_hosts``: the only ``Host`` headers answered (a
    page of another site that rebinds its name to this address reads nothing).
    ``lock_timeout``: with a URL, the longest a request's statement waits for a lock
    another session holds (a migration's, an operator's) before the request is a 503;
    None leaves it to the database (an engine or client given is used as it is)."""
    if client is not None and (database is not None or schema is not None):
        raise InvalidArgumentError(
            "create_app: give a client, or a database (and its schema), not both"
        )
    hosts = None if allowed_hosts is None else host_patterns(allowed_hosts)
    if lock_timeout is not None:
        lock_timeout = positive(lock_timeout, "lock_timeout")

    def made() -> Client:
        # A viewer never migrates (nor creates an embedded file): a database behind is
        # refused with the command that brings it to head.
        own = Client(database, schema=schema, auto_migrate=False)
        if lock_timeout is not None and not isinstance(database, Engine):
            own.backend.bound_lock_waits(lock_timeout)
        return own

    owned = client is None
    view = WebView(
        client if client is not None else made(), allow_actions=allow_actions, token=token
    )
    page_errors, api_errors = _errors(view, api=False), _errors(view, api=True)

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(client, *args)`` off the event loop (the client of the app's life now)."""
        return await run_in_threadpool(fn, view.client, *args)

    @page_errors
    async def runs_page(request: Request) -> Response:
        where = data.RunFilter.parse(request.query_params)
        found = await call(data.runs, where)
        names = sorted({w["name"] for w in await call(data.workflows)})
        return view.page("runs.html", where=where, page=found, names=names)

    @page_errors
    async def run_page(request: Request) -> Response:
        found = await call(data.run, request.path_params["run_id"])
        return view.page("run.html", found=found)

    @page_errors
    async def workflows_page(request: Request) -> Response:
        return view.page("workflows.html", workflows=await call(data.workflows))

    @api_errors
    async def api_workflows(request: Request) -> Response:
        return JSONResponse(await call(data.workflows))

    @api_errors
    async def api_runs(request: Request) -> Response:
        where = data.RunFilter.parse(request.query_params)
        return JSONResponse(await call(data.runs, where))

    @api_errors
    async def api_run(request: Request) -> Response:
        return JSONResponse(await call(data.run, request.path_params["run_id"]))

    @api_errors
    async def api_events(request: Request) -> Response:
        return JSONResponse(await call(data.events, request.path_params["run_id"]))

    def action(fn: Callable[[str, dict[str, Any]], Any]) -> Handler:
        @api_errors
        async def act(request: Request) -> Response:
            if not view.allow_actions:
                return JSONResponse({"error": "actions are not allowed here"}, status_code=403)
            if not view.authorized(request):
                return JSONResponse({"error": "a valid token is needed"}, status_code=401)
            try:
                body = await request.json() if await request.body() else {}
            except ValueError:
                raise InvalidArgumentError("the request body must be JSON") from None
            except RecursionError:  # valid JSON nested deeper than the parser reads
                raise InvalidArgumentError("the request body is nested too deeply") from None
            if not isinstance(body, dict):
                raise InvalidArgumentError("the request body must be a JSON object")
            result = await run_in_threadpool(fn, request.path_params["run_id"], body)
            return JSONResponse(result)

        return act

    def signal(run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("a signal needs a name")
        view.client.signal(run_id, name, body.get("payload"), actor=_actor(body))
        return {"ok": True}

    def cancel(run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        compensate = body.get("compensate", True)
        if not isinstance(compensate, bool):
            raise InvalidArgumentError("compensate must be true or false")
        view.client.cancel(run_id, compensate=compensate, actor=_actor(body))
        return {"ok": True}

    def retry(run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A new run of the same workflow version with the same input, of a run that has
        ended (as the page offers it): one still going would be run twice at once."""
        c = view.client
        info = c.describe(run_id)
        if not lifecycle.is_terminal(info.status):
            raise InvalidArgumentError(
                f"only a run that has ended is retried; this one is {info.status}"
            )
        handle = c.start(info.workflow_name, info.input, version=info.version, actor=_actor(body))
        return {"ok": True, "id": handle.execution_id}

    routes = [
        Route("/", runs_page),
        Route("/runs/{run_id}", run_page),
        Route("/workflows", workflows_page),
        Route("/api/workflows", api_workflows),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}", api_run),
        Route("/api/runs/{run_id}/events", api_events),
        Route("/api/runs/{run_id}/signal", action(signal), methods=["POST"]),
        Route("/api/runs/{run_id}/cancel", action(cancel), methods=["POST"]),
        Route("/api/runs/{run_id}/retry", action(retry), methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    middleware = [Middleware(SecurityHeaders)]
    if hosts is not None:
        middleware.append(Middleware(AllowedHosts, hosts=hosts))
    handlers = {404: _not_found, 405: _not_allowed, 500: _server_error}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if owned and view.closed:  # served again (a second server, a test client)
            view.client = await run_in_threadpool(made)
            view.closed = False
        yield
        if owned:  # the client made here, and its engine's connections, end with the app
            view.closed = True
            await run_in_threadpool(view.client.close)

    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan
    )
    app.state.view = view
    return app


def _route_path(request: Request) -> str:
    """The request's path within the app (mounted at ``/wf``, say, ``/wf/api/runs`` is
    ``/api/runs``)."""
    path: str = request.scope["path"]
    root: str = request.scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _not_found(request: Request, exc: Exception) -> Response:
    """No route: under ``/api/runs/`` an id with a "/" (no run has one) gets the JSON 404 of
    an unknown run, as every other id does."""
    if _route_path(request).startswith("/api/runs/"):
        return JSONResponse({"error": "Run not found"}, status_code=404)
    return PlainTextResponse("Not Found", status_code=404)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    """A method a route does not take: JSON under ``/api/`` (a client there reads JSON)."""
    headers = getattr(exc, "headers", None)
    if _route_path(request).startswith("/api/"):
        return JSONResponse({"error": "Method Not Allowed"}, status_code=405, headers=headers)
    return PlainTextResponse("Method Not Allowed", status_code=405, headers=headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """An unexpected error: Starlette answers it outside every middleware, so the
    security headers are set here."""
    headers = {name.decode(): value.decode() for name, value in SECURITY_HEADERS}
    return PlainTextResponse("Internal Server Error", status_code=500, headers=headers)


def _actor(body: dict[str, Any]) -> str:
    actor = body.get("actor") or "web"
    if not isinstance(actor, str):
        raise InvalidArgumentError("actor must be text")
    return actor
