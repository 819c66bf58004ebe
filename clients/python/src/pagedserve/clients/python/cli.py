"""`pagedserve client generate` (or `pagedserve-client generate` from the client's own
distribution): call a running server from the shell (prints the text to stdout)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_client_parser(sub: Any) -> None:
    client = sub.add_parser("client", help="call a running pagedserve server")
    actions = client.add_subparsers(dest="client_command", required=True)
    gen = actions.add_parser("generate", help="generate a completion and print it")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--address", default="127.0.0.1:50051", help="the control plane's gRPC HOST:PORT")
    gen.add_argument(
        "--model",
        default=None,
        help="model name to ask for: one of the server's --served-model-name names; the server refuses "
        "any other with NOT_FOUND (default: the served model)",
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling mass, in (0, 1] (default: the server's, 1.0)",
    )
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: unseeded)")
    gen.add_argument("--stop", action="append", default=[], help="stop string, repeatable (default: none)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="constrain the output to JSON valid under this JSON Schema (its text, or @FILE); at most one "
        "of the constraint flags (default: unconstrained)",
    )
    constraint.add_argument(
        "--json-object", action="store_true", help="constrain the output to any JSON object"
    )
    constraint.add_argument(
        "--regex",
        default=None,
        help="constrain the output to match this regular expression (default: unconstrained)",
    )
    constraint.add_argument(
        "--choice",
        action="append",
        default=None,
        help="constrain the output to exactly one of the --choice values, repeatable (default: unconstrained)",
    )
    constraint.add_argument(
        "--grammar",
        default=None,
        help="constrain the output to this EBNF grammar (GBNF dialect, a `root` rule; its text, or @FILE) "
        "(default: unconstrained)",
    )
    gen.add_argument(
        "--tool",
        action="append",
        default=[],
        metavar="JSON",
        help='a function the model may call (needs --chat), repeatable: OpenAI\'s JSON {"name", '
        '"description", "parameters"} or @FILE; after the text, one JSON line per completion '
        "with its finish_reason, content and tool_calls (default: none)",
    )
    gen.add_argument(
        "--tool-choice",
        default=None,
        help="none, auto, required or function:NAME (needs --chat) (default: auto with tools, none without)",
    )
    gen.add_argument(
        "--no-parallel-tool-calls",
        action="store_true",
        help="at most one tool call per completion (needs --chat)",
    )
    gen.add_argument("--stream", action="store_true", help="print text as it arrives")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    # Read when the command runs, so --help never prints the key itself.
    gen.add_argument(
        "--api-key",
        default=None,
        help="API key, sent as a Bearer token (default: $PAGEDSERVE_API_KEY, else none)",
    )
    gen.add_argument("--tls", action="store_true", help="connect over TLS (system roots)")
    gen.add_argument(
        "--tls-ca-file",
        default=None,
        help="connect over TLS, verifying with this CA (default: none; plaintext unless --tls)",
    )
    gen.set_defaults(func=cmd_client_generate)


def cmd_client_generate(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.clients.python.client import Completion, GenerationClient

    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    tool_flags = [
        flag
        for flag, given in (
            ("--tool", args.tool),
            ("--tool-choice", args.tool_choice is not None),
            ("--no-parallel-tool-calls", args.no_parallel_tool_calls),
        )
        if given
    ]
    if tool_flags and not args.chat:
        verb = "needs" if len(tool_flags) == 1 else "need"
        message = f"{' and '.join(tool_flags)} {verb} --chat (tools go with a chat prompt)"
        print(f"pagedserve: error: {message}", file=sys.stderr)
        return 2
    try:
        json_schema, grammar = _text_or_file(args.json_schema), _text_or_file(args.grammar)
        tools = [json.loads(_text_or_file(t) or "") for t in args.tool]
        tool_choice = _tool_choice(args.tool_choice)
    except (OSError, ValueError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        model=args.model or "",  # proto3: "" is unset, the server's served model
        json_schema=json_schema,
        json_object=args.json_object,
        regex=args.regex,
        choice=args.choice,
        grammar=grammar,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=False if args.no_parallel_tool_calls else None,
    )
    try:
        with GenerationClient(
            args.address,
            timeout=args.timeout,
            api_key=args.api_key if args.api_key is not None else os.environ.get("PAGEDSERVE_API_KEY"),
            tls=args.tls,
            tls_ca_file=args.tls_ca_file,
        ) as client:
            if args.stream:
                for item in client.generate_stream(prompt, **kwargs):
                    if isinstance(item, Completion):
                        print(flush=True)
                        _report(item)
                        _tool_line(item, tool_flags)
                    else:
                        print(item.text, end="", flush=True)
            else:
                for completion in client.generate(prompt, **kwargs):
                    print(completion.text)
                    _report(completion)
                    _tool_line(completion, tool_flags)
    except grpc.RpcError as exc:
        print(f"pagedserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _tool_choice(value: str | None) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if value.startswith("function:") and value != "function:":
        return {"name": value.removeprefix("function:")}
    raise ValueError(f"--tool-choice must be none, auto, required or function:NAME, got {value!r}")


def _tool_line(c: Any, tool_flags: list[str]) -> None:
    """With tool flags: the completion's calls as one JSON line (as the Go and Java examples)."""
    if not tool_flags:
        return
    calls = [{"id": t.id, "name": t.name, "arguments": t.arguments} for t in c.tool_calls]
    line = {"index": c.index, "finish_reason": c.finish_reason, "content": c.content, "tool_calls": calls}
    print(json.dumps(line), flush=True)


def _text_or_file(value: str | None) -> str | None:
    """A flag's text, or the contents of FILE for "@FILE"."""
    if value is None or not value.startswith("@"):
        return value
    with open(value[1:], encoding="utf-8") as f:
        return f.read()


def _report(c: Any) -> None:
    print(
        f"[{c.finish_reason}; {c.prompt_tokens} prompt ({c.cached_tokens} cached) + {c.completion_tokens} "
        f"generated tokens; ttft {c.time_to_first_token_seconds * 1000:.0f} ms, total {c.e2e_seconds:.2f} s]",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """`pagedserve-client`: the client's commands without the server's shell."""
    parser = argparse.ArgumentParser(prog="pagedserve-client", description="call a running pagedserve server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_client_parser(sub)
    # add_client_parser mounts `client generate`; the client's own command starts one level down.
    args = parser.parse_args(["client", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
