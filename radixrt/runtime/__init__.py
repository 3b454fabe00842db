"""The Python API: `Runtime` (api), the caller-side input handling (inputs) and the engine thread (driver)."""

from radixrt.runtime.api import Runtime

__all__ = ["Runtime"]
