"""Node settings: parsed once at start-up from env, with command-line flags taking precedence."""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.flight as flight

from kubeflow_data_cache import constants
from kubeflow_data_cache.errors import ConfigError
from kubeflow_data_cache.memory import available_cpus, container_memory_limit, parse_bytes
from kubeflow_data_cache.security import (
    CLUSTER_KEY_ENV,
    TLS_DIR_ENV,
    TLS_SCHEME,
    TLS_SECRET_CERT,
    TLS_SECRET_KEY,
    TLS_SERVER_NAME_ENV,
    checked_server_name,
    client_for,
    load_cluster_key,
    load_token,
    tls_certificates,
    tls_folder,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    role: str  # "head" or "worker"
    metadata_loc: str
    schema_name: str
    table_name: str
    bind_host: str
    flight_port: int
    health_port: int
    advertise_host: str
    data_nodes: int  # head: how many data nodes to expect
    node_index: int  # worker: 0-based data node index
    head_location: str  # worker: where the head's Flight server is
    memory_limit: int | None
    token: str | None
    cluster_key: str | None
    tls: TlsSetting
    startup_timeout: float
    failure_grace: float
    load_threads: int
    termination_log: str | None  # TERMINATION_LOG; None: the kubelet's path, where it mounted one

    @property
    def scheme(self) -> str:
        return self.tls.scheme

    def location(self, port: int) -> str:
        return f"{self.scheme}://{host_port(self.advertise_host, port)}"


@dataclass(frozen=True)
class TlsSetting:
    """How a process serves and dials Flight: plaintext where ``certificates`` is empty."""

    certificates: list[tuple[bytes, bytes]]
    # What peers' certificates are checked against: the CA (ca.crt of a TLS Secret's folder), or
    # where none is given our own certificate (one cluster, one self-signed certificate).
    ca: bytes | None = None
    # The name checked in peers' certificates instead of the address dialled (pod IPs).
    server_name: str | None = None

    @property
    def scheme(self) -> str:
        return TLS_SCHEME if self.certificates else "grpc"

    @property
    def root_certs(self) -> bytes | None:
        if not self.certificates:
            return None
        return self.ca or self.certificates[0][0]

    def client_for(self, location: str) -> flight.FlightClient:
        """A Flight client for a peer of this cache, trusting what it trusts, checking its name."""
        return client_for(location, self.root_certs, self.server_name)


def tls_config(
    cert_file: str | None,
    key_file: str | None,
    tls_dir: str | None,
    server_name: str | None,
    flags: bool = True,
) -> TlsSetting:
    """TLS from a certificate and key, or from a TLS Secret's folder (DATA_CACHE_TLS_DIR), with
    the server name peers check. ``flags``: whether messages name the command-line flags too."""

    def name(var: str, flag: str) -> str:
        return label(var, flag if flags else None)

    cert_name, key_name = name("DATA_CACHE_TLS_CERT", "--tls-cert"), name("DATA_CACHE_TLS_KEY", "--tls-key")
    dir_name = name(TLS_DIR_ENV, "--tls-dir")
    server = checked_server_name(server_name or None, name(TLS_SERVER_NAME_ENV, "--tls-server-name"))
    if tls_dir and (cert_file or key_file):
        raise ConfigError(f"set either {dir_name} or {cert_name} and {key_name}, not both")
    ca = None
    if tls_dir:
        folder = tls_folder(tls_dir, dir_name)
        if folder.empty:
            # The optional Secret volume of a cache made by the initializer, where the namespace has
            # no TLS Secret: said once, so that a reader told "does not serve TLS" can see why.
            log.warning(
                "%s %s holds no %s or %s: serving Flight without TLS",
                dir_name,
                tls_dir,
                TLS_SECRET_CERT,
                TLS_SECRET_KEY,
            )
            return TlsSetting([], None, server)
        if folder.cert is None or folder.key is None:
            have, lack = (TLS_SECRET_CERT, TLS_SECRET_KEY) if folder.cert else (TLS_SECRET_KEY, TLS_SECRET_CERT)
            raise ConfigError(
                f"{dir_name} {tls_dir!r} holds {have} but no {lack}: a TLS Secret needs both "
                "(kubectl create secret tls NAME --cert=tls.crt --key=tls.key)"
            )
        cert_file, key_file = folder.cert, folder.key
        cert_name = key_name = f"{dir_name} {tls_dir!r}:"
        if folder.ca is not None:
            ca = _pem_certificates(folder.ca, f"{dir_name} {tls_dir!r}:")
    certificates = tls_setting(cert_file, key_file, cert_name, key_name)
    if certificates:
        _check_certificate(cert_file, cert_name, server, name(TLS_SERVER_NAME_ENV, "--tls-server-name"))
    return TlsSetting(certificates, ca, server)


def _check_certificate(cert_file: str, cert_name: str, server_name: str | None, server_source: str) -> None:
    """Refuse a certificate no peer accepts: one that has expired, or, where peers check
    ``server_name`` (DATA_CACHE_TLS_SERVER_NAME), one that does not carry that name. The head
    served on with it, each data node retried its registration to the startup deadline, and
    readers were told to pass a certificate authority they already passed."""
    # CPython's decoder of a PEM file's first certificate (ssl has no public one); without it, no check.
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    try:
        info = decode(cert_file) if decode is not None else None
    except (ssl.SSLError, OSError, ValueError):
        info = None
    if not info:
        return
    not_after = info.get("notAfter")
    if not_after and ssl.cert_time_to_seconds(not_after) < time.time():
        raise ConfigError(
            f"{cert_name} {cert_file!r}: the certificate expired on {not_after}, and no peer accepts it: renew it "
            "(on Kubernetes, update the TLS Secret; cert-manager renews its own) and start the cache again"
        )
    if server_name is None:
        return
    sans = info.get("subjectAltName", ())
    names = [value for kind, value in sans if kind == "DNS"]
    addresses = [value.strip() for kind, value in sans if kind == "IP Address"]
    if not names:  # no DNS names: a peer may fall back to the subject's common name
        names = [value for rdn in info.get("subject", ()) for key, value in rdn if key == "commonName"]
    # A server name may be an address, which peers match against the address entries.
    if not any(_name_matches(pattern, server_name) for pattern in names) and not any(
        _same_address(address, server_name) for address in addresses
    ):
        raise ConfigError(
            f"{cert_name} {cert_file!r}: the certificate names {', '.join(names + addresses) or 'nothing'}, not "
            f"{server_source} {server_name!r}, the name every peer checks: make the certificate for that name (a "
            f"dnsNames entry), or set {TLS_SERVER_NAME_ENV} to a name it carries, in the cache and its readers"
        )


def _same_address(address: str, name: str) -> bool:
    """Whether a certificate's IP entry is the server name, written as gRPC matches it: an
    address in its usual form (``::1``; gRPC refused ``0:0:0:0:0:0:0:1`` for the same address)."""
    written = name.strip("[]").lower()
    try:
        given = ipaddress.ip_address(written)
        return ipaddress.ip_address(address) == given and str(given) == written
    except ValueError:
        return False


def _name_matches(pattern: str, name: str) -> bool:
    """A certificate's DNS name against a server name: equal ignoring case, or a wildcard
    (``*.example.com``) standing for exactly one leftmost label."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        label, _, rest = name.partition(".")
        return bool(label) and rest == pattern[2:]
    return pattern == name


def _pem_certificates(path: str, source: str) -> bytes:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
        return Path(path).read_bytes()
    except ssl.SSLError:
        raise ConfigError(f"{source} {path!r} holds no PEM certificate: check the Secret's ca.crt") from None
    except OSError as err:  # a traceback, exit 1, where the key and certificate gave one line
        raise ConfigError(f"{source} cannot read {path!r}: {err.strerror}") from None


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[fd00::12]:50051``) as URIs need it: on an
    IPv6 cluster POD_IP is one."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def uri_port(uri: str) -> int | None:
    """The port a ``scheme://host:port`` URI names, or None where it names none or a bad one."""
    try:
        port = urlsplit(uri).port
    except ValueError:  # not a number, or out of range
        return None
    return port if port else None


METADATA_SCHEMES = ("s3", "s3a", "file")
HEAD_SCHEMES = ("grpc", "grpc+tcp", "grpc+tls")


def lower_scheme(location: str) -> str:
    """``S3://bucket/key`` as ``s3://bucket/key``: schemes are case-insensitive (RFC 3986, and the
    upstream cache reads them so), but the readers below match them in lower case."""
    scheme, sep, rest = location.partition("://")
    return f"{scheme.lower()}{sep}{rest}" if sep and scheme.isascii() and scheme.isalnum() else location


def check_metadata_location(location: str) -> None:
    """Refuse, at once, a store the cache cannot read (planning would only fail at its deadline)."""
    try:
        scheme = urlsplit(location).scheme if "://" in location else ""
    except ValueError as err:  # an unclosed [ (urllib reads it as an IPv6 host)
        raise ConfigError(f"{label('METADATA_LOC', '--metadata-loc')} {location!r} is not a valid URI: {err}") from None
    if scheme and scheme not in METADATA_SCHEMES:
        raise ConfigError(
            f"{label('METADATA_LOC', '--metadata-loc')} {location!r}: the {scheme}:// store is not supported; "
            "use s3:// or s3a:// (any S3-compatible store, with AWS_ENDPOINT_URL), file:// or a local path"
        )
    # A scheme alone (a template whose variable went missing) names no file: said now, not as a
    # load error once the cluster has formed.
    rest = location.split("://", 1)[1] if scheme else location
    bucket, _, key = rest.partition("/")
    if (scheme == "file" and not rest.strip("/")) or (scheme in ("s3", "s3a") and not (bucket and key.strip("/"))):
        form = "file:///path/to/metadata.json" if scheme == "file" else f"{scheme}://bucket/path/to/metadata.json"
        raise ConfigError(
            f"{label('METADATA_LOC', '--metadata-loc')} {location!r} names no file: give the table's metadata.json "
            f"as {form}"
        )


def same_table_location(a: str, b: str) -> bool:
    """Whether two METADATA_LOC spellings name the same file: ``file:///x`` and ``/x``, a relative
    and an absolute path, ``s3a://`` and ``s3://`` (the same object store)."""

    def canonical(location: str) -> str:
        if location.startswith("file://"):
            location = urlsplit(location).path
        elif location.startswith("s3a://"):
            location = "s3://" + location.removeprefix("s3a://")
        if "://" not in location:
            location = os.path.normpath(os.path.abspath(location))
        return location

    return canonical(a) == canonical(b)


# A DNS name's label (RFC 1123, what a pod's or a Service's name is made of), with underscores,
# which some machines' own names hold and their resolvers take.
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def valid_host(host: str) -> bool:
    """Whether ``host`` is an IP address (an IPv6 one with or without brackets, no zone id) or a
    DNS name (RFC 1123 labels, underscores allowed, at most 253 characters, a final dot allowed)."""
    if "%" in host:  # an IPv6 zone id (fe80::1%eth0): Arrow cannot parse a URI holding one
        return False
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(part) for part in name.split("."))


