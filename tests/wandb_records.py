"""Read back the history of a W&B offline run (``run-ID.wandb``) for the tests.

wandb 0.31 ships no Python reader of its own (the old ``wandb.sdk.internal.datastore`` went with the move to
wandb-core), so this reads the file's framing -- the LevelDB log format: a 7-byte file header ``:W&B``, 0xBEE1,
version 0; 32 KiB blocks of records, each with a 7-byte header (CRC-32 of type byte + data, length, type
FULL/FIRST/MIDDLE/LAST) -- and checks every record's CRC, then decodes each record with wandb's own protobuf
``wandb_internal_pb2.Record``. A framing mistake fails the CRC check instead of passing silently.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding (a flushed, unfilled block)
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at byte {pos}"
        pos += HEADER + length
        if kind == FULL:
            pending = body
        elif kind == FIRST:
            pending = body
            continue
        elif kind == MIDDLE:
            pending += body
            continue
        else:
            assert kind == LAST, kind
            pending += body
        record = pb.Record()
        record.ParseFromString(pending)
        out.append(record)
    return out


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} of the offline run(s) under ``run_dir/wandb``."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir / 'wandb'}"
    out: dict[int, dict[str, float]] = {}
    for path in files:
        for rec in records(path):
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {"/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
                     for i in rec.history.item}
            step = int(items.pop("_step"))
            out[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out
