"""Past one machine: replicas of a Runtime behind a cache-aware router (see docs/scaleout.md).

`config` (RouterConfig) imports nothing heavy; `router` is the policy; `replica`,
`fleet` and `deploy` put it on Ray Serve, and only `deploy` imports Ray.
"""
