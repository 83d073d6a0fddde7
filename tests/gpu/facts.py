"""What one GPU-evidence part found: named checks, numbers and skips, printed as they happen.

Invariant: a part never stops at its first failed check. Every check is printed immediately (with
flush, so a part killed by its timeout still leaves its progress in the log), recorded, and the part
ends by writing one JSON document; the part's exit status is non-zero iff any check failed or the
part raised. The runner (``run_all.py``) and the pytest wrappers read that JSON, never stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

__all__ = ["Facts", "log"]


def log(*parts: Any) -> None:
    print(*parts, flush=True)


class Facts:
    def __init__(self, part: str, *, dry_run: bool = False) -> None:
        self.part = part
        self.dry_run = dry_run
        self.checks: list[dict[str, Any]] = []
        self.numbers: dict[str, Any] = {}
        self.skips: list[dict[str, str]] = []
        self.errors: list[dict[str, str]] = []
        self._t0 = time.perf_counter()

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)[:2000]})
        log(f"[{self.part}] {'PASS' if ok else 'FAIL'} {name}: {detail}")
        return bool(ok)

    def number(self, name: str, value: Any, unit: str = "") -> None:
        self.numbers[name] = value
        log(f"[{self.part}] NUMBER {name} = {value}{(' ' + unit) if unit else ''}")

    def skip(self, name: str, reason: str) -> None:
        self.skips.append({"name": name, "reason": reason[:1000]})
        log(f"[{self.part}] SKIP {name}: {reason}")

    def error(self, name: str, exc: BaseException) -> None:
        tb = traceback.format_exc()[-4000:]
        self.errors.append({"name": name, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        self.checks.append({"name": name, "ok": False, "detail": f"raised {type(exc).__name__}: {exc}"[:2000]})
        log(f"[{self.part}] FAIL {name}: raised {type(exc).__name__}: {exc}\n{tb}")

    @property
    def ok(self) -> bool:
        return not self.errors and all(c["ok"] for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "seconds": round(time.perf_counter() - self._t0, 2),
            "checks": self.checks,
            "numbers": self.numbers,
            "skips": self.skips,
            "errors": self.errors,
        }

    def finish(self, json_path: str | None) -> int:
        doc = self.as_dict()
        npass = sum(c["ok"] for c in self.checks)
        log(
            f"[{self.part}] DONE ok={doc['ok']} checks={npass}/{len(self.checks)} "
            f"skips={len(self.skips)} in {doc['seconds']}s"
        )
        if json_path:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            with open(json_path, "w") as f:
                json.dump(doc, f, indent=1, default=str)
        sys.stdout.flush()
        return 0 if doc["ok"] else 1
