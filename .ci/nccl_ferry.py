"""The NCCL ferry (issue 51): NCCL 2.31's ``libnccl.so.2`` (the release that lets two or more ranks
share one GPU, ``NCCL_MULTI_RANK_GPU_ENABLE=1``) carried to the lent GPU machine, which reaches no
package index and takes at most 64 MiB per ``run`` call -- the library is 299 MB.

Invariant: the library that ``join`` writes on the device is byte for byte the one in the PyPI wheel:
its sha256 is checked against the hash the wheel's own ``RECORD`` lists, after every chunk was
checked against the manifest. Nothing here needs more than the standard library on the device (the
chunks are one xz stream: Python's ``lzma`` decompresses it; the device image has no ``zstd``).

Here (the CPU machine, which reaches PyPI)::

    bash .ci/nccl-kit                  # -> .nccl-kit/MANIFEST.json + .nccl-kit/part-1 .. part-N

On the device, in every call that carries one or more parts (``carry: [".nccl-kit/MANIFEST.json",
".nccl-kit/part-K"]``), first::

    python3 .ci/nccl_ferry.py stash    # verified parts move to /tmp/ws-nccl (outside the tree: a
                                       # later carry replaces the tree's copies, never these)
    python3 .ci/nccl_ferry.py join     # once all are there: /tmp/ws-nccl/libnccl.so.2, verified;
                                       # otherwise it names the missing parts and exits 3

``env`` prints the ``export`` lines the NCCL parts run under (``.ci/gpu`` reads them itself).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
KIT = os.environ.get("WS_NCCL_KIT", os.path.join(ROOT, ".nccl-kit"))
MANIFEST = "MANIFEST.json"
#: where the device keeps the parts and the joined library: outside the work tree
STASH = os.environ.get("WS_NCCL_STASH", "/tmp/ws-nccl")
LIBRARY = "libnccl.so.2"
#: the wheel: NCCL 2.30 added NCCL_MULTI_RANK_GPU_ENABLE; cu13 matches the device's torch (+cu130)
WHEEL = "nvidia-nccl-cu13==2.31.2"
#: a part and the rest of a call (the tracked tree, ~4 MiB, and the manifest) stay under 64 MiB
PART_MIB = 56
#: the first part rides with the vLLM kit (.kit, ~25 MiB) in the first call
FIRST_PART_MIB = 30


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _record_sha256(wheel: str, member: str) -> str:
    """The hex sha256 the wheel's RECORD lists for ``member`` (RECORD stores urlsafe base64)."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        for line in z.read(record).decode().splitlines():
            path, digest, _size = line.rsplit(",", 2)
            if path == member:
                algo, b64 = digest.split("=", 1)
                assert algo == "sha256", digest
                return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    raise SystemExit(f"nccl-ferry: {member} is not listed in {os.path.basename(wheel)}'s RECORD")


def pack(args: argparse.Namespace) -> int:
    """Download the wheel, then ``pack_wheel`` it into ``KIT``."""
    tmp = tempfile.mkdtemp(prefix="ws-nccl-pack-")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux_2_18_x86_64",
                        "--platform", "manylinux2014_x86_64", "-d", tmp, args.wheel], check=True)
        wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        pack_wheel(wheel, KIT)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pack_wheel(wheel: str, kit: str, *, first_mib: float = FIRST_PART_MIB, part_mib: float = PART_MIB,
               level: str = "-9e") -> dict:
    """Check the wheel's ``libnccl.so.2`` against its RECORD, compress it (xz), split it into parts under
    ``kit`` (emptied first) with ``MANIFEST.json``; returns the manifest."""
    tmp = tempfile.mkdtemp(prefix="ws-nccl-lib-")
    try:
        member = "nvidia/nccl/lib/" + LIBRARY
        want = _record_sha256(wheel, member)
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, tmp)
        lib = os.path.join(tmp, member)
        got = _sha256(lib)
        if got != want:
            raise SystemExit(f"nccl-ferry: {member} sha256 {got} != RECORD's {want}")
        xz = lib + ".xz"
        print(f"nccl-ferry: compressing {os.path.getsize(lib) / 2**20:.0f} MiB (xz {level}, minutes for NCCL)",
              flush=True)
        with open(xz, "wb") as out:
            subprocess.run(["xz", level, f"-T{max(1, os.cpu_count() or 1)}", "-c", lib], stdout=out, check=True)
        shutil.rmtree(kit, ignore_errors=True)
        os.makedirs(kit)
        parts, size = [], os.path.getsize(xz)
        with open(xz, "rb") as f:
            k = 0
            while True:
                chunk = f.read(int((first_mib if k == 0 else part_mib) * 2**20))
                if not chunk:
                    break
                k += 1
                name = f"part-{k}"
                with open(os.path.join(kit, name), "wb") as p:
                    p.write(chunk)
                parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
        doc = {"wheel": os.path.basename(wheel), "library": LIBRARY, "library_bytes": os.path.getsize(lib),
               "library_sha256": want, "compressed": "xz", "compressed_bytes": size,
               "compressed_sha256": _sha256(xz), "parts": parts}
        with open(os.path.join(kit, MANIFEST), "w") as f:
            json.dump(doc, f, indent=1)
        print(f"nccl-ferry: {len(parts)} parts in {kit} ({size / 2**20:.0f} MiB): "
              + ", ".join(f"{p['name']} {p['bytes'] / 2**20:.0f} MiB" for p in parts))
        return doc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _manifest() -> dict:
    for where in (os.path.join(KIT, MANIFEST), os.path.join(STASH, MANIFEST)):
        if os.path.exists(where):
            with open(where) as f:
                return json.load(f)
    raise SystemExit(f"nccl-ferry: no {MANIFEST} in {KIT} or {STASH}: carry .nccl-kit/{MANIFEST} along")