def check_advertise_host(host: str, source: str) -> None:
    """A ConfigError naming ``source`` where readers could not dial ``host``. Unchecked,
    a space or a port in it (``10.0.0.7:5000`` reads as an IPv6 address) failed the load later,
    blamed on a data node ("refused its assignment: Cannot parse URI")."""
    if not valid_host(host):
        raise ConfigError(
            f"{source} should be the host name or IP address readers reach this process at, such as "
            f"10.0.0.7, fd00::7 or cache-0.cache (no scheme, no port), got {host!r}"
        )


def dialable(location: str) -> bool:
    """Whether ``location`` is a Flight URI a cache process can dial: grpc:// (grpc+tcp://,
    grpc+tls://) with a host and a port."""
    if not location.isprintable():  # a newline in an address it logs would forge log lines
        return False
    try:
        parts = urlsplit(location)
        hostname = parts.hostname
    except ValueError:  # an unclosed [ (urllib reads it as an IPv6 host)
        return False
    return (
        "://" in location
        and parts.scheme in HEAD_SCHEMES
        and bool(hostname)
        and valid_host(hostname)
        and bool(uri_port(location))
    )


def check_head_location(location: str) -> None:
    """A data node's --head must be a URI it can dial: a scheme and a port."""
    if not dialable(location):
        raise ConfigError(
            f"the head's address should be a grpc:// (or grpc+tls://) URI with a port, grpc://10.0.0.5:50051, "
            f"got {location!r} (from --head or LWS_LEADER_ADDRESS)"
        )


