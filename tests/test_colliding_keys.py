"""Keys that JSON writes alike. JSON keys are text, so ``{1: "a", "1": "b"}`` stored one
entry and dropped the other, silently, on every backend and through every path a value is
written by: the run saw ``{"1": "b"}``. Such values are refused with a typed error where
they are produced, and nothing is written; keys that stay distinct as text are stored as
their text (``test_bad_input.py`` refuses the colliding ones on every path)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Final

import pydantic
import pytest
import sqlalchemy as sa

import wf_persist as wp
from wf_persist.models import executions_table, history_table
from wf_persist.values import to_json

LOST = "both written as the JSON key"


@wp.step
def keyed(value: Any) -> Any:
    return value


@wp.workflow(name="keys-any", version=1)
def keys_wf(ctx: wp.Context, value: Any) -> Any:
    stepped = ctx.run(keyed, value)
    signalled = ctx.wait_for_signal("more", Any)
    assert isinstance(signalled, wp.Received)
    return {"input": value, "step": stepped, "signal": signalled.value}


class Bag(pydantic.BaseModel):
    inner: dict[Any, int]


@dataclasses.dataclass
class Box:
    items: list[dict[Any, int]]


@dataclasses.dataclass(slots=True)
class Slotted:
    d: dict[Any, int]


class Extra(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class Computed(pydantic.BaseModel):
    n: int

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def table(self) -> dict[Any, int]:
        return {self.n: 1, str(self.n): 2}


ANY: Final = pydantic.TypeAdapter(Any)


@pytest.mark.parametrize(
    "value",
    [
        {1: "a", "1": "b"},
        {True: 1, "true": 2},
        {(1, 2): 1, "1,2": 2},
        {None: 1, "None": 2},
        [0, {"deep": [{1.5: 0, "1.5": 1}]}],
        Bag(inner={3: 1, "3": 2}),
        Box(items=[{}, {False: 0, "false": 1}]),
        collections.deque([{1: 1, "1": 2}]),
        Slotted({1: 1, "1": 2}),
        Extra(d={1: 1, "1": 2}),
        Computed(n=4),
    ],
    ids=[
        "int",
        "bool",
        "tuple",
        "none",
        "nested",
        "model",
        "dataclass",
        "deque",
        "slots",
        "extra",
        "computed",
    ],
)
def test_keys_written_alike_are_refused(value: Any) -> None:
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(ANY, value, "value")


class Node(pydantic.BaseModel):
    name: str
    children: list[Node] = []
    parent: Node | None = pydantic.Field(default=None, exclude=True)


class Graph(pydantic.BaseModel):
    nodes: dict[str, list[Any]] = {}

    @pydantic.field_serializer("nodes")
    def _ids(self, nodes: dict[str, list[Any]]) -> list[str]:
        return sorted(nodes)


class Excluded(pydantic.BaseModel):
    d: Any = pydantic.Field(default=None, exclude=True)


class Pairs(pydantic.BaseModel):
    d: dict[Any, int]

    @pydantic.field_serializer("d")
    def _pairs(self, d: dict[Any, int]) -> list[list[Any]]:
        return sorted([str(k), v] for k, v in d.items())


class Base64Keys(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(ser_json_bytes="base64")
    d: dict[Any, int]


class Refusing(dict[Any, Any]):
    def items(self) -> Any:
        raise RuntimeError("no items")


def test_what_a_dump_leaves_out_is_not_judged_and_not_walked() -> None:
    """A back-reference excluded from the dump made a walk over the object's fields take
    exponential time (and a cycle behind a field serializer forever); keys only the
    Python value has, not the stored document, refused values stored without loss."""
    root = Node(name="root")
    for i in range(50):
        root.children.append(Node(name=f"c{i}", parent=root))
    began = time.perf_counter()
    assert len(to_json(ANY, root, "tree")["children"]) == 50
    cyclic: dict[str, list[Any]] = {"a": [], "b": []}
    cyclic["a"] += [cyclic["b"], cyclic["a"]]
    cyclic["b"] += [cyclic["a"], cyclic["b"]]
    assert to_json(ANY, Graph.model_construct(nodes=cyclic), "graph") == {"nodes": ["a", "b"]}
    assert time.perf_counter() - began < 2
    assert to_json(ANY, Excluded(d={1: 1, "1": 2}), "x") == {}
    assert to_json(ANY, Pairs(d={1: 1, "1": 2}), "x") == {"d": [["1", 1], ["1", 2]]}
    assert to_json(ANY, Base64Keys(d={b"a": 1, "a": 2}), "x") == {"d": {"YQ==": 1, "a": 2}}
    assert to_json(ANY, Refusing({1: 1}), "x") == {"1": 1}


@pytest.mark.parametrize(
    "value",
    [{1: "a", 2: "b"}, {"1": 1, "2": 2}, {True: 1, False: 2}, [{1: 0}, {"1": 0}], {}, "x", 1],
)
def test_distinct_keys_are_not_refused(value: Any) -> None:
    to_json(ANY, value, "value")


class User(pydantic.BaseModel):
    id: int
    name: str


#: A reference by id in JSON, the whole user in Python.
UserRef = Annotated[User, pydantic.PlainSerializer(lambda u: {"id": u.id}, when_used="json")]


class Pair(pydantic.BaseModel):
    a: int
    b: int

    @pydantic.model_serializer(when_used="json")
    def _both(self) -> dict[str, Any]:
        return {"ab": [self.a, self.b]}


class Counted(pydantic.BaseModel):
    d: dict[str, int]

    @pydantic.field_serializer("d", when_used="json")
    def _count(self, d: dict[str, int]) -> dict[str, int]:
        return {"n": len(d)}


#: Entries of None left out of the JSON.
Compact = Annotated[
    dict[str, Any],
    pydantic.PlainSerializer(
        lambda d: {k: v for k, v in d.items() if v is not None}, when_used="json"
    ),
]


class Tree(pydantic.BaseModel):
    id: int
    kids: list[Tree] = []


class Job(pydantic.BaseModel):
    name: str
    graph: Annotated[Tree, pydantic.PlainSerializer(lambda t: {"root": t.id}, when_used="json")]
    extra: dict[int, int] = {1: 1}


def test_serializers_for_json_only_are_judged_by_what_they_write() -> None:
    """A serializer used only for JSON (a reference by id, a compact form) writes fewer
    keys than the Python value has: comparing the two dumps refused such values, stored
    whole before, and walked the subtree the JSON form leaves out (a shared tree of 2**22
    paths took a minute)."""
    assert to_json(pydantic.TypeAdapter(UserRef), User(id=1, name="n"), "x") == {"id": 1}
    assert to_json(pydantic.TypeAdapter(Pair), Pair(a=1, b=2), "x") == {"ab": [1, 2]}
    assert to_json(pydantic.TypeAdapter(Counted), Counted(d={"x": 1, "y": 2}), "x") == {
        "d": {"n": 2}
    }
    assert to_json(pydantic.TypeAdapter(Compact), {"a": (1, 2), "b": None}, "x") == {"a": [1, 2]}
    tree = Tree(id=0)
    for i in range(1, 23):
        tree = Tree(id=i, kids=[tree, tree])
    began = time.perf_counter()
    job = to_json(pydantic.TypeAdapter(Job), Job(name="j", graph=tree), "x")
    assert job == {"name": "j", "graph": {"root": 22}, "extra": {"1": 1}}
    assert time.perf_counter() - began < 2


@dataclasses.dataclass(eq=False)
class Held:
    d: dict[Any, int]


#: Keys written in lower case: "A" and "a" become one.
Lower = Annotated[str, pydantic.PlainSerializer(lambda s: s.lower())]


def test_keys_merged_inside_sets_or_by_a_key_serializer_are_refused() -> None:
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(pydantic.TypeAdapter(set[Held]), {Held({1: 1, "1": 2})}, "x")
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(ANY, frozenset({Held({True: 1, "true": 2})}), "x")
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(pydantic.TypeAdapter(dict[Lower, int]), {"A": 1, "a": 2}, "x")


@pytest.fixture
def thin(db_url: str) -> Iterator[wp.Client]:
    with wp.Client(db_url, poll_interval=0.05) as client:
        yield client


def _counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.execute(sa.select(sa.func.count()).select_from(executions_table)).scalar_one(),
            conn.execute(sa.select(sa.func.count()).select_from(history_table)).scalar_one(),
        )


def test_a_thin_client_refuses_keys_written_alike_and_writes_nothing(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    runtime.register(keys_wf)  # catalogs its (Any) input schema
    before = _counts(thin.engine)
    for value in ({1: "a", "1": "b"}, [{"k": {None: 1, "null": 2}}]):
        with pytest.raises(wp.NotSerializableError, match=LOST):
            thin.start("keys-any", value)
    assert _counts(thin.engine) == before
    run = thin.start("keys-any", {"ok": 1}).execution_id
    runtime.drive(run)
    parked = _counts(thin.engine)
    with pytest.raises(wp.SignalPayloadError, match=LOST):
        thin.signal(run, "more", {2: "a", "2": "b"})
    assert _counts(thin.engine) == parked
    assert thin.status(run) == "suspended"


def test_a_signal_refuses_keys_json_writes_alike_and_the_run_keeps_waiting(
    runtime: wp.Runtime,
) -> None:
    runtime.register(keys_wf)
    client = runtime.client()
    run = client.start(keys_wf, {"ok": 1}).execution_id
    runtime.drive(run)
    engine = runtime.database.backend.engine
    before = _counts(engine)
    # A signal's payload is written as json.dumps writes it: None as "null".
    for payload in ({None: 1, "null": 2}, {"a": [{1: 0, "1": 1}]}):
        with pytest.raises(wp.SignalPayloadError, match=LOST):
            client.signal(run, "more", payload)
    assert _counts(engine) == before, "nothing recorded"
    client.signal(run, "more", {5: "five"})
    runtime.drive(run)
    assert client.result(run, timeout=10).unwrap()["signal"] == {"5": "five"}


def test_distinct_keys_are_stored_as_their_text_everywhere(runtime: wp.Runtime) -> None:
    runtime.register(keys_wf)
    client = runtime.client()
    value = {1: "a", 2: "b", "c": {True: [1], None: 0}}
    run = client.start(keys_wf, value).execution_id
    runtime.drive(run)
    client.signal(run, "more", {1: "x", 2: "y"})
    runtime.drive(run)
    text = {"1": "a", "2": "b", "c": {"true": [1], "None": 0}}
    assert client.result(run, timeout=10).unwrap() == {
        "input": text,
        "step": text,
        "signal": {"1": "x", "2": "y"},
    }


class Rows(pydantic.BaseModel):
    rows: Iterable[dict[Any, str]]


def test_keys_merged_inside_an_iterator_are_refused() -> None:
    """An iterator is read by the one dump that is stored and checked: a second dump for
    the check saw it empty, and the merged key was lost."""
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(ANY, (d for d in [{1: "a", "1": "b"}]), "x")
    with pytest.raises(wp.NotSerializableError, match=LOST):
        to_json(pydantic.TypeAdapter(Rows), {"rows": [{1: "a", "1": "b"}]}, "x")
    rows = to_json(pydantic.TypeAdapter(Rows), {"rows": iter([{1: "a", 2: "b"}])}, "x")
    assert rows == {"rows": [{"1": "a", "2": "b"}]}
