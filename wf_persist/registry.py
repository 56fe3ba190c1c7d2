"""The registry of a runtime: the workflow definitions it can start and drive, each also
cataloged in the database (name, version, source hash, schemas; first registration wins).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import refusals
from .arguments import check_session, check_version, raised
from .authoring import Workflow
from .backends import Backend
from .error_documents import shown
from .errors import (
    InvalidArgumentError,
    InvalidPayloadError,
    MissingWorkflowVersionError,
    UnknownWorkflowError,
    WfPersistError,
    WorkflowVersionConflictError,
)
from .store import Executor, catalog
from .values import from_json, to_json

log = logging.getLogger("wf_persist")


class Registry:
    """Registered definitions by ``(name, version)``; the runtime is one."""

    backend: Backend
    #: False for a runtime built :func:`~.gate.without_cataloging`.
    catalogs: bool
    clock: Callable[[], dt.datetime]
    _lock: threading.RLock
    _registry: dict[tuple[str, int], Workflow[Any, Any]]
    _latest: dict[str, int]
    #: Versions whose catalog rows were written only in a host's transaction, which may
    #: roll back: cataloged again (in the next start's transaction) until one of our own
    #: transactions has written them.
    _uncataloged: set[tuple[str, int]]
    #: Of those, versions the catalog holds with another source: another release's runs,
    #: never driven here with this code (the hash the catalog holds, by version).
    _overruled: dict[tuple[str, int], str]

    def _check_open(self) -> None:
        raise NotImplementedError

    @refusals.typed
    def register(self, *workflows: Workflow[Any, Any], session: Executor | None = None) -> None:
        """Register workflows here and in the database catalog (first registration wins).

        All or nothing: if any (name, version) is cataloged with a different source hash,
        nothing is registered. With ``session`` the catalog rows are written in that (host)
        transaction instead of one of wf_persist's own.

        Raises:
            WorkflowVersionConflictError: (name, version) exists with a different source.
        """
        check_session(session)
        self._register(workflows, session, write=self.catalogs)

    def _register(
        self, workflows: tuple[Workflow[Any, Any], ...], session: Executor | None, write: bool
    ) -> None:
        """:meth:`register`; ``write=False`` checks the catalog without writing to it."""
        self._check_open()
        for wf in workflows:
            if not isinstance(wf, Workflow):
                raise InvalidArgumentError(
                    f"register takes @wp.workflow definitions, got {shown(wf)}"
                )
            known = self._registry.get(wf.key)
            if known is not None and known.source_hash != wf.source_hash:
                raise WorkflowVersionConflictError(
                    wf.name, wf.version, known.source_hash, wf.source_hash
                )
        now = self.clock()

        # In one order everywhere: two processes registering the same new versions in
        # opposite orders each held the row the other waited for (a deadlock).
        ordered = sorted(workflows, key=lambda wf: wf.key)

        def check(conn: Executor) -> None:
            # Read first where nothing is written, and in a host's transaction (which we
            # cannot roll back): a conflict is found before the first row is written.
            read = catalog.entry if session is None else catalog.entry_seen
            for wf in ordered if session is not None or not write else ():
                entry = read(conn, self.backend, wf.name, wf.version)
                if entry is not None and str(entry.source_hash) != wf.source_hash:
                    raise WorkflowVersionConflictError(
                        wf.name, wf.version, str(entry.source_hash), wf.source_hash
                    )
            for wf in ordered if write else ():
                found = catalog.catalog_version(
                    conn, self.backend, wf.name, wf.version, wf.source_hash, now, wf.schemas
                )
                if found != wf.source_hash:
                    raise WorkflowVersionConflictError(wf.name, wf.version, found, wf.source_hash)

        if session is not None:
            check(session)
        else:

            def own() -> None:
                with self.backend.begin() if write else self.backend.read() as conn:
                    check(conn)

            refusals.again_if_deadlocked(self.backend, own)
        with self._lock:
            for wf in workflows:
                self._overruled.pop(wf.key, None)
                if session is None and write:
                    self._uncataloged.discard(wf.key)
                elif wf.key not in self._registry:
                    self._uncataloged.add(wf.key)
                self._registry[wf.key] = wf
                if wf.version > self._latest.get(wf.name, 0):
                    self._latest[wf.name] = wf.version

    def resolve(
        self,
        workflow: Workflow[Any, Any] | str,
        version: int | None,
        session: Executor | None = None,
    ) -> Workflow[Any, Any]:
        """The registered definition to start (see :meth:`choose`); a definition passed in
        that is not registered yet is registered first."""
        found = self.choose(workflow, version)
        self.ensure_startable(workflow, found, session)
        return found

    def choose(self, workflow: Workflow[Any, Any] | str, version: int | None) -> Workflow[Any, Any]:
        """The definition a start of ``workflow`` runs: ``version`` if given, else the highest
        registered, a definition passed in counting as registered. Writes nothing."""
        # type(), not isinstance(): an object's __class__ may claim either.
        if isinstance(workflow, Workflow) and issubclass(type(workflow), Workflow):
            name = workflow.name
        elif issubclass(type(workflow), str):
            name = str.__str__(workflow)  # plain: a subclass's own equality or hash may raise
        else:
            raise InvalidArgumentError(f"expected a workflow or its name, got {shown(workflow)}")
        version = check_version(version)
        with self._lock:
            known = {v: wf for (n, v), wf in self._registry.items() if n == name}
        if isinstance(workflow, Workflow):
            known[workflow.version] = workflow
        if not known:
            raise UnknownWorkflowError(name)
        wanted = max(known) if version is None else version
        found = known.get(wanted)
        if found is None:
            raise MissingWorkflowVersionError(name, wanted)
        return found

    def ensure_startable(
        self,
        workflow: Workflow[Any, Any] | str,
        found: Workflow[Any, Any],
        session: Executor | None = None,
    ) -> None:
        """Before a start of ``found`` (:meth:`choose`'s answer for ``workflow``): a
        definition passed in registered, and ``found``'s catalog row known written (a start
        of one definition may pin another version)."""
        if isinstance(workflow, Workflow):
            self.ensure_registered(workflow, session)
        if found is not workflow:
            self.ensure_registered(found, session)

    def ensure_registered(self, wf: Workflow[Any, Any], session: Executor | None = None) -> None:
        """Register ``wf`` unless this very definition is registered here already and its
        catalog row known committed (one written in a host's transaction is written again
        in the transaction of the start that needs it: the host's may have rolled back)."""
        if self._registry.get(wf.key) is not wf or wf.key in self._uncataloged:
            self._register((wf,), session, write=True)

    def registered(self, name: str, version: int) -> Workflow[Any, Any] | None:
        """The definition registered here, cataloged or not (nothing read)."""
        return self._registry.get((name, version))

    def definition(self, name: str, version: int) -> Workflow[Any, Any]:
        """The exact pinned version, to drive a run of it: :class:`MissingWorkflowVersionError`
        if none is registered here, :class:`WorkflowVersionConflictError` if the catalog
        holds another source under it (registered here only in a transaction that rolled
        back, or by a gating runtime, while another release cataloged its own)."""
        key = (name, version)
        found = self._registry.get(key)
        if found is None:
            raise MissingWorkflowVersionError(name, version)
        if key in self._uncataloged and key not in self._overruled:
            self._confirm_cataloged()
        overruled = self._overruled.get(key)
        if overruled is not None:
            raise WorkflowVersionConflictError(name, version, overruled, found.source_hash)
        return found

    def validate_input(self, wf: Workflow[Any, Any], payload: Any) -> Any:
        """The payload's stored JSON form; raises before anything is written."""
        what = f"input of workflow {wf.name}"
        if not wf.takes_input and payload is not None:
            raise InvalidPayloadError(what, [{"loc": (), "msg": "this workflow takes no input"}])
        try:
            stored = to_json(wf.input_adapter, payload, what)
            # Read back as the run will read it: an instance made without validation
            # (``model_construct``) was stored, and the run then failed on its input.
            from_json(wf.input_adapter, stored, what)
        except WfPersistError:
            raise
        except Exception as exc:  # a validator of the caller's own raising what it likes
            raise InvalidPayloadError(what, [raised(exc)]) from exc
        self.backend.check_size(what, stored)
        return stored

    def runnable_workflows(self) -> list[tuple[str, int]]:
        """The (name, version)s this runtime can drive: a version not known cataloged by a
        transaction of ours is driven once the catalog is seen holding this very source
        (until then no run of it is claimed: another release may catalog other code
        under it, and its runs are not this code's to run)."""
        if self._uncataloged.difference(self._overruled):
            self._confirm_cataloged()
        with self._lock:
            return sorted(k for k in self._registry if k not in self._uncataloged)

    def registered_workflows(self) -> list[tuple[str, int]]:
        """Every (name, version) registered here, cataloged or not (what a replay check
        holds the runs against)."""
        with self._lock:
            return sorted(self._registry)

    def _confirm_cataloged(self) -> None:
        """Read the catalog rows of the versions registered here but not known cataloged:
        one holding this source is known written for good; one holding another source
        overrules this registration (logged once)."""
        with self._lock:
            unsure = [
                self._registry[k] for k in sorted(self._uncataloged) if k not in self._overruled
            ]
        held: dict[tuple[str, int], str] = {}
        with self.backend.read() as conn:
            for wf in unsure:
                entry = catalog.entry(conn, self.backend, wf.name, wf.version)
                if entry is not None:
                    held[wf.key] = str(entry.source_hash)
        with self._lock:
            for wf in unsure:
                found = held.get(wf.key)
                if found is None or self._registry.get(wf.key) is not wf:
                    continue  # not written (yet), or registered again meanwhile
                if found == wf.source_hash:
                    self._uncataloged.discard(wf.key)
                elif wf.key not in self._overruled:
                    self._overruled[wf.key] = found
                    log.error(
                        "workflow %s@v%d is cataloged with another source than this "
                        "process registered (its registration was not committed): its runs "
                        "are not driven here",
                        wf.name,
                        wf.version,
                    )
