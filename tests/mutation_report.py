"""Per-module figures of the last mutation run (``make mutation`` prints them).

Reads mutmut's result files (``mutants/**/*.py.meta``) and prints, per mutated module, how
many mutants were generated, killed, survived, timed out, had no test calling them, and were
not run yet; then the surviving mutants' names (``mutmut show NAME`` prints one's diff).
Standalone on purpose: ``make test`` type-checks this file without mutmut installed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

#: mutmut 3's exit-code convention for a mutant's test run (``mutmut.stats``).
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    2: "interrupted",
    None: "not run",
    34: "skipped",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "type check",
    -11: "segfault",
    -9: "segfault",
}
COLUMNS = ("killed", "survived", "timeout", "no tests", "not run")


def status(code: int | None) -> str:
    return STATUS_BY_EXIT_CODE.get(code, "suspicious")


def main(root: Path = Path("mutants")) -> int:
    metas = sorted(root.glob("wf_persist/**/*.py.meta"))
    if not metas:
        print("no mutation results under mutants/: run `make mutation` first")
        return 1
    survivors: list[str] = []
    total: Counter[str] = Counter()
    header = f"{'module':34} {'mutants':>7} " + " ".join(f"{c:>9}" for c in COLUMNS)
    print(header)
    print("-" * len(header))
    for meta in metas:
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes:
            continue
        counts = Counter(status(code) for code in codes.values())
        total.update(counts)
        total["mutants"] += len(codes)
        module = str(meta.relative_to(root)).removesuffix(".meta")
        print(f"{module:34} {len(codes):>7} " + " ".join(f"{counts[c]:>9}" for c in COLUMNS))
        survivors += sorted(k for k, code in codes.items() if status(code) == "survived")
    print("-" * len(header))
    print(f"{'total':34} {total['mutants']:>7} " + " ".join(f"{total[c]:>9}" for c in COLUMNS))
    other = {k: v for k, v in total.items() if k not in (*COLUMNS, "mutants")}
    if other:
        print("other:", dict(other))
    print(f"\n{len(survivors)} surviving mutant(s) (docs/mutation.md says why each is left):")
    for name in survivors:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
