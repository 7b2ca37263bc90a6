"""`/v1/relay/system_prompts`: list, read, register and delete system prompts over HTTP.

The routes live under `/v1`, so vLLM's `--api-key` check guards them like the OpenAI routes.
With `admin_routes: false` only the two GET routes exist. Shapes and statuses: protocol.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_relay.entrypoints.engines import call_each, first_error
from vllm_relay.entrypoints.protocol import (
    RequestError,
    error_body,
    list_object,
    parse_registration,
    prompt_object,
)

if TYPE_CHECKING:
    from vllm_relay.entrypoints.plugin import RelayServing

PATH = "/v1/relay/system_prompts"


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def build_router(serving: RelayServing, admin: bool) -> APIRouter:
    router = APIRouter()

    @router.get(PATH)
    async def list_prompts() -> JSONResponse:
        if (off := serving.unavailable()) is not None:
            return off
        limits = {
            "max_prompts": serving.config.max_prompts,
            "max_prompt_tokens": serving.config.max_prompt_tokens,
        }
        return JSONResponse({**list_object(await serving.listing()), **limits})

    @router.get(PATH + "/{name}")
    async def get_prompt(name: str) -> JSONResponse:
        if (off := serving.unavailable()) is not None:
            return off
        entries = [e for e in await serving.listing() if e["name"] == name]
        if not entries:
            return error_response(404, f"no system prompt named {name!r}")
        # The current registration over a draining one of the same name.
        return JSONResponse(prompt_object(min(entries, key=lambda e: e["state"] == "draining")))

    if not admin:
        return router

    @router.post(PATH)
    async def add_prompt(raw: Request) -> JSONResponse:
        if (off := serving.unavailable()) is not None:
            return off
        try:
            reg = parse_registration(await raw.body())
            token_ids, text = await serving.token_ids(reg)
        except RequestError as e:
            return error_response(e.status, e.message, e.param)
        results = await call_each(
            serving.engine_client, "relay_prompt_add", reg.name, token_ids, reg.form, text
        )
        if (err := first_error(results)) is not None:
            return error_response(
                err["status"], err["message"], reg.form if err["status"] in (413, 422) else None
            )
        entry = next(iter(results.values()))["prompt"]
        serving.remember_text(reg.name, text, chat=reg.form == "messages")
        if reg.wait:
            entry = await serving.wait_filled(reg.name, entry["generation"])
            if entry is None:
                return error_response(409, f"system prompt {reg.name!r} was deleted while it was filling")
            if entry["state"] == "failed":
                why = entry.get("error") or "see the server log"
                return error_response(500, f"the fill of system prompt {reg.name!r} failed: {why}")
        return JSONResponse(prompt_object(entry), status_code=201 if entry["state"] == "ready" else 202)

    @router.delete(PATH + "/{name}")
    async def delete_prompt(name: str) -> JSONResponse:
        if (off := serving.unavailable()) is not None:
            return off
        results = await call_each(serving.engine_client, "relay_prompt_delete", name)
        if (err := first_error(results)) is not None:
            return error_response(err["status"], err["message"])
        serving.forget_text(name)
        return JSONResponse({**prompt_object(next(iter(results.values()))["prompt"]), "deleted": True})

    return router
