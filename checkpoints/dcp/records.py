"""Which torch.save records of a DCP shard are laid out alike, read from their zip
bytes (`elastrain.checkpoints.dcp.reader` decodes the first of each layout with torch's
decoder and views the others from it). Pure Python.

torch.save writes a zip of stored (uncompressed) entries: the pickle, a few small
metadata entries, one entry per storage, and a per-save serialization id. DCP writes one
such record per tensor, and its shards are written without the zip crc32
(`elastrain.checkpoints.dcp.writer.without_zip_crc32`), so records of same-shaped tensors
differ only in their data and their serialization id.
"""

from __future__ import annotations

import struct

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_ZIP64 = 0xFFFFFFFF

# Where a record's storage data and serialization id lie: (data start, data length,
# [(start, end) of the bytes a layout key leaves out]).
_Places = tuple[int, int, tuple[tuple[int, int], ...]]


class ZipLayouts:
    """Keys of torch.save records by layout, for one load.

    A record's key is all its bytes except its storage's data and its per-save
    serialization id (which decoding never reads): two records with the same key decode
    to tensors of the same dtype, shape and strides, each over its own data. Finding
    those two byte ranges means parsing the zip's directory; records with the same
    directory bytes (names, sizes, offsets: same-shaped tensors) have them in the same
    places, so each distinct directory is parsed once."""

    def __init__(self) -> None:
        self._places: dict[bytes, _Places | None] = {}

    def key(self, record: memoryview) -> tuple[bytes, int, int] | None:
        """(key, data start, data length) of `record`, or None when it is not a stored
        (uncompressed, non-zip64) zip of exactly one storage: such records always take
        torch's decoder."""
        size = len(record)
        if size < _EOCD.size:
            return None
        sig, _d, _cd, _n, _count, cd_size, cd_offset, _c = _EOCD.unpack_from(
            record, size - _EOCD.size
        )
        if sig != b"PK\x05\x06" or _ZIP64 in (cd_size, cd_offset) or cd_offset >= size:
            return None
        directory = bytes(record[cd_offset:])
        if directory not in self._places:
            self._places[directory] = _parse_places(record, cd_offset, _count)
        places = self._places[directory]
        if places is None:
            return None
        data_start, data_len, left_out = places
        key = bytearray()
        at = 0
        for start, end in left_out:
            key += record[at:start]
            at = end
        key += record[at:]
        return bytes(key), data_start, data_len


def _parse_places(record: memoryview, cd_offset: int, count: int) -> _Places | None:
    size = len(record)
    data: tuple[int, int] | None = None
    left_out: list[tuple[int, int]] = []
    at = cd_offset
    for _ in range(count):
        if at + _CENTRAL.size > size:
            return None
        (sig, _v, _vn, _f, method, _t, _dt, _crc, csize, usize, nlen, xlen, clen, *_r, local) = (
            _CENTRAL.unpack_from(record, at)
        )
        if sig != b"PK\x01\x02" or method != 0 or csize != usize or _ZIP64 in (csize, local):
            return None
        name = bytes(record[at + _CENTRAL.size : at + _CENTRAL.size + nlen])
        at += _CENTRAL.size + nlen + xlen + clen
        if local + _LOCAL.size > size:
            return None
        lsig, *_l, lnlen, lxlen = _LOCAL.unpack_from(record, local)
        start = local + _LOCAL.size + lnlen + lxlen
        if lsig != b"PK\x03\x04" or start + csize > cd_offset:
            return None
        if b"/data/" in name:
            if data is not None or not name.endswith(b"/data/0"):
                return None  # several storages: not this simple layout
            data = (start, csize)
            left_out.append((start, start + csize))
        elif name.endswith(b"/.data/serialization_id"):
            left_out.append((start, start + csize))
    if data is None:
        return None
    return data[0], data[1], tuple(sorted(left_out))
