"""What the launcher's fork server imports before it forks any rank (see :mod:`.rank_server`); nothing else
imports this module.

It blocks the stop signals in the server, so that every rank forked from it starts with them blocked, as a spawned
rank does (see the launcher's ``_Supervisor.start``): until the rank has installed its handlers a Ctrl-C stays
pending instead of ending it mid-start. The server itself never takes them; it ends when its launcher does. Then it
imports what every rank imports whatever its job.
"""

import contextlib
import importlib
import signal

from .signals import STOP_SIGNALS

COMMON_IMPORTS = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                  "transformers", "transformers.models.auto.modeling_auto")

signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
for _name in COMMON_IMPORTS:
    with contextlib.suppress(Exception):  # a rank that needs it imports it itself, and reports what fails
        importlib.import_module(_name)
