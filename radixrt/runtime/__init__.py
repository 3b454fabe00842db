"""The Python API: `Runtime` (api), the caller-side input handling (inputs) and the engine thread (driver)."""

from radixrt.runtime.api import Runtime
from radixrt.tree import ALL_NAMESPACES

__all__ = ["ALL_NAMESPACES", "Runtime"]