def stash(_args: argparse.Namespace) -> int:
    """Move every carried part whose hash matches the manifest into ``STASH``; say what is still missing."""
    doc = _manifest()
    os.makedirs(STASH, exist_ok=True)
    if os.path.exists(os.path.join(KIT, MANIFEST)):
        shutil.copyfile(os.path.join(KIT, MANIFEST), os.path.join(STASH, MANIFEST))
    for p in doc["parts"]:
        here = os.path.join(KIT, p["name"])
        if not os.path.exists(here):
            continue
        got = _sha256(here)
        if got != p["sha256"]:
            print(f"nccl-ferry: {p['name']} arrived damaged (sha256 {got[:12]} != {p['sha256'][:12]}): carry it again")
            continue
        shutil.move(here, os.path.join(STASH, p["name"]))
        print(f"nccl-ferry: stashed {p['name']} ({p['bytes'] / 2**20:.0f} MiB, sha256 ok)")
    missing = _missing(doc)
    print(f"nccl-ferry: {len(doc['parts']) - len(missing)} of {len(doc['parts'])} parts in {STASH}"
          + (f"; missing: {', '.join(missing)}" if missing else "; all there: run join"))
    return 0


def _missing(doc: dict) -> list[str]:
    out = []
    for p in doc["parts"]:
        path = os.path.join(STASH, p["name"])
        if not os.path.exists(path) or os.path.getsize(path) != p["bytes"]:
            out.append(p["name"])
    return out


def join(_args: argparse.Namespace) -> int:
    """Join the stashed parts, decompress, and verify the library against the wheel's RECORD hash."""
    doc = _manifest()
    lib = os.path.join(STASH, LIBRARY)
    if os.path.exists(lib) and _sha256(lib) == doc["library_sha256"]:
        print(f"nccl-ferry: {lib} already joined (sha256 {doc['library_sha256'][:16]}, {doc['wheel']})")
        return 0
    missing = _missing(doc)
    if missing:
        print(f"nccl-ferry: cannot join: missing {', '.join(missing)} in {STASH} (the machine went back, or the "
              f"call that carried them did not run 'stash'): carry them again")
        return 3
    comp = hashlib.sha256()
    dec = lzma.LZMADecompressor()
    part_lib = lib + ".partial"
    with open(part_lib, "wb") as out:
        for p in doc["parts"]:
            with open(os.path.join(STASH, p["name"]), "rb") as f:
                data = f.read()
            comp.update(data)
            out.write(dec.decompress(data))
    if comp.hexdigest() != doc["compressed_sha256"]:
        os.remove(part_lib)
        print("nccl-ferry: the joined parts do not hash to the manifest's compressed_sha256")
        return 4
    got = _sha256(part_lib)
    if got != doc["library_sha256"]:
        os.remove(part_lib)
        print(f"nccl-ferry: the library hashes to {got}, not {doc['library_sha256']} ({doc['wheel']}'s RECORD)")
        return 4
    os.replace(part_lib, lib)
    for p in doc["parts"]:  # the disk holds the library once
        os.remove(os.path.join(STASH, p["name"]))
    print(f"nccl-ferry: joined {lib}: {doc['library_bytes']} bytes, sha256 {got} == {doc['wheel']}'s RECORD")
    return 0


def env_lines(_args: argparse.Namespace | None = None) -> int:
    """The environment the one-GPU NCCL parts run under (``export`` lines), or exit 3 without the library."""
    lib = os.path.join(STASH, LIBRARY)
    if not os.path.exists(lib):
        print(f"# no {lib}: run the ferry (docs/gpu.md)", file=sys.stderr)
        return 3
    for k, v in (("WS_NCCL_SO", lib), ("VLLM_NCCL_SO_PATH", lib), ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                 ("NCCL_NVLS_ENABLE", "0")):
        print(f"export {k}={v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: download, verify, compress and split")
    p.add_argument("--wheel", default=WHEEL)
    sub.add_parser("stash", help="device: keep the carried parts, verified")
    sub.add_parser("join", help="device: join, decompress, verify")
    sub.add_parser("env", help="device: the export lines for the NCCL parts")
    args = ap.parse_args(argv)
    return {"pack": pack, "stash": stash, "join": join, "env": env_lines}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