def label(var: str, flag: str | None = None) -> str:
    """How messages name a setting: its env variable, and its flag where the two differ."""
    return f"`{var}` ({flag})" if flag else f"`{var}`"


def int_setting(
    name: str, raw: str | int | None, default: int, minimum: int | None = 0, maximum: int | None = None
) -> int:
    """An integer setting from ``minimum`` to ``maximum`` (None: unbounded): ``default`` when unset or empty."""
    if raw is None or raw == "":
        return default
    try:
        if isinstance(raw, str) and not raw.strip().isascii():
            raise ValueError  # int() takes any script's digits: "٣" would be 3
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} should be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} should be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} should be <= {maximum}, got {value}")
    return value


def port_setting(name: str, raw: str | int | None, default: int) -> int:
    """A TCP port, 0 (any free one) to 65535: checked here rather than by a traceback from the bind."""
    value = int_setting(name, raw, default, minimum=None)  # one message for either side of the range
    if not 0 <= value <= 65535:
        raise ConfigError(f"{name} should be a port number from 0 to 65535, got {value}")
    return value


def seconds_setting(name: str, raw: str | float | None, default: float) -> float:
    """A finite number of seconds > 0: ``nan`` and ``inf`` parse as floats but would turn a
    deadline off (every comparison with nan is false), so they are refused like 0."""
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} should be a number of seconds, got {raw!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} should be a finite number of seconds > 0, got {raw!r}")
    # Past what a thread can wait for, a wait raises OverflowError at the moment it is needed
    # (a failed node's grace before it exits), not here.
    if value > threading.TIMEOUT_MAX:
        raise ConfigError(f"{name} should be at most {int(threading.TIMEOUT_MAX)} seconds, got {raw!r}")
    return value


