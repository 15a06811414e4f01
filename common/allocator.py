"""The memory allocator a long-running gateway process runs on.

CPython's default allocator (pymalloc) serves small objects from 1 MiB arenas and returns an
arena to the system only once every object in it is freed. After a burst of thousands of
streams a few objects that outlive the burst keep most of its arenas: the resident set stays
about a quarter above its idle level, and no collection or ``malloc_trim`` can change that
(bench/results/soak.md). With ``PYTHONMALLOC=malloc`` every object comes from glibc's
``malloc``, whose free pages the idle release (common/idle_trim.py) hands back.

``PYTHONMALLOC`` is read once, when the interpreter starts, so ``fleetgate serve`` runs itself
again with it set (one ``execve``, after parsing its arguments and before it opens or starts
anything). A value already in the environment is kept as it is: ``PYTHONMALLOC=pymalloc``
chooses CPython's default. The re-executed process then removes the variable from its environment again, so
the processes it starts (managed vLLM or simulator replicas) run on their usual allocator.

``reexec_environment`` decides (pure); ``run_on_allocator`` is the edge.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# The allocator `fleetgate serve` runs on unless PYTHONMALLOC says otherwise.
GATEWAY_ALLOCATOR = "malloc"
# Set on the re-executed process only, so that it knows PYTHONMALLOC was its own choice (to
# take back out of the environment its children inherit) and never re-executes twice.
MARKER = "FLEETGATE_ALLOCATOR_SET"


def reexec_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to run the process again with, or None when it runs as it is."""
    if "PYTHONMALLOC" in environ or MARKER in environ:
        return None
    return {**environ, "PYTHONMALLOC": GATEWAY_ALLOCATOR, MARKER: "1"}


def run_on_allocator() -> None:
    """Replace this process with itself on ``GATEWAY_ALLOCATOR`` (same interpreter, same
    arguments), unless ``PYTHONMALLOC`` is already chosen; in the replaced process, take the
    variable back out of the environment its children will inherit."""
    env = reexec_environment(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    if os.environ.pop(MARKER, None) is not None:
        os.environ.pop("PYTHONMALLOC", None)
