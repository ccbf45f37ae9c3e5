"""The typed, pickle-free codec: msgspec msgpack plus tensors anywhere in a message.

A `torch.Tensor` in any field (or nested in lists, tuples and dicts of an `Any` field) is encoded as a
msgpack extension value:

    ext 1  InlineTensor(dtype, shape, data)              at most `inline_tensor_bytes`
    ext 2  TensorRef(segment, offset, nbytes, dtype,     larger: copied once into the sender's arena
                     shape, flags)                       (see `shm.py`), received as a zero-copy view
    ext 3  FrameRef(index, nbytes, dtype, shape)        larger, where there is no shared memory (TCP):
                                                         copied once at send into its own zmq frame,
                                                         received as a view of that frame

A message is then `[msgpack, frame 1, frame 2, ...]`; `encode_frames` returns that list and
`Decoder.frames` holds the current message's frames while it (and its `Raw` parts) are decoded.

Tensors are detached, moved to CPU and made contiguous at send. The receiver validates every handle
before touching memory: the dtype must be in the allowlist, the shape non-negative, `nbytes` exactly
`numel * itemsize`, and the segment a private segment of the announced peer with every offset in bounds.
Anything else raises `ProtocolError`; nothing is ever unpickled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from asyncexec.errors import ProtocolError
from asyncexec.ipc.shm import ShmArena, ShmReader

__all__ = ["DTYPES", "Decoder", "Encoder", "FrameRef", "InlineTensor", "TensorRef"]

EXT_INLINE = 1
EXT_SHM = 2
EXT_FRAME = 3
MAX_NDIM = 64

_DTYPE_ALLOWLIST = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_ALLOWLIST
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class InlineTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: memoryview


class TensorRef(msgspec.Struct, array_like=True, gc=False):
    """A handle to a tensor in the sender's shared memory. Never trusted: see `Decoder`."""

    segment: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    flags: int


class FrameRef(msgspec.Struct, array_like=True, gc=False):
    """A tensor that travels as frame `index` of its message."""

    index: int
    nbytes: int
    dtype: str
    shape: list[int]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Encoder:
    """One reusable msgpack encoder. Large tensors go through `arena`, or, without one, into frames of
    their own. Owned by a single thread.
    """

    def __init__(self, arena: ShmArena | None, inline_tensor_bytes: int) -> None:
        self.arena = arena
        self.inline_tensor_bytes = inline_tensor_bytes
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inner = msgspec.msgpack.Encoder()
        self._num_receivers = 1
        self._frames: list[memoryview] = []

    def encode(self, msg: Any, num_receivers: int = 1) -> bytes:
        """Encode `msg` for `num_receivers` peers as one buffer (shared-memory mode)."""
        frames = self.encode_frames(msg, num_receivers)
        if len(frames) > 1:
            raise TypeError("this message carries tensor frames: send it with encode_frames")
        return frames[0]  # type: ignore[return-value]

    def encode_frames(self, msg: Any, num_receivers: int = 1) -> list[bytes | memoryview]:
        """Encode `msg` as `[msgpack, tensor frames...]`, copying large tensors now."""
        self._num_receivers = num_receivers
        self._frames = []
        try:
            return [self._enc.encode(msg), *self._frames]
        finally:
            self._frames = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        raise TypeError(
            f"objects of type {type(obj).__qualname__} cannot be sent; use msgspec-supported types or tensors"
        )

    def _encode_tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"tensors of dtype {t.dtype} cannot be sent")
        nbytes = t.numel() * t.element_size()
        shape = list(t.shape)
        if nbytes <= self.inline_tensor_bytes:
            data = memoryview(_as_bytes(t.contiguous()).numpy().data) if nbytes else memoryview(b"")
            return msgspec.msgpack.Ext(EXT_INLINE, self._inner.encode(InlineTensor(name, shape, data)))
        if self.arena is None:  # a private copy: the caller may change `t` before zmq sends it
            private = _as_bytes(t.contiguous().clone() if t.is_contiguous() else t.contiguous())
            self._frames.append(memoryview(private.numpy().data))
            frame_ref = FrameRef(len(self._frames), nbytes, name, shape)
            return msgspec.msgpack.Ext(EXT_FRAME, self._inner.encode(frame_ref))
        region = self.arena.allocate(nbytes, self._num_receivers)
        dst = torch.frombuffer(region.payload, dtype=torch.uint8).view(t.dtype).view(t.shape)
        dst.copy_(t)
        ref = TensorRef(region.segment, region.offset, nbytes, name, shape, region.flags)
        return msgspec.msgpack.Ext(EXT_SHM, self._inner.encode(ref))


