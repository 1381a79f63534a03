"""Opening a GGUF file with gguf-py's reader, and one clear error for a file it cannot read
(a file cut short by an interrupted download or copy, anything that is not a GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, ReaderField

#: A GGUF v2/v3 file's fixed header: magic, version, tensor count, key-value count.
_HEADER_BYTES = 4 + 4 + 8 + 8


class _ShortRead(Exception):
    """A read past the end of the file, with what it was reading (see :class:`_BoundedReader`)."""


class _BoundedReader(GGUFReader):
    """gguf-py's reader, refusing to read past the end of the file.

    ``GGUFReader`` slices its mapping without checking the file's size, so a short file fails
    later on an empty or short slice (an ``IndexError``, a numpy view or reshape error) that
    does not say what is wrong; here the first such read raises :class:`_ShortRead` naming
    the part of the file it needed. Every read of the reader goes through ``_get`` (one
    comparison more per read), here on a plain array view of the mapping (4-5x faster
    metadata parse than on the ``np.memmap``). ``_get``, ``_build_tensors``
    and a tensor field's parts (its offset last) are gguf-py's internals (as of 0.19), and
    ``_get`` no longer calls gguf-py's: tests/unit/test_gguf_convert.py's truncated-file
    tests and its field-for-field comparison with gguf-py's own reader notice if they change.
    """

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: Literal["I", "S", "<"] | None = None) -> np.ndarray:
        # gguf-py's _get (0.19), on a plain ndarray view of the mapping: slicing the
        # np.memmap itself runs memmap's Python __getitem__ / __array_finalize__ on every
        # read, and the metadata is read one string at a time (Llama 3's 128,256 tokens and
        # 280,147 merges: ~1.2 M reads); the view shares the mapping, nothing is copied
        dt = np.dtype(dtype)
        offset, count = int(offset), int(count)
        end = offset + dt.itemsize * count
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        if end > plain.size:
            raise _ShortRead(self._short_read(offset, end))
        arr = plain[offset:end].view(dt)
        return arr.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self._tensor_infos = (int(start_offs), fields)  # to name a tensor whose data is cut
        super()._build_tensors(start_offs, fields)

    def _short_read(self, start: int, end: int) -> str:
        """What a read of bytes ``start`` to ``end`` was for, and the file's size."""
        size = int(self.data.size)
        need = f"needs bytes {start} to {end} but the file has {size} bytes"
        infos = getattr(self, "_tensor_infos", None)
        if infos is not None:  # the tensor data: the read at a tensor's offset is its data
            base, fields = infos
            name = next((f.name for f in fields if base + int(f.parts[-1][0]) == start), None)
            return f"tensor {name!r} {need}" if name else f"its tensor data {need}"
        kv, n_tensors = self.get_field("GGUF.kv_count"), self.get_field("GGUF.tensor_count")
        if kv is None or n_tensors is None:
            return f"the file has {size} bytes, fewer than a GGUF header's {_HEADER_BYTES}"
        n_kv, n_tensors = int(kv.contents()), int(n_tensors.contents())
        done = len(self.fields) - 3  # GGUF.version, GGUF.tensor_count, GGUF.kv_count
        if done < n_kv:
            return f"its metadata (key-value pair {done + 1} of {n_kv}) {need}"
        return f"its tensor index ({n_tensors} tensors) {need}"


def open_gguf(path: str | Path, mode: Literal["r", "c"] = "r") -> GGUFReader:
    """gguf-py's :class:`GGUFReader` over ``path``, or one clear error for a file it cannot
    read: a file cut short (an interrupted download or copy) fails here, whether the cut is
    in its header, its metadata or its tensor data, not later on a numpy error. Nothing but
    the header and metadata is read; tensors are checked against the file's size only.

    Args:
        path: the GGUF file.
        mode: ``r`` (read-only mapping) or ``c`` (private copy-on-write mapping).

    Returns:
        The reader, every tensor's data within the file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a complete GGUF file (truncated or corrupt: the message
            names the file, what part of it is missing, e.g. a tensor and the bytes it needs,
            and the file's size), or not a GGUF file at all, or one gguf-py cannot read
            (e.g. an unsupported version).
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes), not a GGUF file")
    try:
        return _BoundedReader(path, mode=mode)
    except _ShortRead as exc:
        raise ValueError(
            f"{path} is not a complete GGUF file (truncated or corrupt): {exc}") from None
    except (ValueError, KeyError, IndexError, OverflowError) as exc:
        why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"{path} cannot be read as a GGUF file: {why}") from exc
