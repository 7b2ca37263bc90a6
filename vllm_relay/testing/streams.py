"""Many concurrent streaming clients against an OpenAI-compatible vLLM server; every answer checked.

``python -m vllm_relay.testing.streams --url http://127.0.0.1:8000 --model NAME --system TEXT
--streams 1024 [--relay-share 0.75] [--max-tokens 32] [--drop 16] [--server-log LOG] [--out JSON]``

Sends `--streams` streaming requests at once (aiohttp, no OpenAI SDK): a `--relay-share` of them
are chat completions whose system message is `--system` (the server must have it registered as a
`chat_system` prompt, so relay serves them), the others plain completions (the ordinary path).
`--drop` of the streams, half relay and half plain, disconnect after their first chunk. Each
request has its own id (`request_id`), and the check is, for every stream that was not dropped:
HTTP 200; every chunk carries its own id and no other stream's; exactly one finish reason; the
usage chunk reports `--max-tokens` completion tokens (`ignore_eos`); `[DONE]` exactly once, last.
With `--server-log` (the server logging relay's summary every second: `log_stats_interval_s` 1),
the relay requests counted by the engine cores (summed over data-parallel engines) must have grown
by exactly the number of relay requests sent, dropped ones included (they reached the engine).
Prints a JSON summary; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

# "(EngineCore_DP1 pid=123) ... vllm-relay: ... relay requests 17, ..." -> per engine core, the last count.
SUMMARY = re.compile(r"^\((?P<proc>EngineCore[^)]*)\).*vllm-relay: .*relay requests (?P<n>\d+),")
QUESTIONS = ["Where is my parcel?", "How do I reset my password?", "Can I change my delivery address?",
             "What is your refund policy?", "Do you ship abroad?", "Why was my card declined?"]


def relay_requests_logged(log: Path) -> int:
    """Relay requests counted by the engine cores, from the last summary line of each in `log`."""
    last: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := SUMMARY.match(line):
            last[m["proc"]] = int(m["n"])
    return sum(last.values())


def requests(args) -> list[dict]:
    """One request per stream: (id, route, body, relay, drop)."""
    out = []
    num_relay = round(args.streams * args.relay_share)
    for i in range(args.streams):
        relay = i < num_relay
        drop = (i < args.drop // 2) if relay else (i - num_relay < args.drop - args.drop // 2)
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"
        body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "request_id": f"s{i}"}
        if relay:
            body["messages"] = [{"role": "system", "content": args.system},
                                {"role": "user", "content": question}]
            out.append({"id": f"chatcmpl-s{i}", "route": "/v1/chat/completions", "body": body, "relay": True,
                        "drop": drop})
        else:
            body["prompt"] = f"Customer question: {question}\nAnswer:"
            out.append({"id": f"cmpl-s{i}", "route": "/v1/completions", "body": body, "relay": False,
                        "drop": drop})
    return out


async def one_stream(session, url: str, req: dict) -> dict:
    """Send one request and read its stream; returns what was seen."""
    seen = {"id": req["id"], "status": None, "ids": Counter(), "finishes": 0, "done": 0, "after_done": 0,
            "usage": None, "error": None}
    try:
        async with session.post(url + req["route"], json=req["body"]) as resp:
            seen["status"] = resp.status
            if resp.status != 200:
                seen["error"] = (await resp.text())[:300]
                return seen
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if seen["done"]:
                    seen["after_done"] += 1
                if data == "[DONE]":
                    seen["done"] += 1
                    continue
                chunk = json.loads(data)
                seen["ids"][chunk.get("id")] += 1
                if chunk.get("usage"):
                    seen["usage"] = chunk["usage"]
                seen["finishes"] += sum(c.get("finish_reason") is not None for c in chunk.get("choices", []))
                if req["drop"]:
                    return seen  # disconnect after the first chunk
    except Exception as e:  # noqa: BLE001 - recorded as this stream's failure
        seen["error"] = f"{type(e).__name__}: {e}"
    return seen


def problems(req: dict, seen: dict, max_tokens: int) -> list[str]:
    if req["drop"]:
        ok = seen["status"] == 200 and not seen["error"]
        return [] if ok else [f"{req['id']}: dropped stream failed: {seen}"]
    bad = []
    if seen["status"] != 200 or seen["error"]:
        bad.append(f"status {seen['status']}, {seen['error']}")
    if set(seen["ids"]) != {req["id"]}:
        bad.append(f"chunk ids {dict(seen['ids'])}")
    if seen["finishes"] != 1:
        bad.append(f"{seen['finishes']} finish reasons")
    if seen["done"] != 1 or seen["after_done"]:
        bad.append(f"[DONE] {seen['done']} times, {seen['after_done']} chunks after it")
    if not seen["usage"] or seen["usage"].get("completion_tokens") != max_tokens:
        bad.append(f"usage {seen['usage']}")
    return [f"{req['id']}: {'; '.join(bad)}"] if bad else []


async def run(args) -> dict:
    import aiohttp

    reqs = requests(args)
    log = Path(args.server_log) if args.server_log else None
    before = relay_requests_logged(log) if log else None
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        seen = await asyncio.gather(*(one_stream(session, args.url, r) for r in reqs))
    elapsed = time.perf_counter() - start
    bad = [p for r, s in zip(reqs, seen) for p in problems(r, s, args.max_tokens)]
    owners = Counter(i for s in seen for i in set(s["ids"]))  # streams each response id appeared in
    answered = [r["id"] for r, s in zip(reqs, seen) if not r["drop"] and not problems(r, s, args.max_tokens)]
    summary = {
        "streams": len(reqs), "relay_sent": sum(r["relay"] for r in reqs),
        "dropped": sum(r["drop"] for r in reqs), "answered": len(answered),
        "lost": [r["id"] for r, s in zip(reqs, seen) if not r["drop"] and not s["done"]],
        "duplicated": sorted(i for i, n in owners.items() if n > 1),
        "problems": bad[:20], "num_problems": len(bad), "elapsed_s": round(elapsed, 2),
        "completion_tokens_per_s": round(len(answered) * args.max_tokens / elapsed, 1),
    }
    if log is not None:
        # The engine cores log their summary every log_stats_interval_s once it changes: wait for it.
        deadline = time.monotonic() + args.log_wait_s
        counted = relay_requests_logged(log) - before
        while counted != summary["relay_sent"] and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            counted = relay_requests_logged(log) - before
        summary["relay_counted"] = counted
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_relay.testing.streams",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--system", required=True, help="the system message relay has registered (chat_system)")
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--relay-share", type=float, default=0.75)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--drop", type=int, default=0, help="streams that disconnect after their first chunk")
    p.add_argument("--server-log", help="the server's log, to check relay's counters")
    p.add_argument("--log-wait-s", type=float, default=15.0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", help="also write the summary here")
    args = p.parse_args(argv)
    if not 0 <= args.drop <= args.streams or not 0.0 <= args.relay_share <= 1.0:
        p.error("--drop must be in [0, --streams] and --relay-share in [0, 1]")
    summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    ok = (summary["num_problems"] == 0 and not summary["lost"] and not summary["duplicated"]
          and summary["answered"] == summary["streams"] - summary["dropped"]
          and summary.get("relay_counted", summary["relay_sent"]) == summary["relay_sent"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
