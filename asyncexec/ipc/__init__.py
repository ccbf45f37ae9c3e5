"""Inter-process plumbing: the typed codec, the shared-memory arena and the ZeroMQ channels."""

from asyncexec.ipc.codec import Decoder, Encoder, TensorRef
from asyncexec.ipc.shm import ShmArena, ShmReader, sweep_stale_segments

__all__ = ["Decoder", "Encoder", "ShmArena", "ShmReader", "TensorRef", "sweep_stale_segments"]
