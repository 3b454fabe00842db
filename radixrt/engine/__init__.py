"""The engine: requests, the prefix-aware scheduler and the step loop."""
