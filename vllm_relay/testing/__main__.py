"""``python -m vllm_relay.testing build [--out DIR] [NAME ...]``: build and print model paths."""

import argparse
import time

from vllm_relay.testing.models import MODEL_NAMES, get_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_relay.testing")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build (or find cached) model folders and print their paths")
    build.add_argument("--out", help="cache folder (default: $VLLM_RELAY_CACHE or <repo>/.cache/models)")
    build.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {', '.join(MODEL_NAMES)}")
    args = parser.parse_args(argv)
    if unknown := set(args.names) - set(MODEL_NAMES):
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(MODEL_NAMES)}")
    for name in args.names or MODEL_NAMES:
        start = time.perf_counter()
        path = get_model(name, cache_dir=args.out)
        print(f"{name}\t{path}\t{time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
