"""An OpenAI-compatible gateway: any agent's chat calls become exact trajectories (docs/gateway.md)."""
