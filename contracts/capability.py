"""Who may call the runtime: capabilities derived from the control plane's key.

The runtime actor and the pool's worker processes are named Ray actors: anything that joins
the Ray cluster (a job's own code runs inside a Ray worker process) can look them up and
call them. So every call that acts on an attempt or a job carries a capability, and the
callee checks it:

- the control plane's calls (launch, reconcile, release, request, workers) carry the
  *control token*;
- rank 0's reports (`push_many`) carry its attempt's *attempt capability*, which the runtime
  hands to the attempt's ranks in their `Assignment` (Ray call arguments, held in the rank
  process's memory: never an environment variable or a file a script of the job sees);
- the runtime's calls into a worker process (run a rank, abort, forget a job) carry the
  *pool token*.

All three are HMAC-SHA256 of the *control key* (32 random bytes the control plane keeps in
its database, `elastrain.service.identity.runtime_control_key`, and gives the runtime when
it creates it; Ray restarts the runtime with the same key). The runtime recomputes what it
checks (no state per attempt), and a rank holds only its own attempt's capability, from
which no other attempt's can be computed. A worker process, in which a job's own code may
run, keeps only the SHA-256 digest of the pool token: reading its memory yields nothing
that can be presented.

Stdlib only: the control plane, the runtime and the ranks import it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: Bytes of randomness in a control key.
CONTROL_KEY_BYTES = 32


def new_control_key() -> bytes:
    return secrets.token_bytes(CONTROL_KEY_BYTES)


def _mac(control_key: bytes, *parts: object) -> str:
    # NUL-separated: no two different part lists give the same message.
    message = b"\0".join(str(p).encode() for p in parts)
    return hmac.new(control_key, message, hashlib.sha256).hexdigest()


def attempt_capability(control_key: bytes, job_id: int, attempt: int) -> str:
    """The capability of attempt `attempt` of job `job_id` (what its ranks present)."""
    return _mac(control_key, "attempt", int(job_id), int(attempt))


def control_token(control_key: bytes) -> str:
    """What the control plane presents on its calls to the runtime."""
    return _mac(control_key, "control-plane")


def pool_token(control_key: bytes) -> str:
    """What the runtime presents on its calls into the pool's worker processes."""
    return _mac(control_key, "worker-pool")


def token_digest(token: str) -> bytes:
    """What a holder that must not keep the token itself (a worker process) keeps."""
    return hashlib.sha256(token.encode()).digest()


def same(expected: str, presented: object) -> bool:
    """Constant-time equality; anything but a string is refused."""
    return isinstance(presented, str) and hmac.compare_digest(expected, presented)


def matches_digest(digest: bytes, presented: object) -> bool:
    """Whether `presented` is the token whose `token_digest` is `digest`."""
    return isinstance(presented, str) and hmac.compare_digest(digest, token_digest(presented))


class Keyring:
    """The runtime's checks: it holds the control key, derives the rest on demand."""

    def __init__(self, control_key: bytes) -> None:
        if not isinstance(control_key, bytes) or len(control_key) < CONTROL_KEY_BYTES:
            raise ValueError(f"a control key is at least {CONTROL_KEY_BYTES} random bytes")
        self._key = control_key
        self._control = control_token(control_key)
        self.pool = pool_token(control_key)

    def is_control(self, presented: object) -> bool:
        return same(self._control, presented)

    def capability(self, job_id: int, attempt: int) -> str:
        return attempt_capability(self._key, job_id, attempt)

    def is_attempt(self, job_id: int, attempt: int, presented: object) -> bool:
        return same(self.capability(job_id, attempt), presented)
