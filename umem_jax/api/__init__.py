"""The user-facing surface: the offline LLM, the asyncio engine, the OpenAI-compatible server,
its protocol and its Prometheus metrics."""
