"""Fault injection: workers killed, stopped past their lease, databases restarted, racing
processes; the invariants of durable execution checked against history and an external
ledger."""
