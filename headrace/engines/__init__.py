"""Rollout engines for actors (no JAX at import): what generates an actor's tokens.

`actor.engine: jax` is the project's jitted sampler (`headrace.model.sampler.Sampler`); `vllm`
is a vLLM OpenAI server per actor (`headrace.engines.vllm_engine`), whose worker extension
(`headrace.engines.vllm_worker`) runs inside vLLM's own environment, which has no JAX. The seam
both satisfy is `headrace.engines.base.Engine` (docs/engines.md).
"""
