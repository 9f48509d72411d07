"""``python -m bregman_server``: the server in this process (`bregman_server.cli.run`); what
``bregman-serve`` runs in a session of its own."""

import sys

from .cli import run

if __name__ == "__main__":  # not again in the API server processes vLLM spawns
    sys.exit(run())
