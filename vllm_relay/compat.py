"""What differs between the vLLM releases relay supports (0.32 and 0.33), in one place.

Every other module imports vLLM as the newest supported release lays it out; a name that moved
between the two is imported from here.
"""


def cli_env_setup():
    """vLLM's environment set-up for its CLI (`vllm serve`): in `entrypoints.common.startup` since
    0.33, in `entrypoints.serve.utils.api_utils` in 0.32."""
    try:
        from vllm.entrypoints.common.startup import cli_env_setup as setup
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as setup
    return setup()
