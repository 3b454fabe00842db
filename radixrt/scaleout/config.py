"""The router's settings, importable without torch (the command line reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["prefix", "round_robin", "least_load"]
POLICIES: tuple[Policy, ...] = ("prefix", "round_robin", "least_load")
Reason = Literal["prefix", "load", "round_robin"]


@dataclass(frozen=True)
class RouterConfig:
    """How the router trades cache affinity against load.

    min_match_tokens: a shorter best match routes by load instead (a shared
        chat template's first tokens are no reason to pile up on a replica).
    max_load_gap: how many more in-flight requests the best-matching replica
        may have than the least loaded one before a request goes elsewhere.
    """

    policy: Policy = "prefix"
    min_match_tokens: int = 32
    max_load_gap: int = 4

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("min_match_tokens", "max_load_gap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
