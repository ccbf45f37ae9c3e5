"""Workers: the per-rank actor (`Worker`) and its process loop (`asyncexec.worker.proc`)."""

from asyncexec.worker.worker import GPUWorker, Worker

__all__ = ["GPUWorker", "Worker"]