class Decoder:
    """Typed decoders sharing one tensor ext hook; `reader` resolves shared-memory handles."""

    def __init__(self, reader: ShmReader | None) -> None:
        self.reader = reader
        self.frames: Sequence[Any] = ()  # the current message's frames (index 0 is its msgpack)
        self._inline = msgspec.msgpack.Decoder(InlineTensor)
        self._ref = msgspec.msgpack.Decoder(TensorRef)
        self._frame_ref = msgspec.msgpack.Decoder(FrameRef)
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    def decoder_for(self, type_: Any) -> Callable[[bytes | memoryview], Any]:
        """The cached `decode` function for `type_` (any msgspec-supported type, tensors included)."""
        dec = self._decoders.get(type_)
        if dec is None:
            dec = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)
            self._decoders[type_] = dec
        return dec.decode

    def decode(self, buf: bytes | memoryview, type_: Any = Any) -> Any:
        """Decode and validate `buf` as `type_`; any malformed input raises `ProtocolError`."""
        try:
            return self.decoder_for(type_)(buf)
        except ProtocolError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise ProtocolError(f"rejected a malformed message: {e}") from e

    def _ext_hook(self, code: int, data: memoryview) -> torch.Tensor:
        if code == EXT_INLINE:
            m = self._inline.decode(data)
            dtype, numel = _check_meta(m.dtype, m.shape)
            if len(m.data) != numel * dtype.itemsize:
                raise ProtocolError(f"inline tensor of shape {m.shape} {m.dtype} carries {len(m.data)} bytes")
            if numel == 0:
                return torch.empty(m.shape, dtype=dtype)
            return torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(dtype).view(m.shape)
        if code == EXT_FRAME:
            fr = self._frame_ref.decode(data)
            dtype, numel = _check_meta(fr.dtype, fr.shape)
            if not 0 < fr.index < len(self.frames):
                raise ProtocolError(
                    f"tensor frame {fr.index} is not in this {len(self.frames)}-frame message"
                )
            buf = memoryview(self.frames[fr.index])
            if fr.nbytes != numel * dtype.itemsize or buf.nbytes != fr.nbytes or fr.nbytes == 0:
                raise ProtocolError(f"tensor frame of shape {fr.shape} {fr.dtype} has {buf.nbytes} bytes")
            with warnings.catch_warnings():  # a received frame is read-only; the view is too, by contract
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(fr.shape)
        if code == EXT_SHM:
            if self.reader is None:
                raise ProtocolError("shared-memory tensor handle on a channel without shared memory")
            ref = self._ref.decode(data)
            dtype, numel = _check_meta(ref.dtype, ref.shape)
            if ref.nbytes != numel * dtype.itemsize or ref.nbytes == 0:
                raise ProtocolError(
                    f"tensor handle of shape {ref.shape} {ref.dtype} claims {ref.nbytes} bytes"
                )
            view = self.reader.view(ref.segment, ref.offset, ref.nbytes, ref.flags)
            return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(ref.shape)
        raise ProtocolError(f"unknown msgpack extension code {code}")


def _check_meta(dtype_name: str, shape: list[int]) -> tuple[torch.dtype, int]:
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ProtocolError(f"unknown or disallowed tensor dtype {dtype_name!r}")
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ProtocolError(f"invalid tensor shape {shape}")
    return dtype, math.prod(shape)


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise TypeError(f"expected {type_.__qualname__}, got {type(obj).__qualname__}")
