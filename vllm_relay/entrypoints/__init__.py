"""The OpenAI server's side of vllm-relay: an endpoint plugin (`vllm.endpoint_plugins`, loaded with
`VLLM_PLUGINS=relay`) with the system-prompt routes, the /metrics series and chat-template rendering.

  plugin.py      RelayServing: vLLM's EndpointPlugin (attach_router, init_state), the state routes use
  routes.py      /v1/relay/system_prompts: GET (list, one), POST (register), DELETE (drain)
  protocol.py    request parsing, response objects, OpenAI-style errors (pure)
  chat.py        chat system prompts rendered with the server's own template
  middleware.py  tags chat requests carrying a registered prompt's text, for the mismatch check
  metrics.py     the vllm_relay_* Prometheus series
  engines.py     calls into each engine core's relay utility methods
"""