def tls_setting(
    cert_file: str | None,
    key_file: str | None,
    cert_name: str = label("DATA_CACHE_TLS_CERT", "--tls-cert"),
    key_name: str = label("DATA_CACHE_TLS_KEY", "--tls-key"),
) -> list[tuple[bytes, bytes]]:
    """The certificate and key, checked now: gRPC would fail only later, with pages of traceback."""
    tls = tls_certificates(cert_file, key_file)
    if not tls:
        return tls
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
    except ssl.SSLError:
        raise ConfigError(
            f"{cert_name} {cert_file!r} holds no PEM certificate: point it at the certificate file "
            "(-----BEGIN CERTIFICATE-----)"
        ) from None
    try:
        # A password callback that gives none: an encrypted key fails here instead of prompting.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=lambda: b"")
    except ssl.SSLError as err:
        # OpenSSL names some reasons (KEY_VALUES_MISMATCH); a garbage or encrypted key is just "PEM lib".
        reason = f" ({err.reason.lower().replace('_', ' ')})" if err.reason and err.reason != "PEM_LIB" else ""
        raise ConfigError(
            f"{key_name} {key_file!r} is not an unencrypted PEM private key of the certificate "
            f"{cert_file!r}{reason}: point it at that certificate's key"
        ) from None
    return tls


