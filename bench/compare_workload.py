"""The workflow :mod:`bench.compare_commits` times, importing whichever ``wf_persist`` is
first on the path (the working tree's, or an exported commit's)."""

from __future__ import annotations

from typing import Any

import wf_persist as wp


@wp.step
def bench_step(i: int) -> dict[str, Any]:
    return {"i": i, "ok": True, "msg": "hello"}


@wp.workflow(name="bench_many_steps", version=1)
def many_steps(ctx: wp.Context, n: int) -> int:
    for i in range(n):
        ctx.run(bench_step, i)
    return n
