"""An expense approval, for operating runs from the command line (README, "Operating runs").

wf-persist db upgrade
wf-persist worker --app examples.expenses:runtime      # executes the runs
wf-persist runs start expense --input '{"employee": "kim", "amount_cents": 12000}'
"""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field

import wf_persist as wp


class Expense(BaseModel):
    employee: str = Field(min_length=1)
    amount_cents: int = Field(gt=0)


class Approval(BaseModel):
    approved: bool
    approver: str


@wp.step
def reserve_budget(expense: Expense) -> str:
    return f"budget_{expense.employee}_{expense.amount_cents}"


@wp.step
def pay(expense: Expense) -> str:
    # A real step would call the payroll system; its result is recorded, so it runs once.
    return f"pay_{expense.employee}_{expense.amount_cents}"


@wp.workflow(name="expense", version=1)
def expense_wf(ctx: wp.Context, expense: Expense) -> dict[str, str]:
    ctx.run(reserve_budget, expense)
    ctx.set_event("stage", "awaiting approval")
    got = ctx.wait_for_signal("approval", Approval, timeout=dt.timedelta(days=2))
    if isinstance(got, wp.TimedOut):
        ctx.set_event("stage", "escalated")
        return {"status": "escalated"}
    if not got.value.approved:
        ctx.set_event("stage", "rejected")
        return {"status": "rejected", "by": got.value.approver}
    payment = ctx.run(pay, expense)
    ctx.set_event("stage", "paid")
    return {"status": "paid", "payment": payment, "by": got.value.approver}


def runtime() -> wp.Runtime:
    """The worker's runtime (``--app`` calls it): $WF_PERSIST_DATABASE_URL, else SQLite."""
    made = wp.Runtime()
    made.register(expense_wf)
    return made
