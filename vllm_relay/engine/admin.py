"""The engine core's side of the serving surface: what the OpenAI server's relay endpoints and its
`/metrics` series read and change.

`RelayAdmin` belongs to a `RelayEngine` (engine/core.py), which tells it when a prompt is
registered, admitted, reused, or fails to fill. It keeps, per registration: when and how it was
registered, its text (a chat system message or completion text), the requests it served and the
system tokens they reused, and the chat requests that carried its text but did not match its
tokens. It also remembers the last failed registration of a name, so a listing can say so.

The utility calls built on it are RelayEngine's (`relay_prompt_add`, `relay_prompt_delete`,
`relay_prompt_list`, `relay_prompt_texts`, `relay_serving_stats`). They never raise for a caller's
mistake: they return `{"error": {"status", "message"}}`, so the front end answers with the right
HTTP status (a raised exception would reach it as a bare message, after a logged traceback).

Threads: `take_chat_expectation` and `check_chat` run on the engine core's input thread (with
routing); everything else on its busy loop. The input thread only increments mismatch counts.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vllm_relay.config import CHAT_SYSTEM_KEY, RelayConfig, check_prompt_name
from vllm_relay.engine.requests import INFO_ATTR, with_sampling
from vllm_relay.system_prompts.chat import first_difference
from vllm_relay.system_prompts.fill import fill_request_id

if TYPE_CHECKING:
    from vllm_relay.engine.pages import PromptPages
    from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry

# The `vllm_xargs` key the OpenAI server's relay middleware sets on a chat request whose system
# message is a registered prompt's text: the name of that prompt (see entrypoints/middleware.py).
CHAT_EXPECT_KEY = "vllm_relay_chat"
# How a registration was given; "config" is the start-up configuration.
SOURCES = ("config", "text", "token_ids", "messages")
# Token ids shown on each side of the first difference in a mismatch warning.
MISMATCH_CONTEXT_TOKENS = 4


@dataclass(slots=True)
class PromptUsage:
    created_at: float
    source: str
    text: str | None  # the chat system message or completion text it was given as, if any
    chat: bool  # `text` is a chat system message (else completion text, or no text)
    requests: int = 0
    tokens_reused: int = 0
    chat_mismatches: int = 0
    warned: bool = False


def error(status: int, message: str) -> dict:
    return {"error": {"status": status, "message": message}}


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.relay.engine")


class RelayAdmin:
    def __init__(self, registry: SystemPromptRegistry, pages: PromptPages, config: RelayConfig,
                 max_model_len: int) -> None:
        self.registry, self.pages, self.config, self.max_model_len = registry, pages, config, max_model_len
        self.started_at = time.time()
        self._usage: dict[int, PromptUsage] = {}  # by generation: one per registration
        self._failed: dict[str, dict] = {}  # name -> listing entry of its last failed fill
        self._cancelled: set[str] = set()  # fill request ids aborted by a delete
        self.fills_cancelled = 0
        self.chat_mismatches = 0

    # ---- what the utility calls read and change (RelayEngine.prompt_*) ------------------------

    def refuse_add(self, name: str, token_ids: list[int], source: str, replace: bool) -> dict | None:
        """Why `token_ids` may not be registered as `name` ({"error"}), or None: they may.

        An existing name is a conflict (409) unless `replace` (the server re-rendering a start-up
        chat prompt with its own template: the same tokens are a no-op, others replace it).
        """
        registry = self.registry
        try:
            check_prompt_name(name)
        except ValueError as e:
            return error(400, str(e))
        if source not in SOURCES:
            return error(400, f"source {source!r}: must be one of {list(SOURCES)}")
        current = registry.get(name)
        if current is not None and not replace:
            return error(
                409,
                f"system prompt {name!r} already exists ({current.state}, slot "
                f"{current.slot}); delete it first",
            )
        what = f"system prompt {name!r}"
        if not isinstance(token_ids, list) or not token_ids:
            return error(422, f"{what}: empty token ids (a system prompt needs at least 1 token)")
        n, limit, max_len = len(token_ids), self.config.max_prompt_tokens, self.max_model_len
        if n > limit:
            return error(413, f"{what}: {n} tokens, more than max_prompt_tokens={limit}")
        if n >= max_len:
            return error(
                413,
                f"{what}: {n} tokens leave no room for a request's own tokens within max_model_len={max_len}",
            )
        busy = current is not None and (current.state != "ready" or current.refcount > 0)
        if busy and current.token_ids != tuple(token_ids):
            return error(
                409,
                f"cannot replace {what}: it is {current.state} with {current.refcount} "
                f"request(s) running on it",
            )
        if current is None and not registry.free_slots():
            taken = [p.name for p in registry.prompts()]
            return error(
                507,
                f"cannot register {what}: no free slot, all max_prompts="
                f"{self.config.max_prompts} are taken by {taken}; delete one first",
            )
        return None

    def added(self, prompt: SystemPrompt, source: str, text: str | None) -> dict:
        """`prompt`, just registered by `relay_prompt_add`, as given: {"prompt": entry}."""
        usage = self._usage[prompt.generation]
        if usage.source != "config" or source == "config":
            usage.source, usage.text, usage.chat = source, text, source != "text"
        self._failed.pop(prompt.name, None)
        return {"prompt": self.entry(prompt)}

    def delete(self, name: str, abort_requests: Callable[[list[str]], None]) -> dict:
        """Stop routing to `name`; {"prompt": entry} with state "draining" (requests still run
        on it; its slot is freed after the last) or "removed", or {"error"} (404). A filling
        prompt's fill is aborted with `abort_requests` (the engine core's)."""
        registry = self.registry
        prompt = registry.get(name)
        if prompt is None:
            if (failed := self._failed.pop(name, None)) is not None:
                return {"prompt": {**failed, "state": "removed"}}
            draining = sum(p.refcount for p in registry.prompts() if p.name == name)
            more = (
                f" (its last registration is draining: {draining} request(s) in flight)" if draining else ""
            )
            return error(404, f"no system prompt named {name!r}{more}")
        if prompt.state == "filling":
            # Abort its fill: the engine drops the prompt and frees the slot when the fill request
            # is freed, within this call; requests held for it then run the ordinary way.
            rid = fill_request_id(prompt)
            self._cancelled.add(rid)
            abort_requests([rid])
            if registry.get(name) is not prompt:
                return {"prompt": self.entry(prompt, state="removed")}
            self._cancelled.discard(rid)  # its fill had finished already: drain it instead
            if prompt.state == "filling":
                return error(
                    409, f"system prompt {name!r} is filling and its fill could not be aborted; retry"
                )
        registry.drain(name)
        self.pages.sweep(registry)  # an idle prompt gives its pages back now
        return {"prompt": self.entry(prompt, state="draining" if prompt.refcount else "removed")}

    def listing(self) -> list[dict]:
        """Every prompt holding a slot (filling, ready, draining) by slot, then failed ones."""
        prompts = self.registry.prompts()
        self._forget_gone(prompts)
        return [self.entry(p) for p in prompts] + list(self._failed.values())

    def texts(self) -> dict[str, dict]:
        """{name: {"generation", "text", "chat"}} of the routable prompts given as text."""
        return {
            p.name: {"generation": p.generation, "text": u.text, "chat": u.chat}
            for p in self.registry.prompts()
            if p.state != "draining" and (u := self._usage.get(p.generation)) and u.text
        }

    def entry(self, p: SystemPrompt, state: str | None = None) -> dict:
        u = self._usage.get(p.generation) or self._adopt(p)
        return {
            "name": p.name,
            "state": state or p.state,
            "tokens": p.num_tokens,
            "shared_tokens": self.pages.relay_len(p),
            "slot": p.slot,
            "live_requests": p.refcount,
            "requests_served": u.requests,
            "tokens_reused": u.tokens_reused,
            "chat_mismatches": u.chat_mismatches,
            "created_at": int(u.created_at),
            "source": u.source,
            "generation": p.generation,
        }

    # ---- events from the RelayEngine (busy loop) ---------------------------------------------

    def on_registered(self, prompt: SystemPrompt, spec: Any) -> None:
        """A registration (start-up, offline helper or `add`): record when and how it was given."""
        self._failed.pop(prompt.name, None)  # a name registered again is no longer a failed one
        if prompt.generation in self._usage:
            return  # the same tokens again: the same registration
        text = (
            spec if isinstance(spec, str) else spec.get(CHAT_SYSTEM_KEY) if isinstance(spec, dict) else None
        )
        if self.config.system_prompts.get(prompt.name) == spec:
            source = "config"
        else:
            source = (
                "text" if isinstance(spec, str) else "messages" if isinstance(spec, dict) else "token_ids"
            )
        self._usage[prompt.generation] = PromptUsage(time.time(), source, text, isinstance(spec, dict))
        self._forget_gone(self.registry.prompts())

    def on_admitted(self, prompt: SystemPrompt) -> None:
        if (u := self._usage.get(prompt.generation)) is not None:
            u.requests += 1

    def on_schedule(self, out, system_lens: dict[str, int], requests: dict[str, Any]) -> None:
        """Per-prompt share of `system_tokens_reused` (see RelayEngine.on_schedule); `requests`
        are the scheduler's, by id."""
        started = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.resumed_req_ids)
        for rid in started:
            S = system_lens.get(rid)
            info = getattr(requests.get(rid), INFO_ATTR, None) if S else None
            if info is not None and (u := self._usage.get(info.prompt.generation)) is not None:
                u.tokens_reused += S

    def failed(self) -> list[dict]:
        """The last failed registrations' listing entries (with "error": why), oldest first."""
        return list(self._failed.values())

    def fill_cancelled(self, rid: str) -> bool:
        """Whether fill `rid` ended because its prompt was deleted (else: it failed)."""
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            self.fills_cancelled += 1
            return True
        return False

    def on_fill_failed(self, prompt: SystemPrompt, reason: str) -> None:
        failed = {**self.entry(prompt), "state": "failed", "slot": None, "live_requests": 0, "error": reason}
        self._failed.pop(prompt.name, None)
        self._failed[prompt.name] = failed
        while len(self._failed) > self.config.max_prompts:  # bounded: the latest few
            self._failed.pop(next(iter(self._failed)))

    # ---- chat requests that should have matched (input thread) -------------------------------

    def take_chat_expectation(self, request) -> tuple[Any, str | None]:
        """Strip CHAT_EXPECT_KEY from a request's extra_args; (request, expected prompt name)."""
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        if not extra or CHAT_EXPECT_KEY not in extra:
            return request, None
        sp = copy.copy(sp)
        sp.extra_args = {k: v for k, v in extra.items() if k != CHAT_EXPECT_KEY} or None
        expected = extra[CHAT_EXPECT_KEY]
        return with_sampling(request, sp), expected if isinstance(expected, str) else None

    def check_chat(self, expected: str | None, ids: list[int]) -> None:
        """A chat request carries the text of prompt `expected`: count a mismatch (and warn once
        per registration, saying why) when its token ids do not start with that prompt's."""
        if expected is None:
            return
        target = self.registry.get(expected)
        u = self._usage.get(target.generation) if target is not None else None
        if target is None or u is None or target.state != "ready":
            return  # deleted, replaced or still filling: nothing to compare against
        P, S = list(target.token_ids), target.num_tokens
        if ids[:S] == P:
            return
        u.chat_mismatches += 1
        self.chat_mismatches += 1
        if u.warned:
            return
        u.warned = True
        at = first_difference(ids, P)
        k = MISMATCH_CONTEXT_TOKENS
        if not u.chat:
            why = (
                "it was registered as completion text, not as a chat system message (register it "
                'with "messages" or {"chat_system": ...})'
            )
        elif at >= S - k:
            why = (
                "likely a tokenizer boundary: the text after the system message (e.g. a user message "
                "starting with a space or newline) changes how its last tokens are tokenized"
            )
        else:
            why = (
                "likely another chat template: the request's chat_template, chat_template_kwargs or "
                "tools, or a server started without the relay endpoint plugin's rendering"
            )
        _logger().warning(
            "vllm-relay: a chat request carries the system message of prompt %r but does not start with "
            "its %d tokens (first difference at token %d: request %s vs prompt %s); %s. It runs the "
            "ordinary way; counted in vllm_relay_chat_mismatches_total. Logged once per registration.",
            expected,
            S,
            at,
            ids[at : at + k],
            P[at : at + k],
            why,
        )

    # ---- helpers -----------------------------------------------------------------------------

    def _adopt(self, p: SystemPrompt) -> PromptUsage:
        # A registration made before this admin existed (cannot happen once attached).
        u = PromptUsage(self.started_at, "config", None, False)
        self._usage[p.generation] = u
        return u

    def _forget_gone(self, prompts: list[SystemPrompt]) -> None:
        live = {p.generation for p in prompts}
        for generation in [g for g in self._usage if g not in live]:
            del self._usage[generation]
