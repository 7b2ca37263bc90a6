"""`RelayServing`: vllm-relay's endpoint plugin for vLLM's OpenAI server (`vllm.endpoint_plugins`).

vLLM loads endpoint plugins only when they are named in `VLLM_PLUGINS`, an allowlist that also
filters the general plugins: serve with `VLLM_PLUGINS=relay` (both entry points are named `relay`).
The registry stays in the engine core; this plugin reaches it through the engine core's utility
calls, which the `relay` general plugin installs (engine/core.py UTILITY_CALLS, engine/admin.py),
and adds:

- the `/v1/relay/system_prompts` routes (routes.py);
- the relay series in `/metrics` (metrics.py), read every `metrics_interval_s`;
- start-up `{"chat_system": ...}` prompts rendered with this server's chat template: the engine
  core renders them with the model's default template before the server exists; once the server's
  own renderer is there, each is rendered again and, if its tokens differ (`--chat-template`),
  registered again with those before the server accepts requests;
- a middleware that tells the engine core which prompt a chat request's system message is, so a
  mismatch is counted and explained (middleware.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi.responses import JSONResponse

from vllm_relay.config import CHAT_SYSTEM_KEY, RelayConfig
from vllm_relay.entrypoints.chat import chat_system_prompt_ids, system_message_text
from vllm_relay.entrypoints.engines import (
    call_each,
    engine_ranks,
    first_error,
    is_first_front_end,
    merge_listings,
)
from vllm_relay.entrypoints.protocol import RequestError, error_body

# How often a registration that waits for its fill asks whether it is done, and for how long.
FILL_POLL_INTERVAL_S = 0.05
MAX_FILL_WAIT_S = 600.0


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.serving")


class RelayServing:
    """The plugin object vLLM instantiates (a zero-argument factory) in the API server process."""

    name = "relay"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None
        self.online_renderer: Any = None
        self.config: RelayConfig | None = None
        self.metrics: Any = None
        self._by_text: dict[str, str] = {}  # registered text -> prompt name, for the middleware
        self._seen: frozenset = frozenset()  # (name, generation) of the texts in _by_text
        self._poller: asyncio.Task | None = None

    # ---- vLLM's EndpointPlugin interface -----------------------------------------------------

    def attach_router(self, app) -> None:
        from vllm_relay.entrypoints.middleware import ChatExpectationMiddleware
        from vllm_relay.entrypoints.routes import build_router

        args = getattr(app.state, "args", None)
        additional = getattr(args, "additional_config", None)
        config = RelayConfig.from_vllm(additional if isinstance(additional, dict) else None)
        app.include_router(build_router(self, admin=config.admin_routes))
        app.add_middleware(ChatExpectationMiddleware, prompts_by_text=lambda: self._by_text)

    async def init_state(self, engine_client, state, args) -> None:
        from vllm_relay.protocol import relay_enabled

        if engine_client is None or not relay_enabled(engine_client.vllm_config):
            _logger().info("vllm-relay: relay endpoints idle (relay attention is not enabled on this server)")
            return
        self.engine_client, self.online_renderer = engine_client, state.online_renderer
        self.config = RelayConfig.from_vllm(engine_client.vllm_config.additional_config)
        await self._render_startup_chat_prompts()
        if is_first_front_end(engine_client):  # one exporter, also with several API server processes
            from vllm_relay.entrypoints.metrics import RelayMetrics

            model_name = engine_client.vllm_config.model_config.served_model_name
            self.metrics = RelayMetrics(model_name, engine_ranks(engine_client), self.config.max_prompts)
        await self.refresh()
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    # ---- what the routes use -----------------------------------------------------------------

    def unavailable(self) -> JSONResponse | None:
        if self.engine_client is None:
            body = error_body(
                404, "relay attention is not enabled on this server (--attention-backend relay)"
            )
            return JSONResponse(body, status_code=404)
        return None

    async def listing(self) -> list[dict]:
        return merge_listings(list((await call_each(self.engine_client, "relay_prompt_list")).values()))

    async def token_ids(self, reg) -> tuple[list[int], str | None]:
        """(token ids, text) of a registration; RequestError for what cannot be used."""
        from vllm.exceptions import VLLMValidationError

        what = f"system prompt {reg.name!r}"
        try:
            if reg.form == "token_ids":
                return list(reg.value), None
            if reg.form == "text":
                return await self._text_token_ids(reg.value), reg.value
            text = system_message_text(reg.value)
            return await chat_system_prompt_ids(self.online_renderer, what, text), text
        except VLLMValidationError as e:
            if e.parameter in ("input_text", "input_tokens"):
                limit = self.config.max_prompt_tokens
                raise RequestError(
                    413,
                    f"{what}: longer than max_model_len={self.engine_client.model_config.max_model_len}"
                    f" tokens (a system prompt may have up to max_prompt_tokens={limit})",
                    reg.form,
                ) from None
            raise RequestError(422, f"{what}: {e}", reg.form) from None
        except ValueError as e:
            raise RequestError(422, str(e), reg.form) from None

    async def wait_filled(
        self, name: str, generation: int, timeout_s: float = MAX_FILL_WAIT_S
    ) -> dict | None:
        """The registration's entry once ready or failed (or still filling after `timeout_s`);
        None if it was deleted meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            entry = next(
                (e for e in await self.listing() if e["name"] == name and e["generation"] == generation), None
            )
            if entry is None or entry["state"] != "filling" or time.monotonic() > deadline:
                return entry
            await asyncio.sleep(FILL_POLL_INTERVAL_S)

    def remember_text(self, name: str, text: str | None, chat: bool) -> None:
        """A registration through this process: known to the middleware at once (other API
        server processes learn it at their next refresh)."""
        self.forget_text(name)
        if text and (chat or text not in self._by_text):
            self._by_text = {**self._by_text, text: name}

    def forget_text(self, name: str) -> None:
        self._by_text = {t: n for t, n in self._by_text.items() if n != name}

    # ---- engine reads ------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every engine's relay stats into the metrics; reload the prompts' texts if the
        registrations changed."""
        stats = await call_each(self.engine_client, "relay_serving_stats")
        if self.metrics is not None:
            for engine, reading in stats.items():
                self.metrics.update(engine, reading)
        seen = frozenset(
            (p["name"], p["generation"])
            for reading in stats.values()
            for p in reading["prompts"]
            if p["state"] in ("filling", "ready")
        )
        if seen != self._seen:
            texts = next(iter((await call_each(self.engine_client, "relay_prompt_texts")).values()))
            by_text: dict[str, str] = {}
            for name, t in sorted(texts.items(), key=lambda item: item[1]["chat"]):  # chat ones win a tie
                by_text[t["text"]] = name
            self._by_text, self._seen = by_text, seen

    async def _poll(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                await self.refresh()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep serving; say so once per outage
                if not failing:
                    _logger().warning("vllm-relay: reading the engine's relay stats failed: %s", e)
                failing = True

    async def _text_token_ids(self, text: str) -> list[int]:
        """`text` tokenized as a completion prompt is, by this server's renderer."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self.online_renderer.render_completion(CompletionRequest(prompt=text, max_tokens=1))
        if isinstance(result, ErrorResponse):
            raise ValueError(result.error.message)
        return list(result[0]["prompt_token_ids"])

    async def _render_startup_chat_prompts(self) -> None:
        for name, spec in self.config.system_prompts.items():
            if not isinstance(spec, dict):
                continue
            text = spec[CHAT_SYSTEM_KEY]
            ids = await chat_system_prompt_ids(
                self.online_renderer, f"RelayConfig.system_prompts[{name!r}]", text
            )
            results = await call_each(self.engine_client, "relay_prompt_add", name, ids, "config", text, True)
            if (err := first_error(results)) is not None:
                raise RuntimeError(
                    f"vllm-relay: system prompt {name!r} with the server's chat template: {err['message']}"
                )
            entry = next(iter(results.values()))["prompt"]
            if entry["state"] == "filling":
                _logger().info(
                    "vllm-relay: system prompt %r rendered with this server's chat template: %d tokens; "
                    "filling it again",
                    name,
                    len(ids),
                )
                entry = await self.wait_filled(name, entry["generation"])
                if entry is None or entry["state"] != "ready":
                    raise RuntimeError(
                        f"vllm-relay: system prompt {name!r} with the server's chat template: "
                        f"its fill did not complete ({entry and entry['state']})"
                    )
