"""The job's rendezvous store: hosted on loopback by the local launcher (:func:`host_store`), the launcher's go to
the ranks once its checks have passed (:func:`say_go`, :func:`wait_for_go`), and messages signed with a secret only
the job's ranks hold (:class:`SignedStore`).

The store (a ``TCPStore``) has no authentication: anything that reaches its port can write any key. The local
launcher binds it to loopback, and the ``python`` tool's sandbox has no network of its own, but another process of
the machine could still connect. So what the ranks tell each other through it -- the launcher's go,
the rollout ranks' messages, weights' descriptions, scored batches and snapshots -- carries an HMAC-SHA256 of its
key and value and of the run's id under the job's secret (:data:`SECRET_ENV`: the local launcher makes one per job;
under torchrun, set the same value on every node), and a value that does not verify stops the job in one line naming
its key. The run id (:func:`run_id`: once the ranks are up, a hash of every rank's random nonce, whoever launched
them) binds each message to one run: with a secret kept in the environment from job to job, or in one torchrun
launch script, a value recorded from an earlier run does not verify in the next.
The sandbox never sees the secret: its environment is empty and, as root, it runs as a uid that cannot read the
ranks' ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only once a job starts: the command line answers --help and config errors without it
    import torch.distributed as dist

SECRET_ENV = "SYNCWISE_JOB_SECRET"
RUN_ID_ENV = "SYNCWISE_RUN_ID"  # the local launcher's, fresh at every launch (never inherited)
GO_KEY = "syncwise/go"  # set in the job's store once the launcher's checks have passed
GO_TIMEOUT_S = 3600.0  # the checks read the user's files (a prompt file is tokenised whole): never cut short
_MAC_BYTES = hashlib.sha256().digest_size


class ForgedMessage(RuntimeError):
    """A value in the job's store that the job did not write."""


def new_secret() -> str:
    return secrets.token_hex(32)


def job_secret() -> bytes | None:
    """This rank's job secret (None: unset, as under torchrun without :data:`SECRET_ENV`)."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def run_id() -> str:
    """This run's id, which every signature covers: once the process group is up, the one every rank agreed on
    (:func:`agree_run_id`); before, the local launcher's (:data:`RUN_ID_ENV`), else torchrun's rendezvous id
    (``--rdzv-id``, ``TORCHELASTIC_RUN_ID``), else empty."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")


def agree_run_id() -> str:
    """Every rank draws a random nonce, the ranks gather them, and the run's id becomes a hash of the id so far and
    all of them (set in :data:`RUN_ID_ENV` for this process): fresh for every run whoever launched it -- torchrun's
    default rendezvous id is the string ``none`` in every job, so two torchrun jobs with one secret in their launch
    script would otherwise accept each other's recorded messages. Collective: every rank of the default group, once,
    right after it is made."""
    import torch.distributed as dist

    nonces: list = [None] * dist.get_world_size()
    dist.all_gather_object(nonces, secrets.token_hex(16))
    agreed = hashlib.sha256("\0".join([run_id(), *nonces]).encode()).hexdigest()
    os.environ[RUN_ID_ENV] = agreed
    return agreed


class SignedStore:
    """``set`` / ``get`` of a ``dist.Store`` with each value signed and checked (plain where ``secret`` is None),
    the signature over the run's id (``run``, default :func:`run_id`), the key and the value; ``check``, ``add``
    and ``delete_key`` as the store has them (a counter cannot be signed: the rollout ranks' read counts only
    decide when a message's keys are deleted)."""

    def __init__(self, store: dist.Store, secret: bytes | None, run: str | None = None):
        self.store, self.secret = store, secret
        self.run = (run_id() if run is None else run).encode()

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, self.run + b"\0" + key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else value
        self.store.set(key, value if self.secret is None else self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        raw = self.store.get(key)
        if self.secret is None:
            return raw
        mac, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(raw) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise ForgedMessage(f"the job's store held {key!r} not signed by this job: something outside the job wrote "
                                f"it (another process on this machine or network, or a value recorded from another "
                                f"run); the job stops rather than use it")
        return value

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_store() -> dist.TCPStore:
    """The job's rendezvous store, hosted here as torchrun's agent hosts it: bound to a port the kernel picks
    and held, so another job starting on this machine at the same moment cannot take it (a port chosen free
    and then bound by rank 0 can be taken in between). On loopback only: ``TCPStore`` given a port listens on
    every interface whatever host it is told, so it is handed a socket bound to 127.0.0.1 instead."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def say_go(store: dist.Store, secret: str, run: str) -> None:
    """The launcher: its checks have passed, the ranks may start their work."""
    SignedStore(store, secret.encode(), run).set(GO_KEY, "1")


def wait_for_go(port: int) -> None:
    """A rank: wait until the launcher says go (this rank's job secret checks it is the launcher's)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=GO_TIMEOUT_S))
    SignedStore(store, job_secret()).get(GO_KEY)
