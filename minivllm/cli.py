"""The `minivllm` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from minivllm.engine.args import add_engine_args, engine_kwargs


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def _sampling_params(args: argparse.Namespace):
    from minivllm import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _stream(engine, prompt, params, out=sys.stdout) -> str:
    """Runs one request, printing text as it is produced; returns the whole text."""
    rid = engine.next_request_id()
    engine.add_request(rid, prompt, params)
    printed, text = 0, ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            text = o.outputs[0].text
            out.write(text[printed:])
            out.flush()
            printed = len(text)
    out.write("\n")
    return text


def _make_engine(args):
    from minivllm.engine.llm_engine import LLMEngine
    return LLMEngine.from_kwargs(**engine_kwargs(args))


def cmd_generate(args) -> int:
    params = _sampling_params(args)  # bad values fail before the model loads
    engine = _make_engine(args)
    prompt = args.prompt
    if not args.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        from minivllm.engine.tokenizer import apply_chat_template
        prompt = {"prompt_token_ids": apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])}
    _stream(engine, prompt, params)
    return 0


def cmd_chat(args) -> int:
    from minivllm.engine.tokenizer import apply_chat_template
    params = _sampling_params(args)
    engine = _make_engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("minivllm chat: type a message; Ctrl-D or /exit to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = apply_chat_template(engine.tokenizer, messages)
        try:
            reply = _stream(engine, {"prompt_token_ids": ids}, params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm", description="A small, fast LLM inference and serving engine.")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="an interactive conversation using the model's chat template")
    c.add_argument("--system", default=None, help="a system message")
    add_engine_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    _add_optional_commands(sub)
    return p


def _add_optional_commands(sub) -> None:
    """serve and bench live in their own packages; each registers its sub-command."""
    try:
        from minivllm.server.cli import register as register_serve
        from minivllm.server.router_cli import register as register_router
        register_serve(sub)
        register_router(sub)
    except ImportError:
        pass
    try:
        from minivllm.bench.cli import register as register_bench
        register_bench(sub)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
