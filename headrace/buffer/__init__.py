"""Trajectory buffer: the contract, an in-memory backend, Redis Streams, and serialization."""

from headrace.buffer.base import Buffer, BufferError, BufferFull
from headrace.buffer.memory import MemoryBuffer
from headrace.buffer.redis_stream import RedisBuffer
from headrace.buffer.serialize import MalformedEntry, decode, encode

__all__ = ["Buffer", "BufferError", "BufferFull", "MalformedEntry", "MemoryBuffer", "RedisBuffer",
           "decode", "encode"]
