"""``mig-operator``, the command line: it wires the layers; decisions live in core.

``main`` parses and dispatches (one-line errors, exit 2); ``flags`` holds the checks the commands share;
``offline`` the commands that need no cluster (catalog, inspect, plan, demo) and ``views`` what they
print; ``parts`` the long-running controller and agent, ``webhook`` the admission webhook's flags and
process, ``top`` the cluster's picture.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
