"""Compile once, replay always: Dynamo trace, split at attention, Inductor per piece, disk cache, CUDA graphs."""

from kiln.compile.cache import (
    CompileCache,
    JsonFolder,
    cache_key_inputs,
    cache_root,
    default_cache_root,
    pin_triton_setup,
)
from kiln.compile.compiled_model import CompiledModel
from kiln.compile.counters import CompileCounters
from kiln.compile.cudagraph import default_capture_sizes

__all__ = [
    "CompileCache",
    "CompileCounters",
    "JsonFolder",
    "CompiledModel",
    "cache_key_inputs",
    "cache_root",
    "default_cache_root",
    "default_capture_sizes",
    "pin_triton_setup",
]
