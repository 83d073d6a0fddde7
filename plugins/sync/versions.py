"""Mixed vLLM versions: which payload fields a server's vLLM parses, and what to do about the others.

**Each server gets a payload its vLLM version parses** (a 0.34 trainer beside 0.33 servers, or the
other way round). vLLM's worker builds its init / update info with ``InfoClass(**payload)``, so a
field it does not know is an "unexpected keyword" error (0.34's NCCL init payload always carries
``"use_load_plan": false``, which a 0.33 worker rejects). ``VLLMHTTPClient`` reads every server's
``GET /version`` once and, per server (``payload_for``), leaves out each field of ``ADDED_FIELDS``
that the server's version predates while the field holds its default (the value that means "as
before": omitting it changes nothing on any version). A field at a non-default value that a server
predates is refused with ``ServerVersionError`` naming the server, both versions and the field,
before the request is sent; ``needs`` lists, from the trainer's init info and metadata alone, the
non-default fields a sync will send, which ``check_compatible`` checks on the sender before
``trainer_init`` so that every rank raises before any collective. A server without ``/version`` (a
proxy, a stand-in) counts as unknown: defaults are left out (safe everywhere), anything else is sent
as is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from weightsync.sources import WeightSyncError

__all__ = ["ADDED_FIELDS", "ServerVersionError", "local_vllm_version", "needs", "parse_vllm_version",
           "payload_for", "too_old"]


class ServerVersionError(WeightSyncError, ValueError):
    """A server's vLLM version cannot parse a payload field the trainer needs at a non-default value."""


#: Fields of vLLM's worker-side payloads that a newer vLLM added: ``{payload: {field: (version that
#: added it, the value that means "as before")}}``. Read from vLLM 0.34.0's
#: ``nccl_common.NCCLWeightTransferInitInfo`` (``use_load_plan``, ``metadata``: direct reload through a
#: load plan) and ``nccl_engine.NCCLWeightTransferUpdateInfo`` (``src``: the broadcasting trainer
#: rank, many senders) against 0.33.0's; the other backends' payloads did not change.
ADDED_FIELDS: dict[str, dict[str, tuple[tuple[int, int], Any]]] = {
    "init_info": {"use_load_plan": ((0, 34), False), "metadata": ((0, 34), None)},
    "update_info": {"src": ((0, 34), 0)},
}

#: What each added field is for, in the refusal's words.
_FIELD_USE = {
    "use_load_plan": "use_load_plan=True (direct reload through a load plan)",
    "metadata": "the load plan's metadata (use_load_plan=True)",
    "src": "a sender other than trainer rank 0 (many senders: ParamMeta.owners[0] != 0)",
}


def parse_vllm_version(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``"0.34.0"``, ``"0.33.1.dev4+gabc"``,
    ``"0.32.0+cpu"``); ``None`` for ``None`` or anything without a leading ``N.N``."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def local_vllm_version() -> str:
    """The trainer's own vLLM version, for messages (``"unknown"`` if it cannot be read)."""
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only for messages
        return "unknown"


def needs(init_info: Any, metadata: Sequence[Any] | None) -> list[tuple[str, str, Any]]:
    """``(payload, field, value)`` for every added field a sync of ``init_info`` (a vLLM
    ``TrainerInitInfo``) and the source's ``metadata`` will send at a non-default value:
    ``use_load_plan=True`` (init field ``use_load_plan``), or, with vLLM's NCCL backend, a parameter
    whose first owner is not rank 0 (update field ``src``)."""
    out: list[tuple[str, str, Any]] = []
    if getattr(init_info, "use_load_plan", False):
        out.append(("init_info", "use_load_plan", True))
    if getattr(init_info, "backend", None) == "nccl" and metadata:
        srcs = sorted({m.owners[0] for m in metadata if getattr(m, "owners", None)} - {0})
        if srcs:
            out.append(("update_info", "src", srcs))
    return out


def too_old(url: str, version: str | None, payload: str, field_: str, value: Any) -> str | None:
    """Why the server at ``url`` (running vLLM ``version``) cannot parse ``field_`` of ``payload`` at
    ``value``; ``None`` if it can (or its version is unknown)."""
    added, _default = ADDED_FIELDS[payload][field_]
    have = parse_vllm_version(version)
    if have is None or have >= added:
        return None
    return (
        f"{url} runs vLLM {version}, whose {payload} has no field {field_!r} (added in vLLM "
        f"{added[0]}.{added[1]}); this trainer runs vLLM {local_vllm_version()} and needs "
        f"{_FIELD_USE.get(field_, field_)} (value {value!r}). Upgrade that server to vLLM >= "
        f"{added[0]}.{added[1]}, or leave {field_!r} at its default"
    )


def payload_for(url: str, version: str | None, payload: str, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (changed in place) as the server at ``url``, running vLLM ``version``, parses it:
    fields it predates are dropped while at their default; ``ServerVersionError`` for one that is
    not."""
    have = parse_vllm_version(version)
    for f, (added, default) in ADDED_FIELDS[payload].items():
        if f not in info or (have is not None and have >= added):
            continue
        if info[f] == default:
            del info[f]
        elif have is not None:
            raise ServerVersionError(too_old(url, version, payload, f, info[f]))
    return info
