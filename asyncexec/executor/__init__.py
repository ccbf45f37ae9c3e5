"""Executors: `Executor.create(config)` picks `UniProcExecutor` or `MultiProcExecutor`."""

from asyncexec.executor.abstract import Executor
from asyncexec.executor.multiproc import MultiProcExecutor
from asyncexec.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiProcExecutor", "UniProcExecutor"]
