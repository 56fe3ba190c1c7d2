"""An order workflow, end to end on the embedded SQLite default.

Run it twice: the second run starts with the same idempotency key, so it finds the first run
instead of charging the customer again, and prints the same result and history.

    python examples/order.py            # database: $WF_PERSIST_DATABASE_URL or ./wf_persist.sqlite3
"""

from __future__ import annotations

import datetime as dt
import json

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

import wf_persist as wp


class OrderLine(BaseModel):
    sku: str
    quantity: int = Field(gt=0)
    unit_price_cents: int = Field(ge=0)


class Order(BaseModel):
    order_id: str = Field(min_length=1)
    customer: str
    lines: list[OrderLine] = Field(min_length=1)


class Confirmation(BaseModel):
    order_id: str
    payment_id: str
    reservation_id: str
    total_cents: int
    confirmed_at: dt.datetime
    confirmation_code: str


@wp.step
def price(order: Order) -> int:
    return sum(line.quantity * line.unit_price_cents for line in order.lines)


@wp.step
def charge_payment(customer: str, amount_cents: int) -> str:
    # A real step would call a payment provider here; its result is recorded, so a replay
    # after a crash never charges twice.
    return f"pay_{customer}_{amount_cents}"


@wp.step
def reserve_stock(order: Order) -> str:
    return "res_" + "_".join(f"{line.sku}x{line.quantity}" for line in order.lines)


@wp.workflow(name="place-order", version=1)
def place_order(ctx: wp.Context, order: Order) -> Confirmation:
    total = ctx.run(price, order)
    reservation = ctx.run(reserve_stock, order)
    payment = ctx.run(charge_payment, order.customer, total)
    return Confirmation(
        order_id=order.order_id,
        payment_id=payment,
        reservation_id=reservation,
        total_cents=total,
        confirmed_at=ctx.now(),
        confirmation_code=ctx.uuid().hex[:8].upper(),
    )


def main() -> None:
    console = Console(width=120)
    with wp.Runtime() as runtime:
        runtime.register(place_order)
        client = runtime.client()
        order = Order(
            order_id="A-1001",
            customer="ada",
            lines=[
                OrderLine(sku="book", quantity=2, unit_price_cents=1250),
                OrderLine(sku="pen", quantity=3, unit_price_cents=199),
            ],
        )
        handle = client.start(place_order, order, idempotency_key=order.order_id, actor="example")
        outcome = client.result(handle.execution_id, timeout=30)
        confirmation: Confirmation = outcome.unwrap()
        console.print(
            f"[bold]{place_order.name}@v{handle.version}[/] execution {handle.execution_id}"
            f" ({'new' if handle.created else 'found by idempotency key'}): {outcome.status}"
        )
        console.print_json(confirmation.model_dump_json())

        table = Table(title="history")
        for column in ("seq", "recorded at (UTC)", "type", "activity", "detail"):
            table.add_column(column, no_wrap=True, overflow="ellipsis")
        for record in client.history(handle.execution_id):
            event = record.event
            detail = event.get("result", event.get("payload", event.get("value", "")))
            table.add_row(
                str(record.sequence),
                record.created_at.strftime("%H:%M:%S.%f"),
                event["type"],
                event.get("activityName", ""),
                json.dumps(detail)[:40] if detail != "" else "",
            )
        console.print(table)


if __name__ == "__main__":
    main()
