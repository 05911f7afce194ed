"""`minivllm router --prefill URL... --decode URL...` (disaggregated prefill/decode) or
`minivllm router --instance URL...` (plain data parallelism); server/router.py is the app.

At startup every instance is asked its kv_role (GET /load); the router exits with status 2 and
a message naming the URL if one cannot be reached within --startup-timeout, if a --prefill URL
is not a KV producer, or a --decode URL not a KV consumer.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="route requests over prefill/decode instances (or plain instances)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill instances (`minivllm serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}'`)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="decode instances (`minivllm serve --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'`)")
    p.add_argument("--instance", nargs="+", default=[], metavar="URL",
                   help="ordinary instances: each request goes to the one with the fewest requests in flight")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--startup-timeout", type=float, default=30.0,
                   help="seconds to wait for every instance to answer at startup")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds an instance may stay silent on a request before the client gets an error")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_router)


class RouterConfigError(Exception):
    """The router cannot start: the message names the flag and URL."""


def check_args(args: argparse.Namespace) -> None:
    if args.instance and (args.prefill or args.decode):
        raise RouterConfigError("give either --prefill and --decode (disaggregated) or --instance (plain), not both")
    if not args.instance and not (args.prefill and args.decode):
        raise RouterConfigError("give --prefill URL... and --decode URL... (disaggregated prefill/decode), or "
                                "--instance URL... (plain data parallelism)")


def instance_role(url: str, deadline: float) -> str | None:
    """The instance's kv_role (None: an ordinary instance), asked until `deadline` (monotonic)."""
    last = None
    while True:
        try:
            r = httpx.get(url.rstrip("/") + "/load", timeout=5.0)
            if r.status_code == 200:
                return r.json().get("kv_role")
            last = f"GET /load answered {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise RouterConfigError(f"{url} cannot be reached ({last}); is `minivllm serve` running there?")
        time.sleep(0.5)


def check_roles(prefill: list[str], decode: list[str], instances: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in prefill:
        role = instance_role(url, deadline)
        if role not in PRODUCER_ROLES:
            raise RouterConfigError(
                f"--prefill {url} is not a KV producer (its kv_role is {role!r}); start it with "
                "--kv-transfer-config '{\"kv_role\": \"kv_producer\"}'")
    for url in decode:
        role = instance_role(url, deadline)
        if role not in CONSUMER_ROLES:
            raise RouterConfigError(
                f"--decode {url} is not a KV consumer (its kv_role is {role!r}); start it with "
                "--kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'")
    for url in instances:
        instance_role(url, deadline)  # reachable (any role serves whole requests)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from minivllm.server.router import Router, create_router_app
    try:
        check_args(args)
        check_roles(args.prefill, args.decode, args.instance, args.startup_timeout)
    except RouterConfigError as e:
        print(f"minivllm router: error: {e}", file=sys.stderr)
        return 2
    router = Router(args.prefill, args.decode, args.instance, args.request_timeout)
    mode = (f"{len(args.prefill)} prefill + {len(args.decode)} decode instances" if args.prefill
            else f"{len(args.instance)} instances")
    print(f"minivllm router: {mode} behind http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(create_router_app(router), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