def claim_port(host: str, port: int, port_name: str, host_name: str) -> int:
    """Fail, naming the setting, when ``host:port`` cannot be bound (something listens there);
    return the port, or for 0 the free one the OS picked. Checked before a server starts: gRPC
    reports a taken port only as "Server did not start properly", after its own log lines, and
    a client polling that port would talk to whatever listens there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As gRPC does: a port whose old connections linger in TIME_WAIT is free to reuse.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
            return probe.getsockname()[1]
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use: stop what listens there or pick another "
                f"port with {port_name}"
            ) from None
        if err.errno == errno.EACCES and 0 < port < 1024:
            # Not the host's fault: binding a port below 1024 takes root or CAP_NET_BIND_SERVICE.
            raise ConfigError(
                f"cannot listen on {host_port(host, port)} ({err.strerror}): ports below 1024 need root or "
                f"CAP_NET_BIND_SERVICE; pick a port of 1024 or more with {port_name}"
            ) from None
        raise ConfigError(
            f"cannot listen on {host_port(host, port)} ({err.strerror or err}): check {host_name}"
        ) from None


def build_config(role: str, flags: dict, env: dict[str, str] | None = None) -> NodeConfig:
    """``flags`` holds the command-line values (None when not given); env fills the rest."""
    env = dict(os.environ if env is None else env)

    def pick(flag: str, var: str) -> str | None:
        value = flags.get(flag)
        return str(value) if value is not None else env.get(var)

    def pick_group(*pairs: tuple[str, str]) -> list[str | None]:
        """Settings that are one choice made two ways (a token or its file; a TLS folder or a
        certificate and key): where any of their flags is given, the flags alone, so a flag
        overrides the env's other way too (cache pods have DATA_CACHE_TLS_DIR set)."""
        if any(flags.get(flag) is not None for flag, _ in pairs):
            return [None if flags.get(flag) is None else str(flags[flag]) for flag, _ in pairs]
        return [env.get(var) for _, var in pairs]

    metadata_loc = pick("metadata_loc", "METADATA_LOC")
    if role == "head" and not metadata_loc:
        raise ConfigError(
            "`METADATA_LOC` is required: the table's metadata.json (s3://, s3a://, file:// or a path), "
            "set by the env METADATA_LOC or --metadata-loc"
        )
    if metadata_loc:
        metadata_loc = lower_scheme(metadata_loc)
        check_metadata_location(metadata_loc)
    flight_port = port_setting(label("FLIGHT_PORT", "--port"), pick("port", "FLIGHT_PORT"), constants.FLIGHT_PORT)
    health_port = port_setting(
        label("HEALTH_PORT", "--health-port"), pick("health_port", "HEALTH_PORT"), constants.HEALTH_PORT
    )
    tls_cert, tls_key, tls_dir = pick_group(
        ("tls_cert", "DATA_CACHE_TLS_CERT"), ("tls_key", "DATA_CACHE_TLS_KEY"), ("tls_dir", TLS_DIR_ENV)
    )
    tls = tls_config(tls_cert, tls_key, tls_dir, pick("tls_server_name", TLS_SERVER_NAME_ENV))
    scheme = tls.scheme

    data_nodes = 0
    node_index = 0
    head_location = ""
    if role == "head":
        explicit = pick("data_nodes", "DATA_NODES")
        if explicit not in (None, ""):  # empty, as every other setting: not set
            data_nodes = int_setting(
                label("DATA_NODES", "--data-nodes"), explicit, 1, minimum=1, maximum=constants.MAX_DATA_NODES
            )
        elif env.get("LWS_GROUP_SIZE"):
            group = env["LWS_GROUP_SIZE"]
            data_nodes = (
                int_setting(label("LWS_GROUP_SIZE"), group, 2, minimum=2, maximum=constants.MAX_DATA_NODES + 1) - 1
            )
        else:
            raise ConfigError(
                "the head needs the number of data nodes: run it in a LeaderWorkerSet (LWS_GROUP_SIZE) "
                "or pass --data-nodes N"
            )
    else:
        explicit = flags.get("index")
        if explicit is not None:
            node_index = int_setting(label("--index"), explicit, 0)
        elif env.get("LWS_WORKER_INDEX"):
            node_index = int_setting(label("LWS_WORKER_INDEX"), env["LWS_WORKER_INDEX"], 1, minimum=1) - 1
        else:
            raise ConfigError("a data node needs its index: LWS_WORKER_INDEX (set by LWS) or --index N")
        head_location = flags.get("head") or ""
        if not head_location:
            leader = env.get("LWS_LEADER_ADDRESS")
            if not leader:
                raise ConfigError("a data node needs the head's address: LWS_LEADER_ADDRESS (set by LWS) or --head URI")
            # In a LeaderWorkerSet the head and its data nodes share one pod template port, so
            # a node dials the leader on its own Flight port; "any free port" names none.
            if flight_port == 0:
                raise ConfigError(
                    f"`FLIGHT_PORT` (--port) is 0 (any free port), so the head's port cannot be taken from "
                    f"it: pass --head {scheme}://{host_port(leader, constants.FLIGHT_PORT)} (the head's real "
                    "port) or set a fixed FLIGHT_PORT, the same as the head's"
                )
            head_location = f"{scheme}://{host_port(leader, flight_port)}"
        check_head_location(head_location)

    raw_limit = pick("memory_limit", "MEMORY_LIMIT")
    memory_limit = (
        parse_bytes(raw_limit, label("MEMORY_LIMIT", "--memory-limit")) if raw_limit else container_memory_limit()
    )
    if memory_limit == 0:  # resourceFieldRef gives 0 when no limit is set on the container
        memory_limit = container_memory_limit()

    advertise_host = pick("advertise_host", "POD_IP")
    if advertise_host:
        check_advertise_host(advertise_host, label("POD_IP", "--advertise-host"))
    else:
        advertise_host = socket.gethostname()  # a name the machine gave itself: not checked
    if flags.get("token") is not None:
        # Every local user can read a process's arguments (ps, /proc/PID/cmdline); not the value.
        log.warning("--token is visible to every user of this machine in the process list: prefer "
                    "DATA_CACHE_TOKEN or --token-file")  # fmt: skip
    return NodeConfig(
        role=role,
        metadata_loc=metadata_loc or "",
        schema_name=pick("schema_name", "SCHEMA_NAME") or "default",
        table_name=pick("table_name", "TABLE_NAME") or "table",
        bind_host=pick("host", "BIND_HOST") or "0.0.0.0",
        flight_port=flight_port,
        health_port=health_port,
        advertise_host=advertise_host,
        data_nodes=data_nodes,
        node_index=node_index,
        head_location=head_location,
        memory_limit=memory_limit,
        token=load_token(*pick_group(("token", "DATA_CACHE_TOKEN"), ("token_file", "DATA_CACHE_TOKEN_FILE"))),
        cluster_key=load_cluster_key(env.get(CLUSTER_KEY_ENV)),
        tls=tls,
        startup_timeout=seconds_setting(
            label("DATA_CACHE_STARTUP_TIMEOUT_SECONDS", "--startup-timeout"),
            pick("startup_timeout", "DATA_CACHE_STARTUP_TIMEOUT_SECONDS"),
            constants.STARTUP_TIMEOUT_SECONDS,
        ),
        failure_grace=seconds_setting(
            label("DATA_CACHE_FAILURE_GRACE_SECONDS", "--failure-grace"),
            pick("failure_grace", "DATA_CACHE_FAILURE_GRACE_SECONDS"),
            constants.FAILURE_GRACE_SECONDS,
        ),
        load_threads=int_setting(
            label("LOAD_THREADS", "--load-threads"), pick("load_threads", "LOAD_THREADS"), available_cpus(), minimum=1
        ),
        # Empty counts as unset: an empty path wrote no termination message, without a word.
        termination_log=env.get("TERMINATION_LOG") or None,
    )
