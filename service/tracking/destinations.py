"""Where a job's metrics may be forwarded: the operator's trackers, never a place a tenant
picks. Pure functions (table-tested).

The forwarder runs in the control plane, with the operator's environment (MLflow's
`MLFLOW_TRACKING_TOKEN`/`_USERNAME`/`_PASSWORD`) and next to its files and database. A
tenant's `tracking_uri` chosen freely made it send those credentials to the tenant's own
server, create a `file://` store in another tenant's data area, and write MLflow's tables
into the service's own `sqlite:///` database. So:

- a job names no URI and gets the operator's tracker (`ELASTRAIN_MLFLOW_TRACKING_URI`,
  any scheme the operator likes), or names one on the operator's allow-list
  (`ELASTRAIN_TRACKING_ALLOWED_URIS`: `https://host[:port]` entries, matched on scheme,
  host and port exactly);
- a URI with a path scheme (`file:`, a bare path), a database scheme (`sqlite:`,
  `postgresql:`, `mysql:`, ...) or user info is refused whatever the list says, unless it
  is the operator's own tracker; any host not on the list is refused, an internal address
  (loopback, private, link-local such as the cloud metadata address, `localhost`) among
  them: only an operator who lists that exact origin lets jobs reach it;
- the operator's credentials go to the operator's tracker only (`is_operator_tracker`);
  the forwarder calls any other allowed host without them.

Names are not resolved here: an allow-listed name is the operator's to point somewhere
sensible. A literal address is judged by what it is.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

#: The schemes a tenant's MLflow URI may use: a server over HTTP(S), nothing on disk.
_NETWORK_SCHEMES = frozenset({"http", "https"})
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int | None

    def __str__(self) -> str:
        port = f":{self.port}" if self.port is not None else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}{port}"


def origin_of(uri: str) -> Origin | None:
    """Scheme, host (lower case, no trailing dot) and explicit port of a network URI;
    None for one that names no host or carries user info (`http://allowed@evil/`)."""
    try:
        parts = urlsplit(uri.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _NETWORK_SCHEMES or not parts.hostname or "@" in parts.netloc:
        return None
    host = parts.hostname.lower().rstrip(".")
    default = {"http": 80, "https": 443}[scheme]
    return Origin(scheme, host, None if port in (None, default) else port)


def is_internal(host: str) -> bool:
    """Loopback, private, link-local, unspecified or reserved addresses and local names."""
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_unspecified
        or address.is_reserved
        or address.is_multicast
    )


def parse_allowed(entries: list[str]) -> list[Origin]:
    """The operator's allow-list; raises ValueError naming an entry that is not an
    `http(s)://host[:port]` origin."""
    found = []
    for entry in entries:
        origin = origin_of(entry)
        if origin is None or urlsplit(entry.strip()).path not in ("", "/"):
            raise ValueError(
                f"ELASTRAIN_TRACKING_ALLOWED_URIS: {entry!r} is not an http(s)://host[:port] origin"
            )
        found.append(origin)
    return found


def is_operator_tracker(uri: str, operator_uri: str | None) -> bool:
    """`uri` is the operator's own tracker: the same URI, or the same network origin."""
    if not operator_uri:
        return False
    if uri.strip() == operator_uri.strip():
        return True
    mine, theirs = origin_of(uri), origin_of(operator_uri)
    return mine is not None and mine == theirs


def mlflow_uri_problem(
    uri: str | None, *, allowed: list[Origin], operator_uri: str | None
) -> str | None:
    """Why a job may not forward to MLflow at `uri` (None: the operator's tracker), or
    None when it may. The reason starts with the field's name."""
    field = "tracking.mlflow.tracking_uri"
    listed = ", ".join(str(o) for o in allowed) or "none"
    if uri is None:
        if operator_uri:
            return None
        return (
            f"{field}: this service has no MLflow tracker of its own "
            "(ELASTRAIN_MLFLOW_TRACKING_URI); name one of the allowed servers: " + listed
        )
    if is_operator_tracker(uri, operator_uri):
        return None
    origin = origin_of(uri)
    if origin is None:
        return (
            f"{field}: only the operator's tracker (leave it out) or an http(s) server on "
            f"the operator's list ({listed}) is allowed; file paths, databases and URIs with "
            "user info are refused"
        )
    if origin not in allowed:
        internal = " (an internal address)" if is_internal(origin.host) else ""
        return f"{field}: {origin}{internal} is not on the operator's list of trackers ({listed})"
    return None
