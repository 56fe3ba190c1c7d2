"""``wf-persist web``: the web view of runs, on this machine by default."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Annotated

import typer

from ..errors import InvalidArgumentError, WfPersistError
from ..timeouts import WEB_LOCK_TIMEOUT
from .common import SchemaOption, err

#: The names a browser on this machine reaches a loopback listener by.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _check_listen(host: str, port: int) -> bool:
    """Refuse an address this process cannot listen on (a name that does not resolve, a
    port in use or not allowed) in one line, before the server's own traceback would. Every
    address the name resolves to is bound at once, as the server binds them (asyncio's: an
    IPv6 socket for IPv6 only). Returns whether they are all loopback addresses (this
    machine only: ``localhost``, 127.0.0.0/8 however spelt, ``127.1`` say, ``::1``), from
    the same lookup the listener makes."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        with contextlib.ExitStack() as held:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                probe = held.enter_context(socket.socket(family, kind, proto))
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    found = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    return bool(found) and all(address.is_loopback for address in found)


def web(
    url: Annotated[
        str | None,
        typer.Option(
            help="Database URL (default $WF_PERSIST_DATABASE_URL, else ./wf_persist.sqlite3)."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 4787,
    allow_actions: Annotated[
        bool,
        typer.Option(
            "--allow-actions",
            help="Allow signal, cancel and retry from the pages and the API (with a token).",
        ),
    ] = False,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="WF_PERSIST_WEB_TOKEN",
            help="The actions' token (default: a new random one, printed at start).",
        ),
    ] = None,
    schema: SchemaOption = None,
    lock_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a request waits for a lock another session holds (a migration's, "
            "say) before it answers 503.",
        ),
    ] = WEB_LOCK_TIMEOUT,
) -> None:
    """Serve the web view of runs: the runs, each run's timeline, the catalog, a JSON API.

    Read-only unless --allow-actions; it never runs workflow code.
    """
    try:
        import uvicorn

        from ..web import create_app
    except ImportError as exc:
        raise WfPersistError(
            f"the web view needs its extra: pip install 'wf-persist[web]' ({exc})"
        ) from exc
    # On this machine only, only this machine's names: another site's page whose name
    # rebinds to a loopback address (DNS rebinding) would otherwise read every run's data.
    allowed = [*LOOPBACK_NAMES, host] if _check_listen(host, port) else None
    app = create_app(
        url,
        allow_actions=allow_actions,
        token=token,
        allowed_hosts=allowed,
        schema=schema,
        lock_timeout=lock_timeout,
    )
    view = app.state.view
    mode = "actions allowed" if allow_actions else "read-only"
    err.print(f"wf-persist web: http://{host}:{port}/ ({mode})")
    if allow_actions and not token:  # made up by the app: say it
        err.print(f"actions token: {view.token}")
    uvicorn.run(app, host=host, port=port, log_level="warning")
